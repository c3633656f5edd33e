"""One streamed request, timed as its client sees it, over raw SSE.

The server-sent events are split out of the byte stream here rather than by an SDK: every
network read that brings tokens is stamped once, so TTFT and the inter-token gaps are what a
client receiving those bytes would measure, and the parsing costs one orjson call per event,
which keeps a 2-vCPU client from becoming the bottleneck of the server it measures. Output
tokens come from the server's own usage (`stream_options.include_usage`), else from
tokenizing the streamed text. A stream whose redserve replica stops (`replica_shutdown`) is
resumed on another, after the last event received, as a client should, and counted. Every
failure (HTTP status, error event, an event of a shape no OpenAI-compatible server sends,
timeout, connection) becomes a failed record with a one-line reason; nothing but cancellation
raises out of `send`, so one odd reply costs one request, not the run.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
from tokenizers import Tokenizer

from ops.loadtest.config import BenchError
from ops.loadtest.dataset import Prompt, count_tokens
from ops.loadtest.stats import RequestRecord


@dataclass(frozen=True)
class Target:
    base_url: str  # ends with /v1
    model: str
    endpoint: str  # "chat" or "completions"
    ignore_eos: bool
    temperature: float
    timeout: float

    @property
    def url(self) -> str:
        path = "chat/completions" if self.endpoint == "chat" else "completions"
        return f"{self.base_url}/{path}"


def headers(api_key: str | None) -> dict[str, str]:
    out = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if api_key:
        out["Authorization"] = f"Bearer {api_key}"
    return out


def request_body(target: Target, prompt: Prompt) -> bytes:
    body: dict[str, Any] = {"model": target.model, "max_tokens": prompt.output_len,
                            "temperature": target.temperature, "stream": True,
                            "stream_options": {"include_usage": True}}
    if target.ignore_eos:
        body["ignore_eos"] = True
    if target.endpoint == "chat":
        body["messages"] = (list(prompt.messages) if prompt.messages is not None
                            else [{"role": "user", "content": prompt.text}])
    else:
        body["prompt"] = prompt.text
    return orjson.dumps(body)


def server_message(body: bytes) -> str:
    """The message of an OpenAI, vLLM or FastAPI error body, else the body's start."""
    message = body.decode(errors="replace").strip()[:300]
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return message
    if isinstance(parsed, dict):
        inner = parsed.get("error", parsed)
        found = inner.get("message") if isinstance(inner, dict) else inner
        found = found if found is not None else parsed.get("detail")
        if found is not None:
            return str(found)[:300]
    return message


def error_text(status: int, body: bytes) -> str:
    message = server_message(body)
    return f"HTTP {status}: {message}" if message else f"HTTP {status}"


class StreamError(Exception):
    """A reply that went wrong after the request was sent: its reason, in one line."""


# A redserve replica that stops ends its streams with this error, their requests running on.
MOVED_CODE = "replica_shutdown"


@dataclass(frozen=True)
class Event:
    text: str  # the generated text it carries (chat deltas, answer or reasoning; or completion)
    usage: dict[str, Any] | None  # the server's token counts, on the last event
    moved: bool = False  # the replica stopped: resume the stream on another


def parse_event(payload: bytes) -> Event:
    """One SSE `data:` payload (not `[DONE]`), or StreamError saying what is wrong with it."""
    event = orjson.loads(payload)  # orjson.JSONDecodeError: reported by `send`
    if not isinstance(event, dict):
        raise StreamError(f"unexpected event {payload[:100]!r}")
    if "error" in event:
        error = event["error"]
        if isinstance(error, dict) and error.get("code") == MOVED_CODE:
            return Event("", None, moved=True)
        raise StreamError(f"error event: {server_message(payload)}")
    usage = event.get("usage")
    choices = event.get("choices") or []
    if (usage is not None and not isinstance(usage, dict)) or not isinstance(choices, list):
        raise StreamError(f"unexpected event {payload[:100]!r}")
    parts = []
    for choice in choices:
        if not isinstance(choice, dict) or not isinstance(choice.get("delta") or {}, dict):
            raise StreamError(f"unexpected choice in event {payload[:100]!r}")
        delta = choice.get("delta") or {}
        piece = (choice.get("text") or delta.get("content") or delta.get("reasoning")
                 or delta.get("reasoning_content") or "")
        if not isinstance(piece, str):
            raise StreamError(f"unexpected text in event {payload[:100]!r}")
        parts.append(piece)
    return Event("".join(parts), usage or None)


