"""Redis connections. Each process keeps two clients:

- `commands`: pooled, with a socket timeout, for short commands and pipelines;
- `blocking`: for XREAD/XREADGROUP BLOCK, with a socket timeout of `BLOCKING_TIMEOUT_S`, longer
  than any block redserve asks for (so it never cuts one short) yet finite (a server that went
  silent, a primary frozen or cut off by a partition, fails the read instead of hanging it
  for good), and its own connections so a block never holds up a command. Every
  connection has TCP keepalive on, so one whose peer vanished is noticed eventually.

`connect` is the one place a process makes them, for each of the three shapes of Redis it may
be given: one server (or a managed endpoint whose name moves to the new primary), a Redis
Cluster, or a primary that Sentinel fails over (`redis+sentinel://`, `shared/redis_address.py`;
its `PrimaryWatch`, `shared/primary_watch.py`, closes the connections to an old primary as
soon as the Sentinels name a new one, rather than at their socket timeout).
A connection whose server turned replica (READONLY, or the UNBLOCKED error a demoted primary
gives a blocked XREAD) drops itself and fails as a lost connection does, so the next call
connects again: Sentinel's pools ask the Sentinels where the primary is now, and a plain URL's
(`_Following`) resolves the name again; a managed endpoint that keeps the old primary up as a
replica would otherwise answer every write on the pooled connections with READONLY.
A Cluster client finds the slot of a stream read itself (`_Cluster`), not by asking the node
redis-py last took as its default, so the death of that node fails only its own slot's
commands, whose connection errors make redis-py read the slots anew and find the promoted
replica.

No command is retried inside redis-py (no `retry` is set; but a Cluster client keeps
redis-py's default, 10 tries with a backoff up to 1 s, which sends a command whose node failed
again once the slot map is read anew): a write whose reply was lost may have run, and only its
caller knows whether running it again is safe, so the error goes to the caller, whose own loop
retries what may be retried (`shared/retry.py`). A Lua script the new primary has never seen
answers NOSCRIPT and redis-py's `Script` loads it and runs it again (`shared/scripts/base.py`):
NOSCRIPT means it did not run.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, cast

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import parse_url
from redis.asyncio.sentinel import (
    DEMOTED_MASTER_UNBLOCKED_ERROR,
    Sentinel,
    SentinelConnectionPool,
    SentinelManagedConnection,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError, ResponseError

from shared.primary_watch import Address, PrimaryWatch
from shared.redis_address import SentinelAddress, is_sentinel_url, parse_sentinel_url, public

StreamEntries = list[tuple[bytes, dict[bytes, bytes]]]

# Above the longest BLOCK any caller passes (5 s, worker/broker/aborts.py) with a margin.
BLOCKING_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class RedisClients:
    commands: aioredis.Redis
    blocking: aioredis.Redis
    sentinel: Sentinel | None = None  # the Sentinels both ask, when Sentinel finds the primary
    where: str = ""  # the URL, its passwords masked: what a log line names
    watch: PrimaryWatch | None = None  # with Sentinel: follows the primary as it moves

    @property
    def failovers(self) -> int:
        """Changes of primary seen so far (always 0 without Sentinel): a part that must check
        what a failover may have lost compares it with the count it last saw."""
        return 0 if self.watch is None else self.watch.failovers

    async def close(self) -> None:
        if self.watch is not None:
            await self.watch.stop()
        await self.commands.aclose()
        await self.blocking.aclose()
        if self.sentinel is not None:
            await self.sentinel.aclose()


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
            blocking=_cluster(url, 4, BLOCKING_TIMEOUT_S, f"{name}-block", common),
            where=public(url),
        )
    if is_sentinel_url(url):
        address = parse_sentinel_url(url)
        sentinel = _sentinels(address)
        watch = PrimaryWatch(sentinel, address.master)
        return RedisClients(
            commands=_primary(sentinel, address, watch, max_connections, 10.0, name, common),
            blocking=_primary(sentinel, address, watch, 4, BLOCKING_TIMEOUT_S,
                              f"{name}-block", common),
            sentinel=sentinel, where=public(url), watch=watch,
        )
    common["connection_class"] = _following(url)
    commands = aioredis.Redis.from_pool(aioredis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, socket_timeout=10.0, client_name=name, **common
    ))
    blocking = aioredis.Redis.from_pool(aioredis.BlockingConnectionPool.from_url(
        url, max_connections=4, socket_timeout=BLOCKING_TIMEOUT_S, client_name=f"{name}-block",
        **common
    ))
    return RedisClients(commands=commands, blocking=blocking, where=public(url))


def _cluster(url: str, max_connections: int, socket_timeout: float | None, name: str,
             common: dict[str, Any]) -> aioredis.Redis:
    """A Redis Cluster client (`url` names any node). Every command redserve sends touches one
    slot, or, in a non-transactional pipeline, is routed key by key, so the rest of the code
    uses it exactly like a single server's client: hence the cast."""
    options = {k: v for k, v in common.items() if k != "timeout"}
    client = _Cluster.from_url(url, max_connections=max_connections,
                               socket_timeout=socket_timeout, client_name=name, **options)
    return cast(aioredis.Redis, client)


# Where the stream keys of a read begin: after this word, searched for from this argument on
# (the command's own key spec, `COMMAND INFO`; XREADGROUP's group and consumer come first).
_STREAMS_FROM = {"XREAD": 0, "XREADGROUP": 3}


