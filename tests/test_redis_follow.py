"""A plain REDIS_URL whose server stops being the primary (a managed endpoint's failover that
keeps the old primary up as a replica): its pooled connections drop themselves and fail as a
lost connection does, rather than answering every write with READONLY for good, and the
same clients serve again once the name leads to a primary."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import redis
import redis.asyncio as aioredis

from ops.embedded_redis import EmbeddedRedis
from shared.redis_conn import connect


@pytest.fixture
def two_servers() -> Iterator[tuple[EmbeddedRedis, EmbeddedRedis]]:
    a, b = EmbeddedRedis(), EmbeddedRedis()
    a.start()
    b.start()
    try:
        yield a, b
    finally:
        a.stop()
        b.stop()


async def test_a_demoted_server_fails_calls_as_a_lost_connection(
    two_servers: tuple[EmbeddedRedis, EmbeddedRedis]
) -> None:
    a, b = two_servers
    clients = connect(a.url, name="test-follow")
    admin = redis.Redis(port=a.port)
    try:
        await clients.commands.set("k", "1")
        blocked = asyncio.create_task(clients.blocking.xread({"s": "$"}, block=5000))
        await asyncio.sleep(0.2)
        admin.replicaof("127.0.0.1", b.port)  # `a` is a replica now
        # The blocked read is unblocked by the demotion, as a lost connection.
        with pytest.raises(aioredis.ConnectionError):
            await blocked
        with pytest.raises(aioredis.ConnectionError, match="replica"):
            await clients.commands.set("k", "2")
        admin.replicaof("NO", "ONE")  # the name leads to a primary again
        await clients.commands.set("k", "3")
        assert await clients.commands.get("k") == b"3"
    finally:
        admin.close()
        await clients.close()
