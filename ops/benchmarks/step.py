"""Where a decode step of the engine goes, against the matrix work it cannot avoid.

    python -m ops.benchmarks.step [--dtype auto] [--batches 1 32 128] [--context 256] [--steps 10]
                                  [--configs vllm-cpu batch-invariant torch] [--page-size 32]
                                  [--vllm-python V/bin/python]

For each kernel configuration (`worker/engine/kernels.py`: the vllm-cpu kernels, the same in
batch-invariant mode, and pure torch) and batch size B, on the default model: B requests with
prompts of `--context` random tokens are prefilled, then decode steps run (greedy, EOS
ignored) and are timed, median of `--steps`, on `--threads` threads (every usable CPU unless
given; pinned, where a worker measures which count is fastest as it runs). Beside each step:
- linear: the model's own linear layers at that batch and dtype (q/k/v, o, gate/up and down of
  every layer, and the vocabulary projection), timed alone with the same weights and kernels;
  the targets are step <= 1.5x linear at batch 32 and <= 1.3x at batch 1;
- the step's parts: the forward pass split by a profile of its tensor operations into matrix
  work, attention (SDPA and the page gathers that feed it), KV writes, other tensor operations
  (norms, rotary, activations, residuals) and what is left of the forward's wall time (Python
  and dispatch); then what the step does outside the forward (scheduling, sampling, the prefix
  index);
- the batched sampler alone on the model's logits of the last step: all B rows greedy, and all
  at temperature 0.8 with top-p 0.9.
Publishing is not part of a step: the worker publishes step k while step k+1 computes.
Given `--vllm-python` (a Python with vLLM's CPU build: `ops/benchmarks/peers.py`), vLLM's own
engine steps the same batches in that Python (`ops/benchmarks/vllm_step.py`: compiled as its CPU
runner compiles it, its threads bound to every core) and its step and parts are printed beside
ours, with the ratio of the two steps.
Then the roofline (`ops/benchmarks/roofline.py`): the machine's read bandwidth and GEMM rate,
measured on the threads the decode steps ran with, and for each step measured its FLOPs, the
bytes it must read and write, the least time they allow per part (linears, attention) and the
step's % of that roofline.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.table import Table

from ops.benchmarks.harness import engine as harness
from ops.benchmarks.machine import describe
from ops.benchmarks.peers import all_cores, model_dir
from ops.benchmarks.roofline import Machine, StepCost, measure_machine, mlp_shape, step_cost
from ops.console import make_console
from shared.messages import SamplingParams
from shared.settings import DEFAULT_MODEL, WorkerSettings
from worker.engine.engine import Engine
from worker.engine.sampler import Row, sample
from worker.engine.threads import usable_cpus

LINEAR_OPS = ("mkldnn::_linear_pointwise", "_C::onednn_mm", "_C::weight_packed_linear", "aten::mm",
              "aten::addmm", "aten::_weight_int8pack_mm")
ATTENTION_OPS = ("aten::_scaled_dot_product_flash_attention_for_cpu",
                 "aten::_scaled_dot_product_attention_math", "aten::index_select",
                 "_C::cpu_attention_with_kv_cache", "_C::get_scheduler_metadata")
KV_WRITE_OPS = ("aten::index_copy_", "_C::cpu_attn_reshape_and_cache")
OP_PREFIXES = ("aten::", "mkldnn::", "_C::")  # profiled tensor operations
# name: (--kernels, --batch-invariant)
CONFIGS = {"vllm-cpu": ("vllm-cpu", False), "batch-invariant": ("vllm-cpu", True),
           "torch": ("torch", False)}
TARGETS = {1: 1.3, 32: 1.5}  # step / linear, at most
LAST_LOGITS: list[torch.Tensor] = []  # the model's logits of the last profiled step
COSTLIEST = 12  # operations named per batch, ours and vLLM's


def _median_ms(fn: Callable[[], object], n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _engine(dtype: str, batch: int, config: str, threads: int, page_size: int) -> Engine:
    kernels, invariant = CONFIGS[config]
    return harness.built(dtype=dtype, max_running=batch, kv_cache_memory=2 * 1024**3,
                         kernels=kernels, batch_invariant=invariant, threads=threads,
                         decode_threads=threads, page_size=page_size)


def _fill(engine: Engine, batch: int, context: int) -> None:
    harness.add_random(engine, batch, context, seed=batch)
    harness.prefill(engine)


def _linear_ms(engine: Engine, batch: int, steps: int) -> float:
    runner: Any = engine.runner
    dtype = runner.kv_shape.dtype
    inputs = {lin: torch.randn(batch, lin.in_features, dtype=dtype) for lin in runner.linears()}

    def run() -> None:
        for lin, x in inputs.items():
            lin(x)

    run()
    return _median_ms(run, steps)


def _profile(engine: Engine, steps: int
             ) -> tuple[dict[str, float], int, list[tuple[str, float]]]:
    """Per-step milliseconds of the step's parts, the tokens the middle timed step attends in
    all (each step adds one to every request), and the costliest operations' profiled ms a
    step."""
    runner: Any = engine.runner
    forward = runner.forward
    spent = {"forward": 0.0}

    def timed(chunks: Any) -> Any:
        t0 = time.perf_counter()
        out = forward(chunks)
        spent["forward"] += time.perf_counter() - t0
        LAST_LOGITS[:] = [out]
        return out

    for _ in range(3):  # oneDNN builds its kernels for a new batch shape on first use
        engine.step()
    runner.forward = timed
    running = engine.scheduler.running.values()
    kv_tokens = sum(len(s.tokens) for s in running) + len(running) * (steps // 2)
    try:
        times = []
        for _ in range(steps):
            spent["forward"] = 0.0
            t0 = time.perf_counter()
            engine.step()
            times.append((time.perf_counter() - t0, spent["forward"]))
        step, fwd = (x * 1e3 for x in sorted(times)[len(times) // 2])  # the median step
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                engine.step()
    finally:
        runner.forward = forward
    parts = {"matrix": 0.0, "attention": 0.0, "KV writes": 0.0, "other ops": 0.0}
    for event in prof.key_averages():
        ms = event.self_cpu_time_total / 1e3 / steps
        if event.key in LINEAR_OPS:
            parts["matrix"] += ms
        elif event.key in ATTENTION_OPS:
            parts["attention"] += ms
        elif event.key in KV_WRITE_OPS:
            parts["KV writes"] += ms
        elif event.key.startswith(("aten::", "_C::")):
            parts["other ops"] += ms
    profiled = sum(parts.values())
    # Scale the profile's shares to the unprofiled forward; the rest of it is Python.
    shares = {k: v / profiled * fwd * _op_fraction(prof, steps, fwd) for k, v in parts.items()}
    shares["python, dispatch"] = fwd - sum(shares.values())
    shares["outside forward"] = step - fwd
    shares["step"] = step
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    costliest = [(e.key, e.self_cpu_time_total / 1e3 / steps) for e in events[:COSTLIEST]]
    return shares, kv_tokens, costliest


def _op_fraction(prof: Any, steps: int, fwd_ms: float) -> float:
    """The part of the forward's wall time spent inside tensor operations (at most 1)."""
    top = sum(e.self_cpu_time_total for e in prof.key_averages()
              if e.key.startswith(OP_PREFIXES)) / 1e3 / steps
    return min(1.0, top / fwd_ms) if fwd_ms else 0.0


