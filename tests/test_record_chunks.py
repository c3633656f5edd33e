"""The record written in chunks (worker/broker/record.py), the feed as the live path.

A replica's reader, on a real Redis with the test playing the worker: a client that falls
behind while the record trails the feed gets every token once, in order (record, then the feed
entries it kept, waiting for the record's next chunk where those do not reach back); a gap in
the record itself ends the request with an error. When a chunk is due. Recovery reads the
feed after the record's end, and says when the feed no longer reaches back that far. With
real workers: a worker killed between chunks, sampling unseeded at temperature
1, is taken over from the record plus the feed after it, so the client's stream, the record
and a replay of it all hold the same tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import orjson
import redis

from api.queue.reader import ResultReader
from api.queue.subscription import Subscription
from shared.keys import WORKER_GROUP, Keys, new_replica_tag, new_request_id
from shared.messages import (
    Error,
    Finish,
    GenerateRequest,
    ResultEntry,
    SamplingParams,
    Tokens,
    decode_feed,
    decode_result,
    expand,
    feed_fields,
)
from shared.redis_conn import connect
from tests.stack import Stack, eventually
from worker.broker.record import Record
from worker.broker.recovery import Claimed, Recovery, lost_tail

MODEL = "tiny-llama"


def _record(r: redis.Redis, keys: Keys, rid: str, first: int, end: int) -> None:
    r.xadd(keys.out(rid), Tokens(first, tuple(range(first, end))).to_fields())  # type: ignore[arg-type]


def _feed(r: redis.Redis, keys: Keys, rid: str, entry: Tokens | Finish) -> None:
    r.xadd(keys.feed(rid.split("-")[0]),  # type: ignore[arg-type]
           feed_fields({rid: entry.to_fields()}))


async def _take(queue: asyncio.Queue[ResultEntry], n: int) -> list[ResultEntry]:
    return [await asyncio.wait_for(queue.get(), 5) for _ in range(n)]


@contextlib.asynccontextmanager
async def _reading(redis_url: str, keys: Keys, replica: str,
                   rid: str) -> AsyncIterator[tuple[ResultReader, Subscription]]:
    """A replica's reader (a 16-entry buffer) and its subscription to `rid`."""
    clients = connect(redis_url, name="test")
    reader = ResultReader(clients, keys, replica, buffer=16, slow_after_s=60)
    await reader.start(60)
    sub = reader.open(rid)
    try:
        yield reader, sub
    finally:
        reader.close(sub)
        await reader.stop()
        await clients.close()


def test_a_client_behind_a_lagging_record_gets_every_token_once(redis_url: str,
                                                                  sync_redis: redis.Redis) -> None:
    keys, replica = Keys(f"rstest-{uuid.uuid4().hex[:8]}"), new_replica_tag()
    rid = new_request_id(replica)

    async def run() -> list[ResultEntry]:
        async with _reading(redis_url, keys, replica, rid) as (reader, sub):
            # 40 tokens on the feed while the client reads nothing: its queue takes 14; the
            # record has the first token and one chunk (1-16), so 17-39 are only in the feed,
            # and the reader keeps the newest 7 feed entries (33-39).
            _record(sync_redis, keys, rid, 0, 1)
            _record(sync_redis, keys, rid, 1, 17)
            for i in range(40):
                _feed(sync_redis, keys, rid, Tokens(i, (i,)))
            await asyncio.sleep(0.3)
            assert sub.behind and sub.queue.qsize() == reader.room
            got: list[ResultEntry] = []

            async def read() -> None:
                while not got or not isinstance(got[-1], Finish):
                    got.append(await sub.queue.get())

            reading = asyncio.create_task(read())
            await asyncio.sleep(0.5)
            assert sub.behind and sub.level  # the record lacks 17-32: the stash starts at 33
            _record(sync_redis, keys, rid, 17, 33)  # the next chunk reaches what was kept
            assert await asyncio.to_thread(eventually, lambda: not sub.behind, 5)
            _feed(sync_redis, keys, rid, Finish("length", 1, 41, 0, Tokens(40, (40,))))
            await asyncio.wait_for(reading, 5)
            return got

    try:
        got = asyncio.run(run())
        tokens = [t for e in got if isinstance(e, Tokens) for t in e.split()]
        assert tokens == [Tokens(i, (i,)) for i in range(41)], got
        assert got[-1] == Finish("length", 1, 41)
    finally:
        sync_redis.delete(keys.out(rid), keys.feed(replica))


