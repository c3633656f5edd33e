"""LoRA adapters served over one base model, redserve against vLLM's CPU server in one run.

    python -m ops.benchmarks.lora [--vllm-python V/bin/python] [--adapters 8] [--rank 16]
                                  [--streams 32] [--max-tokens 64]
    python -m ops.benchmarks.lora --demand [--adapters 50] [--requests 1000] [--max-loras 32]

`--adapters` rank-`--rank` adapters are made for the default model with peft (every attention
and MLP projection, random weights, so that each one's text differs from the base's) and
saved in PEFT's format; both servers are started with all of them declared (redserve's
`--lora NAME=PATH`, vLLM's `--enable-lora --lora-modules NAME=PATH`, as many resident at once
as there are adapters) and run, each alone on the machine:
- `--streams` streams x `--max-tokens` on the base model alone, then the same streams spread
  round-robin over the adapters (greedy, `ignore_eos`, so every stream decodes exactly
  `--max-tokens`): output tokens/s over the load, TTFT p50 and inter-token p50/p99;
- one stream on the base, then one on an adapter: decode tokens/s.
redserve runs with its speculation off (`"speculation": false`): its gain depends on each text.
Targets (issue 41): the adapters' load >= 0.8x the base's tokens/s on redserve and >= 1.2x
vLLM's on the same adapters; one stream on an adapter >= 0.9x the base's.

`--demand` measures adapters loaded on demand instead (ops/benchmarks/lora_demand.py): a cold
load's time and its cost to the other streams, and, over 2 workers, the requests that cause a
cold load with placement on and off.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from ops.benchmarks.harness.client import body, percentile, stream
from ops.benchmarks.harness.stack import Server, up
from ops.benchmarks.lora_demand import cold_load, make_many, placement
from ops.benchmarks.machine import describe
from ops.benchmarks.peers import VLLM_KV_GIB, all_cores, model_dir
from ops.benchmarks.serve import Load, stories
from ops.console import make_console
from ops.embedded_redis import free_port
from shared.settings import DEFAULT_MODEL

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ONE_STREAM_TOKENS = 128
B_SCALE = 0.05  # peft's random B, scaled down (see make_adapters)
# redserve's n-gram speculation off: its gain depends on each text, and the loads compare texts
# of different adapters (vLLM does not speculate unless told to).
NO_SPECULATION: dict[str, Any] = {"speculation": False}


def make_adapters(root: Path, count: int, rank: int) -> dict[str, Path]:
    """`count` PEFT adapters of `rank` for the default model under `root`, by name."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    made = {}
    for i in range(count):
        torch.manual_seed(i)
        base = AutoModelForCausalLM.from_pretrained(model_dir(), dtype=torch.float32)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(TARGET_MODULES),
                            init_lora_weights=False)  # random B too: a text of its own
        model = get_peft_model(base, config)
        with torch.no_grad():  # small enough that the text stays language, as a trained one's
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.mul_(B_SCALE)
        path = root / f"adapter{i}"
        model.save_pretrained(str(path))
        made[path.name] = path
    return made


def _cells(load: Load) -> list[str]:
    return [f"{load.rate:.1f}", f"{percentile(load.ttft, 0.5) * 1e3:.0f}",
            f"{percentile(load.itl, 0.5) * 1e3:.1f}", f"{percentile(load.itl, 0.99) * 1e3:.1f}"]


async def _load(server: Server, models: list[str], prompts: tuple[str, ...],
                max_tokens: int, extra: dict[str, Any]) -> Load:
    """One stream per prompt, all at once, the i-th on `models[i % len(models)]`."""
    load = Load()
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=900, limits=limits) as client:
        async def one(i: int, prompt: str) -> None:
            request = body(models[i % len(models)], max_tokens, content=prompt, ignore_eos=True,
                           **extra)
            reply = await stream(client, server.base, request)
            load.tokens += reply.tokens
            if reply.ttft is not None:
                load.ttft.append(reply.ttft)
            load.itl += reply.itl

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        load.seconds = time.perf_counter() - t0
    return load


def _measure(server: Server, adapters: list[str], streams: int, max_tokens: int,
             extra: dict[str, Any]) -> dict[str, Load]:
    def load(models: list[str], prompts: tuple[str, ...], tokens: int) -> Load:
        return asyncio.run(_load(server, models, prompts, tokens, extra))

    try:
        server.wait()
        load([server.model, *adapters], stories(len(adapters) + 1), 8)  # warm-up
        prompts = stories(streams)
        return {"base": load([server.model], prompts, max_tokens),
                "adapters": load(adapters, prompts, max_tokens),
                "one base": load([server.model], prompts[:1], ONE_STREAM_TOKENS),
                "one adapter": load(adapters[:1], prompts[:1], ONE_STREAM_TOKENS)}
    finally:
        server.stop()


def redserve_lora(adapters: dict[str, Path], rank: int) -> Server:
    pairs = [a for name, path in adapters.items() for a in ("--lora", f"{name}={path}")]
    return up(*pairs, "--max-loras", str(len(adapters)), "--max-lora-rank", str(rank))


