"""The worker engine offline, side by side with what a user would otherwise run.

    python -m ops.benchmarks.engine [--requests 64] [--max-tokens 128] [--only NAME]

One workload (seeded): `--requests` prompts of 100-300 random tokens, `--max-tokens` output
tokens each with EOS ignored, greedy, on the default model (SmolLM2-135M) at `--dtype` (fp32
by default, the dtype these targets were set at; `python -m ops.benchmarks.step` and
`python -m ops.benchmarks.serve` measure the bf16 engine against peers at their best dtype). Each
system runs in its own process, so each peak RSS is its own:
- redserve: the worker engine (`worker/engine/engine.py`), every request added at once;
- generate_batch: transformers' continuous batching (`attn_implementation="paged|sdpa"`);
- static: HF `generate` on one left-padded batch of every prompt;
- and one request alone: decode tokens/s of the engine against HF `generate`.
Prints output tokens/s, the ratios against the targets, and the engine's peak RSS against the
bound base + model + KV budget + 250 MiB. `base` is the process's RSS measured just before the
engine is built, with torch, transformers and the worker's modules imported (about 390 MiB
here), which an earlier fixed allowance of 500 MiB for everything beyond model and KV left out;
the 250 MiB are for a step's activations (512-token prefill chunks, a batch's fp32 logits),
oneDNN's primitive caches (capped by `worker/engine/onednn.py`) and what the allocator holds.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import time
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from ops.benchmarks.harness import engine as harness
from ops.console import make_console
from shared.messages import SamplingParams
from shared.models import resolve_model
from shared.settings import DEFAULT_MODEL, WorkerSettings

MIB = 1024**2
SYSTEMS = ("redserve", "generate_batch", "static", "redserve_single", "hf_single")


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randint(100, 300))] for _ in range(n)]


def _peak_rss() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MIB


def _rss() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def _hf_model(dtype: str, **kw: Any) -> Any:
    from transformers import AutoModelForCausalLM

    info = resolve_model(DEFAULT_MODEL, WorkerSettings().cache_dir)
    return AutoModelForCausalLM.from_pretrained(str(info.path), dtype=getattr(torch, dtype),
                                                **kw).eval()


def _engine(kv_bytes: int, max_running: int, dtype: str) -> Any:
    return harness.built(kv_cache_memory=kv_bytes, max_running=max_running, dtype=dtype)


def _run_engine(engine: Any, prompts: list[list[int]], max_tokens: int) -> tuple[int, float, float]:
    """Output tokens, total seconds, and seconds to the first token of the last request."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add(harness.request(f"b-{i}", prompt, params))
    tokens = 0
    first = 0.0
    while engine.scheduler.has_work():
        for out in engine.step():
            tokens += 1
            if out.index == 0:
                first = time.perf_counter() - t0
    return tokens, time.perf_counter() - t0, first


