"""Speculative decoding (prompt lookup) on against off, side by side in one run.

    python -m ops.benchmarks.speculation [--dtype auto] [--repeats 3] [--max-tokens 160]
                                         [--streams 32] [--served]

On the default model, greedy, every figure from one engine in this process (so one set of
weights and threads), each request asking for speculation or not through its own
`SamplingParams.speculate` (the body's `speculation`), on and off alternating per repeat:
- one stream on grounded prompts (repeat, correct, extract or edit a text given in the prompt:
  output that copies from its prompt), one prompt at a time: output tokens/s, target >= 2x;
- one stream on plain chat (stories, explanations: little to copy);
- `--streams` concurrent streams on the grounded prompts: a step this large is compute-bound
  and drafting turns itself off (worker/engine/speculation/speculator.py), target >= 0.98x;
and, for each, the draft acceptance rate and tokens per request-step, and whether the outputs
on and off were the same tokens (they should be, bar bf16 near-ties). Figures are medians over
`--repeats`. With `--served`, the single grounded stream and the concurrent streams again
through `redserve up` over HTTP (streamed, the `speculation` body field on and off).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import dataclass

import httpx
from rich.table import Table
from transformers import AutoTokenizer

from ops.benchmarks.harness import engine as harness
from ops.benchmarks.harness import stack
from ops.benchmarks.harness.client import body as client_body
from ops.benchmarks.harness.client import stream
from ops.benchmarks.machine import describe
from ops.console import make_console
from shared.messages import SamplingParams
from shared.models import resolve_model
from shared.settings import DEFAULT_MODEL, WorkerSettings
from worker.engine.engine import Engine
from worker.engine.speculation.speculator import SpeculationStats

TEXT = ("The harbour town of Kestrel Bay was founded in 1742 by a group of fishermen who had "
        "sailed north from the southern coast. For more than a century the town lived on "
        "herring and cod, and its narrow streets still follow the paths the fishermen walked "
        "between their cottages and the quay. In 1861 a railway line reached the town, and "
        "with it came the first visitors from the cities, who rented rooms above the shops "
        "and walked along the cliffs. The old lighthouse, built in 1803, was replaced by an "
        "automatic light in 1958, and the keeper's cottage became a small museum. Today about "
        "four thousand people live in Kestrel Bay all year round, and the population doubles "
        "every summer.")
TYPOS = TEXT.replace("fishermen", "fishermne").replace("century", "centruy").replace(
    "visitors", "vistors").replace("population", "popluation").replace("summer", "sumer")
CODE = '''def summarize(orders):
    total = 0
    count = 0
    for order in orders:
        if order.status == "paid":
            total += order.amount
            count += 1
    average = total / count if count else 0
    return {"total": total, "count": count, "average": average}


def report(orders):
    summary = summarize(orders)
    print("Paid orders:", summary["count"])
    print("Total:", summary["total"])
    print("Average:", summary["average"])
'''
GROUNDED = (
    f"Repeat the following text exactly, word for word:\n\n{TEXT}",
    f"Correct the spelling mistakes in this text and write out the corrected text in full:"
    f"\n\n{TYPOS}",
    f"Rename the variable `total` to `paid_total` in this code and return the whole code:"
    f"\n\n{CODE}",
    f"Copy every sentence of this text that mentions a year, verbatim, one per line:\n\n{TEXT}",
)
CHAT = ("Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Explain how a steam engine works, step by step.",
        "What are three good habits for learning a new language? Explain each.",
        "Describe a walk through a forest in autumn.")


@dataclass
class Run:
    tokens: int
    seconds: float
    stats: SpeculationStats  # this run's counters
    outputs: list[list[int]]

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


def _delta(a: SpeculationStats, b: SpeculationStats) -> SpeculationStats:
    return SpeculationStats(b.proposed - a.proposed, b.accepted - a.accepted,
                            b.verifications - a.verifications, b.steps - a.steps,
                            b.tokens - a.tokens)


def run_engine(engine: Engine, prompts: list[list[int]], max_tokens: int, speculate: bool,
               together: bool) -> Run:
    """Greedy completions of `prompts`, all at once (`together`) or one after another."""
    before = engine.speculator.stats()
    outputs: dict[str, list[int]] = {}
    batches = [prompts] if together else [[p] for p in prompts]
    t0 = time.perf_counter()
    for b, batch in enumerate(batches):
        for i, prompt in enumerate(batch):
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, speculate=speculate)
            engine.add(harness.request(f"{b}-{i}", prompt, params))
        while engine.scheduler.has_work():
            for out in engine.step():
                if out.token is not None:
                    outputs.setdefault(out.request_id, []).append(out.token)
    seconds = time.perf_counter() - t0
    return Run(sum(map(len, outputs.values())), seconds, _delta(before, engine.speculator.stats()),
               [outputs.get(k, []) for k in sorted(outputs)])


def _served(prompts: list[str], max_tokens: int, streams: int, repeats: int, dtype: str
            ) -> dict[str, tuple[float, float]]:
    """tokens/s on and off through `redserve up` (its defaults: speculation ngram)."""
    with stack.up("--dtype", dtype) as server:
        server.wait()
        figures: dict[str, tuple[float, float]] = {}
        for name, n in (("1 stream, grounded", 1), (f"{streams} streams, grounded", streams)):
            rates: dict[bool, list[float]] = {True: [], False: []}
            for _ in range(repeats):
                for on in (True, False):
                    rates[on].append(asyncio.run(_http_load(server.base, prompts, n,
                                                            max_tokens, on)))
            figures[name] = (statistics.median(rates[True]), statistics.median(rates[False]))
        return figures


async def _http_load(base: str, prompts: list[str], streams: int, max_tokens: int,
                     speculate: bool) -> float:
    """Output tokens/s of `streams` concurrent streams (one: the prompts one by one)."""
    async def one(client: httpx.AsyncClient, content: str) -> int:
        request = client_body(DEFAULT_MODEL, max_tokens, content=content, speculation=speculate)
        return (await stream(client, base, request)).tokens

    async with httpx.AsyncClient(timeout=900) as client:
        t0 = time.perf_counter()
        if streams == 1:
            tokens = [await one(client, p) for p in prompts]
        else:
            tokens = await asyncio.gather(*(one(client, prompts[i % len(prompts)])
                                            for i in range(streams)))
        return sum(tokens) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--served", action="store_true", help="also through `redserve up`")
    args = ap.parse_args()
    console = make_console()
    engine = harness.built(dtype=args.dtype, max_running=args.streams,
                           kv_cache_memory=2 * 1024**3, speculation="ngram")
    info = resolve_model(DEFAULT_MODEL, WorkerSettings().cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(info.path))

    def chat(text: str) -> list[int]:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                               add_generation_prompt=True, tokenize=False)
        return list(tokenizer.encode(prompt, add_special_tokens=False))

    grounded, plain = [chat(t) for t in GROUNDED], [chat(t) for t in CHAT]
    crowd = [grounded[i % len(grounded)] for i in range(args.streams)]
    console.print(describe())
    console.print(f"{DEFAULT_MODEL}, {engine.runner.kv_shape.dtype}, greedy, "
                  f"{WorkerSettings().speculative_tokens} draft tokens at most, medians of "
                  f"{args.repeats}")
    run_engine(engine, grounded[:1] + plain[:1], 16, True, together=True)  # warm-up
    table = Table(title="speculative decoding (prompt lookup), engine")
    for col in ("load", "tokens/s on", "tokens/s off", "on/off", "acceptance",
                "tokens/step", "same output"):
        table.add_column(col, justify="left" if col == "load" else "right")
    loads = (("1 stream, grounded", grounded, False, args.max_tokens),
             ("1 stream, chat", plain, False, args.max_tokens),
             (f"{args.streams} streams, grounded", crowd, True, 64))
    for name, prompts, together, max_tokens in loads:
        runs: dict[bool, list[Run]] = {True: [], False: []}
        for _ in range(args.repeats):
            for on in (True, False):
                runs[on].append(run_engine(engine, prompts, max_tokens, on, together))
        on_rate = statistics.median(r.rate for r in runs[True])
        off_rate = statistics.median(r.rate for r in runs[False])
        stats = runs[True][-1].stats
        same = all(a.outputs == b.outputs for a, b in zip(runs[True], runs[False], strict=True))
        table.add_row(name, f"{on_rate:.1f}", f"{off_rate:.1f}", f"{on_rate / off_rate:.2f}x",
                      f"{stats.acceptance_rate:.0%}", f"{stats.tokens_per_step:.2f}",
                      "yes" if same else "no")
    console.print(table)
    if args.served:
        del engine  # its memory back before the server loads its own
        figures = _served(list(GROUNDED), args.max_tokens, args.streams, args.repeats,
                          args.dtype)
        served = Table(title="through redserve up (HTTP, streamed)")
        for col in ("load", "tokens/s on", "tokens/s off", "on/off"):
            served.add_column(col, justify="left" if col == "load" else "right")
        for name, (on_rate, off_rate) in figures.items():
            served.add_row(name, f"{on_rate:.1f}", f"{off_rate:.1f}",
                           f"{on_rate / off_rate:.2f}x")
        console.print(served)


if __name__ == "__main__":
    main()
