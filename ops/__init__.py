"""Operator tools: the `redserve` command, the embedded Redis, benchmarks."""
