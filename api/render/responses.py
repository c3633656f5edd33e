"""The Responses API's renderer, of its one choice: streamed as OpenAI's typed events
(`response.created` .. `response.completed`, each with its `sequence_number` from 0), or whole
as one Response object; the output items are `Output`'s (`api.render.responses_output`). Both
store the finished response (with `store`: the `Finished` hook) before the client hears it
ended, so a follow-up sent the moment it has is found on any replica.

A worker's error ends a stream with `response.failed` (its `error` set) and a JSON reply with
the same HTTP error as chat; a failed or abandoned reply is not stored.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from sse_starlette import ServerSentEvent

from api.protocol.errors import APIError
from api.protocol.responses_body import ResponsesRequest
from api.protocol.tools.parse import ParsedCall
from api.render.chat import logprob_item
from api.render.choices import Choice, TokenLogprob
from api.render.renderer import Event
from api.render.responses_output import Output
from shared.messages import Error

RESPONSE_PREFIX = "resp_"
# Called with the finished Response object before the client is told it ended.
Finished = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass(frozen=True)
class ResponseMeta:
    """What every Response object of one reply repeats, from its body."""

    id: str
    created_at: int
    model: str
    body: ResponsesRequest

    def response(self, status: str, output: list[dict[str, Any]],
                 usage: dict[str, Any] | None = None, error: dict[str, Any] | None = None
                 ) -> dict[str, Any]:
        b = self.body
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "background": b.background, "error": error,
            "incomplete_details": incomplete, "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens, "model": self.model, "output": output,
            "parallel_tool_calls": b.parallel_tool_calls,
            "previous_response_id": b.previous_response_id, "reasoning": None,
            "service_tier": "default", "store": b.store, "temperature": b.temperature,
            "text": {"format": b.text.format.echo()}, "tool_choice": b.echo_tool_choice(),
            "tools": [t.model_dump() for t in b.tools or ()], "top_logprobs": b.top_logprobs,
            "top_p": b.top_p, "truncation": b.truncation, "usage": usage, "user": b.user,
            "metadata": b.metadata or {},
        }


def usage(input_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


async def unstored(_: dict[str, Any]) -> None:
    """The `Finished` of a reply with `store` false."""


def _status(finish_reason: str) -> str:
    """A reply cut by max_output_tokens is incomplete; one cancelled (`abort`), cancelled."""
    return {"length": "incomplete", "abort": "cancelled"}.get(finish_reason, "completed")


class ResponsesRenderer:
    """A `Renderer` of one choice as the Responses API."""

    first_number = 0

    def __init__(self, choice: Choice, meta: ResponseMeta, prompt_tokens: int,
                 finished: Finished) -> None:
        self.choice = choice
        self.meta = meta
        self.prompt_tokens = prompt_tokens
        self.finished = finished
        self.output = Output(choice.generation.request_id)
        self.status = "completed"  # until the choice ends otherwise
        self.failure: dict[str, Any] | None = None  # the failed Response, once it has failed

    @property
    def choices(self) -> list[Choice]:
        return [self.choice]

    def opening(self) -> list[Event]:
        started = self.meta.response("in_progress", [])
        return [{"type": "response.created", "response": started},
                {"type": "response.in_progress", "response": started}]

    def text(self, choice: Choice, text: str, logprobs: list[TokenLogprob]) -> list[Event]:
        return list(self.output.text(text, [logprob_item(t) for t in logprobs]))

    def calls(self, choice: Choice, calls: list[ParsedCall]) -> list[Event]:
        return [event for call in calls for event in self.output.call(call)]

    def end(self, choice: Choice, finish_reason: str) -> list[Event]:
        self.status = _status(finish_reason)
        return list(self.output.finish(self.status))

    async def final(self) -> list[Event]:
        final = self._response()
        try:
            await self.finished(final)
        except APIError as e:  # not stored: the client must not count on it
            return self._failed(e.code or "server_error", e.message)
        return [{"type": f"response.{self.status}", "response": final}]

    def failed(self, error: Error) -> list[Event]:
        return self._failed(error.code, error.message)

    async def whole(self) -> dict[str, Any]:
        final = self._response()
        await self.finished(final)
        return final

    def sse(self, event: Event, number: int) -> ServerSentEvent:
        assert isinstance(event, dict)  # every event of this API is an object
        data = orjson.dumps({"type": event["type"], "sequence_number": number, **event})
        return ServerSentEvent(data=data.decode(), event=event["type"], id=str(number),
                               sep="\n")

    def _response(self) -> dict[str, Any]:
        return self.meta.response(self.status, self.output.items, self._usage())

    def _usage(self) -> dict[str, Any]:
        c = self.choice
        return usage(self.prompt_tokens, c.completion_tokens, c.cached_tokens)

    def _failed(self, code: str, message: str) -> list[Event]:
        error = {"code": code, "message": message}
        self.failure = self.meta.response("failed", self.output.items, self._usage(), error)
        return [{"type": "error", **error, "param": None},
                {"type": "response.failed", "response": self.failure}]
