"""Developer benchmarks: each runs redserve (engine, worker, or the whole stack) side by side
with a peer in one process tree and prints figures and ratios against the project's targets.
They start stacks, read streams and build engines through one harness (`harness/`). None of
this ships (the wheel and the image leave it out) and no operator tool imports it;
`redserve bench` (`ops/loadtest/`) is the product's load tester for any OpenAI-compatible
server."""
