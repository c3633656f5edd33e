"""The worker's Redis side on a real server, piece by piece: no terminal entry lost through an
outage and none written twice, the claim walking the pending list with its cursor, a restarted
worker taking back its own entries, and every abort path reaching the worker."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis

from ops.embedded_redis import EmbeddedRedis
from shared.aborts import stage_aborts
from shared.keys import QUEUED_CONSUMER, WORKER_GROUP, Keys
from shared.messages import (
    Error,
    Finish,
    GenerateRequest,
    SamplingParams,
    Tokens,
    decode_result,
    expand,
)
from shared.redis_conn import RedisClients, connect
from shared.settings import WorkerSettings
from tests.stack import Stack, eventually
from worker.broker.aborts import AbortWatch
from worker.broker.publisher import Publisher
from worker.broker.recovery import Recovery
from worker.engine.engine import StepOutput

MODEL = "tiny-llama"


def _request(n: int) -> GenerateRequest:
    now = time.time()
    return GenerateRequest(id=f"{n:08x}-{uuid.uuid4().hex[:24]}", model=MODEL,
                           prompt_ids=(5, 6, 7), params=SamplingParams(max_tokens=4),
                           created=now, queue_deadline=now + 60, deadline=now + 120)


def _enqueue(r: redis.Redis, keys: Keys, requests: list[GenerateRequest],
             consumer: str) -> list[str]:
    stream = keys.requests(MODEL)
    r.xgroup_create(stream, WORKER_GROUP, id="0", mkstream=True)
    ids = [r.xadd(stream, q.to_fields()).decode() for q in requests]  # type: ignore[arg-type]
    r.xreadgroup(WORKER_GROUP, consumer, {stream: ">"})
    return ids


def test_terminal_entries_survive_an_outage_and_are_written_once() -> None:
    server = EmbeddedRedis()
    url = server.start()
    keys = Keys(f"rstest-{uuid.uuid4().hex[:8]}")
    requests = [_request(i) for i in range(3)]
    r = redis.Redis.from_url(url)
    entry_ids = _enqueue(r, keys, requests, "w1")

    async def run() -> None:
        nonlocal server
        clients = connect(url, name="test")
        publisher = Publisher(clients.commands, keys, MODEL, WorkerSettings(), "w1")
        for req, eid in zip(requests, entry_ids, strict=True):
            publisher.take(req, eid)
        # The first request's terminal entry already made it before the connection broke
        # (a pipeline applied in part): the retry must not add a second one.
        r.xadd(keys.out(requests[0].id), {"kind": "finish", "finish_reason": "length",
                                          "prompt_tokens": "3", "completion_tokens": "1"})
        server.stop()
        publisher.stage([StepOutput(q.id, 0, 42, "length", 3, 1) for q in requests[:2]])
        publisher.stage_error(requests[2].id, Error("lost", code="redis_unavailable"))
        with pytest.raises(aioredis.RedisError):
            await publisher.flush()
        assert publisher.backlog == 3
        # Still held (and so kept fresh) until written.
        assert set(publisher.entry_ids) == {q.id for q in requests}
        server = EmbeddedRedis(port=server.port)
        server.start()
        # Redis came back empty, as a restarted cache does; the first stream as it was.
        r.xadd(keys.out(requests[0].id), {"kind": "finish", "finish_reason": "length",
                                          "prompt_tokens": "3", "completion_tokens": "1"})
        await publisher.flush(batch_now=True)
        assert publisher.backlog == 0 and not publisher.entry_ids
        await clients.close()

    try:
        asyncio.run(run())
        for req in requests:
            entries = [decode_result(f) for _, f in r.xrange(keys.out(req.id))]
            assert len(entries) == 1, entries  # exactly one terminal entry each
            assert r.ttl(keys.out(req.id)) > 0 and r.ttl(keys.state(req.id)) > 0
        assert isinstance(entries[0], Error) and entries[0].code == "redis_unavailable"
    finally:
        r.close()
        server.stop()


def test_an_ended_request_is_acknowledged_with_the_next_batch(
    sync_redis: redis.Redis, redis_url: str
) -> None:
    """The acknowledgement may wait for the batch (the take freed the queue place already:
    tests/test_fairness.py)."""
    keys = Keys(f"rstest-{uuid.uuid4().hex[:8]}")
    requests = [_request(i) for i in range(3)]
    entry_ids = _enqueue(sync_redis, keys, requests, "w1")

    async def run() -> None:
        clients = connect(redis_url, name="test")
        publisher = Publisher(clients.commands, keys, MODEL, WorkerSettings(), "w1")
        await publisher.flush(batch_now=True)  # the batch was just sent: the next one waits
        for req, eid in zip(requests[:2], entry_ids[:2], strict=True):
            publisher.take(req, eid)
        publisher.stage([StepOutput(requests[0].id, 0, 42, "length", 3, 1)])
        await publisher.flush()
        assert sync_redis.xpending(keys.requests(MODEL), WORKER_GROUP)["pending"] == 3
        await publisher.flush(batch_now=True)
        assert sync_redis.xpending(keys.requests(MODEL), WORKER_GROUP)["pending"] == 2
        await clients.close()

    try:
        asyncio.run(run())
    finally:
        sync_redis.delete(keys.requests(MODEL), keys.out(requests[0].id),
                          keys.state(requests[0].id))


def test_the_claim_walks_the_pending_list_with_its_cursor(
    sync_redis: redis.Redis, redis_url: str
) -> None:
    keys = Keys(f"rstest-{uuid.uuid4().hex[:8]}")
    stream = keys.requests(MODEL)
    # 40 requests of a live worker (fresh), 150 waiting in the queue for a minute (more than
    # a page of the pending list, never claimed), then one of a dead worker (idle long ago).
    live = _enqueue(sync_redis, keys, [_request(i) for i in range(40)], "live")
    queued = [sync_redis.xadd(stream, _request(i).to_fields()).decode()  # type: ignore[arg-type]
              for i in range(100, 250)]
    sync_redis.xreadgroup(WORKER_GROUP, QUEUED_CONSUMER, {stream: ">"})
    sync_redis.xclaim(stream, WORKER_GROUP, QUEUED_CONSUMER, 0, queued,  # type: ignore[arg-type]
                      idle=60_000, justid=True)
    [orphan] = [sync_redis.xadd(stream, _request(99).to_fields()).decode()]  # type: ignore[arg-type]
    sync_redis.xreadgroup(WORKER_GROUP, "dead", {stream: ">"})
    sync_redis.xclaim(stream, WORKER_GROUP, "dead", 0, [orphan], idle=60_000, justid=True)

    async def claims() -> list[list[str]]:
        clients = connect(redis_url, name="test")
        recovery = Recovery(clients.commands, keys, MODEL, "me", reclaim_after_s=10)
        found = [[c.entry_id for c in await recovery.claim(1)] for _ in range(8)]
        await clients.close()
        return found

    try:
        found = asyncio.run(claims())
        # Each call scans on from where the last stopped: the orphan behind 40 live entries
        # and 150 queued ones is reached, and claimed once; queued entries are not abandoned.
        assert [ids for ids in found if ids] == [[orphan]]
        assert {p["message_id"].decode() for p in sync_redis.xpending_range(
            stream, WORKER_GROUP, "-", "+", 100, consumername="live")} == set(live)
        assert len(sync_redis.xpending_range(stream, WORKER_GROUP, "-", "+", 1000,
                                             consumername=QUEUED_CONSUMER)) == 150
    finally:
        sync_redis.delete(stream)


def test_a_restarted_worker_takes_back_its_own_pending_requests(
    sync_redis: redis.Redis, redis_url: str
) -> None:
    keys = Keys(f"rstest-{uuid.uuid4().hex[:8]}")
    requests = [_request(i) for i in range(2)]
    ids = _enqueue(sync_redis, keys, requests, "worker-0")
    sync_redis.xadd(keys.out(requests[0].id), {"kind": "tokens", "index": "0", "ids": "7,8"})

    async def take_back() -> list[tuple[str, tuple[int, ...], int]]:
        clients = connect(redis_url, name="test")
        recovery = Recovery(clients.commands, keys, MODEL, "worker-0", reclaim_after_s=10)
        claimed = await recovery.own_pending()
        await clients.close()
        return [(c.entry_id, c.generated, c.deliveries) for c in claimed]

    try:
        # Both at once (no waiting for the idle threshold), each resuming from its tokens.
        assert asyncio.run(take_back()) == [(ids[0], (7, 8), 2), (ids[1], (), 2)]
    finally:
        sync_redis.delete(keys.requests(MODEL), *(keys.out(q.id) for q in requests))


def test_aborts_reach_the_worker_by_announcement_and_by_key(
    sync_redis: redis.Redis, redis_url: str
) -> None:
    keys = Keys(f"rstest-{uuid.uuid4().hex[:8]}")
    announced, silent, other = (_request(i).id for i in range(3))

    async def run() -> tuple[set[str], set[str]]:
        clients = connect(redis_url, name="test")
        watch = AbortWatch(keys)
        listener = asyncio.create_task(watch.listen(clients.blocking))
        await asyncio.sleep(0.2)
        pipe = clients.commands.pipeline(transaction=False)
        stage_aborts(pipe, keys, [announced], 60)
        await pipe.execute()
        # Set by hand (redis-cli): no announcement, the key alone.
        await clients.commands.set(keys.abort(silent), "1", ex=60)
        for _ in range(100):
            if watch.aborted([announced]):
                break
            await asyncio.sleep(0.02)
        heard = watch.aborted([announced, silent, other])
        checked = await watch.check(clients.commands, [announced, silent, other])
        listener.cancel()
        await clients.close()
        return heard, checked

    try:
        heard, checked = asyncio.run(run())
        assert heard == {announced}  # no command per step: heard in the background
        assert checked == {announced, silent}  # the keys are the source of truth
        assert sync_redis.ttl(keys.aborts) > 0
    finally:
        sync_redis.delete(keys.aborts, *(keys.abort(i) for i in (announced, silent)))


def test_the_worker_ends_a_request_at_its_deadline(
    redis_url: str, tiny_model: Path, sync_redis: redis.Redis
) -> None:
    """No API replica: the request is put on the stream by hand, with a deadline a second
    away and far more tokens to make than that allows (20 ms a step)."""
    stack = Stack(redis_url, tiny_model, served_name=MODEL, api=False,
                  env={"REDSERVE_SYNTHETIC_STEP_MS": "20"}).start()
    keys = Keys(stack.prefix)
    now = time.time()
    request = GenerateRequest(id=f"deadbeef-{uuid.uuid4().hex[:24]}", model=MODEL,
                              prompt_ids=(5, 6, 7), created=now, queue_deadline=now + 1,
                              deadline=now + 1.0,
                              params=SamplingParams(max_tokens=500, ignore_eos=True))
    try:
        sync_redis.xadd(keys.requests(MODEL), request.to_fields())  # type: ignore[arg-type]
        out = keys.out(request.id)

        def ended() -> bool:
            last = sync_redis.xrevrange(out, count=1)
            return bool(last) and last[0][1][b"kind"] in (b"finish", b"error")

        assert eventually(ended, 30), stack.output()
        entries = [decode_result(f) for _, f in sync_redis.xrange(out)]
        assert isinstance(entries[-1], Error) and entries[-1].code == "request_timeout"
        assert 0 < sum(len(e.ids) for e in entries[:-1] if isinstance(e, Tokens)) < 500
        assert eventually(lambda: sync_redis.xlen(keys.requests(MODEL)) == 0)
    finally:
        stack.stop()


def _one_request(n: int) -> tuple[EmbeddedRedis, str, Keys, GenerateRequest, redis.Redis, str]:
    """A Redis of the test's own (to stop and start), and one request that worker w1 took."""
    server = EmbeddedRedis()
    url = server.start()
    keys = Keys(f"rstest-{uuid.uuid4().hex[:8]}")
    req = _request(n)
    r = redis.Redis.from_url(url)
    [entry_id] = _enqueue(r, keys, [req], "w1")
    return server, url, keys, req, r, entry_id


