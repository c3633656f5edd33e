"""`redserve inspect` shows the stored `/v1/responses` replies: how many, whose, and the memory
they hold, from responses stored through two real replicas by two tenants (and one not stored),
checked against Redis's own MEMORY USAGE of each; and, past the sample size, an estimate
scaled from a random sample of them."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from ops.inspector import stored
from ops.inspector.keyspace import classify
from shared.keys import Keys
from shared.messages import StoredResponse
from tests.responses_stack import MODEL, client, two_replicas
from tests.stack import Stack, inspect, inspect_json

ALPHA, BETA = "sk-inspect-alpha", "sk-inspect-beta"
ENV = {"REDSERVE_API_KEYS": f"alpha:{ALPHA},beta:{BETA}", "REDSERVE_RESPONSE_TTL_S": "600"}


@pytest.fixture(scope="module")
def stack(redis_url: str, tiny_model: Path) -> Iterator[Stack]:
    with two_replicas(redis_url, tiny_model, ENV) as stack:
        yield stack


def _create(stack: Stack, replica: int, key: str, **extra: Any) -> str:
    r = client(stack, replica, key).responses.create(
        model=MODEL, input="Hello", max_output_tokens=4, temperature=0, **extra)
    return r.id.removeprefix("resp_")


def _memory(r: redis.Redis, keys: Keys, ids: list[str]) -> int:
    return sum(int(r.memory_usage(keys.response(i)) or 0) for i in ids)


def test_stored_responses_counted_per_tenant_with_their_memory(
        stack: Stack, sync_redis: redis.Redis) -> None:
    keys = Keys(stack.prefix)
    alpha = [_create(stack, 0, ALPHA), _create(stack, 1, ALPHA)]
    _create(stack, 0, ALPHA, store=False)
    beta = [_create(stack, 1, BETA)]
    shown = inspect_json(stack)["stored_responses"]
    assert shown["count"] == 3 and shown["measured"] == 3
    tenants = {t["tenant"]: t for t in shown["tenants"]}
    assert {t: v["count"] for t, v in tenants.items()} == {"alpha": 2, "beta": 1}
    assert tenants["alpha"]["memory_bytes"] == _memory(sync_redis, keys, alpha) > 0
    assert tenants["beta"]["memory_bytes"] == _memory(sync_redis, keys, beta)
    assert shown["memory_bytes"] == _memory(sync_redis, keys, alpha + beta)
    # Most memory first.
    assert [t["tenant"] for t in shown["tenants"]] == sorted(
        tenants, key=lambda t: -tenants[t]["memory_bytes"])
    table = inspect(stack)
    assert table.returncode == 0, table.stderr
    assert "stored responses: 3," in table.stdout and "(measured)" in table.stdout
    # Deleted: gone from the view at once.
    client(stack, 0, ALPHA).responses.delete(f"resp_{alpha[0]}")
    again = inspect_json(stack)["stored_responses"]
    assert again["count"] == 2
    assert {t["tenant"]: t["count"] for t in again["tenants"]} == {"alpha": 1, "beta": 1}


def test_response_keys_are_recognised_by_their_builder() -> None:
    keys = Keys("rs")
    request = "9051c738-3347a48c44e9294cf8eba197"
    found = classify(keys, [keys.state(request), keys.response(request),
                            keys.response(f"{request}-1"), Keys("rs:a").response(request)])
    assert found.responses == {request, f"{request}-1"}
    assert found.request_ids == {request} and not found.models


def test_past_the_sample_memory_is_scaled_from_the_measured(
        redis_url: str, sync_redis: redis.Redis) -> None:
    """Eight responses of one size for one tenant, two for another; two measured at random:
    every tenant's figure is its count times one response's size (the mean of the measured
    for a tenant none of whose was drawn)."""
    keys = Keys(f"rstest-{uuid.uuid4().hex[:8]}")
    ids = [f"0a1b2c3d-{d * 24}" for d in "0123456789"]
    for i, request_id in enumerate(ids):
        record = StoredResponse("north" if i < 8 else "south", '{"output": []}', "[]")
        sync_redis.hset(keys.response(request_id), mapping=record.to_fields())  # type: ignore[arg-type]
    try:
        one = int(sync_redis.memory_usage(keys.response(ids[0])) or 0)
        assert one > 0 and {sync_redis.memory_usage(keys.response(i)) for i in ids} == {one}

        async def read() -> stored.StoredResponses:
            r = aioredis.from_url(redis_url)
            try:
                return await stored.read(r, keys, ids, sample=2)
            finally:
                await r.aclose()

        shown = asyncio.run(read())
        assert shown.count == 10 and shown.measured == 2
        assert {(t.tenant, t.count, t.memory_bytes) for t in shown.tenants} == {
            ("north", 8, 8 * one), ("south", 2, 2 * one)}
        assert shown.memory_bytes == 10 * one
    finally:
        sync_redis.delete(*(keys.response(i) for i in ids))
