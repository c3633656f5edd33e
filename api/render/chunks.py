"""What the chat and completions renderers share: OpenAI's `choices` objects, streamed as one
chunk per delta (each choice's text, tool calls and finish in chunks of their own, the usage if
asked, then `[DONE]`) or whole, numbered from 1 as SSE ids. Each format's `ChoiceShape` says only
what differs: its object names, and the shape of a delta, of logprobs and of a whole choice;
this driver asks it for shapes and the format never calls back.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

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


class ChoiceShape(Protocol):
    """What a format says of its choices (`api.render.chat.ChatShape`,
    `api.render.completions.CompletionsShape`): asked for shapes, it calls nothing back."""

    ID_PREFIX: ClassVar[str]
    CHUNK: ClassVar[str]  # the `object` of a streamed chunk
    WHOLE: ClassVar[str]  # the `object` of a whole reply

    def opening(self) -> list[tuple[int, dict[str, Any]]]:
        """The deltas sent before any output, with their choice's index."""
        ...

    def delta(self, text: str | None,
              tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """A chunk's choice, less its index, logprobs and finish_reason."""
        ...

    def chunk_logprobs(self, choice: Choice, text: str, items: list[TokenLogprob]
                       ) -> dict[str, Any] | None:
        """A chunk's logprobs, of the tokens its text came from."""
        ...

    def whole_logprobs(self, choice: Choice, items: list[TokenLogprob]) -> dict[str, Any]: ...

    def whole_choice(self, text: str, calls: list[ParsedCall]) -> dict[str, Any]:
        """A whole reply's choice, less its index, logprobs and finish_reason."""
        ...


class ChoicesRenderer:
    """A chat or completions reply (a `Renderer`); `shape` gives the format's shapes."""

    first_number = 1

    def __init__(self, choices: list[Choice], spec: ReplySpec, whole: bool,
                 shape: ChoiceShape) -> None:
        self._choices = choices
        self.spec = spec
        self.shape = shape
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

    # The Renderer.

    def opening(self) -> list[Event]:
        return [self._chunk(index, delta) for index, delta in self.shape.opening()]

    def text(self, choice: Choice, text: str, logprobs: list[TokenLogprob]) -> list[Event]:
        if self._whole:
            self._texts[choice.index].append(text)
            self._logprobs[choice.index] += logprobs
        return [self._chunk(choice.index, self.shape.delta(text),
                            self.shape.chunk_logprobs(choice, text, logprobs))]

    def calls(self, choice: Choice, calls: list[ParsedCall]) -> list[Event]:
        # Each call whole in one delta, numbered across the choice's calls.
        first = self._called[choice.index]
        self._called[choice.index] += len(calls)
        if self._whole:
            self._calls[choice.index] += calls
        return [self._chunk(choice.index, self.shape.delta(None, tool_calls=[
            call.as_openai(first + k) for k, call in enumerate(calls)]))]

    def end(self, choice: Choice, finish_reason: str) -> list[Event]:
        return [self._chunk(choice.index, self.shape.delta(None), finish_reason=finish_reason)]

    async def final(self) -> list[Event]:
        if self.spec.usage_mode == "off":
            return ["[DONE]"]
        return [{**self._envelope(self.shape.CHUNK), "choices": [], "usage": self._usage()},
                "[DONE]"]

    def failed(self, error: Error) -> list[Event]:
        return [error_body(error.message, error.type, None, error.code), "[DONE]"]

    async def whole(self) -> dict[str, Any]:
        assert self._whole, "a streamed reply kept none of its output"
        out = []
        for index, c in enumerate(self._choices):
            items = self._logprobs[c.index]
            text = "".join(self._texts[c.index])
            out.append({"index": index, **self.shape.whole_choice(text, self._calls[c.index]),
                        "logprobs": self.shape.whole_logprobs(c, items) if items else None,
                        "finish_reason": c.finish_reason or "stop"})
        return {**self._envelope(self.shape.WHOLE), "choices": out, "usage": self._usage()}

    def sse(self, event: Event, number: int) -> ServerSentEvent:
        data = event if isinstance(event, str) else orjson.dumps(event).decode()
        return ServerSentEvent(data=data, id=str(number), sep="\n")

    def _chunk(self, index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None = None,
               finish_reason: str | None = None) -> dict[str, Any]:
        choice = {"index": index, **delta, "logprobs": logprobs, "finish_reason": finish_reason}
        chunk = {**self._envelope(self.shape.CHUNK), "choices": [choice]}
        if self.spec.usage_mode == "every":
            chunk["usage"] = self._usage()
        return chunk

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {"id": f"{self.shape.ID_PREFIX}-{self.spec.base_id}", "object": obj,
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
