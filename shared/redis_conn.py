"""Redis connections. Each process keeps two clients:

- `commands`: pooled, with a socket timeout, for short commands and pipelines;
- `blocking`: for XREAD/XREADGROUP BLOCK, with no socket timeout (redis-py's default would cut
  a long block short) and its own connections so a block never holds up a command. Every
  connection has TCP keepalive on, so one whose peer vanished is noticed eventually.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

StreamEntries = list[tuple[bytes, dict[bytes, bytes]]]


@dataclass(frozen=True)
class RedisClients:
    commands: aioredis.Redis
    blocking: aioredis.Redis
    where: str = ""  # the server, as a log line may name it (`location`)

    async def close(self) -> None:
        await self.commands.aclose()
        await self.blocking.aclose()


def connect(url: str, *, name: str, max_connections: int = 64,
            cluster: bool = False) -> RedisClients:
    """Bounded pools: under a burst, callers wait up to 5 s for a free connection instead of
    failing (redis-py's default pool raises past 100 connections). Connecting gives up after
    a second, so while Redis is unreachable callers fail fast (and clients get a 503) instead
    of hanging; every call tries a fresh connection, so service resumes once Redis is back."""
    # RESP2 pinned: stream replies are parsed as RESP2 lists on both sides.
    common: dict[str, Any] = {
        "socket_connect_timeout": 1.0, "health_check_interval": 30, "protocol": 2, "timeout": 5,
        "socket_keepalive": True,
    }
    if cluster:
        return RedisClients(
            commands=_cluster(url, max_connections, 10.0, name, common),
            blocking=_cluster(url, 4, None, f"{name}-block", common),
            where=location(url),
        )
    commands = aioredis.Redis.from_pool(aioredis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, socket_timeout=10.0, client_name=name, **common
    ))
    blocking = aioredis.Redis.from_pool(aioredis.BlockingConnectionPool.from_url(
        url, max_connections=4, socket_timeout=None, client_name=f"{name}-block", **common
    ))
    return RedisClients(commands=commands, blocking=blocking, where=location(url))


def location(url: str) -> str:
    """Where `url` points, without its credentials: `host:port`, or a socket's path."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return parts.path
    return f"{parts.hostname or 'localhost'}:{parts.port or 6379}"


def _cluster(url: str, max_connections: int, socket_timeout: float | None, name: str,
             common: dict[str, Any]) -> aioredis.Redis:
    """A Redis Cluster client (`url` names any node). Every command redserve sends touches one
    slot, or, in a non-transactional pipeline, is routed key by key, so the rest of the code
    uses it exactly like a single server's client: hence the cast."""
    options = {k: v for k, v in common.items() if k != "timeout"}
    client = RedisCluster.from_url(url, max_connections=max_connections,
                                   socket_timeout=socket_timeout, client_name=name, **options)
    return cast(aioredis.Redis, client)


def stream_reply(reply: object) -> list[tuple[bytes, StreamEntries]]:
    """XREAD/XREADGROUP reply as RESP2 gives it: [(stream key, [(entry id, fields)])]."""
    return cast(list[tuple[bytes, StreamEntries]], reply or [])
