"""`redserve inspect`: a read-only view of a whole deployment, taken from Redis alone.

Redis holds everything there is to know about a running deployment (see shared/keys.py): each
request's hash and result stream, each model's queue and request stream, each worker's
heartbeat. Reading those, rather than asking every replica and worker over HTTP, sees all of
them at once, from anywhere that reaches Redis, including replicas that are gone.
`keyspace.py` finds the keys, `snapshot.py` reads them into one `Snapshot`, `render.py` draws
it, `inspect_command.py` is the command (its options and entry point).
"""
