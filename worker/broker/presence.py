"""The worker's heartbeat: what keeps it, its requests and its model's stream known to be alive.

Every `heartbeat_ttl_s / 3` seconds, in one place:
- its status key and its place among the model's live workers (which API replicas read for
  /ready, /v1/models and placement); a draining worker leaves that set first;
- its prefix summary (`Keys.prefixes`: the public digests of the pages its prefix cache
  holds), rewritten only when it changed and otherwise only given a new TTL, so a worker whose
  cache is steady costs one EXPIRE a beat; the heartbeat carries the summary's version, so the
  API replicas' placement (api/queue/placement.py) re-reads it only then;
- its model's request stream TTL (the stream lives while a worker serves it);
- the idle time of every entry it holds (see worker/broker/recovery.py), and, unless draining,
  a claim of entries abandoned by dead workers;
- the abort keys of every request it holds, which catches any announcement it missed;
- the tokens it generated per tenant since its last take, charged to their service counters
  (worker/broker/take.py), so an idle or full worker's tally is not held back.
Each part fails on its own (logged), so a Redis hiccup never stops the beat.

The status key's body is what an operator sees of the worker (`/health`, `redserve inspect`):
the worker's own figures (batch, KV pages, its cumulative `generated_tokens`) plus what only the
beat can tell: when it was written (`at`, unix time, so a reader computes the heartbeat's age
without knowing this worker's TTL) and `tokens_per_s` over the interval since the previous beat.
The rate is worked out here, from two beats, so the step loop pays nothing for it.

What the beat needs comes in two parts, by role: the `Worker` it announces (who it is and what
the beat reads of it, all safe to read while a step runs on its thread), and its `Upkeep` (the
broker parts whose Redis state the beat keeps alive).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import redis.asyncio as aioredis

from shared.keys import Keys
from shared.messages import Heartbeat, PrefixSummary
from worker.broker.aborts import AbortWatch
from worker.broker.intake import Intake
from worker.broker.publisher import Publisher
from worker.broker.recovery import Recovery

log = logging.getLogger("redserve.worker")


@dataclass(frozen=True)
class Worker:
    """The worker the beat announces: who it is, and what the beat reads of it."""

    name: str
    model: str
    status: Callable[[], Heartbeat]  # its own figures (with generated_tokens)
    room: Callable[[], int]  # requests it can still take
    held: Callable[[], list[str]]  # ids of the requests it holds
    prefixes: Callable[[], PrefixSummary]  # what its prefix cache holds


@dataclass(frozen=True)
class Upkeep:
    """The broker parts whose Redis state the beat keeps alive."""

    publisher: Publisher  # the entries of the requests it runs
    recovery: Recovery  # their idle times, and claims of dead workers' entries
    intake: Intake  # the request stream's TTL, the entries it holds, the tenants' charges
    aborts: AbortWatch


@dataclass
class Presence:
    redis: aioredis.Redis
    keys: Keys
    ttl_s: int
    worker: Worker
    upkeep: Upkeep
    draining: bool = False
    # The version of the prefix summary last written (None: write it at the next beat).
    _written: int | None = field(default=None, init=False)
    # (monotonic time, generated_tokens) at the previous beat: the rate's starting point.
    _last: tuple[float, int] = field(default_factory=lambda: (time.monotonic(), 0), init=False)

    async def run(self) -> None:
        upkeep = self.upkeep
        while True:
            await self.beat()
            await self._part("refresh the request stream's TTL", upkeep.intake.refresh_ttl)
            await self._part("refresh pending requests", lambda: upkeep.recovery.touch(
                [*upkeep.publisher.entry_ids.values(),
                 *(c.entry_id for c in upkeep.intake.queue)]))
            if not self.draining:
                await self._part("claim abandoned requests", self._claim)
            await self._part("check abort keys",
                             lambda: upkeep.aborts.check(self.redis, self.worker.held()))
            await self._part("charge tenants' service", upkeep.intake.taker.charge)
            await asyncio.sleep(self.ttl_s / 3)

    async def _claim(self) -> None:
        intake = self.upkeep.intake
        room = self.worker.room() - len(intake.queue)
        await intake.offer(await self.upkeep.recovery.claim(room))

    async def _part(self, what: str, action: Callable[[], Awaitable[Any]]) -> None:
        """One part of the beat; whatever it raises is logged, and the beat goes on (a worker
        whose beat stopped would have its requests claimed while it runs them)."""
        try:
            await action()
        except aioredis.RedisError as e:
            log.warning("could not %s: %s", what, e)
        except Exception:
            log.exception("could not %s", what)

    async def beat(self) -> None:
        """Announce this worker: its status key, and its place among the model's live
        workers unless it is draining."""
        name = self.worker.name
        status = self.worker.status()
        summary = self.worker.prefixes()
        beat = replace(status, draining=self.draining, at=round(time.time(), 3),
                       tokens_per_s=self._rate(status.generated_tokens),
                       prefix_pages=len(summary.digests), prefix_version=summary.version)
        workers = self.keys.workers(self.worker.model)
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(self.keys.worker(name), beat.to_json(), ex=self.ttl_s)
        if self.draining:
            pipe.zrem(workers, name)
        else:
            pipe.zadd(workers, {name: time.time() + self.ttl_s})
            pipe.expire(workers, self.ttl_s * 3)
        changed = summary.version != self._written
        if changed:
            pipe.set(self.keys.prefixes(name), summary.encode(), ex=self.ttl_s)
        else:
            pipe.expire(self.keys.prefixes(name), self.ttl_s)

        async def send() -> None:
            self._written = None
            replies = await pipe.execute()
            # Written, or still there: otherwise (expired, Redis restarted) write it next beat.
            self._written = summary.version if changed or replies[-1] else None

        await self._part("send the heartbeat", send)

    def _rate(self, generated: int) -> float:
        """Tokens generated per second since the previous beat."""
        now = time.monotonic()
        then, before = self._last
        self._last = (now, generated)
        return round((generated - before) / (now - then), 2) if now > then else 0.0

    async def leave(self) -> None:
        name = self.worker.name
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(self.keys.worker(name))
        pipe.delete(self.keys.prefixes(name))  # another slot: its own command
        pipe.zrem(self.keys.workers(self.worker.model), name)
        await self._part("announce the shutdown", pipe.execute)
