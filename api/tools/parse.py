"""Tool calls out of a model's text, as it streams.

Text outside the tags is the message's content; a tag pair holding a JSON call (or a list of
calls) becomes OpenAI's `tool_calls`. While text could still be the start of a tag, it is held
back, so a streaming client never sees half a tag as content; a call is released whole once
its closing tag arrives. What does not parse as a call stays content, as the model wrote it.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from api.tools.syntax import END, START


@dataclass(frozen=True)
class ParsedCall:
    id: str
    name: str
    arguments: str  # JSON text

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {"id": self.id, "type": "function",
                                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def _calls(body: str, ids: Iterator[str]) -> list[ParsedCall] | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        args = item.get("arguments", item.get("parameters", {}))
        text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        calls.append(ParsedCall(next(ids), item["name"], text))
    return calls


class ToolCallParser:
    def __init__(self, request_id: str, most: int | None = None) -> None:
        self.most = most  # calls kept (`parallel_tool_calls` false: 1); later ones are dropped
        # Call ids derive from the request's, so a resumed stream names its calls the same.
        digest = hashlib.sha256(request_id.encode()).hexdigest()[:20]
        self._ids = (f"call_{digest}_{n}" for n in itertools.count())
        self.pending = ""
        self.in_call = False
        self.made = 0  # calls released so far

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        """Content safe to show now, and the calls completed by this text."""
        buf = self.pending + text
        content: list[str] = []
        calls: list[ParsedCall] = []
        while True:
            if self.in_call:
                end = buf.find(END)
                if end < 0:
                    break
                parsed = _calls(buf[:end], self._ids)
                if parsed is None:
                    content.append(START + buf[: end + len(END)])
                else:
                    calls += parsed
                buf, self.in_call = buf[end + len(END):], False
                continue
            start = buf.find(START)
            if start < 0:
                keep = max((k for k in range(1, len(START)) if buf.endswith(START[:k])),
                           default=0)
                content.append(buf[: len(buf) - keep])
                buf = buf[len(buf) - keep:]
                break
            content.append(buf[:start])
            buf, self.in_call = buf[start + len(START):], True
        self.pending = buf
        calls = self._kept(calls)
        return self._content(content), calls

    def flush(self) -> tuple[str, list[ParsedCall]]:
        """At the end: a call cut short (no closing tag) parses if its JSON is whole."""
        buf, self.pending = self.pending, ""
        if not self.in_call:
            return self._content([buf]), []
        self.in_call = False
        parsed = _calls(buf, self._ids)
        if parsed is None:
            # A call that max_tokens cut short: beside whole calls it is no answer of its own.
            return ("" if self.made else START + buf), []
        return "", self._kept(parsed)

    def _kept(self, calls: list[ParsedCall]) -> list[ParsedCall]:
        if self.most is not None:
            calls = calls[: max(self.most - self.made, 0)]
        self.made += len(calls)
        return calls

    def _content(self, parts: list[str]) -> str:
        text = "".join(parts)
        # Between and after calls the model puts newlines: not content worth a delta.
        return "" if self.made and not text.strip() else text