async def _first_token_out(url: str, keys: Keys, req: GenerateRequest,
                           entry_id: str) -> tuple[RedisClients, Publisher]:
    """w1's publisher, the request's first token published (and recorded at once)."""
    clients = connect(url, name="test")
    publisher = Publisher(clients.commands, keys, MODEL, WorkerSettings(), "w1")
    publisher.take(req, entry_id)
    publisher.stage([StepOutput(req.id, 0, 41, None, 3, 1)])
    await publisher.flush()
    return clients, publisher


def test_tokens_of_a_failed_flush_reach_the_record_with_a_later_one() -> None:
    """The record never has a gap: a chunk whose write failed waits in the outbox, and tokens
    not yet due wait in the record's buffer; the feed entries are not sent again."""
    server, url, keys, req, r, entry_id = _one_request(7)

    async def run() -> None:
        nonlocal server
        clients, publisher = await _first_token_out(url, keys, req, entry_id)
        assert [decode_result(f) for _, f in r.xrange(keys.out(req.id))] == [Tokens(0, (41,))]
        server.stop()
        publisher.record.chunk_tokens = 1  # token 1 is due at once: its chunk fails
        publisher.stage([StepOutput(req.id, 1, 42, None, 3, 2)])
        with pytest.raises(aioredis.RedisError):
            await publisher.flush()
        publisher.record.chunk_tokens = 16  # token 2 waits for the finish
        publisher.stage([StepOutput(req.id, 2, 43, None, 3, 3)])
        with pytest.raises(aioredis.RedisError):
            await publisher.flush()
        server = EmbeddedRedis(port=server.port)
        server.start()
        r.xadd(keys.out(req.id), Tokens(0, (41,)).to_fields())  # as it was
        publisher.stage([StepOutput(req.id, 3, 44, "length", 3, 4)])
        await publisher.flush(batch_now=True)
        await clients.close()

    try:
        asyncio.run(run())
        entries = [e for _, f in r.xrange(keys.out(req.id)) for e in expand(decode_result(f))]
        tokens = [t for e in entries if isinstance(e, Tokens) for t in e.split()]
        assert tokens == [Tokens(i, (41 + i,)) for i in range(4)]
        assert entries[-1] == Finish("length", 3, 4)
        assert r.ttl(keys.out(req.id)) > 0
    finally:
        r.close()
        server.stop()


