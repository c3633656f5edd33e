"""LoRA adapters loaded on demand (worker/engine/lora/resident.py): what a load costs, and how
often placement avoids one. `python -m ops.benchmarks.lora --demand` runs it (`--adapters`,
`--requests`, `--max-loras`, `--rank` scale it down on a busy machine).

- A cold load: one `redserve api` declaring the adapters and one `redserve worker` declaring
  none, on the default model. `STREAMS` base streams decode; meanwhile requests name adapters
  the worker has not seen, one at a time. Reported: a load's read and check (on the worker's
  reader thread) and its layout (on the compute thread, between two steps), from the worker's
  metrics; the cold request's TTFT against a resident adapter's; and the base streams'
  inter-token p99 with the loads against without. Targets: a load <= 100 ms, the p99 <= 1.5x.
- Placement: 2 workers (`--max-loras` each, 32 by default: the adapters fit over both but not
  on one) behind one replica, `--requests` requests spread at random over the adapters,
  `CONCURRENCY` at a time, with placement `prefix` (on) and `none` (off): the fraction of
  requests that caused a cold load (the workers' `redserve_worker_lora_loads_total`) and
  output tokens/s. Target: <= 10% with placement on (each adapter's first load counts: 50
  adapters need 500 requests or more for it to be reachable, hence 1000 by default).
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any

import httpx

from ops.benchmarks.harness.client import body, percentile, stream
from ops.benchmarks.harness.stack import Processes, redis_url
from ops.benchmarks.peers import model_dir
from ops.benchmarks.serve import stories
from ops.embedded_redis import free_port
from ops.testkit.probe import scrape
from shared.settings import DEFAULT_MODEL

STREAMS = 4  # base streams decoding while adapters load
STREAM_TOKENS = 96
COLD_LOADS = 3
CONCURRENCY = 8
REQUEST_TOKENS = 16
NO_AUTH = {"REDSERVE_NO_AUTH": "true"}
EXTRA: dict[str, Any] = {"speculation": False}  # as ops/benchmarks/lora.py


def make_many(root: Path, count: int, rank: int, b_scale: float) -> dict[str, Path]:
    """`count` adapters of the default model: one peft model, its A and B drawn again (seeded)
    for each (faster than ops.benchmarks.lora.make_adapters' model per adapter)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir(), dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, init_lora_weights=False,
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                        "up_proj", "down_proj"])
    model = get_peft_model(base, config)
    made = {}
    for i in range(count):
        torch.manual_seed(1000 + i)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_A" in name:
                    param.uniform_(-1 / param.shape[1] ** 0.5, 1 / param.shape[1] ** 0.5)
                elif "lora_B" in name:
                    param.uniform_(-b_scale, b_scale)
        path = root / f"many{i}"
        model.save_pretrained(str(path))
        made[path.name] = path
    return made


def _lora_flags(adapters: dict[str, Path]) -> list[str]:
    return [a for name, path in adapters.items() for a in ("--lora", f"{name}={path}")]


def _counter(metrics: dict[str, float], name: str) -> float:
    return sum(v for k, v in metrics.items() if k == name or k.startswith(name + "{"))


async def _streams(url: str, models: list[str], prompts: tuple[str, ...], tokens: int
                   ) -> tuple[list[float], list[float], int]:
    """One stream per prompt at once: TTFTs, inter-token gaps, tokens."""
    ttft: list[float] = []
    itl: list[float] = []
    total = 0
    async with httpx.AsyncClient(timeout=900) as client:
        async def one(i: int, prompt: str) -> None:
            nonlocal total
            reply = await stream(client, url, body(models[i % len(models)], tokens,
                                                   content=prompt, ignore_eos=True, **EXTRA))
            total += reply.tokens
            if reply.ttft is not None:
                ttft.append(reply.ttft)
            itl.extend(reply.itl)

        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return ttft, itl, total


async def _base_with_loads(url: str, cold: list[str]) -> tuple[list[float], list[float]]:
    """The base streams' gaps while `cold` adapters are named one after another; the cold
    requests' TTFTs."""
    base = asyncio.create_task(_streams(url, [DEFAULT_MODEL], stories(STREAMS), STREAM_TOKENS))
    await asyncio.sleep(1.0)  # the streams are decoding
    ttfts = []
    for name in cold:
        ttft, _, _ = await _streams(url, [name], stories(1), 4)
        ttfts += ttft
        await asyncio.sleep(0.5)
    _, itl, _ = await base
    return itl, ttfts