def measure(system: str, args: argparse.Namespace) -> dict[str, float]:
    prompts = _prompts(args.requests)
    n_out = args.max_tokens
    torch.manual_seed(0)
    if system == "redserve":
        import worker.engine.build  # noqa: F401  # imported before `base` is read

        base = _rss()
        engine = _engine(args.kv_bytes, len(prompts), args.dtype)
        _run_engine(engine, [prompts[0][:32]], 4)  # warm-up
        tokens, seconds, _ = _run_engine(engine, prompts, n_out)
        return {"tokens": tokens, "seconds": seconds, "rss": _peak_rss(), "base": base,
                "kv": engine.pool.nbytes / MIB,
                "model": engine.runner.weight_bytes() / MIB}
    if system == "redserve_single":
        engine = _engine(args.kv_bytes, 1, args.dtype)
        _run_engine(engine, [prompts[0][:32]], 4)
        _, ttft, _ = _run_engine(engine, prompts[:1], 1)
        tokens, seconds, _ = _run_engine(engine, prompts[:1], n_out)
        return {"tokens": tokens - 1, "seconds": seconds - ttft, "rss": _peak_rss()}
    attention = "paged|sdpa" if system == "generate_batch" else "sdpa"
    model = _hf_model(args.dtype, attn_implementation=attention)
    if system == "hf_single":
        ids = torch.tensor(prompts[:1])
        mask = torch.ones_like(ids)
        model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=n_out, min_new_tokens=n_out,
                       do_sample=False)
        return {"tokens": n_out - 1, "seconds": time.perf_counter() - t0 - ttft,
                "rss": _peak_rss()}
    if system == "generate_batch":
        from transformers import GenerationConfig

        config = GenerationConfig(max_new_tokens=n_out, do_sample=False, eos_token_id=-1,
                                  pad_token_id=0)
        t0 = time.perf_counter()
        results = model.generate_batch(prompts, generation_config=config)
        seconds = time.perf_counter() - t0
        tokens = sum(len(r.generated_tokens) for r in results.values())
        return {"tokens": tokens, "seconds": seconds, "rss": _peak_rss()}
    assert system == "static"
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as generate expects for decoder-only models
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=n_out, min_new_tokens=n_out,
                         do_sample=False, pad_token_id=0)
    seconds = time.perf_counter() - t0
    return {"tokens": (out.shape[1] - width) * len(prompts), "seconds": seconds,
            "rss": _peak_rss()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--kv-bytes", type=int, default=1536 * MIB,
                    help="the engine's KV page pool (default 1.5 GiB)")
    ap.add_argument("--only", choices=SYSTEMS, help="measure one system, print JSON (internal)")
    ap.add_argument("--skip", nargs="*", choices=SYSTEMS, default=[])
    args = ap.parse_args()
    if args.only:
        print(json.dumps(measure(args.only, args)))
        return

    console = make_console()
    results: dict[str, dict[str, float]] = {}
    for system in SYSTEMS:
        if system in args.skip:
            continue
        with console.status(f"{system}: {args.requests} requests x {args.max_tokens} tokens"):
            cmd = [sys.executable, "-m", "ops.benchmarks.engine", "--only", system,
                   "--requests", str(args.requests), "--max-tokens", str(args.max_tokens),
                   "--kv-bytes", str(args.kv_bytes), "--dtype", args.dtype]
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        results[system] = json.loads(done.stdout.strip().splitlines()[-1])
        r = results[system]
        console.print(f"{system}: {r['tokens'] / r['seconds']:.1f} tokens/s "
                      f"({r['tokens']:.0f} tokens in {r['seconds']:.1f} s), "
                      f"peak RSS {r['rss']:.0f} MiB")
    _report(console, results, args)


def _report(console: Console, results: dict[str, dict[str, float]],
            args: argparse.Namespace) -> None:
    def rate(name: str) -> float:
        return results[name]["tokens"] / results[name]["seconds"]

    table = Table(title=f"{DEFAULT_MODEL} {args.dtype} CPU: {args.requests} requests, "
                        f"prompts 100-300, {args.max_tokens} output tokens each")
    for col in ("system", "output tokens/s", "redserve ratio", "target", "peak RSS MiB"):
        table.add_column(col)
    if "redserve" in results:
        table.add_row("redserve engine", f"{rate('redserve'):.1f}", "", "",
                      f"{results['redserve']['rss']:.0f}")
        for name, target in (("generate_batch", 3.0), ("static", 1.5)):
            if name in results:
                ratio = rate("redserve") / rate(name)
                table.add_row(f"transformers {name}", f"{rate(name):.1f}", f"{ratio:.2f}x",
                              f">= {target}x {'met' if ratio >= target else 'MISSED'}",
                              f"{results[name]['rss']:.0f}")
    if "redserve_single" in results and "hf_single" in results:
        ratio = rate("redserve_single") / rate("hf_single")
        table.add_row("one request: redserve decode", f"{rate('redserve_single'):.1f}", "", "",
                      f"{results['redserve_single']['rss']:.0f}")
        table.add_row("one request: HF generate decode", f"{rate('hf_single'):.1f}",
                      f"{ratio:.2f}x", f">= 1.5x {'met' if ratio >= 1.5 else 'MISSED'}",
                      f"{results['hf_single']['rss']:.0f}")
    console.print(table)
    if "redserve" in results:
        r = results["redserve"]
        bound = r["base"] + r["model"] + r["kv"] + 250
        console.print(f"redserve peak RSS {r['rss']:.0f} MiB; bound base {r['base']:.0f} + "
                      f"model {r['model']:.0f} + KV {r['kv']:.0f} + 250 = {bound:.0f} MiB: "
                      f"{'within' if r['rss'] <= bound else 'OVER'}")


if __name__ == "__main__":
    main()
