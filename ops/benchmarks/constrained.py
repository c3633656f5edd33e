"""What grammar-constrained rows cost the unconstrained rows that share their batch.

    python -m ops.benchmarks.constrained [--dtype auto|float32] [--decode 128] [--reps 3]

The target: constrained rows may slow the unconstrained rows of the same batch by at most 10%.
Every row of a batch decodes in the same steps, so whatever the masks cost is paid by all 32
rows at once; this measures that cost on the real engine and model, not on a stand-in.

A batch of 32 requests for the default model (SmolLM2-135M-Instruct) at `--dtype`, all admitted
and prefilled in one step (same prompt length, EOS ignored), then `--decode` decode steps in
which every row samples one token. 0, 8 or 32 of the rows (spread evenly) carry a JSON schema
grammar: an order whose `items` array has a `minItems` long enough that no document can end
within the decode count. The configurations alternate (0, 8, 32, 0, 8, 32, ...) `--reps`
times so that the machine's drift hits each alike, and each figure is the median over reps.

Only decode steps are timed: from the step after the one that gave every row its first token.
Around them, timers wrapped onto the engine's own objects split the step: the forward pass,
`Constraints.apply` (the mask: llguidance's batched mask compute, then the bits turned into an
additive bias and added to the constrained rows), `Constraint.advance` (feeding each sampled
token to its matcher) and the rest (scheduling, sampling). The mask figures are the
constrained rows' whole overhead, so they also give a noise-free estimate of the slowdown
beside the measured one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from rich.table import Table
from transformers import AutoTokenizer

from ops.benchmarks.harness import engine as harness
from ops.benchmarks.machine import describe
from ops.console import make_console
from shared import request_grammar as grammar
from shared.messages import GenerateRequest, SamplingParams
from shared.models import resolve_model
from shared.settings import DEFAULT_MODEL, WorkerSettings
from worker.engine import constraint
from worker.engine.engine import Engine

BATCH = 32
MIXES = (0, 8, 32)  # constrained rows per batch
TARGET = 0.90  # unconstrained rows keep at least this share of their tokens/s

ORDER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
        "customer": {"type": "string", "maxLength": 40},
        "items": {
            "type": "array",
            "minItems": 24,  # the shortest item is 29 tokens: a document runs far past --decode
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                    "name": {"type": "string", "maxLength": 40},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                    "unit_price": {"type": "number"},
                    "gift": {"type": "boolean"},
                },
                "required": ["sku", "name", "quantity", "unit_price", "gift"],
                "additionalProperties": False,
            },
        },
        "notes": {"type": "string"},
    },
    "required": ["order_id", "customer", "items"],
    "additionalProperties": False,
}
MIN_DOCUMENT_TOKENS = 24 * 25  # a lower bound, with a margin


@dataclass
class Timers:
    """Seconds spent in each wrapped part; reset before and read after each step."""

    parts: dict[str, float] = field(default_factory=dict)

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.parts[name] = self.parts.get(name, 0.0) + time.perf_counter() - t0

        return timed

    def take(self) -> dict[str, float]:
        parts, self.parts = self.parts, {}
        return parts


class TimedExecutor:
    """llguidance's executor with its mask call timed (the rest of `apply` is bias+add)."""

    def __init__(self, executor: Any, timers: Timers) -> None:
        self.unsafe_compute_mask_ptr = timers.wrap("mask compute",
                                                   executor.unsafe_compute_mask_ptr)


@dataclass
class Run:
    constrained: int
    step_s: list[float]  # each timed decode step
    parts: dict[str, float]  # seconds per part, summed over the timed steps

    @property
    def steps(self) -> int:
        return len(self.step_s)

    @property
    def seconds(self) -> float:
        return sum(self.step_s)

    def per_step_ms(self, part: str) -> float:
        return self.parts.get(part, 0.0) / self.steps * 1e3


def _engine(dtype: str, prompt_len: int) -> Engine:
    return harness.built(dtype=dtype, max_running=BATCH, max_prefill_tokens=BATCH * prompt_len,
                         kv_cache_memory=1024**3)