def vllm_lora(python: str, adapters: dict[str, Path], rank: int) -> Server:
    """vLLM's OpenAI server at bf16, bound to every core (its best here: ops/benchmarks/
    peers.py), with every adapter declared and resident."""
    port = free_port()
    env = {"VLLM_CPU_KVCACHE_SPACE": str(VLLM_KV_GIB), "VLLM_CPU_OMP_THREADS_BIND": all_cores()}
    modules = [f"{name}={path}" for name, path in adapters.items()]
    return Server([python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir(),
                   "--served-model-name", DEFAULT_MODEL, "--dtype", "bfloat16",
                   "--port", str(port), "--enable-lora", "--max-loras", str(len(adapters)),
                   "--max-lora-rank", str(rank), "--lora-modules", *modules],
                  port, DEFAULT_MODEL, env)


def demand(console: Console, args: argparse.Namespace) -> None:
    """Adapters loaded on demand (ops/benchmarks/lora_demand.py)."""
    adapters = 50 if args.adapters == 8 else args.adapters  # the default here: 50
    with tempfile.TemporaryDirectory(prefix="lora-demand-") as tmp:
        with console.status(f"making {adapters} rank-{args.rank} adapters with peft"):
            made = make_many(Path(tmp), adapters, args.rank, B_SCALE)
        with console.status("a cold load"):
            load = cold_load(made)
        table = Table(title=f"a rank-{args.rank} adapter the worker has not seen, "
                            f"{DEFAULT_MODEL}")
        for name in load:
            table.add_column(name)
        table.add_row(*(f"{v:.1f}" for v in load.values()))
        console.print(table)
        ratio = load["ITL p99 ms with loads"] / load["ITL p99 ms alone"]
        total = load["read ms"] + load["lay out ms"]
        console.print(f"a load: {total:.0f} ms (target <= 100: "
                      f"{'met' if total <= 100 else 'MISSED'}); the other streams' ITL p99 "
                      f"with loads: {ratio:.2f}x (target <= 1.5x: "
                      f"{'met' if ratio <= 1.5 else 'MISSED'})")
        table = Table(title=f"{args.requests} requests over {adapters} adapters, 2 workers of "
                            f"--max-loras {args.max_loras}")
        for col in ("placement", "cold loads / request", "tokens/s"):
            table.add_column(col)
        for mode in ("prefix", "none"):
            with console.status(f"placement {mode}"):
                got = placement(made, mode, args.requests, args.max_loras)
            table.add_row(mode, f"{got['cold loads / request']:.1%}", f"{got['tokens/s']:.1f}")
        console.print(table)


def _verdict(ratio: float, target: float) -> str:
    return f"{ratio:.2f}x (target >= {target}x: {'met' if ratio >= target else 'MISSED'})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--vllm-python", help="a Python with vllm-cpu installed: adds vLLM's server")
    ap.add_argument("--demand", action="store_true", help="adapters loaded on demand instead")
    ap.add_argument("--requests", type=int, default=1000, help="--demand: requests spread "
                    "over the adapters")
    ap.add_argument("--max-loras", type=int, default=32, help="--demand: each worker's")
    args = ap.parse_args()
    console = make_console()
    console.print(describe())
    if args.demand:
        demand(console, args)
        return
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as tmp:
        with console.status(f"making {args.adapters} rank-{args.rank} adapters with peft"):
            adapters = make_adapters(Path(tmp), args.adapters, args.rank)
        names = list(adapters)
        results = {}
        with console.status("redserve up"):
            results["redserve up"] = _measure(redserve_lora(adapters, args.rank), names,
                                              args.streams, args.max_tokens, NO_SPECULATION)
        if args.vllm_python:
            with console.status("vLLM"):
                results["vLLM, bound to every core"] = _measure(
                    vllm_lora(args.vllm_python, adapters, args.rank), names, args.streams,
                    args.max_tokens, {})
    table = Table(title=f"{args.streams} streams x {args.max_tokens} tokens (greedy, ignore_eos), "
                        f"{DEFAULT_MODEL} and {args.adapters} rank-{args.rank} adapters")
    for col in ("server", "load", "tokens/s", "TTFT p50 ms", "ITL p50 ms", "ITL p99 ms"):
        table.add_column(col)
    for server, loads in results.items():
        for name, load in loads.items():
            table.add_row(server, name, *_cells(load))
    console.print(table)
    ours = results["redserve up"]
    console.print(f"redserve: adapters' load against the base's: "
                  f"{_verdict(ours['adapters'].rate / ours['base'].rate, 0.8)}; one stream on "
                  f"an adapter against the base's: "
                  f"{_verdict(ours['one adapter'].rate / ours['one base'].rate, 0.9)}")
    if "vLLM, bound to every core" in results:
        theirs = results["vLLM, bound to every core"]
        console.print(f"against vLLM on the same adapters: "
                      f"{_verdict(ours['adapters'].rate / theirs['adapters'].rate, 1.2)}; "
                      f"base alone {ours['base'].rate / theirs['base'].rate:.2f}x")


if __name__ == "__main__":
    main()
