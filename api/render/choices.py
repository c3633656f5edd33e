"""One choice of a reply: its text (detokenized, stop strings applied, tool calls parsed out),
its logprobs and how it ended. A request with `n` > 1 or several prompts has one `Choice` per
generation."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from api.protocol.reply_spec import ReplySpec
from api.protocol.text import IncrementalDecoder, TextCodec
from api.protocol.tools.parse import ParsedCall, ToolCallParser
from shared.messages import Finish, ResultEntry, Tokens


class ResultSource(Protocol):
    """Where a choice's result entries come from: a live `Generation`, or a `Replay` of a
    resumed stream."""

    @property
    def request_id(self) -> str: ...

    def __aiter__(self) -> AsyncIterator[ResultEntry]: ...

    async def close(self, outcome: str | None = None) -> None: ...


@dataclass(frozen=True)
class TokenLogprob:
    """One token's logprob and its alternatives', as text; each wire format shapes it its own
    way (`api.render`)."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...]


class StopStrings:
    """Cuts the text at the first stop string, holding back any tail that could still grow
    into one, so a streaming client never sees part of a stop string."""

    def __init__(self, stops: list[str], include: bool) -> None:
        self.stops = stops
        self.include = include
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Text safe to show now, and whether a stop string ended the choice."""
        buf = self.pending + text
        hits = [(buf.find(s), s) for s in self.stops if s in buf]
        if hits:
            pos, stop = min(hits)
            self.pending = ""
            return buf[: pos + len(stop) if self.include else pos], True
        keep = max((k for s in self.stops for k in range(1, len(s)) if buf.endswith(s[:k])),
                   default=0)
        self.pending = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


@dataclass
class Choice:
    index: int
    generation: ResultSource
    decoder: IncrementalDecoder
    stops: StopStrings | None
    codec: TextCodec
    prefix: str = ""  # echoed prompt text, shown before the completion
    prompt_index: int = 0  # which prompt of the request (n choices share one)
    tools: ToolCallParser | None = None  # the model was offered tools: parse its calls
    finish_reason: str | None = None
    tokens_seen: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def on_tokens(self, entry: Tokens) -> tuple[str, list[TokenLogprob], list[ParsedCall]]:
        """Text delta, logprob items and completed tool calls for a tokens entry. Tokens at
        positions already seen are dropped: a publish that Redis applied but whose reply was
        lost is sent again by the client's retry, and must not show twice."""
        seen = self.tokens_seen - entry.index
        if seen > 0:
            entry = Tokens(entry.index + seen, entry.ids[seen:],
                           entry.logprobs[seen:] if entry.logprobs is not None else None)
        self.tokens_seen += len(entry.ids)
        text = self.decoder.push(entry.ids)
        items = self._logprobs(entry)
        stopped = False
        if self.stops is not None:
            text, stopped = self.stops.feed(text)
        text, calls = self._calls(text, stopped)
        if stopped:
            self.finish_reason = self._reason("stop")
            self.completion_tokens = self.tokens_seen
        return text, items, calls

    def on_finish(self, entry: Finish) -> tuple[str, list[ParsedCall]]:
        """The rest of the text, and of the tool calls, once the worker ended the choice."""
        tail = self.decoder.flush()
        reason = entry.finish_reason
        if self.stops is not None:
            tail, stopped = self.stops.feed(tail)
            if stopped:
                reason = "stop"
            else:
                tail += self.stops.flush()
        tail, calls = self._calls(tail, True, cut_short=reason == "length")
        self.finish_reason = self._reason(reason)
        self.completion_tokens = entry.completion_tokens
        self.cached_tokens = entry.cached_tokens
        return tail, calls

    def _calls(self, text: str, last: bool,
               cut_short: bool = False) -> tuple[str, list[ParsedCall]]:
        if self.tools is None:
            return text, []
        text, calls = self.tools.feed(text)
        if last:
            rest, more = self.tools.flush(cut_short)
            text, calls = text + rest, calls + more
        return text, calls

    def _reason(self, reason: str) -> str:
        """A choice that called tools ends with "tool_calls", unless cut short."""
        return "tool_calls" if self.tools is not None and self.tools.made and (
            reason == "stop") else reason

    def _logprobs(self, entry: Tokens) -> list[TokenLogprob]:
        if entry.logprobs is None:
            return []
        text = self.codec.token_text
        return [TokenLogprob(text(token_id), logprob, tuple((text(i), lp) for i, lp in top))
                for token_id, (logprob, top) in zip(entry.ids, entry.logprobs, strict=True)]


def reply_choice(spec: ReplySpec, source: ResultSource, codec: TextCodec, index: int = 0,
                 prompt_index: int = 0) -> Choice:
    """Choice `index` of the reply `spec` describes, an answer to prompt `prompt_index`, read
    from `source`: the live reply and its resumed stream build their choices here alike. Its
    tool calls' ids derive from the source's request id."""
    return Choice(
        index=index,
        generation=source,
        decoder=codec.decoder(spec.skip_special_tokens),
        stops=StopStrings(list(spec.stops), spec.include_stop) if spec.stops else None,
        codec=codec,
        prefix=spec.prefixes[prompt_index],
        prompt_index=prompt_index,
        tools=(ToolCallParser(source.request_id, 1 if spec.one_call else None,
                              spec.forced_function)
               if spec.tools else None),
    )
