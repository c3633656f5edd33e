"""The Responses API's rendering of one choice: its output items built as its events arrive,
with the typed stream events each step makes, and the Response object around them.

One builder serves both replies: a stream sends the events `Output` returns as it goes, a JSON
reply drops them and sends the Response object `Output` ends with; so the two cannot differ.
Events are returned without `sequence_number`, which the stream numbers as it sends them.

Text opens an assistant message item, a tool call closes it and adds a function_call item (its
arguments in one delta: the parser yields each call whole). Whitespace before any output is
held back, so a reply that only calls tools has no empty message item, as OpenAI answers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from api.responses_api.body import ResponsesRequest
from api.tools.parse import ParsedCall

Event = dict[str, Any]
RESPONSE_PREFIX = "resp_"


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
            "tools": [t.model_dump() for t in b.tools or ()], "top_p": b.top_p,
            "truncation": b.truncation, "usage": usage, "user": b.user,
            "metadata": b.metadata or {},
        }


def usage(input_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


class Output:
    """A reply's output items, built one step at a time; each step returns its events."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.items: list[dict[str, Any]] = []
        self._message: dict[str, Any] | None = None  # the open message item
        self._held = ""  # whitespace before any output

    def text(self, delta: str) -> list[Event]:
        if self._message is None and not (self._held + delta).strip():
            self._held += delta
            return []
        events = self._open_message() if self._message is None else []
        delta, self._held = self._held + delta, ""
        assert self._message is not None
        part = self._message["content"][0]
        part["text"] += delta
        return [*events, {"type": "response.output_text.delta", **self._at(self._message),
                          "content_index": 0, "delta": delta, "logprobs": []}]

    def call(self, call: ParsedCall) -> list[Event]:
        events = self._close_message("completed")
        self._held = ""
        item = {"id": f"fc_{call.id}", "type": "function_call", "status": "in_progress",
                "call_id": call.id, "name": call.name, "arguments": ""}
        self.items.append(item)
        events.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                       "item": dict(item)})
        item["arguments"] = call.arguments
        events.append({"type": "response.function_call_arguments.delta", **self._at(item),
                       "delta": call.arguments})
        events.append({"type": "response.function_call_arguments.done", **self._at(item),
                       "name": call.name, "arguments": call.arguments})
        item["status"] = "completed"
        events.append({"type": "response.output_item.done", "output_index": len(self.items) - 1,
                       "item": dict(item)})
        return events

    def finish(self, status: str) -> list[Event]:
        """The last step: the open message closes (an empty reply still has one)."""
        if not self.items and self._message is None:
            held, self._held = self._held, ""
            events = self._open_message()
            if held:  # a reply of whitespace only: it is the text
                events += self.text(held)
            return events + self._close_message(status)
        return self._close_message(status)

    def _open_message(self) -> list[Event]:
        n = sum(1 for i in self.items if i["type"] == "message")
        item_id = f"msg_{self.request_id}" + (f"_{n}" if n else "")
        self._message = {"id": item_id, "type": "message", "status": "in_progress",
                         "role": "assistant", "content": []}
        self.items.append(self._message)
        added = {"type": "response.output_item.added", "output_index": len(self.items) - 1,
                 "item": {**self._message, "content": []}}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self._message["content"].append(part)
        return [added, {"type": "response.content_part.added", **self._at(self._message),
                        "content_index": 0, "part": dict(part)}]

    def _close_message(self, status: str) -> list[Event]:
        message, self._message = self._message, None
        if message is None:
            return []
        part = message["content"][0]
        message["status"] = status
        at = self._at(message)
        return [{"type": "response.output_text.done", **at, "content_index": 0,
                 "text": part["text"], "logprobs": []},
                {"type": "response.content_part.done", **at, "content_index": 0,
                 "part": dict(part)},
                {"type": "response.output_item.done", "output_index": at["output_index"],
                 "item": {**message, "content": [dict(part)]}}]

    def _at(self, item: dict[str, Any]) -> dict[str, Any]:
        index = next(i for i, it in enumerate(self.items) if it is item)
        return {"item_id": item["id"], "output_index": index}

