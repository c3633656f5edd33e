"""Lifecycle benchmarks on a live `redserve up` (embedded Redis, one replica, one worker).

    python -m ops.benchmarks.lifecycle cancel [--cancels 200] [--load 8]
    python -m ops.benchmarks.lifecycle slow [--streams 200] [--seconds 60]

cancel: while `--load` long streams keep the worker busy, clients open streams, read 1-5
  events and hang up. For each, the latency is from the hang-up to the worker's abort entry
  (published right after the request's KV is freed; Redis stamps the entry id with its clock,
  the same clock as this process). Reported in ms and in decode steps (the median interval
  between consecutive tokens of the load streams). Target: p99 within 2 decode steps.
slow: `--streams` clients read one event a second for `--seconds`, on sockets with a small
  receive buffer (a slow link), against a fast model (a tiny random Llama with SmolLM2's
  tokenizer, so the server is always ahead). The API replica's RSS is sampled throughout and
  compared with its idle figure. Target: within 50 MB.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import socket
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import cast

import httpx
import redis
from rich.table import Table

from ops.benchmarks.harness import stack
from ops.console import make_console
from ops.loadtest.client import read_events
from ops.testkit.probe import wait_healthy
from shared.keys import Keys
from shared.messages import Finish, decode_result, is_terminal
from shared.models import resolve_model
from shared.redis_conn import StreamEntries
from shared.settings import DEFAULT_MODEL, Settings

console = make_console()
PREFIX = "rsbench"


@contextmanager
def running_stack(model: str, served: str, env: dict[str, str],
                  options: Sequence[str] = ()) -> Iterator[tuple[str, str, int]]:
    """(API base URL, Redis URL, API pid) of a fresh `redserve up` given `options`, once its
    replica answers /health (a request may need an API key `env` sets)."""
    with stack.redis_url() as url:
        env = {**env, "REDIS_URL": url, "REDSERVE_KEY_PREFIX": PREFIX}
        with stack.up("--model", model, "--served-model-name", served, *options, env=env,
                      model=served) as server:
            if not wait_healthy(server.base, lambda: server.proc.poll() is None, 300):
                raise RuntimeError("redserve up did not become healthy")
            yield server.base, url, server.child("api")


def _percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def _entries(r: redis.Redis, key: str) -> StreamEntries:
    return cast(StreamEntries, r.xrange(key))


def _entry_ms(entry_id: bytes) -> int:
    return int(entry_id.split(b"-")[0])


async def _cancel_bench(base: str, redis_url: str, cancels: int, load: int) -> None:
    keys = Keys(PREFIX)
    r = redis.Redis.from_url(redis_url)
    stop = asyncio.Event()
    load_ids: list[str] = []

    async def load_stream(client: httpx.AsyncClient) -> None:
        body = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "Tell a story."}],
                "max_tokens": 64, "ignore_eos": True, "stream": True}
        while not stop.is_set():
            async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                load_ids.append(resp.headers["x-request-id"])
                async for _ in read_events(resp):
                    if stop.is_set():
                        break

    async def cancel_one(client: httpx.AsyncClient, rng: random.Random) -> tuple[str, float]:
        body = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "Count to 100."}],
                "max_tokens": 200, "ignore_eos": True, "stream": True}
        keep = rng.randrange(1, 6)
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            rid = resp.headers["x-request-id"]
            seen = 0
            async for _, events in read_events(resp):
                seen += len(events)
                if seen > keep:
                    break
            hung_up = time.time()
        return rid, hung_up

    async with httpx.AsyncClient(base_url=base, timeout=300) as client:
        loaders = [asyncio.create_task(load_stream(client)) for _ in range(load)]
        await asyncio.sleep(3)
        rng = random.Random(0)
        results: list[tuple[str, float]] = []
        with console.status(f"{cancels} cancels under a load of {load} streams"):
            for _ in range(cancels // 4):
                results += await asyncio.gather(*(cancel_one(client, rng) for _ in range(4)))
        stop.set()
        for task in loaders:
            task.cancel()
        await asyncio.gather(*loaders, return_exceptions=True)

    await asyncio.sleep(2)
    latencies = []
    for rid, hung_up in results:
        entries = _entries(r, keys.out(rid))
        terminal = [e for e, f in entries if is_terminal(f)]
        last = decode_result(entries[-1][1]) if terminal else None
        if not isinstance(last, Finish) or last.finish_reason != "abort":
            continue  # finished before the abort landed
        latencies.append(_entry_ms(terminal[0]) - hung_up * 1000)
    intervals = []
    for rid in load_ids:
        ids = [_entry_ms(e) for e, f in _entries(r, keys.out(rid)) if f[b"kind"] == b"tokens"]
        intervals += [b - a for a, b in itertools.pairwise(ids)]
    step = statistics.median(intervals)
    table = Table(title=f"cancellation latency: {len(latencies)} aborts under load")
    for col in ("", "ms", "decode steps"):
        table.add_column(col)
    table.add_row("decode step (median)", f"{step:.0f}", "1")
    for p in (50, 90, 99):
        v = _percentile(latencies, p)
        table.add_row(f"p{p}", f"{v:.0f}", f"{v / step:.2f}")
    table.add_row("max", f"{max(latencies):.0f}", f"{max(latencies) / step:.2f}")
    console.print(table)


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


async def _slow_bench(base: str, api_pid: int, streams: int, seconds: int) -> None:
    idle = _rss_mb(api_pid)
    body = {"model": "tiny", "prompt": "go", "max_tokens": 4000, "ignore_eos": True,
            "stream": True}
    samples: list[float] = []
    events: list[int] = []
    endings: list[str] = []

    async def slow_client() -> None:
        transport = httpx.AsyncHTTPTransport(
            socket_options=[(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)])
        async with httpx.AsyncClient(base_url=base, transport=transport, timeout=300) as client:
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    endings.append(f"HTTP {resp.status_code}: {(await resp.aread())[:120]!r}")
                    return
                n = 0
                last = ""
                deadline = time.monotonic() + seconds
                async for _, batch in read_events(resp):
                    n += len(batch)
                    last = batch[-1].text
                    if time.monotonic() > deadline:
                        break
                    await asyncio.sleep(1)
                events.append(n)
                endings.append("held to the end" if time.monotonic() > deadline
                               else f"ended after {last[:100]!r}")

    async def sample() -> None:
        while True:
            samples.append(_rss_mb(api_pid))
            await asyncio.sleep(0.5)

    sampler = asyncio.create_task(sample())
    with console.status(f"{streams} clients reading one event a second for {seconds}s"):
        await asyncio.gather(*(slow_client() for _ in range(streams)))
    sampler.cancel()
    table = Table(title=f"slow clients: {streams} streams, 1 event/s, {seconds}s")
    for col in ("API replica RSS", "MB"):
        table.add_column(col)
    table.add_row("idle", f"{idle:.1f}")
    table.add_row("peak during the run", f"{max(samples):.1f}")
    table.add_row("peak - idle (target <= 50)", f"{max(samples) - idle:.1f}")
    table.add_row("events read per client (median)", f"{statistics.median(events):.0f}")
    console.print(table)
    for ending, count in Counter(endings).most_common():
        console.print(f"{count} streams: {ending}")


def _tiny_model(directory: Path) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    smol = resolve_model(DEFAULT_MODEL, Settings().cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(smol.path))
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2,
                         vocab_size=len(tokenizer), max_position_embeddings=8192,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return directory


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="bench", required=True)
    c = sub.add_parser("cancel")
    c.add_argument("--cancels", type=int, default=200)
    c.add_argument("--load", type=int, default=8)
    s = sub.add_parser("slow")
    s.add_argument("--streams", type=int, default=200)
    s.add_argument("--seconds", type=int, default=60)
    args = ap.parse_args()

    if args.bench == "cancel":
        with running_stack(DEFAULT_MODEL, DEFAULT_MODEL, {}) as (base, redis_url, _):
            asyncio.run(_cancel_bench(base, redis_url, args.cancels, args.load))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = _tiny_model(Path(tmp))
        env = {"REDSERVE_SLOW_CLIENT_TIMEOUT_S": str(args.seconds * 3),
               "REDSERVE_MAX_RUNNING": str(args.streams),
               "REDSERVE_MAX_QUEUED_REQUESTS": str(args.streams)}
        with running_stack(str(model), "tiny", env) as (base, _, api_pid):
            asyncio.run(_slow_bench(base, api_pid, args.streams, args.seconds))


if __name__ == "__main__":
    main()
