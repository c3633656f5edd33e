"""The engine: continuous batching over a paged KV cache, on this process's CPU or GPU.

Everything here runs a step — schedule, run the model, sample, postprocess — and knows
nothing of Redis: it is importable and testable without redis installed (an import contract
in pyproject.toml holds it to that). `worker.broker` feeds it requests and publishes what it
produces.
"""
