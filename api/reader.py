"""One task per replica reads every in-flight result stream with a single XREAD and routes
entries by request id into bounded per-request queues (the seed's `listen`, without its leaks:
a subscription is removed by whoever opened it, whatever way the request ends).

New requests wake the blocked XREAD through the replica's wake stream, which shares the
replica's hash tag, so the whole read stays within one Redis Cluster slot. A request whose
queue is nearly full is left out of the read until its client catches up: the tokens wait in
Redis, not in this process. A client that stays that far behind for `slow_after_s` is reported
through `on_slow_client`.

Every request of the replica depends on this one task, so it must never die silently: an entry
that cannot be decoded ends only its own request (with an error), and should the loop itself
fail, it is logged and restarted after a short pause, its subscriptions intact; `/health`
shows whether it runs and how often it was restarted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from shared.keys import Keys
from shared.messages import Error, Finish, ResultEntry, decode_result
from shared.redis_conn import RedisClients, StreamEntries, stream_reply

log = logging.getLogger("redserve.api.reader")

READ_COUNT = 64  # most entries per stream per read
BLOCK_MS = 1000
# Reads failing this long mean Redis is gone: open requests end with an error, not a hang.
OUTAGE_AFTER_S = 1.0
# While some client is behind, read with a short block so its stream resumes promptly once it
# catches up (a blocked XREAD would otherwise hold the stream paused for up to BLOCK_MS).
PAUSED_BLOCK_MS = 20
WAKE_MAXLEN = 64
RESTART_PAUSE_S = 0.1


@dataclass
class Subscription:
    request_id: str
    key: str
    queue: asyncio.Queue[ResultEntry]
    last_id: bytes | str = "0-0"
    ended: bool = False  # a terminal entry has been routed
    failed: bool = False  # ...and it came from this replica, not from a worker
    paused_since: float | None = None

    def fail(self, error: Error) -> None:
        """End the request here: drop what is buffered, deliver `error` next."""
        if self.ended:
            return
        while not self.queue.empty():
            self.queue.get_nowait()
        self.queue.put_nowait(error)
        self.ended = self.failed = True


@dataclass
class ResultReader:
    clients: RedisClients
    keys: Keys
    replica: str
    buffer: int
    slow_after_s: float
    on_slow_client: Callable[[str], None] = lambda request_id: None
    subscriptions: dict[str, Subscription] = field(default_factory=dict)  # by stream key
    _wake_id: bytes | str = "0-0"
    _count: int = READ_COUNT
    _task: asyncio.Task[None] | None = None
    restarts: int = 0

    @property
    def wake_key(self) -> str:
        return self.keys.wake(self.replica)

    async def start(self, ttl_s: int) -> None:
        self._count = min(READ_COUNT, self.buffer // 2)
        # Start reading the wake stream after an entry of our own: every later wake is newer.
        self._wake_id = await self._wake(self.clients.commands, ttl_s)
        self._task = asyncio.create_task(self._supervise(), name="result-reader")

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def open(self, request_id: str) -> Subscription:
        sub = Subscription(request_id, self.keys.out(request_id), asyncio.Queue(self.buffer))
        self.subscriptions[sub.key] = sub
        return sub

    def close(self, sub: Subscription) -> None:
        self.subscriptions.pop(sub.key, None)

    def queue_wake(self, pipe: aioredis.client.Pipeline, ttl_s: int) -> None:
        """Add the wake-up to a pipeline that also enqueues a request."""
        pipe.xadd(self.wake_key, {"w": "1"}, maxlen=WAKE_MAXLEN)
        pipe.expire(self.wake_key, ttl_s)

    async def _wake(self, redis: aioredis.Redis, ttl_s: int) -> bytes:
        pipe = redis.pipeline(transaction=False)
        self.queue_wake(pipe, ttl_s)
        entry_id, _ = await pipe.execute()
        return bytes(entry_id)

    async def _supervise(self) -> None:
        while True:
            try:
                await self._run()
            except asyncio.CancelledError:
                raise
            except Exception:
                self.restarts += 1
                log.exception("result reader failed; restarting it (restart %d)", self.restarts)
                await asyncio.sleep(RESTART_PAUSE_S)

    async def _run(self) -> None:
        backoff = 0.05
        failing_since: float | None = None
        while True:
            streams: dict[Any, Any] = {self.wake_key: self._wake_id}
            now = time.monotonic()
            block = BLOCK_MS
            for sub in list(self.subscriptions.values()):
                if sub.ended:
                    continue
                if sub.queue.qsize() <= self.buffer - self._count:
                    sub.paused_since = None
                    streams[sub.key] = sub.last_id
                    continue
                block = PAUSED_BLOCK_MS
                if sub.paused_since is None:
                    sub.paused_since = now
                elif now - sub.paused_since > self.slow_after_s:
                    sub.paused_since = None
                    self.on_slow_client(sub.request_id)
            try:
                response = await self.clients.blocking.xread(
                    streams, count=self._count, block=block
                )
                backoff, failing_since = 0.05, None
            except aioredis.RedisError as e:
                log.warning("result reader: %s; retrying in %.2fs", e, backoff)
                failing_since = failing_since or now
                if now - failing_since >= OUTAGE_AFTER_S:
                    self._fail_all(Error("lost the connection to Redis", "server_error",
                                         "redis_unavailable"))
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            for raw_key, entries in stream_reply(response):
                self._route(raw_key.decode(), entries)

    def _fail_all(self, error: Error) -> None:
        for sub in self.subscriptions.values():
            sub.fail(error)

    def _route(self, key: str, entries: StreamEntries) -> None:
        if key == self.wake_key:
            self._wake_id = entries[-1][0]
            return
        sub = self.subscriptions.get(key)
        if sub is None:
            return  # its request already ended here: late entries have no one to go to
        for entry_id, fields in entries:
            sub.last_id = entry_id
            try:
                entry = decode_result(fields)
            except Exception:
                log.exception("malformed result entry %s in %s", entry_id, key)
                entry = Error("the worker sent a malformed result entry", "server_error",
                              "malformed_result")
            sub.queue.put_nowait(entry)
            if isinstance(entry, Finish | Error):
                sub.ended = True
                return
