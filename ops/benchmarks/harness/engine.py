"""The engine offline, for the benchmarks that time what a worker's step does: built the way the
worker builds it (`built`: worker/engine/build.py from settings) or around a model runner a
benchmark laid out itself (`around`: int8 weights, an fp8 KV cache), loaded with requests
(`add_random`) and stepped in turns (`take_turns`), so that a shared machine's changing load
falls on every configuration alike."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

from shared.messages import GenerateRequest, SamplingParams
from shared.models import resolve_model
from shared.settings import DEFAULT_MODEL, WorkerSettings
from worker.engine.engine import Engine, EngineConfig
from worker.engine.kv_cache import KVPool
from worker.engine.model_runner import ModelRunner
from worker.engine.threads import ThreadPolicy

GREEDY = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)


def built(**settings: Any) -> Engine:
    """The worker's engine for the default model on CPU, `settings` as WorkerSettings' fields
    (dtype, max_running, kv_cache_memory, kernels, threads, ...)."""
    from worker.engine.build import build_engine

    config = WorkerSettings(device="cpu", **settings)
    return build_engine(resolve_model(DEFAULT_MODEL, config.cache_dir), config)


def around(runner: ModelRunner, batch: int, length: int, page: int, threads: int) -> Engine:
    """An engine on `runner` for `batch` requests of up to `length` tokens in pages of `page`,
    on `threads` pinned threads, no prefix cache."""
    pages = batch * -(-(length + page) // page)  # and a spare page each
    return Engine(runner, KVPool(runner.kv_shape, pages, page),
                  EngineConfig(max_running=batch, max_step_tokens=512,
                               max_model_len=length + page, page_size=page,
                               prefix_caching=False, threads=ThreadPolicy(threads, pinned=True)),
                  eos_token_ids=())


def request(rid: str, prompt: Sequence[int], params: SamplingParams = GREEDY
            ) -> GenerateRequest:
    return GenerateRequest(id=rid, model=DEFAULT_MODEL, prompt_ids=tuple(prompt), created=0.0,
                           queue_deadline=0.0, deadline=0.0, params=params)


def add_random(engine: Engine, batch: int, context: int, seed: int) -> None:
    """`batch` greedy requests (EOS ignored) of `context` random prompt tokens, seeded."""
    rng = random.Random(seed)
    for i in range(batch):
        engine.add(request(f"r-{i}", [rng.randrange(100, 40000) for _ in range(context)]))


def prefilling(engine: Engine) -> bool:
    scheduler = engine.scheduler
    return bool(scheduler.waiting) or any(s.num_computed < len(s.tokens) - 1
                                          for s in scheduler.running.values())


def timed_step(engine: Engine) -> float:
    t0 = time.perf_counter()
    engine.step()
    return time.perf_counter() - t0


def prefill(engine: Engine) -> float:
    """Step until every request has its prompt computed; the seconds it took."""
    seconds = 0.0
    while prefilling(engine):
        seconds += timed_step(engine)
    return seconds


def take_turns(engines: list[Engine], steps: int, rounds: int = 1
               ) -> tuple[list[float], list[list[list[float]]]]:
    """Each engine's prefill seconds, then per engine, per round, its decode step times (s).
    The engines take turns step by step, in an order that rotates every round; three untimed
    steps first, since oneDNN builds its kernels for a new batch shape on first use."""
    prefills = [0.0] * len(engines)
    while any(prefilling(e) for e in engines):
        for i, engine in enumerate(engines):
            if prefilling(engine):
                prefills[i] += timed_step(engine)
    for _ in range(3):
        for engine in engines:
            engine.step()
    times: list[list[list[float]]] = [[[] for _ in range(rounds)] for _ in engines]
    n = len(engines)
    for r in range(rounds):
        for _ in range(steps):
            for i in [(i + r) % n for i in range(n)]:
                times[i][r].append(timed_step(engines[i]))
    return prefills, times


def median_ms(times: Sequence[float]) -> float:
    return statistics.median(times) * 1000
