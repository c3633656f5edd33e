"""The scheduler's snapshot (`SchedulerStats`), what the heartbeat and the worker's metrics show
of the batch and the KV pool, read off the engine a worker builds (the tiny Llama, through
`build_engine`): its figures follow requests as they queue, run, are preempted, end and are
aborted, and the pool's pages always add up."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.messages import GenerateRequest, SamplingParams
from shared.models import resolve_model
from shared.settings import WorkerSettings
from worker.engine.build import build_engine
from worker.engine.engine import Engine
from worker.engine.scheduler import SchedulerStats

PAGE_SIZE = 16
PAGES = 8  # 128 tokens of KV


@pytest.fixture
def engine(tiny_model: Path) -> Engine:
    # fp32 KV of 2 layers x 2 heads x 32 dims: 1 KiB a token, so a budget of exactly PAGES.
    settings = WorkerSettings(device="cpu", dtype="float32", kernels="torch", max_running=4,
                              page_size=PAGE_SIZE, kv_cache_memory=PAGES * PAGE_SIZE * 1024)
    return build_engine(resolve_model(str(tiny_model), settings.cache_dir), settings)


def _request(i: int, prompt_tokens: int, max_tokens: int) -> GenerateRequest:
    """Prompts of distinct tokens: no request finds another's pages in the prefix cache."""
    first = 1000 * (i + 1)
    return GenerateRequest(
        id=f"s-{i}", model="m", prompt_ids=tuple(range(first, first + prompt_tokens)),
        created=0.0, queue_deadline=0.0, deadline=0.0,
        params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def _stats(engine: Engine) -> SchedulerStats:
    stats = engine.scheduler.stats()
    assert stats.pages_used + stats.pages_free == stats.pages_total == PAGES
    assert stats.pages_cached <= stats.pages_free
    return stats


def _finish(engine: Engine) -> None:
    while engine.scheduler.has_work():
        engine.step()


def test_the_snapshot_follows_requests_through_the_engine(engine: Engine) -> None:
    assert _stats(engine) == SchedulerStats(running=0, waiting=0, pages_used=0,
                                            pages_free=PAGES, pages_cached=0,
                                            pages_total=PAGES, preempted=0)

    engine.add(_request(0, 40, 4))  # 3 pages of prompt
    engine.add(_request(1, 20, 4))  # 2 pages
    queued = _stats(engine)
    assert (queued.running, queued.waiting, queued.requests, queued.pages_used) == (0, 2, 2, 0)

    engine.step()  # both prompts prefilled in one step: their pages are taken
    running = _stats(engine)
    assert (running.running, running.waiting, running.pages_used) == (2, 0, 5)
    assert (running.pages_free, running.pages_cached) == (3, 0)  # published, still referenced

    _finish(engine)
    done = _stats(engine)
    assert (done.running, done.waiting, done.pages_used, done.preempted) == (0, 0, 0, 0)
    # Their full pages of computed tokens (2 of the 43 computed, 1 of the 23) stay cached.
    assert done.pages_cached == 3

    # Three that outgrow the pool together (4 pages each, 8 in all): the newest is preempted.
    for i in (2, 3, 4):
        engine.add(_request(i, 30, 20))
    engine.step()
    assert _stats(engine).running == 3
    _finish(engine)
    assert _stats(engine).preempted > 0

    engine.add(_request(5, 20, 8))
    engine.step()
    assert _stats(engine).pages_used == 2
    assert engine.scheduler.abort("s-5")
    aborted = _stats(engine)
    assert (aborted.running, aborted.requests, aborted.pages_used) == (0, 0, 0)
