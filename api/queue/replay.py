"""Resumable streams: any replica can replay a request's SSE stream from its result stream.

Every SSE event of a reply carries `id: <n>`, its ordinal. The events are a pure function of
the tokens (one event per token at most, in order: api/render/walk.py takes entries apart,
so the record's chunks render as the feed's steps did), so a replica that reads the same
entries from the start and renders them the same way produces the same events with the same
ids. `GET /v1/requests/{id}/stream` with `Last-Event-ID: n` does exactly that and sends the
events after `n`: no gap, no duplicate, the same text as an unbroken stream, whichever replica
served the start. The record trails what the first stream showed by up to a chunk
(worker/broker/record.py), so a resumed running stream comes in chunks. What rendering needs (the
reply's `ReplySpec`: its kind, stop strings, echo prefix, ...) is stored with the deadlines
as a `StreamView` in the request's hash when the stream starts.

A stream with several choices interleaves their entries in arrival order, which a replay
cannot reproduce, so only single-choice streams are resumable.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any

import orjson
import redis.asyncio as aioredis

from api.protocol.errors import SHUTDOWN_ERROR, moved
from api.protocol.reply_spec import Kind, ReplySpec
from api.queue.context import AppContext
from api.queue.metrics import abort_cause
from shared.aborts import stage_aborts
from shared.messages import (
    Error,
    Finish,
    RequestField,
    RequestState,
    ResultEntry,
    decode_result,
    expand,
    no_worker,
    queue_timeout,
)
from shared.redis_conn import stream_reply

# A resumed stream polls its one key without blocking: a blocking read would hold one of the
# replica's few blocking connections (its main reader's) per resumed stream, and its key may
# sit in another cluster slot, so it cannot join the replica's multiplexed read.
POLL_S = 0.05
READ_COUNT = 64


# The stored keys added after the first version, each at the value that a replica which
# predates it renders with: a key at that value is left out, so such a replica (a rolling
# upgrade) still reads the views that do not use it. queue_deadline 0: not recorded.
_LATER: dict[str, Any] = {"queue_deadline": 0.0, "continuous_usage": False, "tools": False,
                          "one_call": False, "skip_special_tokens": True, "responses": None,
                          "forced_function": None}

# The kind as stored: a completions reply was kind "text" before it was named for its endpoint,
# and is still stored so, so that a replica of an older version can resume a stream this one
# wrote; "completions" is read too, should a later version store it.
_STORED_KIND: dict[Kind, str] = {"chat": "chat", "completions": "text"}
_KIND: dict[str, Kind] = {"chat": "chat", "text": "completions", "completions": "completions"}


@dataclass(frozen=True)
class StreamView:
    """A single-choice stream's `ReplySpec` and deadlines, as stored in its request's hash.
    Replicas of other versions read what this one writes and the reverse, so the JSON's keys
    and their meaning do not change."""

    spec: ReplySpec
    deadline: float
    queue_deadline: float
    # A Responses API stream's own rendering state (JSON, `api.endpoints.responses.resume`): it
    # resumes as that API's events, not as chat chunks.
    responses: str | None = None

    def to_json(self) -> str:
        s = self.spec
        data = {"kind": _STORED_KIND[s.kind], "base_id": s.base_id, "model": s.model,
                "created": s.created, "prompt_tokens": s.prompt_tokens, "prefix": s.prefixes[0],
                "stops": s.stops, "include_stop": s.include_stop, "include_usage": s.include_usage,
                "deadline": self.deadline, "queue_deadline": self.queue_deadline,
                "continuous_usage": s.continuous_usage, "tools": s.tools,
                "one_call": s.one_call, "skip_special_tokens": s.skip_special_tokens,
                "responses": self.responses, "forced_function": s.forced_function}
        return orjson.dumps({k: v for k, v in data.items()
                             if k not in _LATER or v != _LATER[k]}).decode()

    @classmethod
    def from_json(cls, raw: str | bytes) -> StreamView:
        # Keys a newer replica added are not this one's to render: they are not read, which
        # beats failing the resume.
        data = {**_LATER, **orjson.loads(raw)}
        spec = ReplySpec(
            kind=_KIND[data["kind"]], base_id=data["base_id"], model=data["model"],
            created=data["created"], prompt_tokens=data["prompt_tokens"],
            prefixes=(data["prefix"],), stops=tuple(data["stops"]),
            include_stop=data["include_stop"], include_usage=data["include_usage"],
            continuous_usage=data["continuous_usage"], tools=data["tools"],
            one_call=data["one_call"], skip_special_tokens=data["skip_special_tokens"],
            forced_function=data["forced_function"])
        return cls(spec, data["deadline"], data["queue_deadline"], data["responses"])


class Replay:
    """A request's result entries read straight from Redis, from the first one: the source of
    a resumed stream (in place of a live `Generation`). It keeps the request's deadlines as
    the first stream did: no worker by the queue deadline ends it with `queue_timeout`, or
    `no_worker` when its model has had no live worker that long."""

    def __init__(self, ctx: AppContext, request_id: str, view: StreamView,
                 cancels: bool = True) -> None:
        self.ctx = ctx
        self._cancels = cancels  # whether a client leaving cancels the request
        self._id = request_id
        self.view = view
        self._key = ctx.keys.out(request_id)
        self._last: bytes | str = "0-0"
        self._buffer: list[ResultEntry] = []
        self._ended = False
        self._started = False  # some entry was read
        self._failed: Error | None = None
        # When its record last grew, or the resume began: the start of a wait for a worker
        # that may be gone (api/queue/worker_watch.py).
        self._heard = time.time()
        ctx.live.add_resume(self)

    @property
    def request_id(self) -> str:
        return self._id

    def fail(self, error: Error) -> None:
        """End the stream here: `error` comes next."""
        self._failed = error

    def stop_here(self) -> None:
        """The replica stops; the request goes on, and a chat or completions client resumes
        again elsewhere (a Responses API stream ends with the shutdown error)."""
        self.fail(moved(self._id) if self.view.responses is None else SHUTDOWN_ERROR)

    def __aiter__(self) -> Replay:
        return self

    async def __anext__(self) -> ResultEntry:
        while not self._buffer:
            if self._ended:
                raise StopAsyncIteration
            if self._failed is not None:
                self._buffer.append(self._failed)
                break
            late = await self._past_deadline()
            if late is not None:
                self._buffer.append(late)
                break
            try:
                reply = await self.ctx.clients.commands.xread({self._key: self._last},
                                                              count=READ_COUNT)
            except aioredis.RedisError:
                self._buffer.append(Error("the result stream is unavailable", "server_error",
                                          "redis_unavailable"))
                break
            for _, entries in stream_reply(reply):
                for entry_id, fields in entries:
                    self._last = entry_id
                    self._started = True
                    self._heard = time.time()
                    self._buffer.extend(expand(decode_result(fields)))
            if not self._buffer:
                await asyncio.sleep(POLL_S)
        entry = self._buffer.pop(0)
        if isinstance(entry, Finish | Error):
            self._end()
        return entry

    async def _past_deadline(self) -> Error | None:
        now = time.time()
        if now > self.view.deadline:
            await self._abort(abort_cause("request_timeout"))
            return Error("request timed out", "timeout", "request_timeout")
        model, workers = self.view.spec.model, self.ctx.workers
        if workers.abandoned(model, self._heard, self.ctx.settings.queue_timeout_s):
            await self._abort(abort_cause("no_worker"))
            return no_worker(model)
        if self._started or not self.view.queue_deadline or now <= self.view.queue_deadline:
            return None
        try:
            state = await self.ctx.clients.commands.hget(self.ctx.keys.state(self._id),
                                                       RequestField.STATE)
        except aioredis.RedisError:
            return None
        if state not in (None, RequestState.QUEUED.encode()):
            self._started = True  # a worker has it: only the full deadline applies now
            return None
        if workers.gone_since(model) is not None:
            await self._abort(abort_cause("no_worker"))
            return no_worker(model)
        await self._abort(abort_cause("queue_timeout"))
        return queue_timeout(model)

    def _end(self) -> None:
        self._ended = True
        self._buffer.clear()
        self.ctx.live.remove_resume(self)

    async def close(self, outcome: str | None = None) -> None:
        """A client leaving a resumed stream cancels the request, as on its first stream."""
        if self._ended:
            return
        self._end()
        if self._cancels:
            await self._abort(abort_cause(outcome))

    async def _abort(self, cause: str) -> None:
        self.ctx.metrics.aborts.labels(cause).inc()
        pipe = self.ctx.clients.commands.pipeline(transaction=False)
        stage_aborts(pipe, self.ctx.keys, [self._id], self.ctx.settings.request_ttl_s)
        with contextlib.suppress(aioredis.RedisError):
            await pipe.execute()


def last_event_id(header: str | None) -> int:
    try:
        return max(int(header or 0), 0)
    except ValueError:
        return 0

