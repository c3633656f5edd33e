"""A reply as one JSON object: every choice collected to its end, unless the client hangs up
first (then closing the choices aborts their work)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from fastapi import Request

from api.choices import Choice
from api.errors import APIError
from api.replies.merge import entries, logprobs_of, usage_of
from api.reply_spec import ReplySpec
from api.responses import ReplyHeader, WholeChoice
from shared.messages import Error, Finish, Tokens

# Worker error codes that are the client's fault or a capacity problem, not a server bug.
ERROR_STATUS = {
    "context_length": 400,
    "invalid_grammar": 400,
    "model_not_found": 404,
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


async def collect(choices: list[Choice], spec: ReplySpec) -> dict[str, Any]:
    """A chat or completions reply, whole."""
    return await _collect(choices, spec.header, spec.prompt_tokens)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(choices: list[Choice], header: ReplyHeader, prompt_tokens: int
                   ) -> dict[str, Any]:
    texts: dict[int, list[str]] = {c.index: [c.prefix] for c in choices}
    logprobs: dict[int, list[Any]] = {c.index: [] for c in choices}
    calls: dict[int, list[dict[str, Any]]] = {c.index: [] for c in choices}
    async for choice, entry in entries(choices):
        if choice.finish_reason is not None:
            continue
        if isinstance(entry, Tokens):
            text, items, made = choice.on_tokens(entry)
            texts[choice.index].append(text)
            logprobs[choice.index] += items
            calls[choice.index] += [c.as_openai() for c in made]
            if choice.finish_reason is not None:
                await choice.generation.close("stop")
        elif isinstance(entry, Finish):
            tail, made = choice.on_finish(entry)
            texts[choice.index].append(tail)
            calls[choice.index] += [c.as_openai() for c in made]
        else:
            raise worker_error(entry)
    missing = [c.index for c in choices if c.finish_reason is None]
    if missing:
        raise APIError(500, "result stream ended without a terminal entry", type="server_error")
    whole: list[WholeChoice] = [
        ("".join(texts[c.index]), c.finish_reason or "stop",
         logprobs_of(header, logprobs[c.index], len(c.prefix)), calls[c.index])
        for c in choices
    ]
    return header.whole(whole, usage_of(choices, prompt_tokens))


def worker_error(entry: Error) -> APIError:
    """A worker's (or this side's) error entry as the HTTP error of a JSON reply."""
    status = ERROR_STATUS.get(entry.code, 500)
    return APIError(status, entry.message, type=entry.type, code=entry.code,
                    headers={"Retry-After": "1"} if status == 503 else None)
