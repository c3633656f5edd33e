"""`redserve bench URL`: load any OpenAI-compatible server and report what its clients saw.

One tool for every peer (vLLM, `transformers serve`, redserve), so their figures can be put side
by side: the same prompts, the same arrival pattern and the same clock, read from the streamed
replies themselves (time to first token, the gap between token chunks, end-to-end latency) as
`vllm bench serve` reports them. Split by job: `bench_command` (the options), `config` (what was
asked), `dataset` (the prompts), `client` (one streamed request, timed), `load` (the arrival
pattern), `session` (one benchmark, run by run), `stats` (the figures), `report` (tables and
JSON), `plot` (latency against throughput over a sweep).
"""
