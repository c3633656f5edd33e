"""What a Redis failover costs a redserve process, and what the opt-in admission WAIT costs.

    python -m ops.benchmarks.failover [--down-after-ms 1000] [--calls 2000]

On a loopback Valkey primary, one replica and three Sentinels (`ops/testkit/failover_lab.py`):

1. **WAIT's cost.** `--calls` admissions through the replica's own `api.queue.admission.Admission`
   (the admission script, shared/scripts/admit.py, with a request of `--prompt-tokens` prompt
   tokens), one at a time, alternately without a WAIT and with `WAIT 1 100` in the same
   pipeline, as `REDSERVE_ADMISSION_WAIT_REPLICAS=1` sends it: p50 and p99 of each. On loopback
   the difference is the replication round trip and nothing else; across zones add their
   network round trip. The queue is emptied every 16 calls (untimed), as workers taking
   requests would, so both arms see the same queue depths.
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

from api.queue.admission import Admission, QueueLimits, Replication
from ops.console import make_console
from ops.testkit.failover_lab import FailoverLab, LabConfig
from shared.keys import Keys, new_request_id
from shared.messages import GenerateRequest, SamplingParams
from shared.redis_conn import connect

WRITERS = 8
MODEL = "bench-model"
# Roomy enough that no admission is refused: the figure is an admitted request's.
LIMITS = QueueLimits(max_requests=1024, max_tokens=10**9, timeout_s=60, max_per_tenant=1024)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _request(prompt_tokens: int) -> GenerateRequest:
    now = time.time()
    return GenerateRequest(id=new_request_id("bench"), model=MODEL,
                           prompt_ids=tuple(range(1000, 1000 + prompt_tokens)),
                           params=SamplingParams(max_tokens=64, temperature=0.0), created=now,
                           queue_deadline=now + 60, deadline=now + 120)


async def wait_cost(lab: FailoverLab, calls: int, prompt_tokens: int
                    ) -> tuple[list[float], list[float]]:
    """Milliseconds per admission, without WAIT and with `WAIT 1 100`, alternating."""
    clients = connect(lab.url, name="bench-wait")
    keys = Keys("bench-wait")
    arms = [Admission(clients.commands, keys, LIMITS, request_ttl_s=600,
                      replication=Replication(replicas, 100)) for replicas in (0, 1)]
    model_keys = [keys.queued(MODEL), keys.requests(MODEL), keys.entries(MODEL),
                  keys.service(MODEL)]
    times: tuple[list[float], list[float]] = ([], [])
    try:
        for i in range(calls):
            if i % 16 == 0:
                await clients.commands.delete(*model_keys)
            arm = i % 2
            request = _request(prompt_tokens)
            t0 = time.perf_counter()
            admitted = await arms[arm].try_enqueue(request)
            times[arm].append((time.perf_counter() - t0) * 1000)
            assert admitted.refused is None, admitted.refused
        await clients.commands.delete(*model_keys)
    finally:
        await clients.close()
    return times


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
    parser.add_argument("--prompt-tokens", type=int, default=400,
                        help="the admitted request's prompt (400: a body of about 2 KB)")
    args = parser.parse_args()
    console = make_console()
    lab = FailoverLab(LabConfig(down_after_ms=args.down_after_ms)).start()
    try:
        alone, waited = asyncio.run(wait_cost(lab, args.calls, args.prompt_tokens))
        table = Table(title=f"the admission script, {args.calls} calls "
                            f"({args.prompt_tokens} prompt tokens), loopback")
        for column in ("", "p50 ms", "p99 ms"):
            table.add_column(column)
        for name, values in (("admission", alone), ("admission + WAIT 1", waited)):
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
