"""One task per replica reads the results of all its requests from the replica's feed and routes
them by request id into bounded per-request queues (the seed's `listen`, without its leaks: a
subscription is removed by whoever opened it, whatever way the request ends).

Workers append one feed entry per step with every new result entry of this replica's requests
(see shared/keys.py). So the reader blocks on one key and takes a whole step in one command,
whatever the number of requests: a blocking XREAD over every request's stream would cost
Redis a registration and a wake on each of them per step. The feed is within the replica's
hash tag, one Cluster slot.

The result streams are the record, written in chunks that trail the feed by up to 16 tokens
or 0.5 s and a step while the worker lives (worker/broker/record.py), and until another worker takes
the request over if it dies (which records what the feed had: worker/broker/recovery.py). A
request's entries are placed by token index, so one seen twice (a worker that resumed a
request, a retried publish) is dropped and one that skips ahead shows a gap. When a client
falls behind (its queue is full) or a gap shows, its request leaves the feed and catches up
from its own result stream, tokens waiting in Redis rather than in this process, keeping
meanwhile the newest of its feed entries (at most half a buffer); level with its record, it
takes those and rejoins the feed. Until they fit, or while they do not reach back to the
record's end (the record lags), it reads the record again every `GAP_POLL_S`; it waits as a
client on the feed would, up to the request's deadline (api/queue/generation.py). A gap in the
record itself (Redis lost data) ends the request with an error. A client that stays behind
for `slow_after_s` is reported through `on_slow_client`. Should the feed vanish (Redis
restarted), it is made anew and every request catches up from its stream.

Every request of the replica depends on this one task, so it must never die silently: an entry
that cannot be decoded ends only its own request (with an error), and should the loop itself
fail, it is logged and restarted after a short pause, its subscriptions intact; `/health`
shows whether it runs and how often it was restarted.

While its reads fail (Redis, or the node of the feed's slot, does not answer) `failing` says
why, and /ready is 503: a request taken then gets no results until the reads succeed again.

A replica may start before Redis answers (a Kubernetes rollout, `redserve up` against a Redis
still starting): the reader then waits for it, logging one line when the wait begins and one
when it ends, and retrying with backoff meanwhile, while the replica serves its probes (/health
says why it is unavailable, /ready is 503) and refuses requests with 503 (`connected`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import cast

import redis.asyncio as aioredis

from api.queue.subscription import Subscription
from shared.keys import Keys
from shared.messages import (
    Error,
    ResultEntry,
    decode_feed,
    decode_result,
    expand,
    feed_marker,
    feed_min_id,
)
from shared.redis_conn import RedisClients, StreamEntries, stream_reply
from shared.retry import RedisBackoff

log = logging.getLogger("redserve.api.reader")

READ_COUNT = 64  # most feed entries per read; most stream entries per catch-up read
BLOCK_MS = 1000
# Reads failing this long mean Redis is gone: open requests end with an error, not a hang.
# Longer than a failover at a `down-after-milliseconds` of 1 s (docs/operations.md), which
# streams ride out; retried at least every OUTAGE_RETRY_CAP_S meanwhile.
OUTAGE_AFTER_S = 2.5
OUTAGE_RETRY_CAP_S = 0.1
# While some client is behind, read with a short block so it catches up promptly once it
# reads again.
BEHIND_BLOCK_MS = 20
# How often a request level with its record, but not yet back on the feed, reads it again.
GAP_POLL_S = 0.2
# How often the feed's TTL is refreshed (and its loss noticed).
FEED_CHECK_S = 5.0
RESTART_PAUSE_S = 0.1
# Stopping: each cancellation of the loop is given this long to end it, this many times.
STOP_WAIT_S = 0.5
STOP_TRIES = 20
LOST = Error("some of the request's results are missing from its stream (lost when Redis "
             "failed)", "server_error", "redis_unavailable")
MALFORMED = Error("the worker sent a malformed result entry", "server_error", "malformed_result")


@dataclass
class ResultReader:
    clients: RedisClients
    keys: Keys
    replica: str
    buffer: int
    slow_after_s: float
    on_slow_client: Callable[[str], None] = lambda request_id: None
    subscriptions: dict[str, Subscription] = field(default_factory=dict)  # by request id
    _feed_id: bytes | str = "0-0"
    _ttl_s: int = 3600
    _feed_checked: float = 0.0
    _task: asyncio.Task[None] | None = None
    _failovers: int = 0  # the clients' count of failovers when last looked at
    recoveries: int = 0  # outages and failovers this reader has come back from
    restarts: int = 0
    waiting: str | None = None  # while Redis does not answer at start: why
    failing: str | None = None  # while its reads fail: why (/ready is 503 meanwhile)
    _connected: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def room(self) -> int:
        """Queue items a request may hold: a finish entry may carry tokens (two items)."""
        return self.buffer - 2

    @property
    def feed_key(self) -> str:
        return self.keys.feed(self.replica)

    async def start(self, ttl_s: int) -> None:
        """Make the feed and read it from here on; if Redis does not answer, keep trying in
        the background (`connected` turns true once it does)."""
        self._ttl_s = ttl_s
        with contextlib.suppress(aioredis.RedisError):
            await self._connect()
        self._task = asyncio.create_task(self._supervise(), name="result-reader")

    async def _connect(self) -> None:
        # Read the feed from an entry of our own on: every later one is newer.
        self._feed_id = await self._make_feed()
        self._feed_checked = time.monotonic()
        self.waiting = None
        self._connected.set()

    @property
    def connected(self) -> bool:
        """Its feed is made: requests can be served."""
        return self._connected.is_set()

    async def until_connected(self) -> None:
        await self._connected.wait()

    async def _wait_for_redis(self) -> None:
        """Until the feed is made: one line as the wait begins, one as it ends, and tries
        with backoff between (each failure only at debug level)."""
        backoff = RedisBackoff("Redis", start=0.2, cap=5.0, log=log)
        since = time.time()
        while True:
            try:
                await self._connect()
            except aioredis.RedisError as e:
                if self.waiting is None:
                    log.warning("Redis at %s does not answer (%s); waiting for it, retrying "
                                "with backoff (/ready is 503 meanwhile)", self.clients.where, e)
                self.waiting = (f"waiting for Redis at {self.clients.where} since "
                                f"{time.strftime('%H:%M:%S', time.gmtime(since))} UTC: {e}")
                log.debug("Redis still unavailable: %s", e)
                await backoff.pause()
                continue
            log.info("Redis at %s answers; serving", self.clients.where)
            return

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    async def stop(self) -> None:
        """Cancel the loop and wait for it to end. A cancellation can be lost inside redis-py
        (seen with redis-py 8 on Python 3.11: the loop went on blocked in a read, and the
        replica's shutdown waited on it for good), so it is repeated until the loop ends."""
        task = self._task
        if task is None:
            return
        for _ in range(STOP_TRIES):
            task.cancel()
            done, _ = await asyncio.wait([task], timeout=STOP_WAIT_S)
            if done:
                return
        log.warning("the result reader did not stop after %d cancellations", STOP_TRIES)

    def open(self, request_id: str) -> Subscription:
        sub = Subscription(request_id, self.keys.out(request_id), asyncio.Queue(self.buffer))
        self.subscriptions[request_id] = sub
        return sub

    def close(self, sub: Subscription) -> None:
        self.subscriptions.pop(sub.request_id, None)

    async def _make_feed(self) -> bytes:
        """The feed exists from here on (workers never make it), with its TTL."""
        seconds, micros = await self.clients.commands.time()  # trimmed by Redis's clock
        pipe = self.clients.commands.pipeline(transaction=False)
        pipe.xadd(self.feed_key, feed_marker(),  # type: ignore[arg-type]
                  minid=feed_min_id(seconds + micros / 1e6), approximate=True)
        pipe.expire(self.feed_key, self._ttl_s)
        entry_id, _ = await pipe.execute()
        return bytes(entry_id)

    async def _supervise(self) -> None:
        if not self.connected:
            await self._wait_for_redis()
        while True:
            try:
                await self._run()
            except asyncio.CancelledError:
                raise
            except Exception:
                self.restarts += 1
                log.exception("result reader failed; restarting it (restart %d)", self.restarts)
                # What the failed pass was routing may be lost: every request catches up from
                # its stream, the record.
                for sub in self.subscriptions.values():
                    sub.behind = True
                await asyncio.sleep(RESTART_PAUSE_S)

    async def _run(self) -> None:
        backoff = RedisBackoff("result reader", start=0.05, cap=OUTAGE_RETRY_CAP_S, log=log)
        failing_since: float | None = None
        while True:
            now = time.monotonic()
            try:
                if now - self._feed_checked > FEED_CHECK_S:
                    await self._check_feed()
                    self._feed_checked = now
                if self.clients.failovers != self._failovers:
                    self._failovers = self.clients.failovers
                    self._recovered("the primary moved")
                waiting = await self._catch_up(now)
                response = await self.clients.blocking.xread(
                    {self.feed_key: self._feed_id}, count=READ_COUNT,
                    block=BEHIND_BLOCK_MS if waiting else BLOCK_MS)
                backoff.reset()
                if failing_since is not None:
                    self._recovered("Redis answers again")
                failing_since = self.failing = None
            except aioredis.RedisError as e:
                failing_since = failing_since or now
                self.failing = f"the result reader's reads fail: {e}"
                if now - failing_since >= OUTAGE_AFTER_S:
                    self._fail_all(Error("lost the connection to Redis", "server_error",
                                         "redis_unavailable"))
                await backoff.wait(e)
                continue
            for _, entries in stream_reply(response):
                for entry_id, fields in entries:
                    self._feed_id = entry_id
                    self._route_feed(fields)

    def _recovered(self, why: str) -> None:
        """The feed may miss entries the record has (lost with the old primary, or added to
        the new one under an id read past on the old): one with a terminal entry would leave
        no gap to see. Every open request catches up from its record."""
        self.recoveries += 1
        log.warning("%s: every open request catches up from its result stream", why)
        for sub in self.subscriptions.values():
            sub.behind = True

    async def _check_feed(self) -> None:
        """Refresh the feed's TTL. If it is gone (Redis lost its data), make it anew; if it
        was trimmed past what this reader has read (it fell that far behind), read on. Either
        way every open request catches up from its stream."""
        if await self.clients.commands.expire(self.feed_key, self._ttl_s):
            first = (await self.clients.commands.xinfo_stream(self.feed_key)).get("first-entry")
            if not first or _id(first[0]) <= _id(self._feed_id):
                return
            log.warning("the replica's feed was trimmed past this reader; every open request "
                        "catches up from its result stream")
        else:
            log.warning("the replica's feed was gone (Redis restarted?); every open request "
                        "catches up from its result stream")
            self._feed_id = await self._make_feed()
        for sub in self.subscriptions.values():
            sub.behind = True

    async def _catch_up(self, now: float) -> bool:
        """Read the streams of the requests off the feed, those with room; True while some
        request is still behind."""
        waiting = False
        for sub in list(self.subscriptions.values()):
            if not sub.behind or sub.ended:
                continue
            free = self.room - sub.queue.qsize()
            if free < 2:
                waiting = True
                sub.behind_since = sub.behind_since or now
                if now - sub.behind_since > self.slow_after_s:
                    sub.behind_since = None
                    self.on_slow_client(sub.request_id)
                continue
            sub.behind_since = None
            if sub.level and now - sub.polled < GAP_POLL_S:
                waiting = True
                continue
            waiting = await self._read_record(sub, free // 2, now) or waiting
        return waiting

    async def _read_record(self, sub: Subscription, count: int, now: float) -> bool:
        """Catch `sub` up from its record, then from its stash: True while still behind."""
        sub.polled = now
        reply = cast(StreamEntries, await self.clients.commands.xrange(
            sub.key, _after(sub.stream_id), "+", count=count))
        outcome = "ok"
        for entry_id, fields in reply:
            outcome = sub.offer(_decode(sub.key, fields), self.room)
            if outcome == "gap":  # in the record itself: those results never came
                sub.fail(LOST)
            if outcome != "ok":
                break
            sub.stream_id = entry_id
        if sub.ended:
            return False
        sub.level = outcome == "ok" and len(reply) < count
        if not sub.level:
            return True
        # Level with the record: the stash carries on from it, unless the record lags (or
        # the stash does not fit yet).
        if sub.offer(sub.stash, self.room) != "ok":
            return True
        sub.stash.clear()
        sub.behind = sub.level = False
        return False

    def _route_feed(self, fields: Mapping[bytes, bytes]) -> None:
        try:
            batch = decode_feed(dict(fields))
        except Exception:
            log.exception("malformed feed entry")
            return
        for request_id, entry_fields in batch.items():
            sub = self.subscriptions.get(request_id)
            if sub is None or sub.ended:
                continue
            entries = _decode(sub.key, entry_fields)
            if not sub.behind and sub.offer(entries, self.room) != "ok":
                sub.behind = True
            if sub.behind:
                sub.keep(entries, self.room // 2)

    def _fail_all(self, error: Error) -> None:
        for sub in self.subscriptions.values():
            sub.fail(error)


def _decode(key: str, fields: Mapping[bytes, bytes] | Mapping[str, str]) -> list[ResultEntry]:
    try:
        return expand(decode_result(dict(fields)))
    except Exception:
        log.exception("malformed result entry in %s", key)
        return [MALFORMED]


def _after(entry_id: bytes | str) -> str:
    """The XRANGE start just after `entry_id`."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return f"({text}"


def _id(entry_id: bytes | str) -> tuple[int, int]:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)
