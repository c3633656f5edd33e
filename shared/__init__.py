"""The wire contract between API replicas and workers.

Read in this order: `keys` (every Redis key a request touches), `messages` (what goes on the
request stream and on each result stream), `scripts` (the Lua scripts that write those keys
atomically, with typed KEYS, ARGV and replies), `settings` (what every process
reads, and the API replica's and the worker's own),
`redis_conn` (how each side connects), `models` (how a model name becomes a local checkpoint).
"""