def _prompts(tokenizer: Any) -> list[tuple[int, ...]]:
    """One chat prompt per row, alike but for the order number, all of the same length."""
    prompts = []
    for i in range(BATCH):
        messages = [
            {"role": "system", "content": "You are the order desk of a hardware shop. Reply "
             "with the order as one JSON document: order id, customer, and every item with "
             "its SKU, name, quantity, unit price and whether it is a gift."},
            {"role": "user", "content": f"Order {100000 + 7919 * i}: the usual for the "
             "workshop, screws, hinges, two hammers, sandpaper and wood glue, one gift box."},
        ]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                            return_dict=False)
        prompts.append(tuple(ids))
    lengths = {len(p) for p in prompts}
    if len(lengths) != 1:
        raise SystemExit(f"prompts differ in length ({sorted(lengths)}): fix _prompts")
    return prompts


def _run(engine: Engine, prompts: list[tuple[int, ...]], order: str, constrained: int,
         decode: int, timers: Timers, tag: str) -> Run:
    """One batch: all rows prefilled in one step, then `decode` timed decode steps."""
    every = BATCH // constrained if constrained else 0
    params = SamplingParams(max_tokens=decode + 1, temperature=0.0, ignore_eos=True)
    requests = [GenerateRequest(id=f"{tag}-{i}", model=DEFAULT_MODEL, prompt_ids=prompt,
                                params=params, created=0.0, queue_deadline=0.0, deadline=0.0,
                                grammar=order if every and i % every == 0 else None)
                for i, prompt in enumerate(prompts)]
    for request in requests:
        engine.add(request)
    produced = dict.fromkeys((r.id for r in requests), 0)
    finish: dict[str, str] = {}
    started = 0
    step_s: list[float] = []
    parts: dict[str, float] = {}
    while engine.scheduler.has_work():
        decoding = started == BATCH  # every row has its first token: a pure decode step
        timers.take()
        t0 = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - t0
        step_parts = timers.take()
        if decoding:
            if len(outputs) != BATCH:
                raise SystemExit(f"a decode step sampled {len(outputs)} rows, not {BATCH}")
            step_s.append(elapsed)
            for name, seconds in step_parts.items():
                parts[name] = parts.get(name, 0.0) + seconds
        for out in outputs:
            if out.error:
                raise SystemExit(f"{out.request_id} failed: {out.error}")
            produced[out.request_id] += 1
            started += out.index == 0
            if out.finish:
                finish[out.request_id] = out.finish
    short = {k: v for k, v in produced.items() if v != decode + 1 or finish.get(k) != "length"}
    if short:
        raise SystemExit(f"rows did not decode exactly {decode} tokens after the first: "
                         f"{ {k: (v - 1, finish.get(k)) for k, v in short.items()} }")
    if len(step_s) != decode:
        raise SystemExit(f"timed {len(step_s)} decode steps, expected {decode}: the prompts "
                         "were not all prefilled in one step")
    return Run(constrained, step_s, parts)


def _instrument(engine: Engine, timers: Timers) -> None:
    runner: Any = engine.runner
    runner.forward = timers.wrap("forward", runner.forward)
    constraints: Any = engine.constraints
    constraints.apply = timers.wrap("mask apply", constraints.apply)
    constraints.executor = TimedExecutor(constraints.executor, timers)
    constraint.Constraint.advance = timers.wrap(  # type: ignore[method-assign]
        "advance", constraint.Constraint.advance)


