"""Background responses (`background: true`): the create call stores the response `queued` and
answers at once; the generation goes on without a client, and its end is stored.

Who writes the end. The admitting replica reads the request's tokens in a task of its own and
stores the finished response, as a stream would. That replica may die first; so the end is
also derivable from the request's result stream (`Keys.out`), which the worker writes and
which outlives any replica: a `GET` (or cancel) on any replica that finds the response still
`queued` and the result stream ended renders the whole record through the same renderer and
stores that. Both writers render the same entries the same way, so they store the same object.
Limit: a response whose result stream expired (`finished_ttl_s` after it ended) before anyone
read it, with its admitting replica dead, stays `queued` until its own TTL.

The request's `StreamView` (with the body) is stored as for a stream, so a background
response can also be followed with `GET /v1/responses/{id}?stream=true`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, cast

import redis.asyncio as aioredis

from api.endpoints.common import known
from api.endpoints.responses import store
from api.protocol.errors import APIError
from api.protocol.responses_body import ResponsesRequest
from api.queue.context import AppContext, Live
from api.queue.replay import StreamView
from api.render.choices import reply_choice
from api.render.responses import RESPONSE_PREFIX, ResponseMeta, ResponsesRenderer
from api.render.stream import events
from api.render.walk import close_all
from shared.aborts import stage_aborts
from shared.messages import (
    RequestField,
    ResponsesStream,
    ResultEntry,
    decode_result,
    expand,
    is_terminal,
)
from shared.redis_conn import StreamEntries

log = logging.getLogger("redserve.api")

# How long a cancel waits for the worker to end the request before storing it cancelled.
CANCEL_WAIT_S = 5.0
_POLL_S = 0.05

def spawn(live: Live, reply: ResponsesRenderer) -> None:
    """Read the reply to its end in the background (see the module's docstring); `live`
    holds the task (the loop keeps only a weak reference) and the shutdown waits for it."""
    task = asyncio.create_task(_finish(reply))
    live.background.add(task)
    task.add_done_callback(live.background.discard)


async def _finish(reply: ResponsesRenderer) -> None:
    """The reply's events to the end; a failure is stored as `failed` (its `finished` stores
    the rest)."""
    try:
        async for _ in events(reply):
            pass
        if reply.failure is not None:
            with contextlib.suppress(APIError):
                await reply.finished(reply.failure)
    except Exception:  # a task's error has nobody else to go to
        log.exception("background response %s did not finish", reply.meta.id)
    finally:
        await close_all(reply.choices)


class _Recorded:
    """A request's ended result stream, read whole: the source of a derived response."""

    def __init__(self, request_id: str, entries: list[ResultEntry]) -> None:
        self._id = request_id
        self._entries = entries

    @property
    def request_id(self) -> str:
        return self._id

    async def __aiter__(self) -> Any:
        for entry in self._entries:
            yield entry

    async def close(self, outcome: str | None = None) -> None:
        """Nothing runs: the request has ended."""


async def settle(ctx: AppContext, stored: store.Stored, tenant: str) -> dict[str, Any]:
    """The stored response; one still `queued` whose request has ended is rendered from its
    result stream and stored first; one with tokens so far is shown `in_progress`."""
    response = stored.response
    if not response.get("background") or response["status"] in store.TERMINAL:
        return response
    request_id = store.request_id_of(response["id"])
    assert request_id is not None
    commands = ctx.clients.commands
    try:
        last = cast(StreamEntries, await commands.xrevrange(ctx.keys.out(request_id), count=1))
        if not last or not is_terminal(last[0][1]):  # a worker's tokens: it is running
            return {**response, "status": "in_progress"} if last else response
        raw_view = await commands.hget(ctx.keys.state(request_id), RequestField.STREAM)
        records = cast(StreamEntries, await commands.xrange(ctx.keys.out(request_id)))
    except aioredis.RedisError as e:
        raise store.unavailable(e) from e
    model = await known(ctx, response["model"])
    if raw_view is None or model is None:  # expired, or not this replica's model
        return response
    view = StreamView.from_json(cast(bytes, raw_view))
    assert view.responses is not None
    body = ResponsesRequest.model_validate(ResponsesStream.from_json(view.responses).body)
    entries = [e for _, fields in records for e in expand(decode_result(fields))]
    choice = reply_choice(view.spec, _Recorded(request_id, entries), model.codec)
    saved: list[dict[str, Any]] = []

    async def keep(final: dict[str, Any]) -> None:
        saved.append(await store.save_end(ctx, tenant, stored.input_items, final) or final)

    meta = ResponseMeta(RESPONSE_PREFIX + request_id, view.spec.created, view.spec.model, body)
    await _finish(ResponsesRenderer(choice, meta, view.spec.prompt_tokens, keep))
    return saved[0] if saved else response


async def cancel(ctx: AppContext, response_id: str, tenant: str) -> dict[str, Any]:
    """Abort a background response's request and answer it `cancelled`; 400 for one that is
    not a background response or has already ended."""
    stored = await store.load(ctx, response_id, tenant, "response_id")
    if not stored.response.get("background"):
        raise APIError(400, "Only responses created with background=true can be cancelled.",
                       param="response_id", code="not_background")
    response = await settle(ctx, stored, tenant)
    if response["status"] in store.TERMINAL:
        raise APIError(400, f"Cannot cancel a response with status {response['status']!r}.",
                       param="response_id", code="invalid_state")
    request_id = store.request_id_of(response_id)
    assert request_id is not None
    pipe = ctx.clients.commands.pipeline(transaction=False)
    stage_aborts(pipe, ctx.keys, [request_id], ctx.settings.request_ttl_s)
    try:
        await pipe.execute()
    except aioredis.RedisError as e:
        raise store.unavailable(e) from e
    deadline = asyncio.get_running_loop().time() + CANCEL_WAIT_S
    while asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(_POLL_S)
        stored = await store.load(ctx, response_id, tenant, "response_id")
        response = await settle(ctx, stored, tenant)
        if response["status"] in store.TERMINAL:
            return response
    # No worker ended it in time (none has it yet): it is cancelled all the same.
    cancelled = {**response, "status": "cancelled"}
    return await store.save_end(ctx, tenant, stored.input_items, cancelled) or cancelled
