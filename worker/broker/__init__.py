"""The broker side of a worker: everything between the engine and Redis.

It takes requests from the model's queue (intake, take), publishes each step's tokens to the
replicas' feeds and each request's record (publisher, record, staged), watches for aborts,
keeps the worker's heartbeat and prefix summary (presence), claims the requests of a dead
worker (recovery), and runs the loop that joins them to the engine (service).
"""
