"""redserve end to end against `transformers serve` and transformers itself, in one run.

    python -m ops.benchmarks.serve [--streams 32] [--max-tokens 64] [--dtypes bfloat16 float32]

Every figure is measured in this run on this machine, each server alone on it:
- 32 concurrent streams x up to 64 tokens through HTTP (chat completions asking for long
  stories, greedy; the peer knows no `ignore_eos`, so neither gets it and tokens are counted):
  `redserve up` against `transformers serve --continuous-batching` at each dtype; output
  tokens/s over the whole load, TTFT p50/p99 and inter-token latency p50 as the clients saw
  them, and each server's peak RSS (every process of it: API, worker, Redis). The peer's best
  dtype is the one it served most tokens/s with; the targets are >= 2.5x its tokens/s and
  <= 1/3 of its TTFT p50.
- one stream, 128 tokens: redserve's decode tokens/s through HTTP against transformers
  `generate` in this process at its best dtype (target >= 2x).
- a 2,000-token prompt: redserve's time to first token through HTTP against one transformers
  forward pass over the same tokens at its best dtype (target <= 1.2x).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import orjson
from rich.console import Console
from rich.table import Table

from ops.benchmarks.machine import descendants, describe, peak_rss_mib
from ops.benchmarks.single import generate_timing
from ops.console import make_console
from ops.embedded_redis import free_port
from shared.models import resolve_model
from shared.settings import DEFAULT_MODEL, Settings

TOPICS = ("a lighthouse keeper", "the first winter on Mars", "a clockmaker's apprentice",
          "a river that flows uphill", "a dragon who hoards books", "the last train home",
          "a detective in Venice", "an orchard at night", "a robot learning to paint",
          "two rival bakers", "a storm over the prairie", "a lost violin")


@dataclass
class Load:
    tokens: int = 0
    seconds: float = 0.0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    rss_mib: float = 0.0

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Server:
    """A server started in its own session, stopped with everything it started."""

    def __init__(self, cmd: list[str], port: int, model: str, threads: int = 0) -> None:
        self.port, self.model = port, model
        env = dict(os.environ)
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True, env=env)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/chat/completions"

    def wait(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        body = {"model": self.model, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2}
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}")
            try:
                if httpx.post(self.url, json=body, timeout=60).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError("server did not answer")

    def rss(self) -> float:
        return peak_rss_mib(descendants(self.proc.pid))

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGINT)
            self.proc.wait(30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def redserve(dtype: str, threads: int = 0) -> Server:
    """`redserve up` with its defaults (threads: its own choice) at `dtype`."""
    port = free_port()
    return Server([sys.executable, "-m", "ops.cli", "up", "--port", str(port), "--dtype", dtype],
                  port, DEFAULT_MODEL)


def transformers_serve(dtype: str, threads: int) -> Server:
    """The peer at `dtype`, with torch's default threads (0) or `threads`."""
    port = free_port()
    path = str(resolve_model(DEFAULT_MODEL, Settings().cache_dir).path)
    exe = os.path.join(os.path.dirname(sys.executable), "transformers")
    return Server([exe, "serve", "--continuous-batching", "--dtype", dtype, "--device", "cpu",
                   "--port", str(port), path], port, path, threads)


