"""One request's life inside an API replica, owned by one object.

`start` reserves a queue slot, registers the result subscription and enqueues the request;
iterating yields result entries until a terminal one; `close` runs exactly once however the
request ended (completion, client gone, error, timeout, slow client, shutdown). A request closed
before the worker ended it gets its abort key set, so no compute is spent on it. With its
tenant's rate limits, the reply's first choice carries the reply's charge into the admission
script, and every choice reports to the reply's `Reservation` how much of its `max_tokens` it
used as it closes (or is refused), so that the reply is settled once, when it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import redis.asyncio as aioredis

from api.context import AppContext
from api.errors import APIError
from api.limits.replies import headers as limit_headers
from api.limits.replies import rate_limited
from api.limits.reservation import Reservation
from api.metrics import ReplyTimer, abort_cause
from api.reader import Subscription
from api.resume import StreamView
from shared.aborts import stage_aborts
from shared.messages import (
    Error,
    Finish,
    GenerateRequest,
    RequestField,
    RequestHash,
    RequestState,
    ResultEntry,
    Tokens,
    queue_timeout,
)

log = logging.getLogger("redserve.api")

class Generation:
    def __init__(self, ctx: AppContext, request: GenerateRequest, siblings: int = 0,
                 view: StreamView | None = None, streaming: bool = False,
                 reservation: Reservation | None = None, charges: bool = False) -> None:
        self.ctx = ctx
        self.request = request
        self.siblings = siblings  # other choices of the same reply: `<id>-1` .. `<id>-<n-1>`
        self.view = view  # set for a resumable stream
        self.streaming = streaming  # answered with SSE (recorded for `redserve inspect`)
        self.outcome: str | None = None  # how it ended, once it has
        self.timer: ReplyTimer | None = None  # its reply's timings, once every choice started
        self._sub: Subscription | None = None
        self._started = False  # a worker has answered at least once
        self._worker_ended = False  # the worker wrote the terminal entry
        self._aborting: asyncio.Task[None] | None = None
        self._closed = False
        self._enqueued = False  # on the model's stream: a worker may hold it
        self.reservation = reservation  # the reply's, under its tenant's rate limits
        self.charges = charges  # this choice's admission charges the reply's reservation
        self._produced = 0  # tokens the worker generated, as far as this replica has seen
        self._answered = False  # a token or a finish came
        self._settling: asyncio.Future[None] | None = None

    @property
    def request_id(self) -> str:
        return self.request.id

    async def start(self) -> None:
        ctx, req = self.ctx, self.request
        if ctx.live.draining:
            ctx.metrics.rejected.labels("draining").inc()
            raise APIError(503, "this replica is shutting down; retry on another",
                           type="server_error", code="draining", headers={"Retry-After": "1"})
        keys, ttl = ctx.keys, ctx.settings.request_ttl_s
        self._sub = ctx.reader.open(req.id)
        ctx.live.add(self)
        # The hash first: a worker may take the request as soon as it is on the stream.
        pipe = ctx.clients.commands.pipeline(transaction=False)
        state_key = keys.state(req.id)
        record = RequestHash(
            state=RequestState.QUEUED, model=req.model, tenant=req.tenant, created=req.created,
            prompt_tokens=len(req.prompt_ids), replica=ctx.replica,
            choices=max(self.siblings, 1), streaming=self.streaming,
            stream=None if self.view is None else self.view.to_json())
        pipe.hset(state_key, mapping=record.to_fields())  # type: ignore[arg-type]
        pipe.expire(state_key, ttl)
        try:
            await pipe.execute()
            self._enqueued = True  # from here on it may be on the stream (if the script fails)
            charge = self.reservation.charge if self.reservation and self.charges else None
            admitted = await ctx.admission.try_enqueue(req, charge)
        except aioredis.RedisError as e:
            self.outcome = "redis_unavailable"
            await self.close()
            raise _unavailable(ctx, e) from e
        bucket = admitted.limits
        if admitted.refused is None and (bucket is None or bucket.refused is None):
            if self.reservation is not None and bucket is not None:
                self.reservation.bucket = bucket  # charged
            return
        self._closed = True  # never enqueued: nothing to end
        ctx.reader.close(self._sub)
        ctx.live.remove(req.id)
        with contextlib.suppress(aioredis.RedisError):
            await ctx.clients.commands.delete(state_key)
        if bucket is not None and bucket.refused is not None:
            ctx.metrics.rejected.labels("rate_limited").inc()
            ctx.metrics.rate_limited.labels(req.tenant, bucket.refused).inc()
            await self._settled()
            raise rate_limited(bucket, req.model, req.tenant)
        ctx.metrics.rejected.labels("queue_full").inc()
        if self.reservation is not None:
            self.reservation.refused()
        await self._settled()
        if bucket is None and self.reservation is not None:
            bucket = self.reservation.bucket  # a later choice: the first one's charge
        raise APIError(429, admitted.refused or "", type="rate_limit_exceeded",
                       code="queue_full", headers={"Retry-After": "1", **(
                           {} if bucket is None else limit_headers(bucket))})

    async def _settled(self, used: int = 0) -> None:
        """Tell the reply's reservation this choice is over, having used `used` of its
        `max_tokens`. A task, shielded: this often runs while the handler is being
        cancelled, and the reply's last choice settles it."""
        if self.reservation is not None:
            unused = max(self.request.params.max_tokens - used, 0)
            self._settling = asyncio.ensure_future(
                self.reservation.ended(unused, self._answered))
            await asyncio.shield(self._settling)

    def fail(self, error: Error) -> None:
        """End the request from this side: its client gets `error` next, and the worker is
        told now, not once the client gets round to reading (it may be stuck behind)."""
        if self._sub is None or self._sub.ended:
            return
        self._sub.fail(error)
        self._aborting = asyncio.create_task(self._abort(abort_cause(error.code)))

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> ResultEntry:
        sub = self._sub
        if self.outcome is not None or sub is None:
            raise StopAsyncIteration
        while True:
            if not sub.queue.empty():  # the common case while tokens flow: no timer needed
                entry = sub.queue.get_nowait()
                break
            waiting_in_queue = not self._started and time.time() < self.request.queue_deadline
            until = self.request.queue_deadline if waiting_in_queue else self.request.deadline
            try:
                entry = await asyncio.wait_for(sub.queue.get(), max(until - time.time(), 0.0))
                break
            except TimeoutError:
                if waiting_in_queue:
                    if await self._still_queued():
                        return self._end(queue_timeout(self.request.model))
                    self._started = True  # a worker has it: wait for the full deadline
                    continue
                return self._end(Error("request timed out", "timeout", "request_timeout"))
        self._started = True
        if not sub.failed:  # from the worker, not from here
            if self.timer is not None:
                self.timer.entry(self.request.id, entry)
            self._count(entry)
        if isinstance(entry, Finish | Error):
            self._worker_ended = not sub.failed
            return self._end(entry)
        return entry

    def _count(self, entry: ResultEntry) -> None:
        if isinstance(entry, Tokens) and entry.ids:
            self._produced = max(self._produced, entry.index + len(entry.ids))
            self._answered = True
        elif isinstance(entry, Finish):
            self._produced = max(self._produced, entry.completion_tokens)
            self._answered = True

    def _end(self, entry: Finish | Error) -> Finish | Error:
        self.outcome = entry.finish_reason if isinstance(entry, Finish) else entry.code
        return entry

    async def _still_queued(self) -> bool:
        state_key = self.ctx.keys.state(self.request.id)
        try:
            state = await self.ctx.clients.commands.hget(state_key, RequestField.STATE)
        except aioredis.RedisError:
            return True
        return state in (None, RequestState.QUEUED.encode())

    async def close(self, outcome: str | None = None) -> None:
        """`outcome`: how the caller ended it, when the worker did not (a stop string)."""
        if self._closed:
            return
        self._closed = True
        if self._sub is None:
            await self._settled()
            return  # never admitted: nothing to undo
        ctx = self.ctx
        outcome = self.outcome or outcome
        if outcome is None:
            ctx.metrics.disconnects.inc()
        ctx.metrics.finished.labels(self.request.model, outcome or "disconnect").inc()
        if self.timer is not None:
            self.timer.closed(self.request.id, outcome or "disconnect")
        ctx.reader.close(self._sub)
        # Wakes anyone still iterating, who then sees the end.
        self._sub.fail(Error("the request was closed", "server_error", "closed"))
        ctx.live.remove(self.request.id)
        if self._enqueued and not self._worker_ended:
            grace = ctx.settings.resume_grace_s
            if self._aborting is None and outcome is None and self.view is not None and grace:
                # A stream whose client went away: leave it running for a resume.
                deferred = asyncio.create_task(self._abort_unless_resumed(grace))
                ctx.live.deferred.add(deferred)
                deferred.add_done_callback(ctx.live.deferred.discard)
                # It runs on, maybe for a client of another replica: it keeps its tokens.
                await self._settled(self.request.params.max_tokens)
                return
            if self._aborting is None:
                self._aborting = asyncio.create_task(self._abort(abort_cause(outcome)))
            await self._settled(self._produced)
            # Shielded: this often runs while the handler is being cancelled.
            await asyncio.shield(self._aborting)
            return
        await self._settled(self._produced)

    async def _abort_unless_resumed(self, grace: float) -> None:
        await self._mark_detached()
        await asyncio.sleep(grace)
        try:
            resumed = await self.ctx.clients.commands.exists(
                self.ctx.keys.resumed(self.request.id))
        except aioredis.RedisError:
            resumed = 0
        if not resumed:
            await self._abort(abort_cause(None))

    async def _mark_detached(self) -> None:
        """Record in the hash that the stream's client went away (`redserve inspect` shows it
        as resumable). EXPIRE NX: a hash that expired meanwhile does not come back without
        a TTL."""
        state_key = self.ctx.keys.state(self.request.id)
        pipe = self.ctx.clients.commands.pipeline(transaction=False)
        detached = RequestHash.detached_at(time.time())
        pipe.hset(state_key, mapping=detached)  # type: ignore[arg-type]
        pipe.expire(state_key, self.ctx.settings.request_ttl_s, nx=True)
        with contextlib.suppress(aioredis.RedisError):
            await pipe.execute()

    async def _abort(self, cause: str) -> None:
        self.ctx.metrics.aborts.labels(cause).inc()
        keys, ttl = self.ctx.keys, self.ctx.settings.request_ttl_s
        pipe = self.ctx.clients.commands.pipeline(transaction=False)
        stage_aborts(pipe, keys, [self.request.id], ttl)
        # If no worker took it yet, its queue slot is free from now on.
        pipe.zrem(keys.queued(self.request.model), self.request.queue_member)
        with contextlib.suppress(aioredis.RedisError):
            await pipe.execute()  # if Redis is gone the worker still stops at the deadline


def _unavailable(ctx: AppContext, e: Exception) -> APIError:
    ctx.metrics.rejected.labels("redis_unavailable").inc()
    log.warning("request queue unavailable: %s", e)
    return APIError(503, "the request queue is unavailable; retry shortly", type="server_error",
                    code="redis_unavailable", headers={"Retry-After": "1"})
