"""The API replica's result routing, with the test itself playing the worker through Redis.

Writing the result entries by hand lets the test fix their interleaving exactly (A1 B1 B2 A2)
while everything else is real: uvicorn on a port, Redis, the replica's single XREAD reader.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
import redis
from transformers import AutoTokenizer

from shared.keys import Keys, replica_of
from shared.messages import Finish, Tokens
from tests.stack import Stack, eventually, publish, queued_requests

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def api_only(redis_url: str, tiny_model: Path) -> Iterator[Stack]:
    stack = Stack(redis_url, tiny_model, served_name="tiny-llama", workers=0).start()
    yield stack
    stack.stop()


async def _stream_text(client: httpx.AsyncClient, content: str) -> tuple[str, list[dict]]:
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": content}],
            "max_tokens": 8, "stream": True}
    chunks: list[dict] = []
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(orjson.loads(line[6:]))
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    return text, chunks


def test_not_ready_without_a_live_worker(api_only: Stack) -> None:
    assert httpx.get(f"{api_only.base_url}/health").status_code == 200
    ready = httpx.get(f"{api_only.base_url}/ready")
    assert ready.status_code == 503 and "no live worker" in ready.json()["status"]


async def test_interleaved_results_reach_only_their_own_request(
    api_only: Stack, sync_redis: redis.Redis, tiny_model: Path
) -> None:
    keys = Keys(api_only.prefix)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    a_ids = tokenizer.encode(" apple banana", add_special_tokens=False)
    b_ids = tokenizer.encode(" seven eight", add_special_tokens=False)
    assert len(a_ids) == 2 and len(b_ids) == 2

    async with httpx.AsyncClient(base_url=api_only.base_url, timeout=30) as client:
        task_a = asyncio.create_task(_stream_text(client, "request A"))
        task_b = asyncio.create_task(_stream_text(client, "request B"))
        queued = await asyncio.to_thread(queued_requests, sync_redis,
                                         keys.requests(MODEL), 2)
        by_prompt = {tokenizer.decode(q.prompt_ids): q for q in queued}
        req_a = next(q for p, q in by_prompt.items() if "request A" in p)
        req_b = next(q for p, q in by_prompt.items() if "request B" in p)

        # Each request's keys carry its replica's hash tag.
        assert replica_of(req_a.id) == replica_of(req_b.id)
        assert sync_redis.hget(keys.state(req_a.id), "state") == b"queued"
        assert 0 < sync_redis.ttl(keys.state(req_a.id)) <= 3600

        order = [(req_a, Tokens(0, (a_ids[0],))), (req_b, Tokens(0, (b_ids[0],))),
                 (req_b, Tokens(1, (b_ids[1],))), (req_a, Tokens(1, (a_ids[1],)))]
        for req, entry in order:
            publish(sync_redis, keys, req.id, entry)
            await asyncio.sleep(0.05)
        for req in (req_a, req_b):
            publish(sync_redis, keys, req.id, Finish("length", len(req.prompt_ids), 2))
            sync_redis.expire(keys.out(req.id), 60)

        (text_a, chunks_a), (text_b, chunks_b) = await asyncio.gather(task_a, task_b)

    assert text_a == " apple banana"
    assert text_b == " seven eight"
    for chunks, req in ((chunks_a, req_a), (chunks_b, req_b)):
        assert {c["id"] for c in chunks} == {f"chatcmpl-{req.id}"}
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    # Both finished normally: neither was cancelled.
    assert not sync_redis.exists(keys.abort(req_a.id), keys.abort(req_b.id))


async def test_client_that_leaves_early_sets_the_abort_key(
    api_only: Stack, sync_redis: redis.Redis
) -> None:
    keys = Keys(api_only.prefix)
    sync_redis.delete(keys.requests(MODEL))
    body = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 8, "stream": True}
    async with httpx.AsyncClient(base_url=api_only.base_url, timeout=30) as client:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            request_id = response.headers["x-request-id"]
            publish(sync_redis, keys, request_id, Tokens(0, (42,)))
            sync_redis.expire(keys.out(request_id), 60)
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    break  # got one event; now hang up without reading the rest
    abort_key = keys.abort(request_id)
    assert await asyncio.to_thread(eventually, lambda: sync_redis.exists(abort_key))
    assert 0 < sync_redis.ttl(abort_key) <= 3600
    # Tokens a worker publishes after the abort reach no one and create no state here.
    publish(sync_redis, keys, request_id, Tokens(1, (43,)))
    await asyncio.sleep(0.3)
    metrics = await asyncio.to_thread(api_only.metrics, f"{api_only.base_url}/metrics")
    assert metrics["redserve_api_inflight_requests"] == 0
    assert metrics["redserve_api_result_queues"] == 0
    assert metrics["redserve_api_buffered_results"] == 0
    [queued] = queued_requests(sync_redis, keys.requests(MODEL), 1)
    assert queued.id == request_id
