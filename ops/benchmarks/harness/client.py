"""One streamed request as a benchmark reads it: the load tester's SSE reader
(`ops.loadtest.client.read_events`), so TTFT, the gaps between token chunks and the server's
usage are read the way `redserve bench` reads them, with any body a benchmark needs (token-id
prompts, `ignore_eos`, `speculation`, an API key per tenant)."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from ops.loadtest.client import StreamError, error_text, read_events

# What the loads ask stories about: prompts alike in kind, none the same.
TOPICS = ("a lighthouse keeper", "the first winter on Mars", "a clockmaker's apprentice",
          "a river that flows uphill", "a dragon who hoards books", "the last train home",
          "a detective in Venice", "an orchard at night", "a robot learning to paint",
          "two rival bakers", "a storm over the prairie", "a lost violin")


@dataclass
class Reply:
    sent: float  # time.perf_counter() when the request was sent
    stamps: list[float] = field(default_factory=list)  # each network read that brought text
    text: list[str] = field(default_factory=list)
    usage: dict[str, Any] | None = None  # the server's usage, on the last event
    ended: float = 0.0

    @property
    def ttft(self) -> float | None:
        return self.stamps[0] - self.sent if self.stamps else None

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.stamps)]

    @property
    def tokens(self) -> int:
        """Output tokens: the server's count, else the chunks that brought text."""
        return int((self.usage or {}).get("completion_tokens") or len(self.stamps))


def body(model: str, max_tokens: int, *, content: str | None = None,
         prompt: str | list[int] | None = None, **extra: Any) -> dict[str, Any]:
    """A greedy streamed chat (`content`) or completion (`prompt`) with usage reported;
    `extra` adds or overrides fields (`ignore_eos=True`, `speculation=False`, ...)."""
    out: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0,
                           "stream": True, "stream_options": {"include_usage": True}}
    if content is not None:
        out["messages"] = [{"role": "user", "content": content}]
    if prompt is not None:
        out["prompt"] = prompt
    return out | extra


def path(request: dict[str, Any]) -> str:
    return "/v1/chat/completions" if "messages" in request else "/v1/completions"


async def stream(client: httpx.AsyncClient, base_url: str, request: dict[str, Any],
                 headers: dict[str, str] | None = None) -> Reply:
    """Send `request` (see `body`) to `base_url` (no /v1) and read its stream to the end;
    StreamError for a refused request or an error event."""
    reply = Reply(time.perf_counter())
    sent_headers = {"Content-Type": "application/json", **(headers or {})}
    async with client.stream("POST", base_url + path(request), content=orjson.dumps(request),
                             headers=sent_headers) as response:
        if response.status_code != 200:
            raise StreamError(error_text(response.status_code, await response.aread()))
        async for now, events in read_events(response):
            fresh = False
            for event in events:
                reply.usage = event.usage or reply.usage
                if event.text:
                    fresh = True
                    reply.text.append(event.text)
            if fresh:
                reply.stamps.append(now)
    reply.ended = time.perf_counter()
    return reply


def percentile(values: list[float], q: float) -> float:
    """The `q` quantile (0-1) of `values`, by rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
