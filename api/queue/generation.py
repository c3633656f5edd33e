"""One request's life inside an API replica, owned by one object.

`start` reserves a queue slot, registers the result subscription and enqueues the request;
iterating yields result entries until a terminal one; `close` runs exactly once however the
request ended (completion, client gone, error, timeout, slow client, shutdown, refusal), and
undoes what the request's `Phase` says it holds. A request closed before the worker ended it
gets its abort key set, so no compute is spent on it. With its tenant's rate limits, the
reply's first choice carries the reply's charge into the admission script, and every choice
reports to the reply's `Reservation` how much of its `max_tokens` it used as it closes (or is
refused), so that the reply is settled once, when it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from enum import Enum

import redis.asyncio as aioredis

from api.protocol.errors import SHUTDOWN_ERROR, APIError, moved
from api.queue.admission import Admitted
from api.queue.context import AppContext
from api.queue.limits.replies import headers as limit_headers
from api.queue.limits.replies import rate_limited
from api.queue.limits.reservation import Reservation
from api.queue.metrics import ReplyTimer, abort_cause
from api.queue.replay import StreamView
from api.queue.subscription import Subscription
from api.queue.trace import ReplyTrace
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
    no_worker,
    queue_timeout,
)

log = logging.getLogger("redserve.api")

CLOSED = Error("the request was closed", "server_error", "closed")
_NO_SPAN = contextlib.nullcontext()
LOST_ADMISSION = Error("the request was lost when Redis failed over (its primary acknowledged "
                       "it and never passed it on); retry it", "server_error",
                       "redis_unavailable")
# How often a request waiting for its next entry looks whether its model still has a live
# worker (the view itself is refreshed every second: api/queue/worker_watch.py).
WATCH_S = 1.0


class Phase(Enum):
    """How far a request got in this replica: all its one cleanup (`Generation.close`) needs
    to know to undo what it holds. It only moves down this list, then to CLOSED."""

    CREATED = "created"  # nothing registered, nothing written
    OPENED = "opened"  # its result subscription open and in `live`; its hash being written
    ENQUEUED = "enqueued"  # its hash written: it may be on the model's stream
    STARTED = "started"  # a worker has it: it answered, or it left the queue
    WORKER_ENDED = "worker_ended"  # the worker wrote its terminal entry: nothing to abort
    REFUSED = "refused"  # admission turned it away (from ENQUEUED): on no stream
    CLOSED = "closed"


class Generation:
    def __init__(self, ctx: AppContext, request: GenerateRequest, siblings: int = 0,
                 view: StreamView | None = None, streaming: bool = False,
                 reservation: Reservation | None = None, charges: bool = False,
                 trace: ReplyTrace | None = None) -> None:
        self.ctx = ctx
        self.trace = trace  # its reply's, when traced (api/queue/trace.py)
        self._admitted_at = 0.0  # when the admission script queued it (for the trace)
        self.request = request
        self.siblings = siblings  # other choices of the same reply: `<id>-1` .. `<id>-<n-1>`
        self.view = view  # set for a resumable stream
        self.streaming = streaming  # answered with SSE (recorded for `redserve inspect`)
        self.outcome: str | None = None  # how it ended, once it has
        self.timer: ReplyTimer | None = None  # its reply's timings, once every choice started
        self._phase = Phase.CREATED
        self._sub: Subscription | None = None  # from OPENED on
        self._aborting: asyncio.Task[None] | None = None
        self._moved = False  # its replica stopped and its stream is to be resumed elsewhere
        self.reservation = reservation  # the reply's, under its tenant's rate limits
        self.charges = charges  # this choice's admission charges the reply's reservation
        # Tokens the worker generated, as far as this replica has seen; None until a token or
        # a finish came.
        self._produced: int | None = None
        self._settling: asyncio.Future[None] | None = None
        # When a worker was last heard of for this request (an entry), or it was admitted:
        # the start of a wait for a worker that may be gone (`_next`).
        self._heard = time.time()
        # The reader's count of outages and failovers when this request was admitted: after
        # one, a request still queued looks whether the new primary has it (`_lost`).
        self._recoveries = ctx.reader.recoveries
        self._looks_lost = False

    @property
    def request_id(self) -> str:
        return self.request.id

    async def start(self) -> None:
        if self.ctx.live.draining:
            self.ctx.metrics.rejected.labels("draining").inc()
            raise APIError(503, "this replica is shutting down; retry on another",
                           type="server_error", code="draining", headers={"Retry-After": "1"})
        if not self.ctx.reader.connected:
            self.ctx.metrics.rejected.labels("redis_unavailable").inc()
            raise APIError(503, "this replica is waiting for Redis; retry shortly",
                           type="server_error", code="redis_unavailable",
                           headers={"Retry-After": "1"})
        self._sub = self.ctx.reader.open(self.request.id)
        self.ctx.live.add(self)
        self._phase = Phase.OPENED
        charge = self.reservation.charge if self.reservation and self.charges else None
        try:
            with _NO_SPAN if self.trace is None else self.trace.admit(self.request.id):
                await self._write_hash()
                self._phase = Phase.ENQUEUED  # from here on it may be on the stream (even if
                # the script fails)
                admitted = await self.ctx.admission.try_enqueue(self.request, charge)
            self._admitted_at = time.time()
        except aioredis.RedisError as e:
            self.outcome = "redis_unavailable"
            await self.close()
            raise _unavailable(self.ctx, e) from e
        bucket = admitted.limits
        if admitted.refused is None and (bucket is None or bucket.refused is None):
            if self.reservation is not None and bucket is not None:
                self.reservation.bucket = bucket  # charged
            return
        raise await self._refuse(admitted)

    async def _write_hash(self) -> None:
        """The request's hash, written before it is on the stream: a worker may take it at
        once."""
        ctx, req = self.ctx, self.request
        state_key = ctx.keys.state(req.id)
        record = RequestHash(
            state=RequestState.QUEUED, model=req.model, tenant=req.tenant, created=req.created,
            prompt_tokens=len(req.prompt_ids), replica=ctx.replica,
            choices=max(self.siblings, 1), streaming=self.streaming,
            stream=None if self.view is None else self.view.to_json(),
            trace=None if self.trace is None else self.trace.traceparent)
        pipe = ctx.clients.commands.pipeline(transaction=False)
        pipe.hset(state_key, mapping=record.to_fields())  # type: ignore[arg-type]
        pipe.expire(state_key, ctx.settings.request_ttl_s)
        await pipe.execute()

    async def _refuse(self, admitted: Admitted) -> APIError:
        """Admission turned it away: it closes (nothing of it stays), and the error says why."""
        ctx, req, bucket = self.ctx, self.request, admitted.limits
        self._phase = Phase.REFUSED
        if bucket is not None and bucket.refused is not None:
            ctx.metrics.rejected.labels("rate_limited").inc()
            ctx.metrics.rate_limited.labels(req.tenant, bucket.refused).inc()
            await self.close()
            return rate_limited(bucket, req.model, req.tenant)
        ctx.metrics.rejected.labels("queue_full").inc()
        if self.reservation is not None:
            self.reservation.refused()
        await self.close()
        if bucket is None and self.reservation is not None:
            bucket = self.reservation.bucket  # a later choice: the first one's charge
        return APIError(429, admitted.refused or "", type="rate_limit_exceeded",
                        code="queue_full", headers={"Retry-After": "1", **(
                            {} if bucket is None else limit_headers(bucket))})

    async def _settled(self, used: int) -> None:
        """Tell the reply's reservation this choice is over, having used `used` of its
        `max_tokens`. A task, shielded: this often runs while the handler is being
        cancelled, and the reply's last choice settles it."""
        if self.reservation is not None:
            unused = max(self.request.params.max_tokens - used, 0)
            self._settling = asyncio.ensure_future(
                self.reservation.ended(unused, self._produced is not None))
            await asyncio.shield(self._settling)

    def fail(self, error: Error) -> None:
        """End the request from this side: its client gets `error` next, and the worker is
        told now, not once the client gets round to reading (it may be stuck behind)."""
        if self._sub is None or self._sub.ended:
            return
        self._sub.fail(error)
        self._aborting = asyncio.create_task(self._abort(abort_cause(error.code)))

    def stop_here(self) -> None:
        """This replica stops. A resumable stream (one choice, chat or completions) ends with
        the error that says where to resume it, and its worker goes on; any other reply cannot
        be resumed, so it fails and its worker stops."""
        if self.view is None or self.view.responses is not None:
            self.fail(SHUTDOWN_ERROR)
        elif self._sub is not None and not self._sub.ended:
            self._moved = True
            self._sub.fail(moved(self.request.id))

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> ResultEntry:
        sub = self._sub
        if self.outcome is not None or sub is None:
            raise StopAsyncIteration
        entry = await self._next(sub)
        if isinstance(entry, Finish | Error):
            self.outcome = entry.finish_reason if isinstance(entry, Finish) else entry.code
        return entry

    async def _next(self, sub: Subscription) -> ResultEntry:
        """The next entry from the worker (or from `fail`), or a timeout of this side's: the
        request's deadline, its queue deadline while no worker took it, or `no_worker` once
        its model has had no live worker for the queue deadline (api/queue/worker_watch.py): a
        wait with no entry wakes every `WATCH_S` to look."""
        model, ctx = self.request.model, self.ctx
        while True:
            if not sub.queue.empty():  # the common case while tokens flow: no timer needed
                return self._took(sub, sub.queue.get_nowait())
            now = time.time()
            queued = self._phase is Phase.ENQUEUED  # until a worker is seen to have it
            until = self.request.queue_deadline if queued else self.request.deadline
            wake = min(until, now + WATCH_S)
            try:
                entry = await asyncio.wait_for(sub.queue.get(), max(wake - now, 0.0))
            except TimeoutError:
                if ctx.workers.abandoned(model, self._heard, ctx.settings.queue_timeout_s):
                    return no_worker(model)
                if queued and await self._lost():
                    return LOST_ADMISSION
                if time.time() < until:
                    continue
                if not queued:
                    return Error("request timed out", "timeout", "request_timeout")
                if await self._still_queued():
                    return (no_worker(model) if ctx.workers.gone_since(model) is not None
                            else queue_timeout(model))
                self._phase = Phase.STARTED  # a worker has it: wait for the full deadline
                continue
            return self._took(sub, entry)

    def _took(self, sub: Subscription, entry: ResultEntry) -> ResultEntry:
        """`entry`, counted if it came from the worker (not from `fail`)."""
        self._heard = time.time()
        if self._phase is Phase.ENQUEUED:
            self._phase = Phase.STARTED
            if self.trace is not None and not sub.failed:
                self.trace.queue_wait(self.request.id, self._admitted_at, self._heard)
        if not sub.failed:
            if self.timer is not None:
                self.timer.entry(self.request.id, entry)
            self._count(entry)
            if isinstance(entry, Finish | Error) and self._phase is Phase.STARTED:
                self._phase = Phase.WORKER_ENDED
        return entry

    def _count(self, entry: ResultEntry) -> None:
        if isinstance(entry, Tokens) and entry.ids:
            self._produced = max(self._produced or 0, entry.index + len(entry.ids))
        elif isinstance(entry, Finish):
            self._produced = max(self._produced or 0, entry.completion_tokens)

    async def _lost(self) -> bool:
        """After an outage or a failover (the reader came back from one since this request
        was admitted), whether the primary lost its admission: its hash is gone, or it says
        queued while the model's entries hash has no entry for it and no result came. A
        worker that took it a moment ago clears both before it writes its state, so the
        request is lost only if it looks so twice, `WATCH_S` apart (a false alarm ends it with
        the same retryable error, and its worker stops at the abort)."""
        if self._recoveries == self.ctx.reader.recoveries:
            return False
        ctx, req = self.ctx, self.request
        pipe = ctx.clients.commands.pipeline(transaction=False)
        pipe.hget(ctx.keys.state(req.id), RequestField.STATE)
        pipe.hexists(ctx.keys.entries(req.model), req.id)
        pipe.exists(ctx.keys.out(req.id))
        try:
            state, entry, out = await pipe.execute()
        except aioredis.RedisError:
            return False  # the reader ends it if Redis stays away
        looks_lost = state is None or (state == RequestState.QUEUED.encode()
                                       and not entry and not out)
        lost, self._looks_lost = looks_lost and self._looks_lost, looks_lost
        if not looks_lost:
            self._recoveries = ctx.reader.recoveries
        return lost

    async def _still_queued(self) -> bool:
        state_key = self.ctx.keys.state(self.request.id)
        try:
            state = await self.ctx.clients.commands.hget(state_key, RequestField.STATE)
        except aioredis.RedisError:
            return True
        return state in (None, RequestState.QUEUED.encode())

    async def close(self, outcome: str | None = None) -> None:
        """The one way every request ends (finished, cancelled, disconnected, timed out,
        failed, refused), run once: what its phase holds is undone, and its reservation
        settled. `outcome`: how the caller ended it, when the worker did not (a stop
        string)."""
        phase, self._phase = self._phase, Phase.CLOSED
        if phase is Phase.CLOSED:
            return
        outcome = self.outcome or outcome
        if self._sub is not None:  # OPENED or later
            self._unsubscribe(self._sub, counted=phase is not Phase.REFUSED, outcome=outcome)
        if phase is Phase.REFUSED:
            with contextlib.suppress(aioredis.RedisError):
                await self.ctx.clients.commands.delete(self.ctx.keys.state(self.request.id))
        if phase in (Phase.ENQUEUED, Phase.STARTED):
            await self._stop_worker(outcome)
        else:
            await self._settled(self._produced or 0)

    def _unsubscribe(self, sub: Subscription, counted: bool, outcome: str | None) -> None:
        """Out of the reader and of `live`; counted as ended unless it was refused (counted
        as a rejection)."""
        ctx = self.ctx
        if counted:
            if outcome is None:
                ctx.metrics.disconnects.inc()
            ctx.metrics.finished.labels(self.request.model, outcome or "disconnect").inc()
            if self.timer is not None:
                self.timer.closed(self.request.id, outcome or "disconnect")
        ctx.reader.close(sub)
        sub.fail(CLOSED)  # wakes anyone still iterating, who then sees the end
        ctx.live.remove(self.request.id)

    async def _stop_worker(self, outcome: str | None) -> None:
        """A worker may hold it: abort it now, or, for a stream whose client went away, once
        its resume grace has passed unresumed; never for a stream this replica stopped
        serving (`stop_here`), which is resumed elsewhere."""
        ctx = self.ctx
        if self._moved:  # it runs on, for a client that resumes it elsewhere
            await self._mark_detached()
            await self._settled(self.request.params.max_tokens)
            return
        grace = ctx.settings.resume_grace_s
        if self._aborting is None and outcome is None and self.view is not None and grace:
            deferred = asyncio.create_task(self._abort_unless_resumed(grace))
            ctx.live.deferred.add(deferred)
            deferred.add_done_callback(ctx.live.deferred.discard)
            # It runs on, maybe for a client of another replica: it keeps its tokens.
            await self._settled(self.request.params.max_tokens)
            return
        if self._aborting is None:
            self._aborting = asyncio.create_task(self._abort(abort_cause(outcome)))
        await self._settled(self._produced or 0)
        # Shielded: this often runs while the handler is being cancelled.
        await asyncio.shield(self._aborting)

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
