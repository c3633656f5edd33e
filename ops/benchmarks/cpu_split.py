"""Where one stream's CPU goes: each process of `redserve up` while it decodes one request.

    python -m ops.benchmarks.cpu_split [--tokens 512] [--variant "REDSERVE_SPECULATION=off" ...]

One streamed chat request of `--tokens` tokens (a story, greedy) against `redserve up` at bf16,
after a short warm-up; printed: the tokens/s the client saw, the CPU milliseconds each process
of the server (supervisor, Redis, worker, API replica) and the client spent per token, and the
thread counts the worker's chooser ran its steps with (`threads_last` in /health, read every
`SAMPLE_S` while the stream runs). A worker that spends a core's worth of CPU per token of wall
time computes on one thread; the step benchmark (`ops.benchmarks.step`) says what its step takes
on every core alone.
Each `--variant` (space-separated NAME=VALUE settings) is one more run with them.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from ops.benchmarks.harness.client import body, stream
from ops.benchmarks.harness.stack import Server
from ops.benchmarks.machine import cpu_seconds, descendants, describe
from ops.benchmarks.peers import redserve

PROMPT = "Write a long story about the sea."
SAMPLE_S = 0.25  # how often /health is read while the stream runs


def _cpu_by_process(server: Server) -> dict[int, tuple[str, float]]:
    """Each live process of the server (from /proc): its command, shortened, and its CPU
    seconds so far."""
    seen: dict[int, tuple[str, float]] = {}
    for pid in descendants(server.proc.pid):
        try:
            cpu = cpu_seconds(pid)
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        words = [a.decode(errors="replace") for a in argv if a] or ["?"]
        program = Path(words[0]).name
        name = " ".join(words[1:4]) if program.startswith("python") else program
        seen[pid] = (name[:48], cpu)
    return seen


async def _one_stream(server: Server, tokens: int) -> None:
    async with httpx.AsyncClient(timeout=600) as client:
        await stream(client, server.base, body(server.model, 16, content="warm up"))
        before, own, t0 = _cpu_by_process(server), time.process_time(), time.perf_counter()
        reply = asyncio.create_task(stream(client, server.base,
                                           body(server.model, tokens, content=PROMPT)))
        threads: Counter[int] = Counter()
        while not reply.done():
            health: dict[str, Any] = (await client.get(f"{server.base}/health")).json()
            threads.update(w.get("threads_last", 0) for w in health.get("workers", {}).values())
            await asyncio.wait([reply], timeout=SAMPLE_S)
        done = reply.result()
        wall, own = time.perf_counter() - t0, time.process_time() - own
        after, n = _cpu_by_process(server), max(done.tokens, 1)
    print(f"{done.tokens} tokens in {wall:.2f} s: {done.tokens / wall:.1f} tokens/s; the "
          f"worker's last step, read every {SAMPLE_S:g} s, ran on N threads M times: "
          f"{dict(sorted(threads.items()))}")
    print(f"  {'client (this process)':48s} {own * 1000 / n:6.2f} ms CPU a token")
    for pid, (name, cpu) in after.items():
        if pid in before:
            used = (cpu - before[pid][1]) * 1000 / n
            print(f"  {name:48s} {used:6.2f} ms CPU a token")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--variant", action="append", default=[], metavar="ENV")
    args = ap.parse_args()
    print(describe())
    for variant in ["", *args.variant]:
        env = dict(item.split("=", 1) for item in variant.split())
        print(f"redserve up{' ' + variant if variant else ''}:")
        server = redserve("bfloat16", env)
        try:
            server.wait()
            asyncio.run(_one_stream(server, args.tokens))
        finally:
            server.stop()


if __name__ == "__main__":
    main()
