"""What Redis costs per generated token, end to end: commands and Redis CPU under concurrent
streams, so the broker's overhead is a number checked against its targets, not a guess.

    python -m ops.benchmarks.redis_cost [--streams 32] [--requests 3] [--max-tokens 64 256]
                              [--synthetic-step-ms X] [--redis-url URL]

Starts its own Valkey (so the server's stats are this run's alone; `--redis-url` points at
another server instead, whose stats CONFIG RESETSTAT then resets), one `redserve api` and one
`redserve worker` (the default model, or the fixed-time stand-in of worker/engine/synthetic.py with
`--synthetic-step-ms`). For each `--max-tokens` value, nothing restarted in between: CONFIG
RESETSTAT, then `--streams` concurrent clients each send `--requests` greedy streaming
completions back to back (ignore_eos, tokens counted from each stream's usage chunk); once
every request has finished, INFO commandstats and INFO cpu give every command any process sent
(enqueue, intake, tokens, aborts, finish, heartbeats, reads; commands run inside Lua scripts
count too: they appear in commandstats beside the EVALSHA) and the server's CPU.
Targets, at 32 streams: <= 1.1 commands per generated token and <= 10 ms of Redis CPU
(used_cpu_user + used_cpu_sys) per 1,000 generated tokens. Redis spends CPU even idle (its
timers, the stack's heartbeats), which at a CPU model's pace is a large share per token: the
idle rate is measured before each load and the CPU is also given above it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import redis
from rich.console import Console
from rich.table import Table

from ops.benchmarks.harness.client import TOPICS, body, stream
from ops.benchmarks.harness.stack import NO_AUTH, UNBOUNDED_QUEUE, Processes, redis_cpu
from ops.benchmarks.harness.stack import redis_url as stack_redis_url
from ops.benchmarks.machine import describe
from ops.console import make_console
from shared.models import resolve_model
from shared.settings import DEFAULT_MODEL, Settings

COMMANDS_PER_TOKEN_TARGET = 1.1
CPU_MS_PER_1K_TARGET = 10.0
# The benchmark's own commands inside the window: the RESETSTAT that opens it (INFO
# commandstats, which closes it, is not yet counted when it answers).
OWN_COMMANDS = {"config|resetstat": 1}
# After the last stream closes, the worker may still be acknowledging its last requests.
SETTLE_S = 0.2
# Before each load: how much CPU Redis spends with the stack idle (reported beside the gross).
IDLE_S = 5.0


@dataclass
class Window:
    max_tokens: int
    tokens: int
    requests: int
    seconds: float
    cpu_s: float  # Redis used_cpu_user + used_cpu_sys
    commands: dict[str, tuple[int, float]]  # name -> (calls, usec per call)
    idle_cpu_rate: float = 0.0  # Redis CPU seconds per second with the stack idle

    @property
    def busy_cpu_ms_per_1k(self) -> float:
        """Above what Redis spends idle (its timers, the stack's heartbeats) as long."""
        busy = self.cpu_s - self.idle_cpu_rate * self.seconds
        return busy * 1e6 / self.tokens if self.tokens else float("inf")

    @property
    def calls(self) -> int:
        return sum(calls for calls, _ in self.commands.values())

    @property
    def per_token(self) -> float:
        return self.calls / self.tokens if self.tokens else float("inf")

    @property
    def cpu_ms_per_1k(self) -> float:
        return self.cpu_s * 1e6 / self.tokens if self.tokens else float("inf")


def _commandstats(r: redis.Redis) -> dict[str, tuple[int, float]]:
    stats: dict[str, tuple[int, float]] = {}
    for key, value in r.info("commandstats").items():
        name = str(key).removeprefix("cmdstat_")
        calls = int(value["calls"]) - OWN_COMMANDS.get(name, 0)
        if calls > 0:
            stats[name] = (calls, float(value["usec"]) / int(value["calls"]))
    return stats


async def _client(client: httpx.AsyncClient, i: int, requests: int,
                  max_tokens: int) -> int:
    """`requests` streaming completions back to back; the tokens their usage chunks report."""
    tokens = 0
    for n in range(requests):
        prompt = f"Once upon a time, {TOPICS[i % len(TOPICS)]} (story {i}.{n})"
        reply = await stream(client, "", body(DEFAULT_MODEL, max_tokens, prompt=prompt,
                                              ignore_eos=True))
        if reply.usage is None:
            raise RuntimeError("a stream ended without its usage chunk")
        tokens += reply.tokens
    return tokens


async def _load(url: str, streams: int, requests: int, max_tokens: int) -> int:
    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=limits) as client:
        counts = await asyncio.gather(*(_client(client, i, requests, max_tokens)
                                        for i in range(streams)))
    return sum(counts)


