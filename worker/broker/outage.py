"""What a worker does when Redis fails while it serves: ride a short outage out, or end the
requests it holds.

When Redis fails mid-step, nothing already decided is lost: the step's outputs are still
staged, and every terminal entry waits in the publisher's outbox. A failover takes about
`down-after-milliseconds` plus a second or two, so an outage up to `RIDE_OUT_S` is ridden out:
the requests held wait (no step runs) and go on once Redis takes what is staged. A longer one
ends every request held with a clear error (their clients' replicas give up on an unreachable
Redis too), kept in the outbox until Redis takes it; once Redis answers again the outbox goes out
first and the worker serves on. Either way the endings written just before the outage may have
been lost with an old primary, so they are written again where missing
(`Publisher.reassert_recent`).
"""

from __future__ import annotations

import asyncio
import logging
import time

import redis.asyncio as aioredis

from shared.messages import Error
from shared.retry import RedisBackoff
from worker.broker.intake import Intake
from worker.broker.publisher import Publisher
from worker.broker.recovery import Recovery
from worker.engine.scheduler import Scheduler

log = logging.getLogger("redserve.worker")

LOST_REDIS = Error("the worker lost its connection to Redis", "server_error", "redis_unavailable")
# Longer than a failover takes at a `down-after-milliseconds` of 1 s; the same as the replicas'
# (api/queue/reader.py), which end their streams after it.
RIDE_OUT_S = 2.5
RIDE_OUT_RETRY_S = 0.1


class Outage:
    def __init__(self, scheduler: Scheduler, publisher: Publisher, intake: Intake,
                 recovery: Recovery, stopping: asyncio.Event) -> None:
        self.scheduler, self.publisher, self.intake = scheduler, publisher, intake
        self.recovery, self.stopping = recovery, stopping

    async def ride_out(self, error: aioredis.RedisError) -> None:
        """Retry for up to `RIDE_OUT_S` (a failover): if Redis takes what is staged by then,
        the requests held go on. Otherwise end every request held (each gets an error entry,
        kept until Redis takes it), then retry until the outbox is written. Either way the
        endings written just before may have been lost with the old primary: they are
        written again where missing."""
        if await self._brief(error):
            return
        log.error("lost Redis (%s): ending %d request(s); retrying", error,
                  self.scheduler.stats().requests)
        for seq in [*self.scheduler.drop_running(), *self.scheduler.drop_waiting()]:
            self.publisher.stage_error(seq.request.id, LOST_REDIS)
        for claimed in self.intake.take():
            self.publisher.take(claimed.request, claimed.entry_id, claimed.unrecorded)
            self.publisher.stage_error(claimed.request.id, LOST_REDIS)
        backoff = RedisBackoff("Redis still unavailable", start=0.2, cap=5.0, log=log)
        while not self.stopping.is_set():  # stopping: the shutdown tries one last time
            await backoff.pause()
            try:
                # Requests another worker claimed meanwhile are its own to end, not ours.
                self.publisher.forget(await self.recovery.taken_by_others())
                await self.publisher.flush()
                await self.intake.ensure_group()
            except aioredis.RedisError as e:
                backoff.report(e)
                continue
            log.info("Redis is back; serving again")
            return

    async def _brief(self, error: aioredis.RedisError) -> bool:
        """True once Redis has taken the outbox, within `RIDE_OUT_S`."""
        log.warning("lost Redis (%s): holding %d request(s) for up to %gs", error,
                    self.scheduler.stats().requests, RIDE_OUT_S)
        until = time.monotonic() + RIDE_OUT_S
        while not self.stopping.is_set() and time.monotonic() < until:
            await asyncio.sleep(RIDE_OUT_RETRY_S)
            try:
                self.publisher.reassert_recent()
                self.publisher.forget(await self.recovery.taken_by_others())
                await self.publisher.flush()
                await self.intake.ensure_group()
            except aioredis.RedisError:
                continue
            log.info("Redis answers again; the requests held go on")
            return True
        return False