class _Cluster(RedisCluster):
    """The cluster client, with the slot of XREAD and XREADGROUP found here. redis-py asks a
    node for their keys (COMMAND GETKEYS: their key spec is one it does not evaluate), the node
    that was its default at its last slot-map refresh, before it routes the read. Should that
    node die, every read fails there, whatever its slot, and that failure is not one that
    makes redis-py refresh its slot map (only a command sent to a node does): a client whose
    commands are all such reads (a worker's `blocking`) kept asking the dead node for good,
    long after its replica was promoted. Here the keys are the first half of the arguments
    after STREAMS, as the server's key spec reads them, so a read goes to its slot's node,
    and a dead one's connection error asks for the refresh that finds the promoted replica
    (and every read saves a round trip)."""

    async def _determine_slot(self, command: str, *args: Any) -> int:
        start = _STREAMS_FROM.get(str(command).upper())
        if start is not None:
            for i in range(start, len(args)):
                word = args[i]
                if isinstance(word, (str, bytes)) and word.upper() in ("STREAMS", b"STREAMS"):
                    rest = args[i + 1:]
                    slots = {self.keyslot(k) for k in rest[:len(rest) // 2]}
                    if len(slots) == 1:
                        return slots.pop()
                    break
        return await super()._determine_slot(command, *args)


class _Following(aioredis.Connection):
    """A connection to a server that may stop being the primary under its name: READONLY, or a
    blocked read's UNBLOCKED, closes it and raises ConnectionError."""

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().read_response(*args, **kwargs)
        except ResponseError as e:
            if isinstance(e, ReadOnlyError) or str(e).startswith(DEMOTED_MASTER_UNBLOCKED_ERROR):
                await self.disconnect()
                raise RedisConnectionError(f"the server is a replica now: {e}") from e
            raise


class _FollowingSSL(_Following, aioredis.SSLConnection):
    pass


def _following(url: str) -> type[aioredis.connection.AbstractConnection]:
    """`_Following` for a TCP URL (TLS or not); a Unix socket's class as it is."""
    base = parse_url(url).get("connection_class", aioredis.Connection)
    if base is aioredis.SSLConnection:
        return _FollowingSSL
    return _Following if base is aioredis.Connection else cast(type, base)


class _BoundedSentinelPool(SentinelConnectionPool, aioredis.BlockingConnectionPool):
    """Sentinel's pool (it finds the primary) with the blocking pool's bound (a burst waits
    for a free connection): the two only meet in `ConnectionPool`, so the mix is sound. Its
    first connection starts the process's `PrimaryWatch`, which calls `drop_others` when the
    primary moves."""

    watch: PrimaryWatch | None = None

    async def get_master_address(self) -> Any:
        """Where a new connection goes: the primary the Sentinels name (redis-py's discovery),
        unless the watch has seen it replaced; idle connections elsewhere are closed, as
        redis-py's own pool does."""
        if self.watch is None:
            return await super().get_master_address()
        self.watch.ensure_running()
        found = await self.sentinel_manager.discover_master(self.service_name)
        address = self.watch.superseded((str(found[0]), int(found[1]))) or found
        if self.master_address != address:
            self.master_address = address
            await self.disconnect(inuse_connections=False)
        return address

    async def drop_others(self, primary: Address) -> None:
        """Close every connection, idle or in use, to a server other than `primary`: a
        command waiting on one fails at once (ConnectionError) instead of at its socket
        timeout, and the next connection goes to `primary`."""
        self.master_address = primary
        connections = [*self._available_connections, *self._in_use_connections]
        stale = [c for c in connections
                 if isinstance(c, SentinelManagedConnection) and c.host
                 and (c.host, int(c.port)) != primary]
        await asyncio.gather(*(c.disconnect(nowait=True) for c in stale),
                             return_exceptions=True)


# Asking a Sentinel is short: one that does not answer in this long is skipped for the next.
SENTINEL_TIMEOUT_S = 0.5


def _sentinels(address: SentinelAddress) -> Sentinel:
    """The Sentinels, asked in turn (one that fails is skipped) for the primary's address."""
    return Sentinel(
        list(address.sentinels), min_other_sentinels=0,
        sentinel_kwargs={"socket_connect_timeout": SENTINEL_TIMEOUT_S,
                         "socket_timeout": SENTINEL_TIMEOUT_S, "protocol": 2, "ssl": address.tls,
                         "username": address.sentinel_username,
                         "password": address.sentinel_password},
    )


def _primary(sentinel: Sentinel, address: SentinelAddress, watch: PrimaryWatch,
             max_connections: int, socket_timeout: float, name: str,
             common: dict[str, Any]) -> aioredis.Redis:
    """A client of the primary that the Sentinels name now, whoever that is."""
    client: aioredis.Redis = sentinel.master_for(
        address.master, connection_pool_class=_BoundedSentinelPool,
        max_connections=max_connections, socket_timeout=socket_timeout, client_name=name,
        db=address.db, username=address.username, password=address.password,
        ssl=address.tls, **common)
    pool = cast(_BoundedSentinelPool, client.connection_pool)
    pool.watch = watch
    watch.drops.append(pool.drop_others)
    return client


def stream_reply(reply: object) -> list[tuple[bytes, StreamEntries]]:
    """XREAD/XREADGROUP reply as RESP2 gives it: [(stream key, [(entry id, fields)])]."""
    return cast(list[tuple[bytes, StreamEntries]], reply or [])
