"""Fair share across tenants, measured: a light tenant's time to first token alone, then beside
a tenant sending ten times its load, with the queue taken first-come first-served and with the
fair share (worker/broker/take.py), side by side in one run.

    python -m ops.benchmarks.fairness [--duration 30] [--max-tokens 32] [--light-rps X]
                              [--heavy-factor 10] [--max-running 8] [--synthetic-step-ms X]

Starts its own Valkey, one `redserve api` with an API key per tenant, and one `redserve worker`
(the default model, or the fixed-time stand-in of worker/engine/synthetic.py with
`--synthetic-step-ms`, for a quick check), restarted with REDSERVE_QUEUE_POLICY=fifo, then
fair. The worker's capacity is measured first (`--max-running` streams back to back); the light
tenant then sends a tenth of it (unless `--light-rps`), Poisson arrivals of streaming greedy
completions (ignore_eos, `--max-tokens` each), and its TTFT (send to first text chunk) is taken:
alone, then with the heavy tenant sending `--heavy-factor` times as many, which overloads the
worker, so a queue forms. What the heavy tenant still has queued or running when a phase ends
is cancelled (the cancel path), and the next phase starts on an empty queue.
Target: the light tenant's TTFT p99 under the fair share <= 1.5x its TTFT p99 alone (the FIFO
figure beside it).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from dataclasses import dataclass, field

import httpx
import redis
from rich.console import Console
from rich.table import Table

from ops.benchmarks.harness.client import body, stream
from ops.benchmarks.harness.stack import Processes, redis_url
from ops.benchmarks.machine import describe
from ops.console import make_console
from ops.loadtest.client import StreamError
from shared.keys import Keys
from shared.models import resolve_model
from shared.settings import DEFAULT_MODEL, Settings

RATIO_TARGET = 1.5
API_KEY_OF = {"light": "sk-light-0123456789", "heavy": "sk-heavy-0123456789",
              "probe": "sk-probe-0123456789"}  # probe: the capacity measurement
CALIBRATE_S = 10.0


@dataclass
class Phase:
    name: str
    ttfts: list[float] = field(default_factory=list)  # the light tenant's, in seconds
    sent: dict[str, int] = field(default_factory=lambda: {"light": 0, "heavy": 0})
    refused: dict[str, int] = field(default_factory=lambda: {"light": 0, "heavy": 0})

    def p(self, q: float) -> float:
        ordered = sorted(self.ttfts)
        return ordered[min(int(q * len(ordered)), len(ordered) - 1)] if ordered else float("nan")


async def _request(client: httpx.AsyncClient, tenant: str, max_tokens: int, n: int
                   ) -> float | None:
    """One streaming completion; its TTFT, or None when refused (429)."""
    request = body(DEFAULT_MODEL, max_tokens, prompt=f"Request {n} of {tenant}: a story",
                   ignore_eos=True)
    try:
        reply = await stream(client, "", request,
                             headers={"Authorization": f"Bearer {API_KEY_OF[tenant]}"})
    except StreamError as e:
        if str(e).startswith("HTTP 429"):
            return None
        raise
    return reply.ttft


async def _tenant(client: httpx.AsyncClient, phase: Phase, tenant: str, rps: float,
                  duration: float, max_tokens: int, tasks: set[asyncio.Task[None]]) -> None:
    """Poisson arrivals at `rps` for `duration` seconds."""
    rng = random.Random(f"{tenant}-{phase.name}")

    async def one(n: int) -> None:
        ttft = await _request(client, tenant, max_tokens, n)
        if ttft is None:
            phase.refused[tenant] += 1
        elif tenant == "light":
            phase.ttfts.append(ttft)

    end = time.monotonic() + duration
    n = 0
    while (wait := rng.expovariate(rps)) < end - time.monotonic():
        await asyncio.sleep(wait)
        phase.sent[tenant] += 1
        n += 1
        task = asyncio.create_task(one(n))
        tasks.add(task)
        task.add_done_callback(tasks.discard)


async def _run_phase(url: str, phase: Phase, rates: dict[str, float], args: argparse.Namespace
                     ) -> None:
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=200)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        by_tenant: dict[str, set[asyncio.Task[None]]] = {t: set() for t in rates}
        await asyncio.gather(*(_tenant(client, phase, t, rps, args.duration, args.max_tokens,
                                       by_tenant[t]) for t, rps in rates.items()))
        if by_tenant.get("light"):  # every light request measured to its end
            await asyncio.gather(*by_tenant["light"])
        for task in by_tenant.get("heavy", set()):  # the rest of the flood: cancelled
            task.cancel()
        await asyncio.gather(*by_tenant.get("heavy", set()), return_exceptions=True)


async def _capacity(url: str, streams: int, max_tokens: int) -> float:
    """Completions per second with `streams` clients back to back."""
    done = 0
    end = time.monotonic() + CALIBRATE_S

    async def client_loop(client: httpx.AsyncClient, i: int) -> None:
        nonlocal done
        n = 0
        while time.monotonic() < end:
            await _request(client, "probe", max_tokens, 10_000 * i + n)
            n += 1
            done += 1

    started = time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        await asyncio.gather(*(client_loop(client, i) for i in range(streams)))
    return done / (time.monotonic() - started)


def _settle(r: redis.Redis, keys: Keys, timeout: float = 120.0) -> None:
    """Until nothing of a phase is left queued or unfinished; then the tenants' service
    counters start again from zero, so each phase stands alone."""
    stream, queued = keys.requests(DEFAULT_MODEL), keys.queued(DEFAULT_MODEL)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (r.xlen(stream) or r.zcard(queued)):
        time.sleep(0.2)
    r.delete(keys.service(DEFAULT_MODEL))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of load per phase")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--light-rps", type=float, default=None,
                    help="the light tenant's requests/s (default: a tenth of the capacity)")
    ap.add_argument("--heavy-factor", type=float, default=10.0)
    ap.add_argument("--max-running", type=int, default=8, help="the worker's batch")
    ap.add_argument("--synthetic-step-ms", type=float, default=None,
                    help="replace the model by a fixed-time stand-in (worker/engine/synthetic.py)")
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    args = ap.parse_args()
    console = make_console()
    phases: list[Phase] = []
    model = resolve_model(DEFAULT_MODEL, Settings().cache_dir)
    console.print(describe())
    what = (f"synthetic model, {args.synthetic_step_ms:g} ms a step"
            if args.synthetic_step_ms is not None else f"{DEFAULT_MODEL} ({model.path})")
    console.print(f"model: {what}; worker --max-running {args.max_running}; "
                  f"{args.max_tokens} tokens a request; {args.duration:g} s a phase")
    env = {"REDSERVE_MAX_RUNNING": str(args.max_running),
           "REDSERVE_API_KEYS": ",".join(f"{t}:{k}" for t, k in API_KEY_OF.items())}
    if args.synthetic_step_ms is not None:
        env["REDSERVE_SYNTHETIC_STEP_MS"] = str(args.synthetic_step_ms)
    with (redis_url() as url, Processes(url, model.path, env=env, name="bench-fair") as procs,
          redis.Redis.from_url(url) as r):
        keys = Keys(procs.prefix)
        api = procs.api()  # one replica for the run; the worker restarted for each policy
        for policy in ("fifo", "fair"):
            with console.status(f"starting the worker ({policy})"):
                procs.worker(env={"REDSERVE_QUEUE_POLICY": policy})
                procs.wait_ready(api, timeout=args.startup_timeout)
            if not phases:
                with console.status("measuring the worker's capacity"):
                    capacity = asyncio.run(_capacity(api, args.max_running, args.max_tokens))
                light = args.light_rps or capacity / 10
                console.print(f"capacity {capacity:.2f} requests/s; light tenant {light:.2f}/s,"
                              f" heavy {light * args.heavy_factor:.2f}/s")
                _settle(r, keys)
                phases.append(Phase("light alone"))
                with console.status("light tenant alone"):
                    asyncio.run(_run_phase(api, phases[-1], {"light": light}, args))
                _settle(r, keys)
            phases.append(Phase(f"with heavy, {policy}"))
            with console.status(f"light + heavy, {policy}"):
                asyncio.run(_run_phase(api, phases[-1],
                                       {"light": light, "heavy": light * args.heavy_factor},
                                       args))
            _settle(r, keys)
    _report(console, phases)


def _report(console: Console, phases: list[Phase]) -> None:
    alone = phases[0].p(0.99) if phases else float("nan")
    table = Table(title="the light tenant's TTFT (send to first text chunk)")
    for col in ("phase", "light sent", "heavy sent", "heavy refused (429)", "TTFT p50 s",
                "TTFT p99 s", "p99 / alone"):
        table.add_column(col, justify="left" if col == "phase" else "right")
    for ph in phases:
        table.add_row(ph.name, str(ph.sent["light"]), str(ph.sent["heavy"]),
                      str(ph.refused["heavy"]), f"{ph.p(0.5):.3f}", f"{ph.p(0.99):.3f}",
                      f"{ph.p(0.99) / alone:.2f}x")
    console.print(table)
    fair = next((ph for ph in phases if ph.name.endswith("fair")), None)
    if fair is not None:
        ratio = fair.p(0.99) / alone
        console.print(
            f"fair share: light TTFT p99 {ratio:.2f}x alone (target <= {RATIO_TARGET:g}x): "
            f"{'met' if ratio <= RATIO_TARGET else 'missed'}", markup=False)


if __name__ == "__main__":
    main()
