"""An abort key expires with its request: the finished TTL after the request's end, like its
hash and record, not the request TTL (an hour by default). A soak with a fifth of its streams
cancelled saw abort keys pile up by thousands an hour while hashes and records stayed flat.

The real stack (the tiny model, the session's stack) and the real Redis."""

from __future__ import annotations

import asyncio

import httpx
import openai
import redis
import redis.asyncio as aioredis

from shared.aborts import stage_aborts
from shared.keys import Keys
from shared.settings import ApiSettings, WorkerSettings
from tests.stack import Stack, eventually

MODEL = "tiny-llama"
# The stack runs with the default TTLs.
FINISHED_TTL_S = WorkerSettings.model_fields["finished_ttl_s"].default
REQUEST_TTL_S = ApiSettings.model_fields["request_ttl_s"].default


def _state(r: redis.Redis, keys: Keys, request_id: str) -> str:
    return (r.hget(keys.state(request_id), "state") or b"").decode()


def test_a_cancelled_requests_abort_key_expires_with_the_request(
    tiny_stack: Stack, client: openai.OpenAI, sync_redis: redis.Redis
) -> None:
    keys = Keys(tiny_stack.prefix)
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt="count", max_tokens=480, stream=True,
        extra_body={"ignore_eos": True, "speculation": False})
    request_id = raw.headers["x-request-id"]
    stream = raw.parse()
    next(iter(stream))  # a worker runs it
    cancelled = httpx.delete(f"{tiny_stack.base_url}/v1/requests/{request_id}").json()
    assert cancelled["cancelled"], cancelled
    stream.close()
    assert eventually(lambda: _state(sync_redis, keys, request_id) == "aborted", 30)
    assert 0 < sync_redis.ttl(keys.abort(request_id)) <= FINISHED_TTL_S
    abort_ms = sync_redis.pttl(keys.abort(request_id))
    assert abort_ms <= sync_redis.pttl(keys.state(request_id)) + 50  # read a moment apart


def test_an_abort_set_after_the_end_lives_no_longer_than_the_request(
    tiny_stack: Stack, client: openai.OpenAI, sync_redis: redis.Redis
) -> None:
    """As the replica sets it when a client's cancel or a stop string comes after the worker
    ended the request (its cancel route, which reads the state first, sets none then)."""
    keys = Keys(tiny_stack.prefix)
    reply = client.completions.with_raw_response.create(model=MODEL, prompt="hi", max_tokens=2)
    ended = reply.headers["x-request-id"]
    assert _state(sync_redis, keys, ended) == "done"
    assert not sync_redis.exists(keys.abort(ended))

    async def abort_late() -> None:
        r = aioredis.Redis.from_url(tiny_stack.redis_url)
        try:
            pipe = r.pipeline(transaction=False)
            stage_aborts(pipe, keys, [ended], REQUEST_TTL_S)
            await pipe.execute()
        finally:
            await r.aclose()

    asyncio.run(abort_late())
    assert sync_redis.get(keys.abort(ended)) == b"1"
    abort_ms, state_ms = sync_redis.pttl(keys.abort(ended)), sync_redis.pttl(keys.state(ended))
    # Read one after the other: the hash's TTL may have run a millisecond or two meanwhile.
    assert 0 < abort_ms <= state_ms + 50
    assert sync_redis.ttl(keys.abort(ended)) <= FINISHED_TTL_S
