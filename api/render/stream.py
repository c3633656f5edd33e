"""The streaming driver: any renderer over the walk, as server-sent events. Each event is
numbered (from the renderer's `first_number`), so a client that lost the connection can resume
after the last one it saw (`api.queue.replay`, `api.endpoints.responses.resume`): the events are a
pure function of the entries, so a replay numbers them alike and leaves out those up to `after`.
A stream whose replica stops while its request goes on ends with events that carry no number:
the client's last event id stays that of the last event it really got, where its resume starts.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi.responses import Response
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.background import BackgroundTask

from api.protocol.errors import MOVED_CODE
from api.render.renderer import Event, Renderer
from api.render.walk import Calls, End, Text, close_all, walk


class Ping(ServerSentEvent):
    """The keep-alive: a comment line, with no blank line after it. A blank line ends an
    event, and a client that keeps the last event id across events (as the SSE spec says, and
    the official openai client does) would take a comment and a blank line after a numbered
    event for an event of its own, with that id and no data, and fail to parse it. Without
    the blank line the comment joins the next event, which ignores it."""

    def encode(self) -> bytes:
        return b": ping\n"


@dataclass(frozen=True)
class Unnumbered:
    """An event sent without an id (the SSE spec: the client's last event id stays as it was)."""

    event: Event


def event_stream(events: AsyncIterator[ServerSentEvent], headers: dict[str, str],
                 background: BackgroundTask | None, ping_s: float) -> EventSourceResponse:
    """The SSE response; a keep-alive every `ping_s` (`REDSERVE_SSE_PING_S`), for proxies
    that close a connection idle for longer: a stream waiting for a worker stays open."""
    return EventSourceResponse(events, headers=headers, sep="\n", ping=ping_s,
                               ping_message_factory=Ping,
                               background=background)


def sse(renderer: Renderer, headers: dict[str, str], after: int, ping_s: float) -> Response:
    """The reply as an SSE response, the events numbered up to `after` left out; its choices
    close however it ends (a client gone too)."""
    return event_stream(_numbered(renderer, after), headers,
                        BackgroundTask(close_all, renderer.choices), ping_s)


async def events(renderer: Renderer) -> AsyncIterator[Event | Unnumbered]:
    """Every event of the reply: the opening, each walk event's, and the final ones (or the
    failure's)."""
    for event in renderer.opening():
        yield event
    async for step in walk(renderer.choices):
        if isinstance(step, Text):
            made = renderer.text(step.choice, step.text, step.logprobs)
        elif isinstance(step, Calls):
            made = renderer.calls(step.choice, step.calls)
        elif isinstance(step, End):
            made = renderer.end(step.choice, step.finish_reason)
        else:
            moved = step.error.code == MOVED_CODE
            for event in renderer.failed(step.error):
                yield Unnumbered(event) if moved else event
            return
        for event in made:
            yield event
    for event in await renderer.final():
        yield event


async def _numbered(renderer: Renderer, after: int) -> AsyncIterator[ServerSentEvent]:
    number = renderer.first_number - 1
    try:
        async for event in events(renderer):
            if isinstance(event, Unnumbered):
                sent = renderer.sse(event.event, number)
                yield ServerSentEvent(data=sent.data, event=sent.event, sep="\n")
                continue
            number += 1
            if number > after:
                yield renderer.sse(event, number)
    finally:
        await close_all(renderer.choices)
