"""What the chat and completions renderers share: OpenAI's `choices` objects, streamed as one
chunk per delta (each choice's text, tool calls and finish in chunks of their own, the usage if
asked, then `[DONE]`) or whole, numbered from 1 as SSE ids. Each format's subclass says only
what differs: its object names, and the shape of a delta, of logprobs and of a whole choice.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import orjson
from sse_starlette import ServerSentEvent

from api.protocol.errors import error_body
from api.protocol.reply_spec import ReplySpec
from api.protocol.tools.parse import ParsedCall
from api.render.choices import Choice, TokenLogprob
from api.render.renderer import Event
from shared.messages import Error

SYSTEM_FINGERPRINT = "redserve"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class ChoicesRenderer(ABC):
    """A chat or completions reply (a `Renderer`); its subclass gives the format's shapes."""

    ID_PREFIX: ClassVar[str]
    CHUNK: ClassVar[str]  # the `object` of a streamed chunk
    WHOLE: ClassVar[str]  # the `object` of a whole reply
    first_number = 1

    def __init__(self, choices: list[Choice], spec: ReplySpec, whole: bool) -> None:
        self._choices = choices
        self.spec = spec
        # A JSON reply keeps each choice's output for `whole`; a stream sends it and keeps
        # none (a long stream with logprobs would hold them all until it ended).
        self._whole = whole
        self._texts: dict[int, list[str]] = {c.index: [c.prefix] for c in choices}
        self._logprobs: dict[int, list[TokenLogprob]] = {c.index: [] for c in choices}
        self._calls: dict[int, list[ParsedCall]] = {c.index: [] for c in choices}
        self._called = {c.index: 0 for c in choices}  # calls sent so far, for their index

    @property
    def choices(self) -> list[Choice]:
        return self._choices

    # What each format says.

    @abstractmethod
    def opening(self) -> list[Event]: ...

    @abstractmethod
    def _delta(self, text: str | None, role: bool = False,
               tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """A chunk's choice, less its index, logprobs and finish_reason."""

    @abstractmethod
    def _chunk_logprobs(self, choice: Choice, text: str, items: list[TokenLogprob]
                        ) -> dict[str, Any] | None:
        """A chunk's logprobs, of the tokens its text came from."""

    @abstractmethod
    def _whole_logprobs(self, choice: Choice, items: list[TokenLogprob]) -> dict[str, Any]: ...

    @abstractmethod
    def _whole_choice(self, text: str, calls: list[ParsedCall]) -> dict[str, Any]:
        """A whole reply's choice, less its index, logprobs and finish_reason."""

    # The Renderer.

    def text(self, choice: Choice, text: str, logprobs: list[TokenLogprob]) -> list[Event]:
        if self._whole:
            self._texts[choice.index].append(text)
            self._logprobs[choice.index] += logprobs
        return [self._chunk(choice.index, self._delta(text),
                            self._chunk_logprobs(choice, text, logprobs))]

    def calls(self, choice: Choice, calls: list[ParsedCall]) -> list[Event]:
        # Each call whole in one delta, numbered across the choice's calls.
        first = self._called[choice.index]
        self._called[choice.index] += len(calls)
        if self._whole:
            self._calls[choice.index] += calls
        return [self._chunk(choice.index, self._delta(None, tool_calls=[
            call.as_openai(first + k) for k, call in enumerate(calls)]))]

    def end(self, choice: Choice, finish_reason: str) -> list[Event]:
        return [self._chunk(choice.index, self._delta(None), finish_reason=finish_reason)]

    async def final(self) -> list[Event]:
        if self.spec.usage_mode == "off":
            return ["[DONE]"]
        return [{**self._envelope(self.CHUNK), "choices": [], "usage": self._usage()}, "[DONE]"]

    def failed(self, error: Error) -> list[Event]:
        return [error_body(error.message, error.type, None, error.code), "[DONE]"]

    async def whole(self) -> dict[str, Any]:
        assert self._whole, "a streamed reply kept none of its output"
        out = []
        for index, c in enumerate(self._choices):
            items = self._logprobs[c.index]
            out.append({"index": index,
                        **self._whole_choice("".join(self._texts[c.index]), self._calls[c.index]),
                        "logprobs": self._whole_logprobs(c, items) if items else None,
                        "finish_reason": c.finish_reason or "stop"})
        return {**self._envelope(self.WHOLE), "choices": out, "usage": self._usage()}

    def sse(self, event: Event, number: int) -> ServerSentEvent:
        data = event if isinstance(event, str) else orjson.dumps(event).decode()
        return ServerSentEvent(data=data, id=str(number), sep="\n")

    def _chunk(self, index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None = None,
               finish_reason: str | None = None) -> dict[str, Any]:
        choice = {"index": index, **delta, "logprobs": logprobs, "finish_reason": finish_reason}
        chunk = {**self._envelope(self.CHUNK), "choices": [choice]}
        if self.spec.usage_mode == "every":
            chunk["usage"] = self._usage()
        return chunk

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {"id": f"{self.ID_PREFIX}-{self.spec.base_id}", "object": obj,
                "created": self.spec.created, "model": self.spec.model,
                "system_fingerprint": SYSTEM_FINGERPRINT}

    def _usage(self) -> dict[str, Any]:
        # Each prompt is counted once however many choices share it; so is its cache reuse.
        cached: dict[int, int] = {}
        for c in self._choices:
            cached[c.prompt_index] = max(cached.get(c.prompt_index, 0), c.cached_tokens)
        # A choice still running has produced the tokens it has seen so far.
        completion = sum(c.completion_tokens if c.finish_reason else c.tokens_seen
                         for c in self._choices)
        return usage(self.spec.prompt_tokens, completion, sum(cached.values()))