def test_a_retried_chunk_never_follows_its_terminal_entry() -> None:
    """A flush whose pipeline Redis applied but whose reply was lost: its chunk and finish wait
    in the outbox; the retry finds the finish and adds neither again."""
    server, url, keys, req, r, entry_id = _one_request(8)

    async def run() -> None:
        nonlocal server
        clients, publisher = await _first_token_out(url, keys, req, entry_id)
        server.stop()
        publisher.record.chunk_tokens = 1
        publisher.stage([StepOutput(req.id, 1, 42, None, 3, 2)])  # a chunk, due at once
        publisher.stage_error(req.id, Error("stopped", code="internal_error"))
        with pytest.raises(aioredis.RedisError):
            await publisher.flush()
        assert publisher.backlog == 1
        server = EmbeddedRedis(port=server.port)
        server.start()
        # Redis had applied that pipeline: the record as it was (the first token, the chunk,
        # the error).
        for entry in (Tokens(0, (41,)), Tokens(1, (42,)), Error("stopped", code="internal_error")):
            r.xadd(keys.out(req.id), entry.to_fields())  # type: ignore[arg-type]
        await publisher.flush(batch_now=True)
        assert publisher.backlog == 0
        await clients.close()

    try:
        asyncio.run(run())
        entries = [decode_result(f) for _, f in r.xrange(keys.out(req.id))]
        assert entries == [Tokens(0, (41,)), Tokens(1, (42,)),
                           Error("stopped", code="internal_error")]
    finally:
        r.close()
        server.stop()
