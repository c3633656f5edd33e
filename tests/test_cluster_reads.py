"""A Redis Cluster node that dies fails only its own slot's commands: the slot of a stream read
is found by the client itself, not asked of the node redis-py took as its default (which, once
dead, failed every read of every slot and asked for no new slot map, so the processes never
followed the replica promoted in its place). tests/test_cluster.py kills such a node under load:
the streams after /ready says 200 again must all be served (a replica whose result reader cannot
read its feed now says 503 instead)."""

from __future__ import annotations

from typing import cast

from redis.asyncio.cluster import RedisCluster

from shared.redis_conn import connect


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
