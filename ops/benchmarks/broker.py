"""Broker scaling: requests/s and tokens/s through real API replicas, Redis and workers, with
the model replaced by a fixed-time stand-in (`REDSERVE_SYNTHETIC_STEP_MS`, see
worker/engine/synthetic.py), so that what is measured is the serving layer, not a CPU-bound model.

    python -m ops.benchmarks.broker [--step-ms 50] [--max-running 16] [--tokens 32]
                               [--concurrency 96] [--seconds 15]

For 1, 2 and 4 workers with 1 and 2 API replicas: start the topology (its own Valkey unless
REDIS_URL is set), drive it with `--concurrency` streaming clients spread over the replicas
for `--seconds`, and report completed requests/s, streamed tokens/s and the CPU each part
used (in cores), then the 1 -> 2 worker and 1 -> 2 replica ratios and what saturated first.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from dataclasses import dataclass

import httpx
import redis
from rich.console import Console
from rich.table import Table

from ops.benchmarks.harness.stack import (
    NO_AUTH,
    UNBOUNDED_QUEUE,
    Processes,
    redis_cpu,
    self_cpu_seconds,
)
from ops.benchmarks.harness.stack import redis_url as stack_redis_url
from ops.console import make_console
from ops.loadtest.client import read_events
from shared.models import resolve_model
from shared.settings import DEFAULT_MODEL, Settings

TOPOLOGIES = [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (4, 2)]  # (workers, replicas)


@dataclass
class Result:
    workers: int
    replicas: int
    requests_per_s: float
    tokens_per_s: float
    cpu: dict[str, float]  # cores used, by part


@dataclass
class Counts:
    requests: int = 0  # finished inside the window
    tokens: int = 0  # token events received inside the window


async def _client(base_url: str, body: dict[str, object], stop_at: float,
                  counts: Counts) -> None:
    """Back-to-back streaming requests; only what arrives before `stop_at` counts, so the
    requests still in flight at the end (queued ones can take several rounds) don't skew it."""
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        while time.monotonic() < stop_at:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    await asyncio.sleep(0.05)
                    continue
                async for _, events in read_events(response):
                    if time.monotonic() >= stop_at:
                        return
                    counts.tokens += sum(1 for e in events if e.text)
                counts.requests += 1


async def _drive(urls: list[str], args: argparse.Namespace) -> Counts:
    # Greedy: random sampling runs row by row on the worker, a cost of its own.
    body = {"model": DEFAULT_MODEL, "prompt": list(range(100, 116)), "max_tokens": args.tokens,
            "ignore_eos": True, "stream": True, "temperature": 0}
    counts = Counts()
    stop_at = time.monotonic() + args.seconds
    await asyncio.gather(*(_client(urls[i % len(urls)], body, stop_at, counts)
                           for i in range(args.concurrency)))
    return counts


def run(workers: int, replicas: int, redis_url: str, args: argparse.Namespace) -> Result:
    info = resolve_model(DEFAULT_MODEL, Settings().cache_dir)
    env = {**NO_AUTH, **UNBOUNDED_QUEUE, "REDSERVE_SYNTHETIC_STEP_MS": str(args.step_ms),
           "REDSERVE_MAX_RUNNING": str(args.max_running)}
    r = redis.Redis.from_url(redis_url)
    with Processes(redis_url, info.path, env=env, name="bench-broker") as procs:
        for i in range(workers):
            procs.worker(name=f"worker{i}")
        urls = [procs.api(name=f"api{i}") for i in range(replicas)]
        for url in urls:
            procs.wait_ready(url, workers, timeout=120)
        asyncio.run(_drive(urls, argparse.Namespace(**{**vars(args), "seconds": 2})))  # warm-up
        before = {name: procs.cpu_seconds(name) for name in procs.procs}
        redis_before, self_before = redis_cpu(r), self_cpu_seconds()
        t0 = time.monotonic()
        counts = asyncio.run(_drive(urls, args))
        wall = time.monotonic() - t0

        def cores(role: str) -> float:
            return sum(procs.cpu_seconds(n) - before[n] for n in procs.procs
                       if n.startswith(role)) / wall

        cpu = {"load generator": (self_cpu_seconds() - self_before) / wall,
               "redis": (redis_cpu(r) - redis_before) / wall,
               "api (all)": cores("api"), "workers (all)": cores("worker")}
    r.close()
    return Result(workers, replicas, counts.requests / args.seconds,
                  counts.tokens / args.seconds, cpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--step-ms", type=float, default=50.0, help="synthetic step time")
    ap.add_argument("--max-running", type=int, default=16, help="requests per worker step")
    ap.add_argument("--tokens", type=int, default=32, help="output tokens per request")
    ap.add_argument("--concurrency", type=int, default=96, help="concurrent client streams")
    ap.add_argument("--seconds", type=float, default=15.0)
    args = ap.parse_args()
    console = make_console()
    results: dict[tuple[int, int], Result] = {}
    with stack_redis_url() as redis_url:
        for workers, replicas in TOPOLOGIES:
            with console.status(f"{workers} worker(s), {replicas} replica(s)"):
                res = run(workers, replicas, redis_url, args)
            results[(workers, replicas)] = res
            console.print(f"{workers} worker(s), {replicas} replica(s): "
                          f"{res.requests_per_s:.1f} req/s, {res.tokens_per_s:.0f} tokens/s; "
                          + ", ".join(f"{k} {v:.2f} cores" for k, v in res.cpu.items()))
    _report(console, results, args)


def _report(console: Console, results: dict[tuple[int, int], Result],
            args: argparse.Namespace) -> None:
    capacity = 1000 / args.step_ms * args.max_running * 1  # tokens/s one worker can emit
    table = Table(title=f"broker scaling: synthetic step {args.step_ms:.0f} ms x "
                        f"{args.max_running} requests/worker ({capacity:.0f} tokens/s per worker), "
                        f"{args.tokens} tokens/request, {args.concurrency} client streams, "
                        f"{os.cpu_count()} CPU cores")
    for col in ("workers", "replicas", "req/s", "tokens/s", "x 1 worker", "x 1 replica",
                "load gen cores", "redis cores", "api cores", "worker cores"):
        table.add_column(col)
    for (workers, replicas), res in results.items():
        base_w = results.get((1, replicas))
        base_r = results.get((workers, 1))
        table.add_row(
            str(workers), str(replicas), f"{res.requests_per_s:.1f}", f"{res.tokens_per_s:.0f}",
            f"{res.tokens_per_s / base_w.tokens_per_s:.2f}" if base_w else "",
            f"{res.tokens_per_s / base_r.tokens_per_s:.2f}" if base_r else "",
            *(f"{v:.2f}" for v in res.cpu.values()),
        )
    console.print(table)
    busiest = {k: max(r.cpu[k] for r in results.values()) for k in next(iter(results.values())).cpu}
    console.print("highest CPU seen, in cores: " + ", ".join(f"{k} {v:.2f}"
                                                              for k, v in busiest.items()))


if __name__ == "__main__":
    main()
