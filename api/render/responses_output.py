"""The Responses API's output items of one choice, built as its events arrive, with the typed
stream events each step makes (`api.render.responses` puts the Response object around them).
Events are returned without `sequence_number`, which the stream numbers as it sends them.

Text opens an assistant message item, a tool call closes it and adds a function_call item (its
arguments in one delta: the parser yields each call whole). Whitespace before any output is
held back, so a reply that only calls tools has no empty message item, as OpenAI answers.

With `include: ["message.output_text.logprobs"]` each text delta carries its tokens' logprobs
(chat's items: `api.render.chat.logprob_item`), and the output_text part gathers them all.
"""

from __future__ import annotations

from typing import Any

from api.protocol.tools.parse import ParsedCall

Event = dict[str, Any]


class Output:
    """A reply's output items, built one step at a time; each step returns its events."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.items: list[dict[str, Any]] = []
        self._message: dict[str, Any] | None = None  # the open message item
        self._held = ""  # whitespace before any output
        self._held_logprobs: list[dict[str, Any]] = []  # its tokens'

    def text(self, delta: str, logprobs: list[dict[str, Any]]) -> list[Event]:
        if self._message is None and not (self._held + delta).strip():
            self._held += delta
            self._held_logprobs += logprobs
            return []
        events = self._open_message() if self._message is None else []
        delta, self._held = self._held + delta, ""
        logprobs, self._held_logprobs = self._held_logprobs + logprobs, []
        assert self._message is not None
        part = self._message["content"][0]
        part["text"] += delta
        part["logprobs"] += logprobs
        return [*events, {"type": "response.output_text.delta", **self._at(self._message),
                          "content_index": 0, "delta": delta, "logprobs": logprobs}]

    def call(self, call: ParsedCall) -> list[Event]:
        events = self._close_message("completed")
        self._held, self._held_logprobs = "", []
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
            held_logprobs, self._held_logprobs = self._held_logprobs, []
            events = self._open_message()
            if held or held_logprobs:  # a reply of whitespace only: it is the text
                events += self.text(held, held_logprobs)
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
                        "content_index": 0, "part": _copy(part)}]

    def _close_message(self, status: str) -> list[Event]:
        message, self._message = self._message, None
        if message is None:
            return []
        part = message["content"][0]
        message["status"] = status
        at = self._at(message)
        return [{"type": "response.output_text.done", **at, "content_index": 0,
                 "text": part["text"], "logprobs": list(part["logprobs"])},
                {"type": "response.content_part.done", **at, "content_index": 0,
                 "part": _copy(part)},
                {"type": "response.output_item.done", "output_index": at["output_index"],
                 "item": {**message, "content": [_copy(part)]}}]

    def _at(self, item: dict[str, Any]) -> dict[str, Any]:
        index = next(i for i, it in enumerate(self.items) if it is item)
        return {"item_id": item["id"], "output_index": index}


def _copy(part: dict[str, Any]) -> dict[str, Any]:
    """An event's copy of a text part: the part's own lists grow as the text does."""
    return {**part, "annotations": list(part["annotations"]), "logprobs": list(part["logprobs"])}
