"""From settings to an engine: device, dtype, kernels, threads, model, KV pool, scheduler
limits.

On CPU, oneDNN's primitive caches are capped first. oneDNN keeps every primitive it builds
(1,024 by default, and torch's ideep a cache of its own in front), one per linear shape per
token count, each holding memory in proportion to its weight: 472 token counts through the
default model's four decoder shapes grew a worker's RSS by 1,818 MiB, and a worker meets a new
token count with nearly every new mix of prefill and decode. A step runs five shapes at one
token count, so 16 entries serve steady decode with no more misses (19 in both a
prefill-and-decode run and the default) and the growth stops (62 MiB over the same 472 counts).
"""

from __future__ import annotations

import logging
import os

import orjson
import torch
from transformers import AutoTokenizer

from shared.models import ModelInfo
from shared.settings import WorkerSettings
from worker.engine import checkpoint
from worker.engine.constraint import Constraints
from worker.engine.dev_hooks import DevHooks
from worker.engine.dtype import dtype_name, pick_dtype
from worker.engine.engine import Engine, EngineConfig
from worker.engine.kv_cache import KVPool, budget_bytes
from worker.engine.linear import check_quantization
from worker.engine.model_runner import ModelRunner
from worker.engine.synthetic import SyntheticRunner
from worker.engine.threads import ThreadPolicy, usable_cpus

log = logging.getLogger("redserve.worker")

ONEDNN_CACHE_ENTRIES = 16


def _cap_onednn_caches() -> None:
    """Read when oneDNN builds its first primitive: call before that (see the docstring)."""
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(name, str(ONEDNN_CACHE_ENTRIES))


def pick_device(setting: str) -> torch.device:
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(setting)


def build_engine(info: ModelInfo, settings: WorkerSettings) -> Engine:
    synthetic_step_ms = DevHooks().synthetic_step_ms
    if synthetic_step_ms:
        return _synthetic_engine(info, settings, synthetic_step_ms / 1000)
    device = pick_device(settings.device)
    dtype = pick_dtype(settings.dtype, device)
    log.info("computing in %s on %s (--dtype %s)", dtype_name(dtype), device, settings.dtype)
    threads = ThreadPolicy(settings.threads or usable_cpus(), settings.decode_threads)
    if device.type == "cpu":
        log.info("CPU threads: %s", threads.describe())
        _cap_onednn_caches()
    check_quantization(settings.quantization, dtype, device)  # before the slow load
    runner = ModelRunner(checkpoint.load(info, device, dtype), release_modules=True,
                         kernels=settings.kernels, batch_invariant=settings.batch_invariant,
                         page_size=settings.page_size, quantization=settings.quantization,
                         kv_cache_dtype=settings.kv_cache_dtype)
    log.info("kernels: %s (%s)%s", runner.kernels.name, runner.kernels.note,
             "; batch-invariant" if runner.kernels.batch_invariant else "")
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
    )
    return Engine(runner, pool, config, eos_token_ids=info.eos_token_ids,
                  constraints=build_constraints(info))


def build_constraints(info: ModelInfo) -> Constraints:
    """The grammar compiler, over the model's tokenizer and its logits width."""
    vocab = int(orjson.loads((info.path / "config.json").read_bytes())["vocab_size"])
    tokenizer = AutoTokenizer.from_pretrained(str(info.path))
    return Constraints(tokenizer, max(vocab, len(tokenizer)), info.eos_token_ids)


def _synthetic_engine(info: ModelInfo, settings: WorkerSettings, step_s: float) -> Engine:
    # Nothing to parallelise: more threads would only spin between steps and take CPU from
    # the processes being measured.
    torch.set_num_threads(1)
    vocab = int(orjson.loads((info.path / "config.json").read_bytes())["vocab_size"])
    runner = SyntheticRunner(vocab, step_s)
    tokens = settings.batch_limit * info.max_model_len
    pool = KVPool(runner.kv_shape, -(-tokens // settings.page_size), settings.page_size)
    config = EngineConfig(max_running=settings.batch_limit, max_step_tokens=1 << 20,
                          max_model_len=info.max_model_len, page_size=settings.page_size,
                          prefix_caching=False)
    return Engine(runner, pool, config, eos_token_ids=info.eos_token_ids)