def _sampler_ms(logits: torch.Tensor, steps: int) -> tuple[float, float]:
    batch = logits.shape[0]
    greedy = [Row(SamplingParams(max_tokens=1, temperature=0.0), None, (1,), 1)] * batch
    warm = SamplingParams(max_tokens=1, temperature=0.8, top_p=0.9)
    hot = [Row(warm, None, (1,), 1)] * batch
    return (_median_ms(lambda: sample(logits, greedy), steps),
            _median_ms(lambda: sample(logits, hot), steps))


def _roofline_table(costs: list[tuple[str, float, float, StepCost]],
                    machine: Machine) -> Table:
    table = Table(title="decode step against its roofline (linears: their FLOPs, weights; "
                        "attention: its QK and PV FLOPs, KV read and written)")
    for col in ("kernels", "batch", "KV tokens", "GFLOP linears", "GFLOP attention",
                "MB weights", "MB KV read", "MB KV written", "roofline linears ms",
                "roofline attention ms", "roofline ms", "step ms", "step/linear",
                "% of roofline"):
        table.add_column(col)
    for config, step, linear, cost in costs:
        roof = cost.roofline_ms(machine)
        table.add_row(config, str(cost.batch), str(cost.kv_tokens),
                      f"{cost.linear_flops / 1e9:.2f}", f"{cost.attention_flops / 1e9:.2f}",
                      f"{cost.weight_bytes / 1e6:.0f}", f"{cost.kv_read_bytes / 1e6:.0f}",
                      f"{cost.kv_write_bytes / 1e6:.2f}",
                      _bound(cost.linear_ms(machine), cost.linear_flops, machine),
                      _bound(cost.attention_ms(machine), cost.attention_flops, machine),
                      f"{roof:.2f}", f"{step:.1f}", f"{step / linear:.2f}x",
                      f"{100 * roof / step:.0f}%")
    return table


def _bound(ms: float, flops: float, machine: Machine) -> str:
    """A part's roofline time and what bounds it."""
    compute = flops / machine.gemm_flops_s * 1e3 >= ms
    return f"{ms:.2f} ({'compute' if compute else 'bytes'})"


VLLM_PARTS = ("matrix", "attention", "KV writes", "other ops", "compiled (fused)")