def test_a_gap_in_the_record_itself_ends_the_request(redis_url: str,
                                                     sync_redis: redis.Redis) -> None:
    """Tokens 1-4 are missing from the record (Redis lost them): the feed shows 5, the
    record jumps from 0 to 5, so the request ends with an error rather than a gap."""
    keys, replica = Keys(f"rstest-{uuid.uuid4().hex[:8]}"), new_replica_tag()
    rid = new_request_id(replica)

    async def run() -> list[ResultEntry]:
        async with _reading(redis_url, keys, replica, rid) as (_, sub):
            _record(sync_redis, keys, rid, 0, 1)
            _feed(sync_redis, keys, rid, Tokens(0, (0,)))
            _record(sync_redis, keys, rid, 5, 7)
            _feed(sync_redis, keys, rid, Tokens(5, (5,)))
            return await _take(sub.queue, 2)

    try:
        first, error = asyncio.run(run())
        assert first == Tokens(0, (0,))
        assert isinstance(error, Error) and error.code == "redis_unavailable"
    finally:
        sync_redis.delete(keys.out(rid), keys.feed(replica))


def test_when_a_chunk_is_due() -> None:
    record = Record(chunk_tokens=4, chunk_s=0.5)
    record.add("a", Tokens(0, (1,)), 10.0)
    assert record.due(10.0) == [("a", Tokens(0, (1,)))]  # a request's first token here
    for i in range(1, 4):
        record.add("a", Tokens(i, (i,)), 10.1)
    assert record.due(10.1) == []  # three tokens, none waited 0.5 s, the last chunk is new
    record.add("a", Tokens(4, (4,)), 10.2)
    assert record.due(10.2) == [("a", Tokens(1, (1, 2, 3, 4)))]  # four: a chunk
    record.add("a", Tokens(5, (5,)), 10.3)
    assert record.due(10.6) == []  # the chunk at 10.2 is 0.4 s old, token 5 0.3 s
    assert record.due(10.8) == [("a", Tokens(5, (5,)))]  # it waited 0.5 s
    record.add("a", Tokens(6, (6,)), 20.0)  # after a pause (a preemption): at once
    assert record.due(20.0) == [("a", Tokens(6, (6,)))]
    record.add("a", Tokens(7, (7,)), 20.1)
    assert record.take("a") == Tokens(7, (7,)) and record.take("a") is None
    assert len(record) == 0


def test_recovery_reads_the_feed_after_the_record_or_says_it_cannot(
        redis_url: str, sync_redis: redis.Redis) -> None:
    keys, replica = Keys(f"rstest-{uuid.uuid4().hex[:8]}"), new_replica_tag()
    now = time.time()

    def request(temperature: float) -> GenerateRequest:
        return GenerateRequest(id=new_request_id(replica), model=MODEL, prompt_ids=(5, 6),
                               created=now, queue_deadline=now + 60, deadline=now + 120,
                               params=SamplingParams(max_tokens=50, temperature=temperature))

    async def inspect(req: GenerateRequest) -> Claimed:
        clients = connect(redis_url, name="test")
        try:
            recovery = Recovery(clients.commands, keys, MODEL, "w2", reclaim_after_s=1)
            return await recovery._inspect("1-0", req)
        finally:
            await clients.close()

    sampled, greedy = request(1.0), request(0.0)
    sync_redis.xgroup_create(keys.requests(MODEL), WORKER_GROUP, id="0", mkstream=True)
    try:
        _feed(sync_redis, keys, sampled.id, Tokens(0, (7,)))
        _record(sync_redis, keys, sampled.id, 0, 3)  # 0-2 recorded...
        for i in range(3, 6):  # ...3-5 streamed only (another request's entry between)
            _feed(sync_redis, keys, sampled.id, Tokens(i, (i,)))
            _feed(sync_redis, keys, greedy.id, Tokens(i, (i,)))
        claimed = asyncio.run(inspect(sampled))
        assert claimed.generated == (0, 1, 2, 3, 4, 5) and not claimed.tail_lost
        assert claimed.unrecorded == Tokens(3, (3, 4, 5))
        assert lost_tail(claimed) is None

        # The feed was trimmed past the record's end (a takeover too late): a sampled
        # request cannot go on; a greedy one can (its lost tokens come out the same).
        sync_redis.delete(keys.feed(replica))
        _feed(sync_redis, keys, sampled.id, Tokens(9, (9,)))  # the feed starts now
        for req in (sampled, greedy):  # records last written a minute ago
            sync_redis.delete(keys.out(req.id))
            sync_redis.xadd(keys.out(req.id), Tokens(0, (0,)).to_fields(),  # type: ignore[arg-type]
                            id=f"{int(time.time() * 1000) - 60_000}-0")
        lost = asyncio.run(inspect(sampled))
        assert lost.tail_lost and lost.generated == (0,)
        error = lost_tail(lost)
        assert error is not None and error.code == "worker_failed"
        assert lost_tail(asyncio.run(inspect(greedy))) is None
    finally:
        sync_redis.delete(keys.out(sampled.id), keys.out(greedy.id), keys.feed(replica),
                          keys.requests(MODEL))


