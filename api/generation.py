"""One request's life inside an API replica, owned by one object.

`start` registers the result subscription and enqueues the request; iterating yields result
entries until the terminal one; `close` runs exactly once however the request ended
(completion, client gone, error, timeout, shutdown). A request closed before its terminal entry
gets its abort key set, so the worker stops spending compute on it.
"""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis

from api.context import AppContext
from api.errors import APIError
from api.reader import Subscription
from shared.messages import Error, Finish, GenerateRequest, RequestState, ResultEntry


class Generation:
    def __init__(self, ctx: AppContext, request: GenerateRequest) -> None:
        self.ctx = ctx
        self.request = request
        self.finished = False  # nothing more will be read
        self._terminal_seen = False  # the worker ended the request itself
        self._sub: Subscription | None = None
        self._closed = False

    async def start(self) -> None:
        ctx, req = self.ctx, self.request
        keys, ttl = ctx.keys, ctx.settings.request_ttl_s
        self._sub = ctx.reader.open(req.id)
        pipe = ctx.clients.commands.pipeline(transaction=False)
        state_key = keys.state(req.id)
        pipe.hset(state_key, mapping={
            "state": RequestState.QUEUED,
            "model": req.model,
            "created": f"{req.created:.3f}",
            "prompt_tokens": str(len(req.prompt_ids)),
            "replica": ctx.replica,
        })
        pipe.expire(state_key, ttl)
        pipe.xadd(keys.requests, req.to_fields(),  # type: ignore[arg-type]
                  maxlen=ctx.settings.request_stream_maxlen, approximate=True)
        ctx.reader.queue_wake(pipe, ttl)
        try:
            await pipe.execute()
        except aioredis.RedisError as e:
            self._closed = True
            ctx.reader.close(self._sub)
            raise APIError(503, f"request queue unavailable: {e}", type="server_error",
                           code="redis_unavailable", headers={"Retry-After": "1"}) from e

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> ResultEntry:
        if self.finished or self._sub is None:
            raise StopAsyncIteration
        remaining = self.request.deadline - time.time()
        try:
            entry = await asyncio.wait_for(self._sub.queue.get(), timeout=max(remaining, 0.0))
        except TimeoutError:
            self.finished = True  # close() will still abort the work
            return Error("request timed out", "timeout", "request_timeout")
        if isinstance(entry, Finish | Error):
            self.finished = True
            self._terminal_seen = True
        return entry

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._sub is not None:
            self.ctx.reader.close(self._sub)
        if not self._terminal_seen:
            # Shielded: this often runs while the handler is being cancelled.
            await asyncio.shield(self._abort())

    async def _abort(self) -> None:
        key = self.ctx.keys.abort(self.request.id)
        try:
            await self.ctx.clients.commands.set(key, "1", ex=self.ctx.settings.request_ttl_s)
        except aioredis.RedisError:
            pass  # the request's deadline still ends it on the worker