async def _stream(client: httpx.AsyncClient, server: Server, content: str, max_tokens: int,
                  load: Load) -> None:
    body = {"model": server.model, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    times: list[float] = []
    usage = 0
    async with client.stream("POST", server.url, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = orjson.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]["completion_tokens"]
            if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                times.append(time.perf_counter())
    load.tokens += usage or len(times)
    load.ttft.append(times[0] - t0)
    load.itl += [b - a for a, b in itertools.pairwise(times)]


async def _load(server: Server, streams: int, max_tokens: int, prompt: str | None) -> Load:
    load = Load()
    limits = httpx.Limits(max_connections=streams + 4)
    async with httpx.AsyncClient(timeout=900, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(
            _stream(client, server, prompt or f"Write a long story about "
                    f"{TOPICS[i % len(TOPICS)]}, part {i // len(TOPICS) + 1}.", max_tokens, load)
            for i in range(streams)))
        load.seconds = time.perf_counter() - t0
    return load


def measure(start: Callable[[str, int], Server], dtype: str, threads: int,
            runs: list[tuple[int, int, str | None]]) -> list[Load]:
    server = start(dtype, threads)
    try:
        server.wait()
        asyncio.run(_load(server, 4, 8, None))  # warm-up
        loads = [asyncio.run(_load(server, n, m, p)) for n, m, p in runs]
        for load in loads:
            load.rss_mib = server.rss()
        return loads
    finally:
        server.stop()


def _hf(dtype: str, max_tokens: int, long_ids: list[int]) -> tuple[float, float]:
    """transformers in this process: decode tokens/s of `generate` on one chat prompt, and the
    seconds of one forward pass over `long_ids` (best of three)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(resolve_model(DEFAULT_MODEL, Settings().cache_dir).path)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    ids = torch.tensor([tok.apply_chat_template(
        [{"role": "user", "content": f"Write a long story about {TOPICS[0]}."}],
        add_generation_prompt=True, return_dict=False)])
    _, rate = generate_timing(model, ids, max_tokens)
    with torch.inference_mode():
        long = torch.tensor([long_ids])
        forward = []
        for _ in range(3):
            t0 = time.perf_counter()
            model(long, use_cache=False, logits_to_keep=1)
            forward.append(time.perf_counter() - t0)
    return rate, min(forward)


def _long_prompt(n: int) -> tuple[str, list[int]]:
    """A user message whose chat prompt is about `n` tokens, and those tokens."""
    from transformers import AutoTokenizer

    path = resolve_model(DEFAULT_MODEL, Settings().cache_dir).path
    tok = AutoTokenizer.from_pretrained(str(path))
    words = " ".join(f"{TOPICS[i % len(TOPICS)]} number {i}." for i in range(n))
    ids = tok(words)["input_ids"]
    text = str(tok.decode(ids[: n - 30]))
    chat: list[int] = tok.apply_chat_template(  # type: ignore[assignment]
        [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False)
    return text, chat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"],
                    help="dtypes to run each system at (default bfloat16 float32)")
    ap.add_argument("--redserve-dtype", default="auto", help="redserve's --dtype (default auto)")
    ap.add_argument("--no-peers", action="store_true",
                    help="redserve alone (no ratios: for quick checks while developing)")
    args = ap.parse_args()
    console = make_console()
    console.print(describe())
    text, long_ids = _long_prompt(2000)
    runs = [(args.streams, args.max_tokens, None), (1, 128, None), (1, 1, text)]
    results: dict[str, list[Load]] = {}
    for dtype in [] if args.no_peers else args.dtypes:
        for threads in (0, 1):  # on a few cores its own HTTP threads compete with torch's
            name = f"transformers serve {dtype}, {threads or 'default'} thread(s)"
            with console.status(name):
                results[name] = measure(transformers_serve, dtype, threads, runs[:1])
    with console.status(f"redserve up --dtype {args.redserve_dtype}"):
        results[f"redserve {args.redserve_dtype}"] = measure(redserve, args.redserve_dtype, 0,
                                                             runs)
    if args.no_peers:
        for load in results.popitem()[1]:
            console.print(f"tokens {load.tokens} in {load.seconds:.2f} s: {load.rate:.1f}/s, "
                          f"TTFT p50 {_pct(load.ttft, 0.5) * 1e3:.0f} ms, ITL p50 "
                          f"{_pct(load.itl or [0.0], 0.5) * 1e3:.1f} ms, "
                          f"RSS {load.rss_mib:.0f} MiB")
        return
    hf: dict[str, tuple[float, float]] = {}
    for dtype in args.dtypes:
        with console.status(f"transformers generate and forward, {dtype}"):
            hf[dtype] = _hf(dtype, 128, long_ids)
    _report(console, args, results, hf, len(long_ids))


def _report(console: Console, args: argparse.Namespace, results: dict[str, list[Load]],
            hf: dict[str, tuple[float, float]], long_len: int) -> None:
    ours_name = next(n for n in results if n.startswith("redserve"))
    ours = results[ours_name]
    peers = {n: r[0] for n, r in results.items() if n != ours_name}
    best = max(peers, key=lambda n: peers[n].rate)
    table = Table(title=f"{args.streams} streams x {args.max_tokens} tokens, {DEFAULT_MODEL}, "
                        "greedy, through HTTP")
    for col in ("server", "tokens", "tokens/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
                "peak RSS MiB"):
        table.add_column(col)
    for name, load in [*peers.items(), (ours_name, ours[0])]:
        table.add_row(name, str(load.tokens), f"{load.rate:.1f}",
                      f"{_pct(load.ttft, 0.5) * 1e3:.0f}", f"{_pct(load.ttft, 0.99) * 1e3:.0f}",
                      f"{_pct(load.itl, 0.5) * 1e3:.1f}",
                      f"{load.rss_mib:.0f}")
    console.print(table)
    ratio = ours[0].rate / peers[best].rate
    ttft = _pct(ours[0].ttft, 0.5) / _pct(peers[best].ttft, 0.5)
    console.print(f"against the best peer ({best}): tokens/s {ratio:.2f}x (target >= 2.5x: "
                  f"{'met' if ratio >= 2.5 else 'MISSED'}), TTFT p50 {ttft:.2f}x (target <= "
                  f"0.33x: {'met' if ttft <= 1 / 3 else 'MISSED'})")

    hf_best = max(hf, key=lambda d: hf[d][0])
    single = ours[1]
    decode = (single.tokens - 1) / sum(single.itl) if single.itl else 0.0
    ratio = decode / hf[hf_best][0]
    console.print(f"one stream: redserve {decode:.1f} decode tokens/s, transformers generate "
                  f"{hf[hf_best][0]:.1f} ({hf_best}): {ratio:.2f}x (target >= 2x: "
                  f"{'met' if ratio >= 2 else 'MISSED'}); peak RSS {single.rss_mib:.0f} MiB")
    fwd_best = min(hf, key=lambda d: hf[d][1])
    first = ours[2].ttft[0]
    ratio = first / hf[fwd_best][1]
    console.print(f"{long_len}-token prompt: redserve TTFT {first * 1e3:.0f} ms, one "
                  f"transformers forward {hf[fwd_best][1] * 1e3:.0f} ms ({fwd_best}): "
                  f"{ratio:.2f}x (target <= 1.2x: {'met' if ratio <= 1.2 else 'MISSED'})")
    for d, (rate, fwd) in hf.items():
        console.print(f"  transformers {d}: generate {rate:.1f} tokens/s, forward "
                      f"{fwd * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
