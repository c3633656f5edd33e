"""OpenAI response objects for chat and text completions, streamed or whole."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import orjson
from starlette.responses import Response

Kind = Literal["chat", "text"]
# One choice of a whole reply: text, finish_reason, logprobs, tool calls (OpenAI's shape).
WholeChoice = tuple[str, str, dict[str, Any] | None, list[dict[str, Any]]]
SYSTEM_FINGERPRINT = "redserve"


@dataclass(frozen=True)
class ReplyHeader:
    """What every object of one reply repeats: its id, object type, creation time, model."""

    kind: Kind
    request_id: str
    model: str
    created: int

    @property
    def id(self) -> str:
        return f"{'chatcmpl' if self.kind == 'chat' else 'cmpl'}-{self.request_id}"

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
        }

    def chunk(
        self,
        index: int,
        text: str | None,
        finish_reason: str | None = None,
        *,
        role: bool = False,
        logprobs: dict[str, Any] | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        if self.kind == "chat":
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice: dict[str, Any] = {"index": index, "delta": delta}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": text or ""}
            obj = "text_completion"
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish_reason
        return {**self._envelope(obj), "choices": [choice]}

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._envelope(obj), "choices": [], "usage": usage}

    def whole(self, choices: list[WholeChoice], usage: dict[str, Any]) -> dict[str, Any]:
        """`choices` in index order."""
        out = []
        for index, (text, finish_reason, logprobs, calls) in enumerate(choices):
            if self.kind == "chat":
                message: dict[str, Any] = {"role": "assistant", "content": text}
                if calls:
                    # As OpenAI answers: no content beside the calls unless the model wrote some.
                    message["content"] = text.strip() or None
                    message["tool_calls"] = calls
                choice: dict[str, Any] = {"index": index, "message": message}
            else:
                choice = {"index": index, "text": text}
            choice["logprobs"] = logprobs
            choice["finish_reason"] = finish_reason
            out.append(choice)
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {**self._envelope(obj), "choices": out, "usage": usage}


def json_response(
    body: dict[str, Any], status_code: int = 200, headers: dict[str, str] | None = None
) -> Response:
    return Response(orjson.dumps(body), status_code, headers, media_type="application/json")


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
