"""The record written in chunks (worker/record.py), the feed as the live path.

A replica's reader, on a real Redis with the test playing the worker: a client that falls
behind while the record trails the feed gets every token once, in order (record, then the feed
entries it kept, waiting for the record's next chunk where those do not reach back); a record
that stops short of what the feed showed ends the request with an error once `record_lag_s`
passes. With real workers: a worker killed between chunks, sampling unseeded at temperature
1, is taken over from the record plus the feed after it, so the client's stream, the record
and a replay of it all hold the same tokens.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import uuid
from pathlib import Path

import httpx
import orjson
import redis

from api.reader import ResultReader
from shared.keys import WORKER_GROUP, Keys, new_replica_tag, new_request_id
from shared.messages import (
    Error,
    Finish,
    ResultEntry,
    Tokens,
    decode_feed,
    decode_result,
    expand,
    feed_fields,
)
from shared.redis_conn import connect
from tests.stack import Stack, eventually

MODEL = "tiny-llama"


def _record(r: redis.Redis, keys: Keys, rid: str, first: int, end: int) -> None:
    r.xadd(keys.out(rid), Tokens(first, tuple(range(first, end))).to_fields())  # type: ignore[arg-type]


def _feed(r: redis.Redis, keys: Keys, rid: str, entry: Tokens | Finish) -> None:
    r.xadd(keys.feed(rid.split("-")[0]),  # type: ignore[arg-type]
           feed_fields({rid: entry.to_fields()}))


async def _take(queue: asyncio.Queue[ResultEntry], n: int) -> list[ResultEntry]:
    return [await asyncio.wait_for(queue.get(), 5) for _ in range(n)]



def test_a_client_behind_a_lagging_record_gets_every_token_once(redis_url: str,
                                                                  sync_redis: redis.Redis) -> None:
    keys, replica = Keys(f"rstest-{uuid.uuid4().hex[:8]}"), new_replica_tag()
    rid = new_request_id(replica)

    async def run() -> list[ResultEntry]:
        clients = connect(redis_url, name="test")
        reader = ResultReader(clients, keys, replica, buffer=16, slow_after_s=60,
                              record_lag_s=10)
        await reader.start(60)
        sub = reader.open(rid)
        try:
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
            assert sub.behind and sub.lagging_since is not None  # the record lacks 17-32
            _record(sync_redis, keys, rid, 17, 33)  # the next chunk reaches what was kept
            assert await asyncio.to_thread(eventually, lambda: not sub.behind, 5)
            _feed(sync_redis, keys, rid, Finish("length", 1, 41, 0, Tokens(40, (40,))))
            await asyncio.wait_for(reading, 5)
            return got
        finally:
            reader.close(sub)
            await reader.stop()
            await clients.close()

    try:
        got = asyncio.run(run())
        tokens = [t for e in got if isinstance(e, Tokens) for t in e.split()]
        assert tokens == [Tokens(i, (i,)) for i in range(41)], got
        assert got[-1] == Finish("length", 1, 41)
    finally:
        sync_redis.delete(keys.out(rid), keys.feed(replica))


def test_a_record_that_stops_short_of_the_feed_ends_the_request(redis_url: str,
                                                                 sync_redis: redis.Redis) -> None:
    keys, replica = Keys(f"rstest-{uuid.uuid4().hex[:8]}"), new_replica_tag()
    rid = new_request_id(replica)

    async def run() -> list[ResultEntry]:
        clients = connect(redis_url, name="test")
        reader = ResultReader(clients, keys, replica, buffer=16, slow_after_s=60,
                              record_lag_s=1)
        await reader.start(60)
        sub = reader.open(rid)
        try:
            _record(sync_redis, keys, rid, 0, 1)
            _feed(sync_redis, keys, rid, Tokens(0, (0,)))
            _feed(sync_redis, keys, rid, Tokens(5, (5,)))  # 1-4 never come
            return await _take(sub.queue, 2)
        finally:
            reader.close(sub)
            await reader.stop()
            await clients.close()

    try:
        first, error = asyncio.run(run())
        assert first == Tokens(0, (0,))
        assert isinstance(error, Error) and error.code == "redis_unavailable"
    finally:
        sync_redis.delete(keys.out(rid), keys.feed(replica))


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
    victim = f"{socket.gethostname()}-{stack.worker_proc(0).pid}"
    try:
        async def disturbed() -> tuple[list[tuple[str, str, str]], list[tuple[int, int]]]:
            async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as client:
                run = asyncio.gather(*(_stream(client, b) for b in bodies))

                def orphans() -> list[str]:  # the started requests the victim holds
                    held = sync_redis.xpending_range(keys.requests(MODEL), WORKER_GROUP, "-",
                                                     "+", 100, consumername=victim)
                    entries = dict(sync_redis.xrange(keys.requests(MODEL)))
                    return [rid for p in held if p["message_id"] in entries
                            for rid in [entries[p["message_id"]][b"id"].decode()]
                            if sync_redis.xlen(keys.out(rid)) > 1]

                def trailing() -> bool:  # some orphan's record trails its feed
                    return any(fed > recorded for recorded, fed in
                               (_ends(sync_redis, keys, rid) for rid in orphans()))

                assert await asyncio.to_thread(eventually, trailing, 60), stack.output()
                stack.worker_proc(0).send_signal(signal.SIGKILL)
                stack.worker_proc(0).wait()
                ends = [_ends(sync_redis, keys, rid) for rid in orphans()]
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