def idle_rate(r: redis.Redis, seconds: float = IDLE_S) -> float:
    """Redis CPU seconds per second while the stack is up but idle."""
    before = redis_cpu(r)
    time.sleep(seconds)
    return (redis_cpu(r) - before) / seconds


def measure(r: redis.Redis, url: str, args: argparse.Namespace, max_tokens: int) -> Window:
    idle = idle_rate(r)
    cpu_before = redis_cpu(r)
    r.config_resetstat()
    t0 = time.perf_counter()
    tokens = asyncio.run(_load(url, args.streams, args.requests, max_tokens))
    seconds = time.perf_counter() - t0
    time.sleep(SETTLE_S)
    commands = _commandstats(r)
    cpu_s = redis_cpu(r) - cpu_before
    return Window(max_tokens, tokens, args.streams * args.requests, seconds, cpu_s, commands,
                  idle)


def _serving(redis_url: str, model: Path, step_ms: float | None) -> tuple[Processes, str]:
    """One `redserve api` and one `redserve worker` against `redis_url`; the replica's URL."""
    env = {**NO_AUTH, **UNBOUNDED_QUEUE, "REDSERVE_MAX_RUNNING": "32"}
    if step_ms is not None:
        env["REDSERVE_SYNTHETIC_STEP_MS"] = str(step_ms)
    procs = Processes(redis_url, model, env=env, name="bench-redis")
    procs.worker()
    return procs, procs.api()


def _server_version(r: redis.Redis) -> str:
    info: dict[str, Any] = r.info("server")
    if "valkey_version" in info:
        return f"{info.get('server_name', 'valkey')} {info['valkey_version']}"
    return f"redis {info.get('redis_version', '?')}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--streams", type=int, default=32, help="concurrent clients (default 32)")
    ap.add_argument("--requests", type=int, default=3,
                    help="streaming requests each client sends back to back (default 3)")
    ap.add_argument("--max-tokens", type=int, nargs="+", default=[64, 256],
                    help="max_tokens of each measurement, one measurement per value "
                         "(default 64 256)")
    ap.add_argument("--synthetic-step-ms", type=float, default=None,
                    help="replace the model by a fixed-time stand-in (worker/engine/synthetic.py)")
    ap.add_argument("--redis-url", default=None,
                    help="use this server instead of an embedded Valkey (its stats are reset)")
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    args = ap.parse_args()
    console = make_console()
    if args.redis_url is not None:
        os.environ["REDIS_URL"] = args.redis_url  # the harness's Redis: this one
        console.print(f"[bold yellow]warning:[/] CONFIG RESETSTAT resets the command statistics "
                      f"of {args.redis_url}, and anything else it serves adds to the figures")
    else:
        os.environ.pop("REDIS_URL", None)  # an embedded Valkey: its stats are this run's alone
    windows: list[Window] = []
    with stack_redis_url() as redis_url, redis.Redis.from_url(redis_url) as r:
        r.ping()  # connect now: no handshake commands inside a window
        model = resolve_model(DEFAULT_MODEL, Settings().cache_dir)
        console.print(describe())
        what = (f"synthetic model, {args.synthetic_step_ms:g} ms a step"
                if args.synthetic_step_ms is not None else f"{DEFAULT_MODEL} ({model.path})")
        where = redis_url if args.redis_url else "embedded"
        console.print(f"Redis: {_server_version(r)} ({where})"
                      f"\nload: {args.streams} streams x {args.requests} requests, max_tokens "
                      f"{' '.join(map(str, args.max_tokens))}\nmodel: {what}")
        procs, api = _serving(redis_url, model.path, args.synthetic_step_ms)
        with procs:
            with console.status("starting redserve api and worker"):
                procs.wait_ready(api, timeout=args.startup_timeout)
            with console.status("warm-up"):
                asyncio.run(_load(api, 4, 1, 8))
            for max_tokens in args.max_tokens:
                with console.status(f"{args.streams} streams x {args.requests} requests x "
                                    f"{max_tokens} tokens"):
                    windows.append(measure(r, api, args, max_tokens))
                _report(console, args, windows[-1])
    _targets(console, windows)


