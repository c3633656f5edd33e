"""What every benchmark needs and none should write again: one way to start a stack
(`stack.py`: `redserve up`, or `redserve api` and `redserve worker` processes on one Redis),
one client (`client.py`, over the load tester's SSE reader in ops/loadtest/client.py) and one
engine builder with its step timing (`engine.py`, for the benchmarks that drive the engine in
process). A benchmark then holds only what it measures."""
