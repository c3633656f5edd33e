"""Test support: what the tests and the benchmarks start or look at beside a stack (a Sentinel
failover lab, an OTLP receiver, a replica's /health and /metrics). Kept apart from the operator
tools so that it leaves the wheel and the image: no `redserve` command needs it, and import-linter
keeps the tools from importing it (pyproject's [tool.importlinter])."""
