"""vLLM's own decode step, timed as `ops.benchmarks.step` times ours: run by the Python of a
virtual environment that has vLLM (`ops/benchmarks/peers.py` says how to make one), as a file,
not a module, so that nothing of redserve is imported beside vLLM's pins:

    V/bin/python ops/benchmarks/vllm_step.py MODEL_DIR --dtype bfloat16 --batches 1 32
                 --context 256 --steps 10 --bind 0,1

prints one JSON object: for each batch size, the median decode step in ms, its parts by
operation family from torch's profiler, as `ops.benchmarks.step` names them, and its costliest
operations (self time per step).

vLLM's engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so each
`LLMEngine.step()` is one scheduler step, forward pass and sampling, as in its server; the
model is compiled as its CPU runner compiles it by default (inductor). B requests of
`--context` random tokens are added, prefilled, then `--steps` decode steps are timed and as
many again profiled, with EOS ignored and no detokenizing (our step does neither).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

# The operation families, as ops.benchmarks.step groups its own profile.
FAMILIES = {
    "matrix": ("_C::onednn_mm", "_C::weight_packed_linear", "aten::mm", "aten::addmm",
               "aten::linear", "mkldnn::_linear_pointwise", "aten::bmm"),
    "attention": ("_C::cpu_attention_with_kv_cache", "_C::get_scheduler_metadata"),
    "KV writes": ("_C::cpu_attn_reshape_and_cache",),
}


def _family(name: str) -> str | None:
    for family, names in FAMILIES.items():
        if name in names:
            return family
    if name.startswith(("aten::", "_C::", "mkldnn::")):
        return "other ops"
    # inductor's compiled graph (its fused elementwise kernels), as the profiler names it
    if "CompiledFxGraph" in name or "cpp_fused" in name:
        return "compiled (fused)"
    return None


def _run(engine: object, batch: int, context: int, steps: int, seed: int) -> dict[str, object]:
    import torch
    from vllm import SamplingParams

    rng = random.Random(seed)
    # Enough tokens for the prefill steps, the timed steps and the profiled ones.
    params = SamplingParams(max_tokens=2 * steps + 8, ignore_eos=True, temperature=0.0,
                            detokenize=False)
    for i in range(batch):
        ids = [rng.randrange(100, 30000) for _ in range(context)]
        engine.add_request(f"{seed}-{i}", {"prompt_token_ids": ids}, params)  # type: ignore
    produced: dict[str, int] = {}

    def step() -> float:
        t0 = time.perf_counter()
        for out in engine.step():  # type: ignore[attr-defined]
            produced[out.request_id] = len(out.outputs[0].token_ids)
        return time.perf_counter() - t0

    while len(produced) < batch or min(produced.values()) < 2:  # every prompt prefilled
        step()
    for _ in range(3):
        step()
    times = [step() for _ in range(steps)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    while engine.has_unfinished_requests():  # type: ignore[attr-defined]
        step()
    parts: dict[str, object] = {"matrix": 0.0, "attention": 0.0, "KV writes": 0.0,
                                "other ops": 0.0, "compiled (fused)": 0.0}
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    for event in events:
        family = _family(event.key)
        if family is not None:
            parts[family] += event.self_cpu_time_total / 1e3 / steps
    parts["step"] = statistics.median(times) * 1e3
    parts["costliest"] = [(e.key, round(e.self_cpu_time_total / 1e3 / steps, 3))
                          for e in events[:12]]
    return parts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("model")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--bind", default="auto", help="VLLM_CPU_OMP_THREADS_BIND")
    args = ap.parse_args()
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="2",
                      VLLM_CPU_OMP_THREADS_BIND=args.bind)
    from vllm import LLM

    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=max(args.batches),
              max_model_len=args.context + 2 * args.steps + 64, skip_tokenizer_init=True,
              seed=0)
    start_s = time.perf_counter() - t0
    results = {str(b): _run(llm.llm_engine, b, args.context, args.steps, seed=b)
               for b in args.batches}
    import torch

    json.dump({"vllm": _version(), "start_s": start_s, "threads": torch.get_num_threads(),
               "batches": results}, sys.stdout)
    print()


def _version() -> str:
    import vllm

    return str(vllm.__version__)


if __name__ == "__main__":
    main()