def cold_load(adapters: dict[str, Path]) -> dict[str, float]:
    """See the docstring: a cold load's cost, alone and to the other streams."""
    names = list(adapters)
    metrics_port = free_port()
    with redis_url() as url, Processes(url, model_dir(), env=NO_AUTH,
                                       name="bench-lora-load") as procs:
        procs.worker("--max-loras", str(len(names)),
                     env={"REDSERVE_METRICS_PORT": str(metrics_port)})
        api = procs.api(*_lora_flags(adapters))
        procs.wait_ready(api)
        worker_metrics = f"http://127.0.0.1:{metrics_port}/metrics"
        warm = names[0]
        asyncio.run(_streams(api, [DEFAULT_MODEL, warm], stories(2), 8))  # warm-up, warm loaded
        _, alone, _ = asyncio.run(_streams(api, [DEFAULT_MODEL], stories(STREAMS), STREAM_TOKENS))
        warm_ttft, _, _ = asyncio.run(_streams(api, [warm], stories(1), 4))
        before = scrape(worker_metrics)
        during, cold_ttfts = asyncio.run(_base_with_loads(api, names[1 : 1 + COLD_LOADS]))
        after = scrape(worker_metrics)
    loads = (_counter(after, "redserve_worker_lora_loads_total")
             - _counter(before, "redserve_worker_lora_loads_total"))
    per = {key: (after[f"redserve_worker_lora_{key}_seconds_total"]
                 - before[f"redserve_worker_lora_{key}_seconds_total"]) / max(loads, 1)
           for key in ("read", "lay_out")}
    return {"loads": loads, "read ms": per["read"] * 1e3, "lay out ms": per["lay_out"] * 1e3,
            "cold TTFT ms": percentile(cold_ttfts, 0.5) * 1e3,
            "warm TTFT ms": percentile(warm_ttft, 0.5) * 1e3,
            "ITL p99 ms alone": percentile(alone, 0.99) * 1e3,
            "ITL p99 ms with loads": percentile(during, 0.99) * 1e3}


async def _spread(url: str, names: list[str], requests: int) -> tuple[int, float]:
    """`requests` requests, each on a random adapter, `CONCURRENCY` at a time: tokens, seconds."""
    rng = random.Random(41)
    models = [rng.choice(names) for _ in range(requests)]
    prompts = stories(requests)
    gate = asyncio.Semaphore(CONCURRENCY)
    total = 0
    async with httpx.AsyncClient(timeout=900) as client:
        async def one(i: int) -> None:
            nonlocal total
            async with gate:
                reply = await stream(client, url, body(models[i], REQUEST_TOKENS,
                                                       content=prompts[i], ignore_eos=True,
                                                       **EXTRA))
                total += reply.tokens

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(requests)))
        return total, time.perf_counter() - t0


def placement(adapters: dict[str, Path], mode: str, requests: int,
              max_loras: int) -> dict[str, float]:
    """See the docstring: 2 workers, placement `mode`; cold loads per request, tokens/s."""
    ports = [free_port(), free_port()]
    with redis_url() as url, Processes(url, model_dir(), env=NO_AUTH,
                                       name=f"bench-lora-{mode}") as procs:
        for i, port in enumerate(ports):
            procs.worker("--max-loras", str(max_loras), "--threads", "1", name=f"worker-{i}",
                         env={"REDSERVE_METRICS_PORT": str(port)})
        api = procs.api(*_lora_flags(adapters), "--placement", mode)
        procs.wait_ready(api, workers=2)
        asyncio.run(_streams(api, [DEFAULT_MODEL], stories(2), 4))  # warm-up
        tokens, seconds = asyncio.run(_spread(api, list(adapters), requests))
        loads = sum(_counter(scrape(f"http://127.0.0.1:{p}/metrics"),
                             "redserve_worker_lora_loads_total") for p in ports)
    return {"cold loads / request": loads / requests, "tokens/s": tokens / seconds}