def _report(console: Console, args: argparse.Namespace, w: Window) -> None:
    table = Table(title=f"Redis per generated token: {args.streams} streams x {args.requests} "
                        f"requests x max_tokens {w.max_tokens}")
    for col in ("generated tokens", "requests", "commands", "commands/token",
                "commands/request", "Redis CPU ms/1k tokens", "above idle", "idle ms/s",
                "wall s", "tokens/s"):
        table.add_column(col, justify="right")
    table.add_row(str(w.tokens), str(w.requests), str(w.calls), f"{w.per_token:.3f}",
                  f"{w.calls / w.requests:.1f}", f"{w.cpu_ms_per_1k:.2f}",
                  f"{w.busy_cpu_ms_per_1k:.2f}", f"{w.idle_cpu_rate * 1000:.2f}",
                  f"{w.seconds:.1f}", f"{w.tokens / w.seconds:.1f}")
    console.print(table)
    breakdown = Table(title=f"commands by name, max_tokens {w.max_tokens} (Lua scripts' "
                            "commands included)")
    for col in ("command", "calls", "calls/token", "usec/call", "usec total"):
        breakdown.add_column(col, justify="left" if col == "command" else "right")
    for name, (calls, usec) in sorted(w.commands.items(), key=lambda kv: -kv[1][0]):
        breakdown.add_row(name, str(calls), f"{calls / w.tokens:.3f}" if w.tokens else "-",
                          f"{usec:.2f}", f"{calls * usec:.0f}")
    console.print(breakdown)


def _targets(console: Console, windows: list[Window]) -> None:
    """One line per target: the worst run decides; each run's figure follows."""
    if not windows:
        return
    worst = max(w.per_token for w in windows)
    each = ", ".join(f"max_tokens {w.max_tokens}: {w.per_token:.3f}" for w in windows)
    console.print(f"commands/token {worst:.3f} (target <= {COMMANDS_PER_TOKEN_TARGET:g}): "
                  f"{'met' if worst <= COMMANDS_PER_TOKEN_TARGET else 'missed'} ({each})",
                  markup=False)
    for label, value in (("", lambda w: w.cpu_ms_per_1k),
                         (" above idle", lambda w: w.busy_cpu_ms_per_1k)):
        worst = max(value(w) for w in windows)
        each = ", ".join(f"max_tokens {w.max_tokens}: {value(w):.2f}" for w in windows)
        console.print(f"Redis CPU{label} {worst:.2f} ms per 1,000 tokens (target <= "
                      f"{CPU_MS_PER_1K_TARGET:g}): "
                      f"{'met' if worst <= CPU_MS_PER_1K_TARGET else 'missed'} ({each})",
                      markup=False)


if __name__ == "__main__":
    main()