def _median(runs: list[Run], fn: Callable[[Run], float]) -> float:
    return statistics.median(fn(r) for r in runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"))
    ap.add_argument("--decode", type=int, default=128, help="timed decode tokens per row")
    ap.add_argument("--reps", type=int, default=3, help="runs of each configuration")
    args = ap.parse_args()
    if args.decode >= MIN_DOCUMENT_TOKENS:
        ap.error(f"--decode must stay under {MIN_DOCUMENT_TOKENS}: the schema's shortest "
                 "document would end a constrained row early")
    console = make_console()
    info = resolve_model(DEFAULT_MODEL, WorkerSettings().cache_dir)
    prompts = _prompts(AutoTokenizer.from_pretrained(str(info.path)))
    order = grammar.from_json_schema(json.dumps(ORDER_SCHEMA))
    with console.status("loading the model"):
        engine = _engine(args.dtype, len(prompts[0]))
    timers = Timers()
    _instrument(engine, timers)
    dtype = str(engine.runner.kv_shape.dtype).removeprefix("torch.")
    with console.status("warm-up"):  # oneDNN kernels for batch 32, the compiled grammar
        _run(engine, prompts, order, 8, 4, timers, "warm")
    runs: dict[int, list[Run]] = {m: [] for m in MIXES}
    load_before = os.getloadavg()[0]
    t_start = time.perf_counter()
    for rep in range(args.reps):
        for mix in MIXES:
            with console.status(f"rep {rep + 1}/{args.reps}: {mix} constrained rows"):
                run = _run(engine, prompts, order, mix, args.decode, timers, f"r{rep}m{mix}")
            runs[mix].append(run)
    wall = time.perf_counter() - t_start

    console.print(describe())
    console.print(f"model {DEFAULT_MODEL}, dtype {dtype} (--dtype {args.dtype}), "
                  f"{torch.get_num_threads()} torch threads in decode steps; batch {BATCH}, "
                  f"prompts of {len(prompts[0])} tokens, {args.decode} timed decode steps per "
                  f"run, greedy, EOS ignored; {args.reps} reps alternating, medians shown")
    table = Table(title="decode phase of a batch of 32 (per-step parts in ms)")
    columns = ("constrained rows", "batch tok/s", "(min-max)", "unconstrained row tok/s",
               "ms/step", "forward", "mask apply", "- compute", "- bias+add", "advance",
               "rest")
    for col in columns:
        table.add_column(col, justify="right")
    batch_rate: dict[int, float] = {}
    row_rate: dict[int, float] = {}
    for mix in MIXES:
        rs = runs[mix]
        rates = [BATCH * r.steps / r.seconds for r in rs]
        batch_rate[mix] = statistics.median(rates)
        # Every row samples once per step: an unconstrained row's rate is steps per second.
        row_rate[mix] = _median(rs, lambda r: r.steps / r.seconds)
        step = _median(rs, lambda r: r.seconds / r.steps * 1e3)
        apply = _median(rs, lambda r: r.per_step_ms("mask apply"))
        compute = _median(rs, lambda r: r.per_step_ms("mask compute"))
        fill = _median(rs, lambda r: r.per_step_ms("mask apply") - r.per_step_ms("mask compute"))
        rest = _median(rs, lambda r: r.seconds / r.steps * 1e3 - sum(
            r.per_step_ms(p) for p in ("forward", "mask apply", "advance")))
        table.add_row(str(mix), f"{batch_rate[mix]:.0f}", f"{min(rates):.0f}-{max(rates):.0f}",
                      f"{row_rate[mix]:.2f}" if mix < BATCH else "-", f"{step:.1f}",
                      f"{_median(rs, lambda r: r.per_step_ms('forward')):.1f}", f"{apply:.2f}",
                      f"{compute:.2f}", f"{fill:.2f}",
                      f"{_median(rs, lambda r: r.per_step_ms('advance')):.2f}", f"{rest:.1f}")
    console.print(table)

    ratio8 = row_rate[8] / row_rate[0]
    ratio32 = batch_rate[32] / batch_rate[0]
    verdict = "PASS" if ratio8 >= TARGET else "FAIL"
    console.print(f"unconstrained-row tokens/s, 8 constrained vs 0: {ratio8:.3f} "
                  f"({(ratio8 - 1) * 100:+.1f}%; target: no worse than {(TARGET - 1) * 100:.0f}%): "
                  f"{verdict}")
    console.print(f"batch tokens/s, 32 constrained vs 0: {ratio32:.3f} "
                  f"({(ratio32 - 1) * 100:+.1f}%)")
    # The measured ratios carry the machine's noise; the constrained rows' own work per step
    # against the unconstrained step time is the same question without it.
    base = _median(runs[0], lambda r: r.seconds / r.steps * 1e3)
    for mix in (8, 32):
        own = _median(runs[mix], lambda r: r.per_step_ms("mask apply") + r.per_step_ms("advance"))
        console.print(f"mask + advance per step with {mix} constrained rows: {own:.2f} ms = "
                      f"{own / base * 100:.1f}% of a {base:.1f} ms unconstrained step")
    console.print(f"measured runs took {wall:.0f} s; load average {load_before:.1f} before, "
                  f"{os.getloadavg()[0]:.1f} after (on {os.cpu_count()} CPUs: above that, other "
                  "processes shared the cores and the figures are noise-bound)")


if __name__ == "__main__":
    main()
