"""What int8 weights (`--quantization int8`) cost the default model in output, and buy in speed.

    python -m ops.benchmarks.quantization [--tokens 48] [--batches 1 32] [--context 256]
        [--steps 20] [--threads N]

On SmolLM2-135M, CPU, bf16 activations, each configuration built as the worker builds it
(`ModelRunner`, every linear laid out once):
- drift: bf16 decodes a fixed set of chat prompts greedily, `--tokens` tokens each, all in one
  batch; every other configuration is then teacher-forced on that continuation in the same
  batch, as tests/test_dtype.py does, and each token's logprob is compared with bf16's. bf16's
  own gap to fp32 is printed beside it for scale: the rounding the default dtype already
  spends. Top-1 is how often a configuration's argmax is bf16's token; then each decodes
  greedily on its own, and "shared" is how many tokens it emits before it parts from bf16;
- speed: decode steps of B requests over prompts of `--context` random tokens (greedy, EOS
  ignored), median step of `--steps`, as tokens/s; and the prefill of those prompts. The
  configurations' engines take turns step by step, so a shared machine's changing load falls
  on all of them alike.
"int8 + lm_head" also quantizes the vocabulary projection, which the worker does not: it is
here as the measurement behind that choice.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from rich.table import Table

from ops.benchmarks import drift
from ops.benchmarks.harness import engine as harness
from ops.benchmarks.machine import describe
from ops.console import make_console
from shared.models import resolve_model
from shared.settings import DEFAULT_MODEL, DEFAULT_PAGE_SIZE, Settings
from worker.engine import checkpoint, onednn
from worker.engine.engine import Engine
from worker.engine.linear import Linear
from worker.engine.model_runner import ModelRunner
from worker.engine.threads import usable_cpus

QUESTIONS = ["What is KV Cache?", "Name three primary colors.", "Write a haiku about Redis.",
             "Explain photosynthesis in one paragraph.", "What is the capital of France?",
             "Give me a recipe for pancakes.", "Why is the sky blue?",
             "Write a Python function that reverses a string.", "Summarise the plot of Hamlet.",
             "List four prime numbers and explain why they are prime.",
             "How does a hash table work?", "Translate 'good morning' into Spanish and German."]
PAGE = DEFAULT_PAGE_SIZE  # the worker's
SPEED_CONFIGS = ("bf16", "int8", "int8 + lm_head")


def _runner(path: Path, config: str) -> ModelRunner:
    dtype = torch.float32 if config == "fp32" else torch.bfloat16
    weights = checkpoint.load(path, torch.device("cpu"), dtype)
    head = weights.lm_head()
    runner = ModelRunner(weights, release_modules=True,
                         quantization="int8" if config.startswith("int8") else "none")
    if config == "int8 + lm_head":
        runner.lm_head = Linear(head, quantization="int8")
    return runner


def _drift_row(name: str, ours: drift.Run, ref: drift.Run, greedy: drift.Run | None,
               base: drift.Run) -> list[str]:
    cells = [name, *drift.gap_cells(ours, ref)]
    if greedy is None:
        return [*cells, "", "", ""]
    return [*cells, drift.top1(ours, base), *drift.shared_cells(greedy, base)]


def drift_table(path: Path, tokens: int) -> Table:
    prompts = drift.chat_prompts(path, QUESTIONS)
    bf16 = drift.decode(_runner(path, "bf16"), prompts, tokens)
    forced: dict[str, drift.Run] = {}
    greedy: dict[str, drift.Run] = {}
    for config in ("fp32", "int8", "int8 + lm_head"):
        runner = _runner(path, config)
        forced[config] = drift.decode(runner, prompts, tokens, bf16.fed)
        greedy[config] = drift.decode(runner, prompts, tokens)
        del runner
    table = Table(title=f"logprob drift per token, teacher-forced on bf16's greedy output "
                        f"({len(prompts)} prompts x {tokens} tokens)")
    for col in ("configuration", "mean |d|", "p99 |d|", "max |d|", "top-1 = bf16",
                "shared greedy tokens", "identical"):
        table.add_column(col)
    table.add_row(*_drift_row("bf16 vs fp32 (scale)", bf16, forced["fp32"], greedy["fp32"],
                              bf16))
    table.add_row(*_drift_row("int8 vs bf16", forced["int8"], bf16, greedy["int8"], bf16))
    table.add_row(*_drift_row("int8 vs fp32", forced["int8"], forced["fp32"], None, bf16))
    table.add_row(*_drift_row("int8 + lm_head vs bf16", forced["int8 + lm_head"], bf16,
                              greedy["int8 + lm_head"], bf16))
    return table


def _engine(path: Path, config: str, batch: int, context: int, steps: int,
            threads: int) -> tuple[Engine, float]:
    """An engine holding `batch` requests of `context` random prompt tokens, not yet run, and
    its model's MiB of weights."""
    runner = _runner(path, config)
    engine = harness.around(runner, batch, context + steps, PAGE, threads)
    harness.add_random(engine, batch, context, seed=batch)
    return engine, runner.weight_bytes() / 2**20


def _speeds(engines: list[Engine], batch: int, context: int, steps: int
            ) -> list[tuple[float, float]]:
    """Decode and prefill tokens/s of each engine, their steps taking turns."""
    prefills, times = harness.take_turns(engines, steps)
    return [(batch / statistics.median(d[0]), batch * context / p)
            for d, p in zip(times, prefills, strict=True)]


def speed_table(path: Path, batches: list[int], context: int, steps: int,
                threads: int) -> Table:
    table = Table(title=f"decode and prefill speed, prompts of {context} tokens "
                        f"({threads} threads)")
    for col in ("configuration", "batch", "decode tokens/s", "vs bf16", "prefill tokens/s",
                "vs bf16", "weights MiB"):
        table.add_column(col)
    for batch in batches:
        built = [_engine(path, c, batch, context, steps, threads) for c in SPEED_CONFIGS]
        speeds = _speeds([engine for engine, _ in built], batch, context, steps)
        decode0, prefill0 = speeds[0]
        for config, (_, mib), (decode, prefill) in zip(SPEED_CONFIGS, built, speeds,
                                                       strict=True):
            table.add_row(config, str(batch), f"{decode:.1f}", f"{decode / decode0:.2f}x",
                          f"{prefill:.0f}", f"{prefill / prefill0:.2f}x", f"{mib:.0f}")
        del built
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, default=48, help="tokens decoded per prompt (drift)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--context", type=int, default=256, help="prompt tokens per request (speed)")
    ap.add_argument("--steps", type=int, default=20, help="decode steps timed (speed)")
    ap.add_argument("--threads", type=int, default=usable_cpus(), help="CPU threads (speed)")
    args = ap.parse_args()
    onednn.cap_caches()  # as a worker's engine is built (before torch builds any primitive)
    console = make_console()
    console.print(describe())
    path = resolve_model(DEFAULT_MODEL, Settings().cache_dir).path
    with console.status("drift"):
        drift = drift_table(path, args.tokens)
    console.print(drift)
    with console.status("speed"):
        speed = speed_table(path, args.batches, args.context, args.steps,
                            args.threads)
    console.print(speed)


if __name__ == "__main__":
    main()
