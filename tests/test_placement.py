"""Prefix-aware placement (api/queue/placement.py) with real workers.

The worker and the API compute one public page-digest chain (shared/page_digest.py); a worker's
prefix summary appears under `Keys.prefixes` with a TTL; with two workers, requests sharing a
prefix go to the worker that cached it; a worker killed while holding cached prefixes loses no
request and leaves no key without a TTL.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
import redis

from api.auth.keys import ANONYMOUS
from ops.testkit.probe import scrape
from shared.keys import WORKER_GROUP, Keys
from shared.messages import Heartbeat, PrefixSummary, RequestHash
from shared.page_digest import prompt_digests
from shared.settings import WorkerSettings
from tests.stack import Stack, eventually, inspect, inspect_json
from worker.engine.pages import PageManager

MODEL = "tiny-llama"
PAGE = WorkerSettings().page_size  # the workers' default
ENV = {"REDSERVE_HEARTBEAT_TTL_S": "2", "REDSERVE_DTYPE": "float32",
       "REDSERVE_KERNELS": "torch"}


def _prefix(seed: int, pages: int = 4) -> list[int]:
    return [100 + (seed * 37 + i * 13) % 5000 for i in range(pages * PAGE)]


def test_worker_and_api_compute_the_same_page_digests() -> None:
    pages = PageManager(8, PAGE)
    tokens = [*_prefix(1, 3), 7]
    table = pages.allocate(4)
    assert table is not None
    pages.publish(tokens, table, [], len(tokens), pages.root("alice"))
    summary = PrefixSummary.decode(pages.summary().encode())
    assert summary.page_size == PAGE and len(summary.digests) == 3
    assert summary.digests == set(prompt_digests(tokens, PAGE, "alice"))
    # Per tenant: another tenant's identical prompt has other digests.
    assert not summary.digests & set(prompt_digests(tokens, PAGE, "bob"))
    before = pages.version
    pages.release(table)
    assert pages.allocate(8) is not None  # evicts every cached page
    assert pages.version > before and not pages.summary().digests


def _names(stack: Stack, n: int) -> list[str]:
    return [f"{socket.gethostname()}-{stack.worker_proc(i).pid}" for i in range(n)]


@pytest.fixture(scope="module")
def two_workers(redis_url: str, tiny_model: Path) -> Iterator[Stack]:
    stack = Stack(redis_url, tiny_model, served_name=MODEL, workers=2, env=ENV).start()
    yield stack
    stack.stop()


def _complete(stack: Stack, prompt: list[int], max_tokens: int = 4) -> dict[str, object]:
    reply = httpx.post(f"{stack.base_url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert reply.status_code == 200, reply.text
    body: dict[str, object] = reply.json()
    body["request_id"] = reply.headers["x-request-id"]
    return body


def _holder(r: redis.Redis, keys: Keys, names: list[str], prompt: list[int]) -> str | None:
    """The worker whose summary holds every full page of `prompt`."""
    wanted = set(prompt_digests(prompt, PAGE, ANONYMOUS))  # no keys: one tenant
    for name in names:
        raw = r.get(keys.prefixes(name))
        if raw and wanted <= PrefixSummary.decode(raw).digests:
            return name
    return None


def test_a_worker_publishes_its_prefix_summary(two_workers: Stack,
                                               sync_redis: redis.Redis) -> None:
    keys, names = Keys(two_workers.prefix), _names(two_workers, 2)
    prompt = [*_prefix(2), 1, 2]
    _complete(two_workers, prompt)
    assert eventually(lambda: _holder(sync_redis, keys, names, prompt), 10)
    holder = _holder(sync_redis, keys, names, prompt)
    assert holder is not None
    assert 0 < sync_redis.ttl(keys.prefixes(holder)) <= 2
    beat = Heartbeat.from_json(sync_redis.get(keys.worker(holder)) or b"")
    assert beat.prefix_pages >= 4
    shown = {w["name"]: w for w in inspect_json(two_workers)["workers"]}
    assert shown[holder]["prefix_pages"] >= 4
    assert "prefix pages" in inspect(two_workers).stdout


def test_requests_sharing_a_prefix_go_to_the_worker_that_cached_it(
        two_workers: Stack, sync_redis: redis.Redis) -> None:
    keys, names = Keys(two_workers.prefix), _names(two_workers, 2)
    prefix = _prefix(3)
    _complete(two_workers, [*prefix, 5, 5])
    assert eventually(lambda: _holder(sync_redis, keys, names, [*prefix, 5]), 10)
    holder = _holder(sync_redis, keys, names, [*prefix, 5])
    time.sleep(1.5)  # the API's view refreshes about every second
    before = scrape(f"{two_workers.base_url}/metrics")
    for i in range(6):
        reply = _complete(two_workers, [*prefix, 9, i])
        usage = reply["usage"]
        assert isinstance(usage, dict)
        assert usage["prompt_tokens_details"]["cached_tokens"] == 4 * PAGE, i
        state = RequestHash.decode(sync_redis.hgetall(keys.state(str(reply["request_id"]))))
        assert state.worker == holder
    hits = 'redserve_api_placements_total{model="tiny-llama",outcome="hit"}'
    assert scrape(f"{two_workers.base_url}/metrics")[hits] - before.get(hits, 0) == 6


async def _stream(client: httpx.AsyncClient, prompt: list[int], max_tokens: int
                  ) -> tuple[int, str]:
    """Tokens streamed (one per chunk with logprobs off: counted from usage) and finish."""
    finish, tokens = "", 0
    async with client.stream("POST", "/v1/completions", json={
            "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = orjson.loads(line[6:])
            if "error" in event:
                return tokens, event["error"]["code"]
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            for choice in event["choices"]:
                finish = choice["finish_reason"] or finish
    return tokens, finish


def test_a_worker_killed_holding_cached_prefixes_loses_no_request(
        redis_url: str, sync_redis: redis.Redis, tiny_model: Path) -> None:
    stack = Stack(redis_url, tiny_model, served_name=MODEL, workers=2,
                  env={**ENV, "REDSERVE_MAX_RUNNING": "8"}).start()
    keys, names = Keys(stack.prefix), _names(stack, 2)
    prefixes = [_prefix(10 + p) for p in range(4)]
    try:
        for p in prefixes:
            _complete(stack, [*p, 1])

        def holder() -> int | None:
            """A worker caching one of the prefixes (placement chose which: idle workers
            tie on load)."""
            return next((i for i, name in enumerate(names) for p in prefixes
                         if _holder(sync_redis, keys, [name], [*p, 1])), None)

        assert eventually(lambda: holder() is not None, 10), "no worker cached a prefix"
        victim = holder()
        assert victim is not None
        time.sleep(1.5)

        async def load() -> list[tuple[int, str]]:
            async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as client:
                run = asyncio.gather(*(_stream(client, [*prefixes[i % 4], 2, i], 60)
                                       for i in range(16)))
                task = asyncio.ensure_future(run)

                def held() -> object:
                    return sync_redis.xpending_range(keys.requests(MODEL), WORKER_GROUP, "-",
                                                     "+", 100, consumername=names[victim])

                assert await asyncio.to_thread(eventually, held, 30), "the victim took nothing"
                stack.worker_proc(victim).send_signal(signal.SIGKILL)
                return await task

        results = asyncio.run(load())
        stack.worker_proc(victim).wait()
        assert results == [(60, "length")] * 16, stack.output()
        # Every key expires: the dead worker's heartbeat and summary included.
        found = [k for k in sync_redis.scan_iter(match=f"{stack.prefix}:*", count=1000)]
        assert found and all(sync_redis.ttl(k) != -1 for k in found), [
            k for k in found if sync_redis.ttl(k) == -1]
        assert eventually(lambda: not sync_redis.exists(keys.prefixes(names[victim])), 10)
    finally:
        stack.stop()
