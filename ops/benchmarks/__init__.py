"""Developer benchmarks: each runs redserve (engine, worker, or the whole stack) side by side
with a peer in one process tree and prints figures and ratios against the project's targets.
None of this ships as a command; `redserve bench` (`ops/loadtest/`) is the product's load
tester for any OpenAI-compatible server."""
