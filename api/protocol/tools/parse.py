"""Tool calls out of a model's text, as it streams.

Text outside the tags is the message's content; a tag pair holding a JSON call (or a list of
calls) becomes OpenAI's `tool_calls`. While text could still be the start of a tag, it is held
back, so a streaming client never sees half a tag as content; a call is released whole once its
closing tag arrives. What does not parse as a call stays content, as the model wrote it, except
a call that max_tokens cut short: once its name was whole, that is still the call the model was
making (a forced call always is one), so it comes back as OpenAI returns one cut short, its
arguments the JSON text written so far, beside finish_reason "length"; cut before its name was
whole (or inside its opening tag), it is no content (the model was writing a call's syntax,
not words for the user), and a call only when the request forced one function (a named
`tool_choice`, or `required` with one tool): then it can only be that function's, and it comes
back with empty arguments, as OpenAI returns a forced call cut short; otherwise no call anyone
can name, so the reply holds neither, as a reply cut short before its first word. vLLM returns
such text as content; OpenAI, whose calls are never text, never shows call syntax.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from api.protocol.tools.syntax import END, START


@dataclass(frozen=True)
class ParsedCall:
    id: str
    name: str
    arguments: str  # JSON text

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {"id": self.id, "type": "function",
                                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


# What decoding a model's JSON can raise: a syntax error, or nesting deeper than Python's
# recursion limit (a model can write a thousand brackets).
NOT_JSON = (ValueError, RecursionError)


def _calls(body: str, ids: Iterator[str]) -> list[ParsedCall] | None:
    try:
        value = json.loads(body)
    except NOT_JSON:
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


# A call's opening, as the forced-call grammar writes it and models do: its whole name, then
# the rest (no pattern here can backtrack on a long run of the same character).
_NAMED = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")(.*)', re.DOTALL)
_ARGUMENTS = re.compile(r'\s*,\s*"(?:arguments|parameters)"\s*:(.*)', re.DOTALL)
_KEYS = (',"arguments":', ',"parameters":')


def _cut_call(body: str, ids: Iterator[str]) -> ParsedCall | None:
    """The call a cut-short object began, if its name is whole; else None. Its arguments
    are the text written so far, unless they are whole and something else follows (then it
    is no call's shape)."""
    named = _NAMED.match(body)
    if named is None:
        return None
    try:
        name = json.loads(named[1])
    except ValueError:  # a bad escape: not a name
        return None
    arguments = _ARGUMENTS.match(named[2])
    if arguments is None:  # cut inside the key, or no call's key at all
        key = "".join(named[2].split())
        return ParsedCall(next(ids), name, "") if any(k.startswith(key) for k in _KEYS) else None
    text = arguments[1].strip()
    try:
        _, end = json.JSONDecoder().raw_decode(text)
    except NOT_JSON:  # cut inside the arguments
        return ParsedCall(next(ids), name, text)
    return ParsedCall(next(ids), name, text) if not text[end:].strip(" \n\t}") else None


_SEPARATOR = re.compile(r"\s*,?\s*")
# What a call's opening looks like before its name is whole: `{"name": "get_we`, or less of
# it (the possessive `*+` never backtracks on a long run of whitespace).
_OPENING = re.compile(r'\s*+(?:\{\s*+(?:"(?:n(?:a(?:m(?:e(?:"\s*+(?::\s*+'
                      r'(?:"(?:[^"\\]|\\.)*+\\?)?)?)?)?)?)?)?)?)?')


def _begun(body: str) -> bool:
    """Whether a cut-short text is a call (or a list of them) begun, its first name not whole
    yet."""
    text = body.lstrip()
    return _OPENING.fullmatch(text[1:] if text.startswith("[") else text) is not None


def _cut_calls(body: str, ids: Iterator[str]) -> list[ParsedCall] | None:
    """The calls a cut-short text began: a list's whole calls, then the one it was writing."""
    text = body.lstrip()
    calls: list[ParsedCall] = []
    if text.startswith("["):
        decoder, at = json.JSONDecoder(), 1
        while True:
            at = _SEPARATOR.match(text, at).end()  # type: ignore[union-attr]
            try:
                _, end = decoder.raw_decode(text, at)
            except NOT_JSON:  # the call it was writing
                break
            whole = _calls(text[at:end], ids)
            if whole is None:
                return None
            calls, at = calls + whole, end
        text = text[at:]
    cut = _cut_call(text, ids)
    if cut is not None:
        calls.append(cut)
    return calls or None


class ToolCallParser:
    def __init__(self, request_id: str, most: int | None = None,
                 forced: str | None = None) -> None:
        self.most = most  # calls kept (`parallel_tool_calls` false: 1); later ones are dropped
        self.forced = forced  # the one function every call must be, when the request says
        # Call ids derive from the request's, so a resumed stream names its calls the same.
        digest = hashlib.sha256(request_id.encode()).hexdigest()[:20]
        self._ids = (f"call_{digest}_{n}" for n in itertools.count())
        self.pending = ""
        self.in_call = False
        self.made = 0  # calls released so far
        self._said = False  # whether content other than whitespace was released

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

    def flush(self, cut_short: bool = False) -> tuple[str, list[ParsedCall]]:
        """At the end: a call left open (no closing tag) parses if its JSON is whole; if
        max_tokens cut it short (`cut_short`), what it began is a call once a name is whole,
        and nothing before (nor is the start of a tag the cut left unfinished)."""
        buf, self.pending = self.pending, ""
        if not self.in_call:  # `buf`: what could begin a tag, which a cut never finished
            # A lone `<` after words is more likely text ("if a <") than a tag begun.
            if cut_short and buf and (buf != "<" or not self._said or self.forced):
                return "", self._unnamed()
            return self._content([buf]), []
        self.in_call = False
        parsed = _calls(buf, self._ids)
        if parsed is not None:
            return "", self._kept(parsed)
        if self.made:  # left open beside whole calls: no answer of its own
            return "", []
        if not cut_short:
            return START + buf, []
        cut = _cut_calls(buf, self._ids)
        if cut is not None:
            return "", self._kept(cut)
        return ("", self._unnamed()) if _begun(buf) else (START + buf, [])

    def _unnamed(self) -> list[ParsedCall]:
        """A call cut short before its name was whole: the forced function's, if one was
        forced and it is the reply's first call; else none."""
        if self.forced is None or self.made:
            return []
        return self._kept([ParsedCall(next(self._ids), self.forced, "")])

    def _kept(self, calls: list[ParsedCall]) -> list[ParsedCall]:
        if self.most is not None:
            calls = calls[: max(self.most - self.made, 0)]
        self.made += len(calls)
        return calls

    def _content(self, parts: list[str]) -> str:
        text = "".join(parts)
        self._said = self._said or bool(text.strip())
        # Between and after calls the model puts newlines: not content worth a delta.
        return "" if self.made and not text.strip() else text
