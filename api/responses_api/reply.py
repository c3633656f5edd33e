"""A Responses API reply from its one choice's token events: streamed as OpenAI's typed events
(`response.created` .. `response.completed`, each with its `sequence_number`), or whole as one
Response object. Both walk the same steps through one `Output` (`api.responses_api.render`),
and both store the finished response (with `store`) before the client hears it ended, so a
follow-up sent the moment it has is found on any replica.

A worker's error ends a stream with `response.failed` (its `error` set) and a JSON reply with
the same HTTP error as chat; a failed or abandoned reply is not stored.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from sse_starlette import ServerSentEvent

from api.choices import Choice
from api.errors import APIError
from api.replies.collected import worker_error
from api.replies.merge import close_all, entries
from api.responses_api.render import Event, Output, ResponseMeta, usage
from api.tools.parse import ParsedCall
from shared.messages import Error, Finish, Tokens

# Called with the finished Response object before the client is told it ended.
Finished = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass(frozen=True)
class Ended:
    finish_reason: str


Step = str | ParsedCall | Ended | Error  # text, a tool call, the end, a failure


async def steps(choice: Choice) -> AsyncIterator[Step]:
    """The choice's text deltas and tool calls as they arrive, then how it ended."""
    async for _, entry in entries([choice]):
        if isinstance(entry, Tokens):
            text, _, calls = choice.on_tokens(entry)
        elif isinstance(entry, Finish):
            text, calls = choice.on_finish(entry)
        else:
            yield entry
            return
        if text:
            yield text
        for call in calls:
            yield call
        if choice.finish_reason is not None:
            if isinstance(entry, Tokens):  # a stop string ended it here
                await choice.generation.close("stop")  # tells the worker to stop now
            yield Ended(choice.finish_reason)
            return
    yield Error("result stream ended without a terminal entry", "server_error",
                "internal_error")


def _status(finish_reason: str) -> str:
    """A reply cut by max_output_tokens is incomplete; one cancelled (`abort`), cancelled."""
    return {"length": "incomplete", "abort": "cancelled"}.get(finish_reason, "completed")


class Reply:
    def __init__(self, choice: Choice, meta: ResponseMeta, prompt_tokens: int,
                 finished: Finished) -> None:
        self.choice = choice
        self.meta = meta
        self.prompt_tokens = prompt_tokens
        self.finished = finished
        self.output = Output(choice.generation.request_id)

    def _usage(self) -> dict[str, Any]:
        c = self.choice
        return usage(self.prompt_tokens, c.completion_tokens, c.cached_tokens)

    async def events(self) -> AsyncIterator[Event]:
        """Every event of the stream, unnumbered."""
        started = self.meta.response("in_progress", [])
        yield {"type": "response.created", "response": started}
        yield {"type": "response.in_progress", "response": started}
        async for step in steps(self.choice):
            if isinstance(step, str):
                for event in self.output.text(step):
                    yield event
            elif isinstance(step, ParsedCall):
                for event in self.output.call(step):
                    yield event
            elif isinstance(step, Ended):
                status = _status(step.finish_reason)
                for event in self.output.finish(status):
                    yield event
                final = self.meta.response(status, self.output.items, self._usage())
                try:
                    await self.finished(final)
                except APIError as e:  # not stored: the client must not count on it
                    for event in self._failed(e.code or "server_error", e.message):
                        yield event
                    return
                yield {"type": f"response.{status}", "response": final}
            else:
                for event in self._failed(step.code, step.message):
                    yield event

    def _failed(self, code: str, message: str) -> list[Event]:
        error = {"code": code, "message": message}
        return [{"type": "error", **error, "param": None},
                {"type": "response.failed", "response": self.meta.response(
                    "failed", self.output.items, self._usage(), error)}]

    async def whole(self) -> dict[str, Any]:
        """The Response object; a worker's error raises its HTTP error."""
        async for step in steps(self.choice):
            if isinstance(step, str):
                self.output.text(step)
            elif isinstance(step, ParsedCall):
                self.output.call(step)
            elif isinstance(step, Ended):
                status = _status(step.finish_reason)
                self.output.finish(status)
                final = self.meta.response(status, self.output.items, self._usage())
                await self.finished(final)
                return final
            else:
                raise worker_error(step)
        raise AssertionError("steps always end with Ended or Error")


async def numbered(events: AsyncIterator[Event], after: int) -> AsyncIterator[ServerSentEvent]:
    """Each event with its `sequence_number` (also its SSE id), those up to `after` left out."""
    n = -1
    async for event in events:
        n += 1
        if n > after:
            data = orjson.dumps({"type": event["type"], "sequence_number": n,
                                 **event}).decode()
            yield ServerSentEvent(data=data, event=event["type"], id=str(n), sep="\n")


async def unstored(_: dict[str, Any]) -> None:
    """The `Finished` of a reply with `store` false."""


async def closing(events: AsyncIterator[Event], choices: list[Choice]) -> AsyncIterator[Event]:
    """The events; however the stream ends (a client gone too), its choices close."""
    try:
        async for event in events:
            yield event
    finally:
        await close_all(choices)
