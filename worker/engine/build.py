"""From settings to an engine: device, dtype, kernels, threads, model, KV pool, scheduler
limits.

oneDNN's primitive caches are capped first, before torch builds any (`worker/engine/onednn.py`).
"""

from __future__ import annotations

import logging

import orjson
import torch

from shared.lora import LoraAdapter, check_compute, parse_lora_specs, read_adapters
from shared.models import ModelInfo
from shared.settings import WorkerSettings
from worker.engine import checkpoint, onednn
from worker.engine.constraint import Constraints, tokenizer_view
from worker.engine.dev_hooks import DevHooks
from worker.engine.dtype import dtype_name, pick_dtype
from worker.engine.engine import Engine, EngineConfig
from worker.engine.kv_cache import KVPool, budget_bytes
from worker.engine.linear import check_quantization
from worker.engine.lora.resident import LoraLimits, Residency
from worker.engine.model_runner import ModelRunner
from worker.engine.speculation.speculator import NO_SPECULATION, SpeculationConfig
from worker.engine.synthetic import SyntheticRunner
from worker.engine.threads import ThreadPolicy, usable_cpus

log = logging.getLogger("redserve.worker")


def pick_device(setting: str) -> torch.device:
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(setting)


def build_engine(info: ModelInfo, settings: WorkerSettings) -> Engine:
    caches = onednn.cap_caches()
    synthetic_step_ms = DevHooks().synthetic_step_ms
    if synthetic_step_ms:
        return _synthetic_engine(info, settings, synthetic_step_ms / 1000)
    device = pick_device(settings.device)
    dtype = pick_dtype(settings.dtype, device)
    log.info("computing in %s on %s (--dtype %s)", dtype_name(dtype), device, settings.dtype)
    threads = ThreadPolicy(settings.threads or usable_cpus(), settings.decode_threads)
    if device.type == "cpu":
        log.info("CPU threads: %s", threads.describe())
        log.info("oneDNN primitive caches: %s", ", ".join(f"{k}={v}" for k, v in caches.items()))
    check_quantization(settings.quantization, dtype, device)  # before the slow load
    runner = ModelRunner(checkpoint.load(info.path, device, dtype), release_modules=True,
                         kernels=settings.kernels, batch_invariant=settings.batch_invariant,
                         page_size=settings.page_size, quantization=settings.quantization,
                         kv_cache_dtype=settings.kv_cache_dtype)
    log.info("kernels: %s (%s)%s", runner.kernels.name, runner.kernels.note,
             "; batch-invariant" if runner.kernels.batch_invariant else "")
    loras = attach_loras(runner, info, settings)
    if settings.quantization == "int8":
        linears = runner.linears()
        log.info("int8 weights (--quantization int8): %d of %d linear layers (the vocabulary "
                 "projection stays %s); %.0f MiB of weights",
                 sum(lin.mode == "int8" for lin in linears), len(linears), dtype_name(dtype),
                 runner.weight_bytes() / 2**20)
    budget = budget_bytes(settings.kv_cache_memory, device)
    pool = KVPool.from_budget(runner.kv_shape, budget, settings.page_size)
    log.info("KV cache in %s (--kv-cache-dtype %s): %d tokens in %d pages, %.0f MiB",
             runner.kv_shape.storage_name, settings.kv_cache_dtype,
             pool.num_pages * pool.page_size, pool.num_pages, pool.nbytes / 2**20)
    step_tokens = settings.max_prefill_tokens or (8192 if device.type == "cuda" else 512)
    config = EngineConfig(
        max_running=settings.batch_limit,
        max_step_tokens=step_tokens,
        max_model_len=info.max_model_len,
        page_size=settings.page_size,
        prefix_caching=settings.prefix_caching,
        threads=threads if device.type == "cpu" else None,
        speculation=speculation_config(settings),
        loras=loras,
    )
    return Engine(runner, pool, config, eos_token_ids=info.eos_token_ids,
                  constraints=build_constraints(info))


def check_loras(info: ModelInfo, settings: WorkerSettings) -> list[LoraAdapter]:
    """The declared adapters, checked against the model (without torch: `shared/lora.py`)
    and against what this worker computes; LoraError names the problem."""
    specs = parse_lora_specs(settings.lora)
    check_compute(len(specs), settings.batch_invariant)
    adapters = read_adapters(specs, {info.name: info.path}, settings.max_lora_rank)
    return [adapter for _, adapter in adapters.values()]


def attach_loras(runner: ModelRunner, info: ModelInfo,
                 settings: WorkerSettings) -> Residency | None:
    """The worker's adapters on `runner` (worker/engine/lora/resident.py), the declared ones
    preloaded up to `--max-loras`; None in batch-invariant mode, which serves none."""
    adapters = check_loras(info, settings)
    if runner.kernels.batch_invariant:
        return None
    residency = Residency(runner, LoraLimits(info.name, info.path, settings.max_loras,
                                             settings.max_lora_rank),
                          {a.name: a.path for a in adapters})
    residency.preload(adapters)
    if adapters:
        log.info("LoRA adapters: %s; %d resident at most (--max-loras)",
                 ", ".join(f"{a.name} (rank {a.rank}, {len(a.modules)} projections)"
                           for a in adapters), settings.max_loras)
    return residency


def speculation_config(settings: WorkerSettings) -> SpeculationConfig:
    if settings.speculation != "off":
        log.info("speculative decoding: %s, up to %d draft tokens a request a step",
                 settings.speculation, settings.speculative_tokens)
    return SpeculationConfig(settings.speculation, settings.speculative_tokens)


def build_constraints(info: ModelInfo) -> Constraints:
    """The grammar compiler, over the model's tokenizer and its logits width."""
    vocab = int(orjson.loads((info.path / "config.json").read_bytes())["vocab_size"])
    return Constraints(tokenizer_view(info.path, vocab, info.eos_token_ids))


def _synthetic_engine(info: ModelInfo, settings: WorkerSettings, step_s: float) -> Engine:
    # Nothing to parallelise: more threads would only spin between steps and take CPU from
    # the processes being measured. No speculation: the stand-in would accept every draft,
    # and the broker's figures would no longer compare with a step a token.
    torch.set_num_threads(1)
    vocab = int(orjson.loads((info.path / "config.json").read_bytes())["vocab_size"])
    runner = SyntheticRunner(vocab, step_s)
    tokens = settings.batch_limit * info.max_model_len
    pool = KVPool(runner.kv_shape, -(-tokens // settings.page_size), settings.page_size)
    config = EngineConfig(max_running=settings.batch_limit, max_step_tokens=1 << 20,
                          max_model_len=info.max_model_len, page_size=settings.page_size,
                          prefix_caching=False, speculation=NO_SPECULATION)
    return Engine(runner, pool, config, eos_token_ids=info.eos_token_ids)
