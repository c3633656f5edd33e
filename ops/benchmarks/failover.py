"""What a Redis failover costs a redserve process, and what the opt-in admission WAIT costs.

    python -m ops.benchmarks.failover [--down-after-ms 1000] [--calls 2000]

On a loopback Valkey primary, one replica and three Sentinels (`ops/testkit/failover_lab.py`):

1. **WAIT's cost.** `--calls` admissions-sized writes (a Lua script that XADDs a 2 KB body and
   sets a hash, as the admission script roughly does) run one at a time, alone and then in one
   pipeline with `WAIT 1 100` as `REDSERVE_ADMISSION_WAIT_REPLICAS=1` sends them: p50 and p99
   of each, and the difference. On loopback this is the replication round trip and nothing
   else; across zones add their network round trip.
2. **Stall per case.** Eight writers on the project's own client (`shared/redis_conn.connect`
   with the redis+sentinel:// URL) write every 10 ms while the primary goes by `SENTINEL
   FAILOVER`, SIGKILL, or SIGSTOP past down-after and SIGCONT. Per case: the longest time a
   writer went without a successful write (p50 and max over writers) and the errors they saw.
   That is the floor under what a request sees end to end (tests/test_failover.py prints those
   for 32 streams through the whole stack).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from rich.table import Table

from ops.console import make_console
from ops.testkit.failover_lab import FailoverLab, LabConfig
from shared.redis_conn import connect

LUA = "redis.call('XADD', KEYS[1], '*', 'body', ARGV[1]); " \
      "redis.call('HSET', KEYS[2], 'state', 'queued'); return 1"
WRITERS = 8


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def wait_cost(lab: FailoverLab, calls: int) -> tuple[list[float], list[float]]:
    clients = connect(lab.url, name="bench-wait")
    script = clients.commands.register_script(LUA)
    body = "x" * 2048
    alone, waited = [], []
    try:
        for i in range(calls):
            keys = [f"bench:stream:{i % 16}", f"bench:hash:{i}"]
            t0 = time.perf_counter()
            await script(keys=keys, args=[body])
            alone.append((time.perf_counter() - t0) * 1000)
            pipe = clients.commands.pipeline(transaction=False)
            await script(keys=keys, args=[body], client=pipe)
            pipe.wait(1, 100)
            t0 = time.perf_counter()
            _, acknowledged = await pipe.execute()
            waited.append((time.perf_counter() - t0) * 1000)
            assert acknowledged == 1
        await clients.commands.delete(*[f"bench:stream:{i}" for i in range(16)])
    finally:
        await clients.close()
    return alone, waited


async def stall(lab: FailoverLab, case: str) -> tuple[list[float], int]:
    clients = connect(lab.url, name=f"bench-{case}")
    stop = asyncio.Event()
    errors = 0

    async def writer(n: int) -> float:
        nonlocal errors
        last_ok, longest = time.monotonic(), 0.0
        while not stop.is_set():
            try:
                await clients.commands.incr(f"bench:writer:{n}")
                now = time.monotonic()
                longest, last_ok = max(longest, now - last_ok), now
            except Exception:  # every error a caller would see counts
                errors += 1
            await asyncio.sleep(0.01)
        return longest

    tasks = [asyncio.create_task(writer(n)) for n in range(WRITERS)]
    await asyncio.sleep(1.0)
    old = await asyncio.to_thread(_disturb, lab, case)
    await asyncio.sleep(2.0)
    stop.set()
    longest = await asyncio.gather(*tasks)
    await clients.close()
    if case == "kill":
        lab.restart(old)
    lab.wait_settled()
    return list(longest), errors


def _disturb(lab: FailoverLab, case: str) -> int:
    """Make the primary go; back once the Sentinels have promoted the replica."""
    if case == "failover":
        old = lab.primary_port()
        lab.failover()
    elif case == "kill":
        old = lab.kill_primary()
    else:
        old = lab.pause_primary()
    lab.wait_primary_moved(old)
    if case == "pause":
        time.sleep(0.5)
        lab.resume(old)
    return old


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--down-after-ms", type=int, default=1000)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    console = make_console()
    lab = FailoverLab(LabConfig(down_after_ms=args.down_after_ms)).start()
    try:
        alone, waited = asyncio.run(wait_cost(lab, args.calls))
        table = Table(title=f"admission-sized script, {args.calls} calls, loopback")
        for column in ("", "p50 ms", "p99 ms"):
            table.add_column(column)
        for name, values in (("script", alone), ("script + WAIT 1", waited)):
            table.add_row(name, f"{statistics.median(values):.3f}",
                          f"{_quantile(values, 0.99):.3f}")
        console.print(table)
        table = Table(title=f"longest write stall per writer, down-after {args.down_after_ms} ms")
        for column in ("case", "p50 s", "max s", "errors"):
            table.add_column(column)
        for case in ("failover", "kill", "pause"):
            longest, errors = asyncio.run(stall(lab, case))
            table.add_row(case, f"{statistics.median(longest):.2f}", f"{max(longest):.2f}",
                          str(errors))
        console.print(table)
    finally:
        lab.stop()


if __name__ == "__main__":
    main()