def _vllm_steps(python: str, dtype: str, batches: list[int], context: int,
                steps: int) -> dict[str, Any]:
    """vLLM's engine stepping the same batches, in `python` (ops/benchmarks/vllm_step.py)."""
    script = str(Path(__file__).with_name("vllm_step.py"))
    out = subprocess.run([python, script, model_dir(), "--dtype", dtype, "--context", str(context),
                          "--steps", str(steps), "--bind", all_cores(),
                          "--batches", *map(str, batches)],
                         check=True, capture_output=True, text=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _peer_table(ours: dict[int, dict[str, float]], vllm: dict[str, Any], dtype: str) -> Table:
    table = Table(title=f"decode step beside vLLM {vllm['vllm']}'s ({dtype}, its engine in "
                        f"process, {vllm['threads']} threads; ms per step)")
    for col in ("batch", "vLLM step", "ours", "ours/vLLM", *(f"vLLM {p}" for p in VLLM_PARTS),
                "our matrix", "our attention", "our KV writes", "our other ops",
                "our python, dispatch", "our outside forward"):
        table.add_column(col)
    for batch, parts in ours.items():
        theirs = vllm["batches"].get(str(batch))
        if theirs is None:
            continue
        table.add_row(str(batch), f"{theirs['step']:.1f}", f"{parts['step']:.1f}",
                      f"{parts['step'] / theirs['step']:.2f}x",
                      *(f"{theirs[p]:.1f}" for p in VLLM_PARTS),
                      *(f"{parts[k]:.1f}" for k in ("matrix", "attention", "KV writes",
                                                     "other ops", "python, dispatch",
                                                     "outside forward")))
    return table


def main() -> None:
    from worker.engine.kernels import KernelsUnavailable

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--context", type=int, default=256, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--configs", nargs="+", choices=tuple(CONFIGS), default=list(CONFIGS))
    ap.add_argument("--threads", type=int, default=usable_cpus(), help="for every step")
    ap.add_argument("--page-size", type=int, default=WorkerSettings().page_size,
                    help="KV page size in tokens (the worker's --page-size)")
    ap.add_argument("--vllm-python", help="a Python with vllm-cpu installed: adds vLLM's step")
    args = ap.parse_args()
    console = make_console()
    console.print(describe())
    table = Table(title=f"{DEFAULT_MODEL} decode step, prompts of {args.context} tokens "
                        "(ms per step)")
    columns = ("kernels", "batch", "step", "tokens/s", "linear", "step/linear", "matrix",
               "attention", "KV writes", "other ops", "python, dispatch", "outside forward",
               "sample greedy", "sample top-p")
    for col in columns:
        table.add_column(col)
    dtype_used = ""
    machine: Machine | None = None
    costs: list[tuple[str, float, float, StepCost]] = []  # config, step, linear, cost
    default_parts: dict[int, dict[str, float]] = {}  # the default kernels' parts, per batch
    costliest: dict[int, list[tuple[str, float]]] = {}  # the default kernels', per batch
    for config in args.configs:
        for batch in args.batches:
            with console.status(f"{config}, batch {batch}"):
                try:
                    engine = _engine(args.dtype, batch, config, args.threads, args.page_size)
                except KernelsUnavailable as e:
                    console.print(f"{config}: not run here: {e}")
                    break
                dtype = engine.runner.kv_shape.dtype
                dtype_used = str(dtype).removeprefix("torch.")
                _fill(engine, batch, args.context)
                parts, kv_tokens, ops = _profile(engine, args.steps)
                linear = _linear_ms(engine, batch, args.steps)
                greedy, hot = _sampler_ms(LAST_LOGITS[0], args.steps)
                costs.append((config, parts["step"], linear,
                              step_cost(engine.runner, batch, kv_tokens)))
                shape = mlp_shape(engine.runner)
            if config == "vllm-cpu":
                default_parts[batch], costliest[batch] = parts, ops
            ratio = parts["step"] / linear
            target = TARGETS.get(batch)
            verdict = "" if target is None else (
                f" ({'met' if ratio <= target else 'MISSED'} <= {target})")
            table.add_row(config, str(batch), f"{parts['step']:.1f}",
                          f"{batch / parts['step'] * 1e3:.0f}", f"{linear:.1f}",
                          f"{ratio:.2f}x{verdict}",
                          *(f"{parts[k]:.1f}" for k in columns[6:12]), f"{greedy:.2f}",
                          f"{hot:.2f}")
            del engine
            if machine is None or machine.threads != torch.get_num_threads():
                with console.status("measuring read bandwidth and GEMM rate"):
                    machine = measure_machine(dtype, shape)
    console.print(table)
    if args.vllm_python and default_parts:
        with console.status("vLLM's engine, the same batches"):
            vllm = _vllm_steps(args.vllm_python, dtype_used, args.batches, args.context,
                               args.steps)
        console.print(_peer_table(default_parts, vllm, dtype_used))
        for batch, theirs in vllm["batches"].items():
            for whose, ops in (("vLLM's", theirs["costliest"]),
                               ("our", costliest.get(int(batch), []))):
                named = ", ".join(f"{name} {ms:.2f}" for name, ms in ops)
                console.print(f"{whose} costliest operations at batch {batch} (ms a step, "
                              f"profiled): {named}")
    if machine is not None:
        console.print(machine.describe())
        console.print(_roofline_table(costs, machine))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    console.print(f"dtype {dtype_used}, {torch.get_num_threads()} threads; peak RSS {rss:.0f} MiB")


if __name__ == "__main__":
    main()
