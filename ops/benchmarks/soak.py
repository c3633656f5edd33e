"""A soak: does a `redserve up` kept busy for a long time hold its memory and its keys flat?

    python -m ops.benchmarks.soak [--minutes 30] [--clients 6] [--restart-every 5]

A leak shows only over time: a per-request key whose TTL is missed, a dict in the replica that
keeps an entry for each finished stream, a worker's pages never returned. So this keeps one
`redserve up` (its own embedded Redis, one replica, `--workers` workers, the default model)
under a steady mixed load from two tenants for `--minutes`, and SIGKILLs one worker every
`--restart-every` minutes (`up` restarts it; another worker, or the restarted one, takes its
requests over). The load's clients loop over five kinds of request: a streamed chat, a chat
with `n` = 2, a JSON-schema structured output, a completion, and a stream cancelled after a
few tokens, each through the official `openai` client.

Sampled every `--sample-s`: the RSS of the replica and of each worker, Redis's `used_memory`
and its key count. After the warm-up (`--warmup-minutes`, longer than the 5 minutes a finished
request's keys are kept, over which the key count rises by design), each figure's slope is
fitted by least squares; a worker's over each of its lives, after its own warm-up
(`--worker-warmup-minutes`: its memory does not wait on key TTLs).
Targets: RSS slope at most 20 MiB/hour, Redis memory and keys flat (their slopes are printed
beside their means), no error. A cancelled stream is not an error; any other exception or
failed request is, counted by its kind.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import openai
import redis
from openai.types.chat import ChatCompletionMessageParam
from rich.table import Table

from ops.benchmarks.lifecycle import running_stack
from ops.benchmarks.machine import descendants, describe
from ops.console import make_console
from shared.settings import DEFAULT_MODEL

console = make_console()
TENANTS = {"soak-a": "key-soak-a", "soak-b": "key-soak-b"}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
KINDS = ("stream", "n2", "json", "completion", "cancel")
SLOPE_LIMIT_MIB_PER_HOUR = 20


@dataclass
class Samples:
    """(seconds since start, value) series, a worker's keyed by its pid (one per life)."""
    api: list[tuple[float, float]] = field(default_factory=list)
    workers: dict[int, list[tuple[float, float]]] = field(default_factory=dict)
    redis_memory: list[tuple[float, float]] = field(default_factory=list)
    redis_keys: list[tuple[float, float]] = field(default_factory=list)


def _rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _role(pid: int) -> str | None:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\x00")
    except OSError:
        return None
    for role in (b"api", b"worker"):
        if role in argv:
            return role.decode()
    return None


def _workers(up_pid: int) -> list[int]:
    return [p for p in descendants(up_pid) if _role(p) == "worker"]


def _slope_per_hour(series: list[tuple[float, float]], after_s: float) -> float | None:
    points = [(t, v) for t, v in series if t >= after_s]
    if len(points) < 3:
        return None
    slope, _ = statistics.linear_regression([t for t, _ in points], [v for _, v in points])
    return slope * 3600


async def _client(base: str, tenant: int, rng: random.Random, stop: float,
                  outcomes: Counter[str]) -> None:
    key = list(TENANTS.values())[tenant % len(TENANTS)]
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=300)
    topic = f"Tell me about the number {rng.randint(0, 999)}."
    chat: list[ChatCompletionMessageParam] = [{"role": "user", "content": topic}]
    while time.monotonic() < stop:
        kind = rng.choice(KINDS)
        try:
            if kind == "stream":
                stream = await client.chat.completions.create(
                    model=DEFAULT_MODEL, messages=chat, max_tokens=64, stream=True)
                async for _ in stream:
                    pass
            elif kind == "n2":
                await client.chat.completions.create(
                    model=DEFAULT_MODEL, messages=chat, max_tokens=32, n=2, temperature=0.8)
            elif kind == "json":
                await client.chat.completions.create(
                    model=DEFAULT_MODEL, messages=chat, max_tokens=48,
                    response_format={"type": "json_schema", "json_schema": {
                        "name": "person", "schema": SCHEMA}})
            elif kind == "completion":
                await client.completions.create(model=DEFAULT_MODEL, prompt="Once upon a time",
                                                max_tokens=48)
            else:
                stream = await client.chat.completions.create(
                    model=DEFAULT_MODEL, messages=chat, max_tokens=256, stream=True)
                seen = 0
                async for _ in stream:
                    seen += 1
                    if seen >= rng.randint(1, 5):
                        break
                await stream.close()
            outcomes[f"{kind}: ok"] += 1
        except openai.APIError as error:
            outcomes[f"{kind}: error {type(error).__name__}: {str(error)[:80]}"] += 1
    await client.close()