async def send(client: httpx.AsyncClient, target: Target, prompt: Prompt, index: int,
               run_start: float, tokenizer: Tokenizer) -> RequestRecord:
    start = time.perf_counter()

    def failed(reason: str) -> RequestRecord:
        return RequestRecord(index, start - run_start, False, reason, prompt.input_tokens, 0,
                             None, time.perf_counter() - start, ())

    try:
        async with asyncio.timeout(target.timeout):
            return await _stream(client, target, prompt, index, start, run_start, tokenizer)
    except TimeoutError:
        return failed(f"no complete reply within --timeout {target.timeout:g} s")
    except httpx.HTTPError as e:
        return failed(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
    except orjson.JSONDecodeError as e:
        return failed(f"an event is not JSON: {e}")
    except StreamError as e:
        return failed(str(e))
    except Exception as e:  # anything else about one reply fails that request alone
        return failed(f"{type(e).__name__}: {e}")


async def read_events(reply: httpx.Response) -> AsyncIterator[tuple[float, list[Event]]]:
    """The reply's SSE events, one batch per network read that brought any, stamped when that
    read arrived (`time.perf_counter`). The one SSE reader of ops/: the developer benchmarks
    read their streams through it too."""
    pending = b""
    async for data in reply.aiter_bytes():
        now = time.perf_counter()
        *lines, pending = (pending + data).split(b"\n")
        events = []
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload != b"[DONE]":
                events.append(parse_event(payload))
        if events:
            yield now, events


async def _stream(client: httpx.AsyncClient, target: Target, prompt: Prompt, index: int,
                  start: float, run_start: float, tokenizer: Tokenizer) -> RequestRecord:
    stamps: list[float] = []
    text: list[str] = []
    usage: dict[str, Any] | None = None
    received = resumes = 0  # events so far (numbered from 1); resumes after a replica stopped
    request_id: str | None = None
    opened = client.stream("POST", target.url, content=request_body(target, prompt))
    while True:
        moved = False
        async with opened as reply:
            if reply.status_code != 200:
                raise StreamError(error_text(reply.status_code, await reply.aread()))
            request_id = request_id or reply.headers.get("x-request-id")
            async for now, events in read_events(reply):
                fresh = False
                for event in events:
                    if event.moved:
                        moved = True
                        break
                    received += 1
                    if event.usage is not None:
                        usage = event.usage
                    if event.text:
                        fresh = True
                        text.append(event.text)
                if fresh:
                    stamps.append(now)
                if moved:
                    break
        if not moved:
            break
        if request_id is None:
            raise StreamError("the replica stopped and its reply named no request to resume")
        resumes += 1
        opened = client.stream("GET", f"{target.base_url}/requests/{request_id}/stream",
                               headers={"Last-Event-ID": str(received)})
    end = time.perf_counter()
    if not stamps:
        raise StreamError("the reply streamed no tokens")
    output = (usage or {}).get("completion_tokens") or count_tokens(tokenizer, "".join(text))
    inputs = (usage or {}).get("prompt_tokens") or prompt.input_tokens
    return RequestRecord(index, start - run_start, True, None, int(inputs), int(output),
                         stamps[0] - start, end - start,
                         tuple(b - a for a, b in itertools.pairwise(stamps)), resumes)


async def discover_model(client: httpx.AsyncClient, base_url: str, model: str | None
                         ) -> str:
    """The model to load: `model`, else the first of GET /v1/models. Also the reachability
    check: an unreachable server or a refused key fails here, in one line."""
    try:
        reply = await client.get(f"{base_url}/models", timeout=10.0)
    except httpx.HTTPError as e:
        raise BenchError(f"cannot reach {base_url}: {type(e).__name__}: {e}") from e
    if reply.status_code in (401, 403):
        raise BenchError(f"{base_url}/models refused the API key: "
                         f"{error_text(reply.status_code, reply.content)} (give --api-key or "
                         "set OPENAI_API_KEY)")
    if model is not None:
        return model
    if reply.status_code != 200:
        raise BenchError(f"GET {base_url}/models: {error_text(reply.status_code, reply.content)}"
                         " (name the model with --model)")
    try:
        return str(orjson.loads(reply.content)["data"][0]["id"])
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError) as e:
        raise BenchError(f"GET {base_url}/models lists no model (name one with --model)") from e
