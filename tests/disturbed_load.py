"""Many streams read while Redis is disturbed, and what each client saw (shared by the
failover tests: tests/test_failover.py, Sentinel; tests/test_cluster.py, a Cluster shard).

`load` runs `STREAMS` greedy streams over HTTP, starts the disturbance (a thread) part-way, and
returns each stream's `Outcome`: its text, how it ended, whether its SSE event ids ran in order,
and its stall (the longest wait for an event). `classify` names what a client got: identical
(the undisturbed text), error (a definite error, after a prefix of that text), hung, or changed
(a token twice, missing or different: what must never happen). `summary` is the line the tests
print with -s.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from collections import Counter
from dataclasses import dataclass

import httpx
import orjson

STREAMS = 32
MAX_TOKENS = 160
HANG_S = 60.0  # a request not ended this long after the disturbance hangs


@dataclass(frozen=True)
class Outcome:
    text: str
    finish: str  # the finish reason, or the error's code
    ended_by_error: bool
    ids_in_order: bool  # SSE event ids 0, 1, 2, ... with nothing after the last
    stall_s: float  # the longest wait for an event, from the request's start
    response_id: str = ""
    message: str = ""  # an error's message: which part ended it


def body(i: int, model: str) -> dict[str, object]:
    return {"model": model, "prompt": [40 + i, 7, 200 + 13 * i, 9, 900 + i],
            "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}


async def stream(client: httpx.AsyncClient, url: str, body: dict[str, object]) -> Outcome:
    """One stream, read to its end: what a client saw."""
    parts: list[str] = []
    finish, error, response_id, message = "", False, "", ""
    ids: list[int] = []
    after_end = 0
    last = time.monotonic()
    stall = 0.0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            detail = orjson.loads(response.content)["error"]
            # Refused before the first byte: an OpenAI error object, and when to retry.
            definite = response.status_code == 503 and "retry-after" in response.headers
            return Outcome("", detail["code"] if definite else f"http {response.status_code}",
                           definite, True, 0.0, message=detail["message"])
        event_id: int | None = None
        async for line in response.aiter_lines():
            now = time.monotonic()
            stall, last = max(stall, now - last), now
            if line.startswith("id: "):
                event_id = int(line[4:])
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if finish:
                after_end += 1
            event = orjson.loads(line[6:])
            if event_id is not None:
                ids.append(event_id)
            if "error" in event:
                finish, error = event["error"]["code"], True
                message = event["error"]["message"]
                continue
            response_id = event["id"]
            choice = event["choices"][0]
            parts.append(choice["text"])
            finish = choice["finish_reason"] or finish
    in_order = ids == list(range(ids[0], ids[0] + len(ids))) if ids else True
    return Outcome("".join(parts), finish, error, in_order and after_end == 0,
                   max(stall, time.monotonic() - last) if not parts else stall, response_id,
                   message)


async def load(urls: list[str], model: str, disturb: threading.Thread | None, at_s: float,
               spread_s: float = 0.0, streams: int = STREAMS) -> list[Outcome | None]:
    """`streams` streams over the replicas in turn, started evenly over `spread_s`;
    `disturb` started `at_s` in. None: hung."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(HANG_S, connect=5.0)) as client:
        async def one(i: int) -> Outcome | None:
            await asyncio.sleep(spread_s * i / streams)
            try:
                async with asyncio.timeout(HANG_S + at_s):
                    return await stream(client, urls[i % len(urls)], body(i, model))
            except (TimeoutError, httpx.ReadTimeout):
                return None

        tasks = [asyncio.create_task(one(i)) for i in range(streams)]
        if disturb is not None:
            await asyncio.sleep(at_s)
            disturb.start()
        return await asyncio.gather(*tasks)


def classify(outcome: Outcome | None, whole: str) -> str:
    """identical, error (a definite error, the text before it a prefix of the whole), hung,
    or changed (a token twice, missing, or different: what must never happen)."""
    if outcome is None:
        return "hung"
    if not outcome.ids_in_order:
        return "changed"
    if outcome.ended_by_error:
        return "error" if whole.startswith(outcome.text) else "changed"
    return "identical" if outcome.finish == "length" and outcome.text == whole else "changed"


def summary(case: str, outcomes: list[Outcome | None], undisturbed: list[str]) -> tuple[
        Counter[str], float, str]:
    """Per kind, the longest stall, and the line to print: kinds, errors, stalls, and each
    error's message (which part ended the request)."""
    kinds = Counter(classify(o, whole) for o, whole in zip(outcomes, undisturbed, strict=True))
    stalls = sorted(o.stall_s for o in outcomes if o is not None) or [0.0]
    errors = Counter(o.finish for o in outcomes if o is not None and o.ended_by_error)
    messages = Counter(o.message for o in outcomes if o is not None and o.message)
    text = "\n".join([f"{case}: {dict(kinds)}; errors {dict(errors)}; stall p50 "
                      f"{statistics.median(stalls):.2f}s max {stalls[-1]:.2f}s",
                      *(f"  {n} x {m}" for m, n in messages.items()),
                      *(f"  stream {i} changed: {_how(o, whole)}"
                        for i, (o, whole) in enumerate(zip(outcomes, undisturbed, strict=True))
                        if classify(o, whole) == "changed")])
    return kinds, stalls[-1], text


def _how(outcome: Outcome | None, whole: str) -> str:
    """How a changed stream differs from its undisturbed text: what a failure report needs."""
    assert outcome is not None
    same = zip(outcome.text, whole, strict=False)  # up to the shorter one's end
    at = next((i for i, (a, b) in enumerate(same) if a != b), min(len(outcome.text), len(whole)))
    return (f"response {outcome.response_id}, finish {outcome.finish!r}, ids in order "
            f"{outcome.ids_in_order}, {len(outcome.text)} of {len(whole)} characters, first "
            f"difference at {at}: {outcome.text[at:at + 40]!r} for {whole[at:at + 40]!r}; "
            f"message {outcome.message!r}")
