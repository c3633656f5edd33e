"""A Redis Cluster node that dies fails only its own slot's commands: the slot of a stream read
is found by the client itself, not asked of the node redis-py took as its default (which, once
dead, failed every read of every slot and asked for no new slot map, so the processes never
followed the replica promoted in its place: tests/test_cluster.py). And a replica whose result
reader cannot read is not ready: every request it took would wait, then end with an error."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace
from typing import Any, cast

import redis.asyncio as aioredis
from fastapi import Request
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError

from api.endpoints.status import ready
from api.queue.reader import ResultReader
from shared.keys import Keys
from shared.redis_conn import RedisClients, connect


async def test_the_slot_of_a_stream_read_is_found_without_asking_a_node() -> None:
    # Nothing listens there: asking a node (COMMAND GETKEYS) would fail.
    clients = connect("redis://127.0.0.1:1/0", name="test-slots", cluster=True)
    cluster = cast(RedisCluster, clients.blocking)
    key, other = "t:{abc}:feed", "t:{abc}:aborts"
    slot = cluster.keyslot(key)
    assert await cluster._determine_slot(
        "XREAD", "COUNT", "64", "BLOCK", "1000", "STREAMS", key, "0-0") == slot
    # A group or consumer named "streams" is not the keyword.
    assert await cluster._determine_slot(
        "XREADGROUP", b"GROUP", "streams", "STREAMS", b"BLOCK", "5", b"STREAMS", key, other,
        ">", ">") == slot
    await clients.close()


class _Reads:
    """A blocking client whose reads fail (a dead node's connection error) until told not to."""

    def __init__(self) -> None:
        self.failing = True

    async def xread(self, *args: Any, **kwargs: Any) -> list[object]:
        await asyncio.sleep(0.01)
        if self.failing:
            raise RedisConnectionError("Error 111 connecting to 127.0.0.1:1.")
        return []


async def _ready_status(reader: ResultReader) -> tuple[int, dict[str, Any]]:
    ctx = SimpleNamespace(live=SimpleNamespace(draining=False), reader=reader)
    request = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(ctx=ctx)))
    response = await ready(cast(Request, request))
    return response.status_code, json.loads(bytes(response.body))


async def _within_5s(condition: Any) -> bool:
    for _ in range(500):
        if condition():
            return True
        await asyncio.sleep(0.01)
    return False


async def test_a_replica_whose_reader_cannot_read_is_not_ready() -> None:
    reads = _Reads()
    clients = RedisClients(commands=cast(aioredis.Redis, None),
                           blocking=cast(aioredis.Redis, reads))
    reader = ResultReader(clients, Keys("t"), "abc", buffer=16, slow_after_s=60)
    reader._connected.set()  # its feed made: reading it is what fails
    reader._feed_checked = time.monotonic()
    reader._task = asyncio.create_task(reader._supervise())
    try:
        assert await _within_5s(lambda: reader.failing is not None)
        status, body = await _ready_status(reader)
        assert status == 503 and "Error 111" in body["reason"], body
        reads.failing = False
        assert await _within_5s(lambda: reader.failing is None)
    finally:
        await reader.stop()