async def _sample(up_pid: int, api_pid: int, redis_url: str, t0: float, stop: float,
                  every_s: float, samples: Samples) -> None:
    r = redis.Redis.from_url(redis_url)
    while time.monotonic() < stop:
        now = time.monotonic() - t0
        if (api := _rss_mib(api_pid)) is not None:
            samples.api.append((now, api))
        for pid in _workers(up_pid):
            if (rss := _rss_mib(pid)) is not None:
                samples.workers.setdefault(pid, []).append((now, rss))
        samples.redis_memory.append((now, r.info("memory")["used_memory"] / 2**20))
        samples.redis_keys.append((now, float(r.dbsize())))
        await asyncio.sleep(every_s)
    r.close()


async def _restarts(up_pid: int, every_s: float, stop: float, killed: list[int]) -> None:
    while time.monotonic() + every_s < stop:
        await asyncio.sleep(every_s)
        if workers := _workers(up_pid):
            victim = random.choice(workers)
            os.kill(victim, signal.SIGKILL)
            killed.append(victim)


async def _soak(args: argparse.Namespace, base: str, redis_url: str, api_pid: int,
                up_pid: int) -> None:
    rng = random.Random(0)
    t0 = time.monotonic()
    stop = t0 + args.minutes * 60
    samples, outcomes, killed = Samples(), Counter[str](), list[int]()
    with console.status(f"soaking for {args.minutes} min"):
        await asyncio.gather(
            _sample(up_pid, api_pid, redis_url, t0, stop, args.sample_s, samples),
            _restarts(up_pid, args.restart_every * 60, stop, killed),
            *(_client(base, i, random.Random(rng.random()), stop, outcomes)
              for i in range(args.clients)))
    _report(args, samples, outcomes, killed)


def _report(args: argparse.Namespace, samples: Samples, outcomes: Counter[str],
            killed: list[int]) -> None:
    warm = args.warmup_minutes * 60
    table = Table(title=f"soak: {args.minutes} min, {args.clients} clients, "
                        f"{len(killed)} worker kills, slopes after {args.warmup_minutes} min")
    for col in ("figure", "mean", "slope / hour", "target"):
        table.add_column(col)

    def row(name: str, series: list[tuple[float, float]], unit: str, target: str,
            after_s: float = warm) -> None:
        slope = _slope_per_hour(series, after_s)
        mean = statistics.fmean(v for _, v in series) if series else float("nan")
        table.add_row(name, f"{mean:.1f} {unit}",
                      "too few samples" if slope is None else f"{slope:+.1f} {unit}", target)

    limit = f"<= {SLOPE_LIMIT_MIB_PER_HOUR} MiB/h"
    row("API replica RSS", samples.api, "MiB", limit)
    for pid, series in samples.workers.items():
        # Each life warms up anew: its slope is fitted from its own start + the warm-up.
        start = series[0][0]
        lived = [(t - start, v) for t, v in series]
        row(f"worker {pid} RSS ({lived[-1][0] / 60:.1f} min)", lived, "MiB", limit,
            args.worker_warmup_minutes * 60)
    row("Redis used_memory", samples.redis_memory, "MiB", "flat")
    row("Redis keys", samples.redis_keys, "keys", "flat")
    console.print(table)
    errors = sum(n for outcome, n in outcomes.items() if ": ok" not in outcome)
    for outcome, n in sorted(outcomes.items()):
        console.print(f"{n:6d}  {outcome}")
    console.print(f"errors: {errors} (target 0)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--warmup-minutes", type=float, default=6,
                    help="past the 5 minutes a finished request's keys live (finished_ttl_s)")
    ap.add_argument("--worker-warmup-minutes", type=float, default=1)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--restart-every", type=float, default=5, help="minutes between kills")
    ap.add_argument("--sample-s", type=float, default=10)
    args = ap.parse_args()
    console.print(describe())
    env = {"REDSERVE_API_KEYS": ",".join(f"{t}:{k}" for t, k in TENANTS.items())}
    options = ["--workers", str(args.workers)]
    with running_stack(DEFAULT_MODEL, DEFAULT_MODEL, env, options) as (base, redis_url, api_pid):
        up_pid = int(Path(f"/proc/{api_pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        asyncio.run(_soak(args, base, redis_url, api_pid, up_pid))


if __name__ == "__main__":
    main()