async def _stream(client: httpx.AsyncClient, body: dict[str, object]) -> tuple[str, str, str]:
    """Request id, streamed text and finish reason."""
    parts, finish = [], ""
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        rid = response.headers["x-request-id"]
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = orjson.loads(line[6:])
            if "error" in event:
                return rid, "".join(parts), event["error"]["code"]
            for choice in event["choices"]:
                parts.append(choice["text"])
                finish = choice["finish_reason"] or finish
    return rid, "".join(parts), finish


def _replayed(stack: Stack, rid: str) -> str:
    parts = []
    with httpx.stream("GET", f"{stack.base_url}/v1/requests/{rid}/stream", timeout=60) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                parts += [c["text"] for c in orjson.loads(line[6:]).get("choices", ())]
    return "".join(parts)


def _ends(r: redis.Redis, keys: Keys, rid: str) -> tuple[int, int]:
    """How far the record, and the feed, have the request's tokens."""
    record = [e for _, f in r.xrange(keys.out(rid)) for e in expand(decode_result(f))]
    fed = [e for _, f in r.xrange(keys.feed(rid.split("-")[0]))
           for raw in [decode_feed(f).get(rid)] if raw for e in expand(decode_result(raw))]
    return (max((e.end for e in record if isinstance(e, Tokens)), default=0),
            max((e.end for e in fed if isinstance(e, Tokens)), default=0))


def test_a_worker_killed_between_chunks_is_taken_over_from_record_and_feed(
        redis_url: str, sync_redis: redis.Redis, tiny_model: Path) -> None:
    stack = Stack(redis_url, tiny_model, served_name=MODEL, workers=2, env={
        "REDSERVE_HEARTBEAT_TTL_S": "2", "REDSERVE_MAX_RUNNING": "16",
        "REDSERVE_PLACEMENT": "none"}).start()
    keys = Keys(stack.prefix)
    bodies = [{"model": MODEL, "prompt": [60 + i, 7, 9], "max_tokens": 400, "temperature": 1.0,
               "ignore_eos": True, "stream": True} for i in range(8)]
    names = [f"{socket.gethostname()}-{stack.worker_proc(i).pid}" for i in range(2)]
    try:
        async def disturbed() -> tuple[list[tuple[str, str, str]], list[tuple[int, int]]]:
            async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as client:
                run = asyncio.gather(*(_stream(client, b) for b in bodies))

                def orphans(worker: str) -> list[str]:  # the started requests it holds
                    held = sync_redis.xpending_range(keys.requests(MODEL), WORKER_GROUP, "-",
                                                     "+", 100, consumername=worker)
                    entries = dict(sync_redis.xrange(keys.requests(MODEL)))
                    return [rid for p in held if p["message_id"] in entries
                            for rid in [entries[p["message_id"]][b"id"].decode()]
                            if sync_redis.xlen(keys.out(rid)) > 1]

                def trailing() -> int | None:
                    """A worker (either: whichever took the requests) holding a request whose
                    record trails its feed."""
                    return next((i for i, name in enumerate(names)
                                 if any(fed > recorded for recorded, fed in
                                        (_ends(sync_redis, keys, rid)
                                         for rid in orphans(name)))), None)

                found: list[int] = []

                def victim_found() -> bool:
                    found.extend(i for i in [trailing()] if i is not None)
                    return bool(found)

                assert await asyncio.to_thread(eventually, victim_found, 60), stack.output()
                victim = found[0]
                stack.worker_proc(victim).send_signal(signal.SIGKILL)
                stack.worker_proc(victim).wait()
                ends = [_ends(sync_redis, keys, rid) for rid in orphans(names[victim])]
                return await run, ends

        results, ends = asyncio.run(disturbed())
        # The test means something only if the record trailed the feed at the kill.
        assert any(fed > recorded for recorded, fed in ends), ends
        for rid, text, finish in results:
            assert finish == "length", (finish, stack.output())
            record = [e for _, f in sync_redis.xrange(keys.out(rid))
                      for e in expand(decode_result(f))]
            tokens = [t for e in record if isinstance(e, Tokens) for t in e.split()]
            assert [t.index for t in tokens] == list(range(400))  # no gap, no repeat
            assert _replayed(stack, rid) == text
    finally:
        stack.stop()
