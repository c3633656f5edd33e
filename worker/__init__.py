"""The worker: reads requests from Redis, runs the model in batches, publishes tokens.

Two halves: `worker.engine` (the model, its KV cache and the step; no Redis) and
`worker.broker` (the queue, the feeds and the record, recovery; the loop that drives the
engine). The broker imports the engine, never the other way round.
"""
