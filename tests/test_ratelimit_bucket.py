"""The rate-limit buckets of the admission script and the settle script, against real Redis:
no replica, no worker (the requests admitted here sit on a model stream nobody reads, under a
prefix of their own, until their keys expire)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from api.queue.admission import Admission, QueueLimits
from api.queue.limits.replies import duration
from api.queue.limits.reservation import RateLimits
from shared.keys import Keys, new_request_id
from shared.messages import Bucket, BucketField, GenerateRequest, SamplingParams
from shared.tenants import TenantPolicy

MODEL = "m"


@pytest.fixture
async def keys(redis_url: str) -> AsyncIterator[tuple[aioredis.Redis, Keys]]:
    r = aioredis.Redis.from_url(redis_url)
    keys = Keys(f"rstest-{uuid.uuid4().hex[:8]}")
    yield r, keys
    found = [k async for k in r.scan_iter(match=f"{keys.prefix}:*")]
    if found:
        await r.delete(*found)
    await r.aclose()


def _request(tenant: str, prompt: int = 3, max_tokens: int = 5) -> GenerateRequest:
    now = time.time()
    return GenerateRequest(id=new_request_id("0badcafe"), model=MODEL,
                           prompt_ids=tuple(range(1, prompt + 1)),
                           params=SamplingParams(max_tokens=max_tokens), created=now,
                           queue_deadline=now + 60, deadline=now + 600, tenant=tenant)


def _admission(r: aioredis.Redis, keys: Keys, max_requests: int = 1000) -> Admission:
    return Admission(r, keys, QueueLimits(max_requests, 10**9, 60.0, max_requests), 600)


async def test_requests_refill_at_limit_per_minute(
        keys: tuple[aioredis.Redis, Keys]) -> None:
    r, k = keys
    admission, limits = _admission(r, k), RateLimits(r, k)
    policy = TenantPolicy(requests_per_minute=60)  # a whole minute's burst, then 1 a second
    for i in range(60):
        req = _request("a")
        reservation = limits.reserve(policy, [req], 3)
        assert reservation is not None
        admitted = await admission.try_enqueue(req, reservation.charge)
        assert admitted.refused is None and admitted.limits is not None
        assert admitted.limits.refused is None, i
        assert admitted.limits.remaining_requests == 59 - i
    req = _request("a")
    reservation = limits.reserve(policy, [req], 3)
    assert reservation is not None
    refused = await admission.try_enqueue(req, reservation.charge)
    assert refused.limits is not None and refused.limits.refused == "requests"
    assert 0 < refused.limits.retry_after_ms <= 1000
    assert await r.xlen(k.requests(MODEL)) == 60  # the refused one is not queued
    await asyncio.sleep(refused.limits.retry_after_ms / 1000 + 0.05)
    again = await admission.try_enqueue(req, reservation.charge)
    assert again.limits is not None and again.limits.refused is None
    ttl = await r.pttl(k.limits(MODEL, "a"))
    assert 0 < ttl <= 61_000
    # Another tenant's bucket is its own.
    other = _request("b")
    fresh = await admission.try_enqueue(other, limits.reserve(policy, [other], 3).charge)  # type: ignore[union-attr]
    assert fresh.limits is not None and fresh.limits.remaining_requests == 59


async def test_tokens_charged_only_when_the_queue_admits(
        keys: tuple[aioredis.Redis, Keys]) -> None:
    r, k = keys
    admission, limits = _admission(r, k, max_requests=1), RateLimits(r, k)
    policy = TenantPolicy(tokens_per_minute=100)
    first, second = _request("a", 3, 5), _request("a", 3, 5)
    ok = await admission.try_enqueue(first, limits.reserve(policy, [first], 3).charge)  # type: ignore[union-attr]
    assert ok.refused is None and ok.limits is not None and ok.limits.remaining_tokens == 92
    full = await admission.try_enqueue(second, limits.reserve(policy, [second], 3).charge)  # type: ignore[union-attr]
    assert full.refused is not None and "queue is full" in full.refused
    assert full.limits is not None and full.limits.refused is None
    stored = Bucket.decode({f: v.decode() for f, v in zip(
        BucketField, await r.hmget(k.limits(MODEL, "a"), list(BucketField)), strict=True)})
    assert 92 <= stored.tokens < 93  # the refused request took nothing
    # More than a minute's tokens can never pass: refused as too large, not queued.
    big = _request("a", 3, 200)
    huge = await admission.try_enqueue(big, limits.reserve(policy, [big], 3).charge)  # type: ignore[union-attr]
    assert huge.limits is not None and huge.limits.too_large and huge.limits.refused == "tokens"


async def test_settle_gives_back_what_was_not_used(keys: tuple[aioredis.Redis, Keys]) -> None:
    r, k = keys
    admission, limits = _admission(r, k), RateLimits(r, k)
    policy = TenantPolicy(tokens_per_minute=60_000)  # 1 token a ms: refill is visible, bounded
    req = _request("a", 10, 5000)
    reservation = limits.reserve(policy, [req], 10)
    assert reservation is not None and reservation.charge.tokens == 5010
    admitted = await admission.try_enqueue(req, reservation.charge)
    assert admitted.limits is not None and admitted.limits.remaining_tokens == 60_000 - 5010
    reservation.bucket = admitted.limits
    await reservation.ended(unused=5000 - 7, answered=True)  # 7 tokens generated
    raw = await r.hmget(k.limits(MODEL, "a"), list(BucketField))
    level = Bucket.decode({f: v.decode() for f, v in zip(BucketField, raw, strict=True)}).tokens
    # Everything back but the prompt and the 7 tokens, capped at the limit: without the
    # settle, only the refill (1 a ms) would have given back a few ms' worth.
    assert 60_000 - 17 <= level <= 60_000


async def test_a_reply_that_failed_before_its_first_token_gets_everything_back(
        keys: tuple[aioredis.Redis, Keys]) -> None:
    r, k = keys
    admission, limits = _admission(r, k), RateLimits(r, k)
    policy = TenantPolicy(requests_per_minute=10, tokens_per_minute=600)  # 10 tokens a s
    requests = [_request("a", 100, 200), _request("a", 100, 200)]  # n=2 on one prompt
    reservation = limits.reserve(policy, requests, 100)
    assert reservation is not None and reservation.charge.tokens == 100 + 2 * 200
    admitted = await admission.try_enqueue(requests[0], reservation.charge)
    assert admitted.limits is not None and admitted.limits.remaining_tokens == 100
    reservation.bucket = admitted.limits
    await reservation.ended(unused=200, answered=False)
    assert await r.hget(k.limits(MODEL, "a"), BucketField.TOKENS) == str(
        admitted.limits.remaining_tokens).encode()  # nothing until the last choice ends
    await reservation.ended(unused=200, answered=False)
    raw = await r.hmget(k.limits(MODEL, "a"), list(BucketField))
    bucket = Bucket.decode({f: v.decode() for f, v in zip(BucketField, raw, strict=True)})
    assert bucket.tokens == 600  # the prompt back too (capped at the limit)
    assert 9 <= bucket.requests < 10  # a request that was admitted still counts


async def test_no_limit_touches_no_bucket(keys: tuple[aioredis.Redis, Keys]) -> None:
    r, k = keys
    admission, limits = _admission(r, k), RateLimits(r, k)
    req = _request("a")
    assert limits.reserve(TenantPolicy(), [req], 3) is None
    admitted = await admission.try_enqueue(req)
    assert admitted.refused is None and admitted.limits is None
    assert not await r.exists(k.limits(MODEL, "a"))


def test_duration_is_openais_format() -> None:
    assert [duration(ms) for ms in (0, 20, 999, 1000, 1500, 9816, 60_000, 360_000,
                                    3_723_500)] == [
        "0s", "20ms", "999ms", "1s", "1.5s", "9.816s", "1m0s", "6m0s", "1h2m3.5s"]
