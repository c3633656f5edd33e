"""Taking requests off the model's queue, in the background, only as far as there is room.

Whenever the worker has room, the take script (shared/scripts/take.py, run by
worker/broker/take.py) hands it the queued requests it should run next (fair share, priority,
placement), up to that room, in one command. With room left and nothing more for it, the intake
blocks on XREAD from where the stream ended at that take, so a request that arrives even a
moment after it wakes the worker at once (and one placed on another worker is looked at again
when it becomes anyone's). All of this runs beside the steps rather than between them: a request
that arrives mid-step is taken as it arrives and admitted at the next step boundary. Requests
claimed from dead workers (see worker/broker/recovery.py) join the same queue. Each batch's
abort keys are read once, before the batch is offered (where an announcement could have been
missed, see `offer`), so a request cancelled while it was queued never starts.

Nothing taken is ever dropped: a take is one script (never cancelled halfway; what it claimed
is offered), and `stop` ends the wait that follows it (the XREAD it cancels only watches the
stream: it holds nothing), so every entry taken stays queued here for the drain to hand back.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from shared.keys import WORKER_GROUP
from shared.messages import GenerateRequest
from shared.redis_conn import RedisClients, StreamEntries
from shared.retry import RedisBackoff
from shared.scripts.take import Taken
from worker.broker.aborts import LOOKBACK_MS, AbortWatch
from worker.broker.recovery import Claimed
from worker.broker.take import Room, Taker

log = logging.getLogger("redserve.worker")

BLOCK_MS = 1000


class Intake:
    def __init__(self, clients: RedisClients, stream: str, name: str, aborts: AbortWatch,
                 room: Callable[[], Room], request_ttl_s: int, taker: Taker) -> None:
        self.clients = clients
        self.taker = taker
        self.stream = stream
        self.name = name
        self.aborts = aborts
        self._room = room  # what the worker can still take, beside `queue`
        self.request_ttl_s = request_ttl_s
        self.queue: list[Claimed] = []
        self.arrived = asyncio.Event()
        self._room_changed = asyncio.Event()
        self._stopping = False
        self._stopped = asyncio.Event()
        # The XREAD that waits for the next entry; never cancelled (see `_wait`).
        self._arrival: asyncio.Task[object] | None = None

    def take(self) -> list[Claimed]:
        """Everything read so far, for admission."""
        taken, self.queue = self.queue, []
        self.arrived.clear()
        return taken

    def room_changed(self) -> None:
        self._room_changed.set()

    def stop(self) -> None:
        self._stopping = True
        self._stopped.set()
        self._room_changed.set()

    async def offer(self, claimed: list[Claimed]) -> None:
        """Queue requests for admission, each with whether its abort key is set. Only the
        keys of requests that may have been cancelled before this worker could hear of it
        are read: those taken over from another worker or queued longer than the
        announcements heard at start reach back; a fresh one's abort, if any, was heard."""
        if not claimed:
            return
        horizon = time.time() - LOOKBACK_MS / 1000
        unheard = [c.request.id for c in claimed
                   if c.deliveries > 1 or c.request.created < horizon]
        try:
            aborted = await self.aborts.check(self.clients.commands, unheard)
        except aioredis.RedisError as e:
            # Taken all the same (they are pending here now); the next check of the keys
            # held, or an announcement, still stops any that were cancelled.
            log.warning("could not read the abort keys of new requests: %s", e)
            aborted = set()
        for c in claimed:
            self.queue.append(dataclasses.replace(c, aborted=c.request.id in aborted))
        self.arrived.set()

    async def ensure_group(self) -> None:
        """The model's stream and consumer group, made if missing (from id 0: requests
        enqueued before any worker existed are still served)."""
        try:
            await self.clients.commands.xgroup_create(self.stream, WORKER_GROUP, id="0",
                                                      mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
        await self.refresh_ttl()

    async def refresh_ttl(self) -> None:
        """The stream lives while a worker serves it (see shared/keys.py)."""
        await self.clients.commands.expire(self.stream, self.request_ttl_s)

    async def run(self) -> None:
        backoff = RedisBackoff("reading requests", start=0.1, cap=5.0, log=log)
        while not self._stopping:
            room = self._room()
            if not room:
                await self._until_room()
                continue
            try:
                taken = await self.taker.take(room)
                await self.offer(await self._requests(taken.entries))
                backoff.reset()
                if not (taken.waiting and self._room().regular > 0):  # nothing more for now
                    await self._wait(taken, full=self._room().regular <= 0)
            except aioredis.RedisError as e:
                if "NOGROUP" in str(e):
                    log.warning("the request stream or its group is gone (expired, or Redis "
                                "restarted): making it anew")
                    with contextlib.suppress(aioredis.RedisError):
                        await self.ensure_group()
                        continue
                await backoff.wait(e)
        if self._arrival is not None:  # a read that holds nothing: no need to wait for it
            self._arrival.cancel()
            with contextlib.suppress(BaseException):
                await self._arrival

    async def _until_room(self) -> None:
        self._room_changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._room_changed.wait(), BLOCK_MS / 1000)

    async def _wait(self, taken: Taken, *, full: bool) -> None:
        """Until an entry is added after the take, a member placed on another worker becomes
        anyone's, or (`full`: only a burst was left) a slot frees. The XREAD runs on as a task
        when a slot frees first, rather than being cancelled (that would drop its
        connection); the next wait reuses it: from an older id it only wakes sooner."""
        block = BLOCK_MS if taken.retry_ms < 0 else max(min(taken.retry_ms, BLOCK_MS), 1)
        if self._arrival is None or self._arrival.done():
            if self._arrival is not None:  # a wake for a take that has happened since
                with contextlib.suppress(Exception):
                    self._arrival.result()
            self._arrival = asyncio.create_task(self._next_entry(taken.last_id, block))
        deadline = time.monotonic() + block / 1000
        while not self._arrival.done() and (left := deadline - time.monotonic()) > 0:
            self._room_changed.clear()
            waits: list[asyncio.Future[object]] = [
                self._arrival, asyncio.ensure_future(self._stopped.wait())]
            if full:
                waits.append(asyncio.ensure_future(self._room_changed.wait()))
            await asyncio.wait(waits, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            for extra in waits[1:]:
                extra.cancel()
            if self._stopping or (full and self._room().regular > 0):
                return
        if self._arrival.done():
            self._arrival.result()  # a Redis error is the caller's to handle

    async def _next_entry(self, after: str, block: int) -> object:
        return await self.clients.blocking.xread({self.stream: after}, count=1, block=block)

    async def _requests(self, entries: StreamEntries) -> list[Claimed]:
        claimed: list[Claimed] = []
        for entry_id, fields in entries:
            eid = entry_id.decode()
            try:
                claimed.append(Claimed(eid, GenerateRequest.from_fields(fields), (), False, 1))
            except (KeyError, ValueError):
                # The API validates everything it enqueues; a foreign entry has nowhere to
                # send an error, so drop it.
                log.error("dropping malformed request entry %s", eid)
                pipe = self.clients.commands.pipeline(transaction=False)
                pipe.xack(self.stream, WORKER_GROUP, eid)
                pipe.xdel(self.stream, eid)
                await pipe.execute()
        return claimed
