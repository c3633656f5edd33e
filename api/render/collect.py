"""The collecting driver: any renderer over the walk to its end, as one JSON object, unless the
client hangs up first (then closing the choices aborts their work). A failure is the HTTP
error of a JSON reply (`worker_error`)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response

from api.protocol.errors import APIError
from api.protocol.http import json_response
from api.render.renderer import Renderer
from api.render.walk import Calls, End, Text, close_all, walk
from shared.messages import Error

# Worker error codes that are the client's fault or a capacity problem, not a server bug.
ERROR_STATUS = {
    "context_length": 400,
    "invalid_grammar": 400,
    "model_not_found": 404,
    "invalid_lora_adapter": 400,  # an adapter the worker could not load (the problem named)
    "queue_timeout": 503,
    "no_worker": 503,
    "worker_shutdown": 503,
    "server_shutdown": 503,
    "request_timeout": 504,
    "redis_unavailable": 503,
    "sampling_failed": 400,
}

T = TypeVar("T")


async def unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T | None:
    """A client waiting for one JSON reply may hang up too: watch the ASGI disconnect message
    while `work` collects it, and stop (closing the choices then aborts their work) as soon as
    it comes. None: nobody is listening for this reply."""
    collecting = asyncio.ensure_future(work)
    gone = asyncio.create_task(_disconnected(request))
    try:
        await asyncio.wait((collecting, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not collecting.done():
            collecting.cancel()
            # Ended before it returns: `cancel` only asks, and reading the result of a task
            # still running raised InvalidStateError when a client hung up.
            await asyncio.wait([collecting])
    if collecting.cancelled():
        return None
    return collecting.result()


async def reply(request: Request, renderer: Renderer, headers: dict[str, str]) -> Response:
    """The JSON reply once every choice has ended (its choices closed however it ends); an
    empty object to a client that has gone."""
    try:
        whole = await unless_disconnected(request, collect(renderer))
    finally:
        await close_all(renderer.choices)
    return json_response(whole or {}, headers=headers)


async def collect(renderer: Renderer) -> dict[str, Any]:
    """The renderer's whole object, its stream events dropped; a failure raises its HTTP
    error."""
    async for step in walk(renderer.choices):
        if isinstance(step, Text):
            renderer.text(step.choice, step.text, step.logprobs)
        elif isinstance(step, Calls):
            renderer.calls(step.choice, step.calls)
        elif isinstance(step, End):
            renderer.end(step.choice, step.finish_reason)
        else:
            raise worker_error(step.error)
    return await renderer.whole()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def worker_error(entry: Error) -> APIError:
    """A worker's (or this side's) error entry as the HTTP error of a JSON reply."""
    status = ERROR_STATUS.get(entry.code, 500)
    return APIError(status, entry.message, type=entry.type, code=entry.code,
                    headers={"Retry-After": "1"} if status == 503 else None)
