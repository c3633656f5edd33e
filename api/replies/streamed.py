"""A reply as server-sent events: a role chunk, then text (and tool-call) deltas as tokens
arrive, each choice's finish, the usage if asked, and `[DONE]`. Each event is numbered, so a
client that lost the connection can resume after the last one it saw (`api.resume`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi.responses import Response
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.background import BackgroundTask

from api.choices import Choice
from api.errors import error_body
from api.replies.merge import close_all, entries, logprobs_of, usage_of
from api.reply_spec import ReplySpec, UsageMode
from api.responses import ReplyHeader
from api.tools.parse import ParsedCall
from shared.messages import Error, Finish, Tokens


class Ping(ServerSentEvent):
    """The keep-alive: a comment line, with no blank line after it. A blank line ends an
    event, and a client that keeps the last event id across events (as the SSE spec says, and
    the official openai client does) would take a comment and a blank line after a numbered
    event for an event of its own, with that id and no data, and fail to parse it. Without
    the blank line the comment joins the next event, which ignores it."""

    def encode(self) -> bytes:
        return b": ping\n"


def event_stream(events: AsyncIterator[ServerSentEvent], headers: dict[str, str],
                 background: BackgroundTask | None, ping_s: float) -> EventSourceResponse:
    """The SSE response; a keep-alive every `ping_s` (`REDSERVE_SSE_PING_S`), for proxies
    that close a connection idle for longer: a stream waiting for a worker stays open."""
    return EventSourceResponse(events, headers=headers, sep="\n", ping=ping_s,
                               ping_message_factory=Ping,
                               background=background)


def sse(choices: list[Choice], spec: ReplySpec, headers: dict[str, str], after: int,
        ping_s: float) -> Response:
    return event_stream(
        _numbered(_stream(choices, spec.header, spec.prompt_tokens, spec.usage_mode), after),
        headers, BackgroundTask(close_all, choices), ping_s)


async def _numbered(events: AsyncIterator[ServerSentEvent], after: int
                    ) -> AsyncIterator[ServerSentEvent]:
    """Give each event its ordinal as `id:`, and skip those a resuming client has seen."""
    n = 0
    async for event in events:
        n += 1
        if n > after:
            event.id = str(n)
            yield event


def _sse_event(payload: dict[str, Any] | str) -> ServerSentEvent:
    data = payload if isinstance(payload, str) else orjson.dumps(payload).decode()
    return ServerSentEvent(data=data, sep="\n")


def _final_text(header: ReplyHeader) -> str | None:
    return None if header.kind == "chat" else ""


async def _stream(
    choices: list[Choice], header: ReplyHeader, prompt_tokens: int, mode: UsageMode
) -> AsyncIterator[ServerSentEvent]:
    offsets = {c.index: len(c.prefix) for c in choices}
    called = {c.index: 0 for c in choices}  # tool calls sent so far, per choice
    failed = False

    def _event(payload: dict[str, Any]) -> ServerSentEvent:
        if mode == "every":
            payload["usage"] = usage_of(choices, prompt_tokens)
        return _sse_event(payload)

    def _calls(choice: Choice, calls: list[ParsedCall]) -> ServerSentEvent:
        # Each call whole in one delta: name, id and all of its arguments.
        first = called[choice.index]
        called[choice.index] += len(calls)
        return _event(header.chunk(choice.index, None, tool_calls=[
            call.as_openai(first + k) for k, call in enumerate(calls)]))

    try:
        for c in choices:
            if header.kind == "chat":
                yield _event(header.chunk(c.index, "", role=True))
            elif c.prefix:
                yield _event(header.chunk(c.index, c.prefix))
        async for choice, entry in entries(choices):
            if choice.finish_reason is not None:
                continue  # ended here by a stop string; the worker's late entries are moot
            if isinstance(entry, Tokens):
                text, items, calls = choice.on_tokens(entry)
                if text or items:
                    yield _event(header.chunk(choice.index, text,
                                              logprobs=logprobs_of(header, items,
                                                                   offsets[choice.index])))
                    offsets[choice.index] += len(text)
                if calls:
                    yield _calls(choice, calls)
                if choice.finish_reason is not None:
                    yield _event(header.chunk(choice.index, _final_text(header),
                                              choice.finish_reason))
                    await choice.generation.close("stop")  # tells the worker to stop now
            elif isinstance(entry, Finish):
                tail, calls = choice.on_finish(entry)
                if tail:
                    yield _event(header.chunk(choice.index, tail))
                if calls:
                    yield _calls(choice, calls)
                yield _event(header.chunk(choice.index, _final_text(header),
                                          choice.finish_reason))
            elif isinstance(entry, Error):
                yield _sse_event(error_body(entry.message, entry.type, None, entry.code))
                failed = True
                break
        if mode != "off" and not failed:
            yield _sse_event(header.usage_chunk(usage_of(choices, prompt_tokens)))
        yield _sse_event("[DONE]")
    finally:
        await close_all(choices)
