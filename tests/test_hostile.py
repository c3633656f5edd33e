"""Hostile input: no request can hang a replica or hurt another.

Each case is sent while ordinary streams run on the same replica; each gets a clear answer
(a 200 whose numbers are all finite, or an OpenAI-style 4xx naming the problem), the replica
then still serves an ordinary request, and the ordinary streams end with exactly the text
they have when nothing else is going on. The replica's result reader, on which all of its
requests depend, survives malformed result entries and restarts after an unexpected failure.
"""

from __future__ import annotations

import asyncio
import http.client
import math
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
import redis

from api.queue.reader import ResultReader
from shared.keys import Keys
from shared.messages import Finish, Tokens
from shared.redis_conn import connect
from shared.settings import ApiSettings
from tests.stack import Stack, eventually, publish, queued_requests

MODEL = "tiny-llama"
HI = [{"role": "user", "content": "Hi"}]
CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": HI, "max_tokens": 8, **extra}


def text(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Hi", "max_tokens": 8, **extra}


# Served, made numerically safe: (path, body).
SAFE = [
    (CHAT, chat(repetition_penalty=1e-300, logprobs=True, top_logprobs=5, temperature=0)),
    (CHAT, chat(repetition_penalty=1e-300, logprobs=True)),
    (CHAT, chat(repetition_penalty=10, logprobs=True, temperature=0.01)),
    (CHAT, chat(temperature=1e-40)),
    (CHAT, chat(temperature=1e-40, logprobs=True, top_logprobs=20)),
    (CHAT, chat(temperature=1e-6, seed=1)),
    (CHAT, chat(logit_bias={"1": 100, "2": 100, "3": -100}, logprobs=True, top_logprobs=3)),
    (CHAT, chat(logit_bias={str(i): -100 for i in range(1000)}, temperature=2, logprobs=True)),
    (CHAT, chat(logit_bias={"1": 100, "01": -100})),
    (CHAT, chat(frequency_penalty=-2, presence_penalty=-2, repetition_penalty=1e-30,
                temperature=1e-4, logprobs=True)),
    (CHAT, chat(top_p=1e-300, min_p=1.0, top_k=10**12, seed=-(2**63))),
    (TEXT, text(repetition_penalty=1e-300, logprobs=20, temperature=0, echo=False)),
    # `null` is "the default" for every optional field, as in OpenAI's API.
    (CHAT, chat(temperature=None, top_p=None, n=None, stream=None, logprobs=None,
                presence_penalty=None, max_tokens=None, stop=None)),
    (TEXT, text(temperature=1e-40, logprobs=5, n=4, seed=2**63 - 4)),
]

BIG = b'{"model": "tiny-llama", "prompt": "' + b"a" * (3 * 1024**2) + b'"}'
DEEP = b"[" * 400_000 + b"]" * 400_000
# Refused: (path, body or raw bytes, status, the parameter named, or None).
REFUSED: list[tuple[str, Any, int, str | None]] = [
    (CHAT, chat(logit_bias={"²": 5}), 400, "logit_bias"),
    (CHAT, chat(logit_bias={"-1": 5}), 400, "logit_bias"),
    (CHAT, chat(logit_bias={"1e3": 5}), 400, "logit_bias"),
    (CHAT, chat(logit_bias={"12345678901": 5}), 400, "logit_bias"),
    (CHAT, chat(logit_bias={"99999": 5}), 400, "logit_bias"),  # past the vocabulary
    (CHAT, chat(logit_bias={str(i): 1 for i in range(1025)}), 400, "logit_bias"),
    (CHAT, b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "Hi"}], '
           b'"temperature": NaN}', 400, "temperature"),
    (CHAT, b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "Hi"}], '
           b'"logit_bias": {"1": Infinity}}', 400, "logit_bias.1"),
    (CHAT, chat(temperature=2.5), 400, "temperature"),
    (CHAT, chat(repetition_penalty=0), 400, "repetition_penalty"),
    (CHAT, chat(seed=2**63), 400, "seed"),
    (CHAT, chat(stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    (CHAT, chat(stop="x" * 257), 400, "stop"),
    (CHAT, chat(stop=["ok", "y" * 257]), 400, "stop[1]"),
    (CHAT, chat(stop_token_ids=list(range(65))), 400, "stop_token_ids"),
    (CHAT, chat(stop_token_ids=[10**12]), 400, "stop_token_ids"),
    (CHAT, chat(messages=HI * 1025), 400, "messages"),
    (CHAT, chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}] * 257}]),
     400, "messages[0].content"),
    (CHAT, chat(model="m" * 300), 400, "model"),
    (CHAT, chat(user="u" * 300), 400, "user"),
    (CHAT, chat(max_tokens=10**30), 400, "max_tokens"),
    (CHAT, chat(n=17), 400, "n"),
    (TEXT, text(prompt=["Hi"] * 129), 400, "prompt"),
    (TEXT, text(prompt=["Hi"] * 9, n=16), 400, None),
    (TEXT, text(prompt=[[1, 2]] * 129), 400, "prompt"),
    (TEXT, text(prompt=[-1]), 400, "prompt[0]"),
    (TEXT, text(prompt=[10**30]), 400, "prompt"),
    (TEXT, BIG, 413, None),
    (TEXT, DEEP, 400, None),
    (TEXT, b'{"model": "tiny-llama", "prompt": "\xff\xfe"}', 400, None),
    (TEXT, b"not json", 400, None),
    # Lone surrogates (valid JSON escapes, not valid Unicode) never reach the tokenizer.
    (CHAT, b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "\\ud800x"}]}',
     400, "messages[0].content"),
    (TEXT, b'{"model": "tiny-llama", "prompt": ["ok", "\\udfff"]}', 400, "prompt[1]"),
    # Values of the wrong JSON type are not coerced.
    (TEXT, text(max_tokens="4"), 400, "max_tokens"),
    (TEXT, text(max_tokens=True), 400, "max_tokens"),
    (TEXT, text(prompt=[1.0, 2.0]), 400, None),
    (CHAT, chat(logit_bias={"1": "5"}), 400, "logit_bias.1"),
    # Text that cannot fit in the context is refused before it is tokenized.
    (TEXT, text(prompt="a" * (1024**2 + 1)), 400, "prompt"),
    (TEXT, b"", 400, None),
]


def _post(stack: Stack, path: str, body: Any) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(f"{stack.base_url}{path}", content=body, timeout=60,
                          headers={"content-type": "application/json"})
    return httpx.post(f"{stack.base_url}{path}", json=body, timeout=60)


def _finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    return True


# Greedy with one token far ahead of the rest: its text does not hang on float near-ties of
# the random model, which another batch composition can flip; so any difference is damage.
STREAM = {"model": MODEL, "prompt": [11, 22, 33], "max_tokens": 150, "ignore_eos": True,
          "temperature": 0, "logit_bias": {"28": 100}, "stream": True}


class Streams:
    """Ordinary greedy streams running beside the hostile requests."""

    def __init__(self, stack: Stack, n: int) -> None:
        self.stack = stack
        self.texts: list[str | None] = [None] * n
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(n)]

    def _run(self, i: int) -> None:
        parts, done = [], False
        with httpx.stream("POST", f"{self.stack.base_url}{TEXT}", json=STREAM,
                          timeout=120) as response:
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunk = orjson.loads(line[6:])
                    assert "error" not in chunk, chunk
                    parts.append(chunk["choices"][0]["text"])
        self.texts[i] = "".join(parts) if done else None

    def __enter__(self) -> Streams:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for t in self.threads:
            t.join(120)


def _reference(stack: Stack) -> str:
    reply = httpx.post(f"{stack.base_url}{TEXT}", timeout=60,
                       json={**STREAM, "stream": False}).json()
    return str(reply["choices"][0]["text"])


def _serves(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=3)  # type: ignore[arg-type]
    assert reply.choices[0].finish_reason in ("length", "stop")


def test_hostile_requests_get_answers_and_harm_no_one(tiny_stack: Stack,
                                                      client: openai.OpenAI) -> None:
    reference = _reference(tiny_stack)
    with Streams(tiny_stack, 3) as streams:
        for path, body in SAFE:
            response = _post(tiny_stack, path, body)
            assert response.status_code == 200, (body, response.text)
            reply = response.json()
            assert _finite(reply), reply
            assert all(c["finish_reason"] in ("length", "stop") for c in reply["choices"])
            _serves(client)
        for path, body, status, param in REFUSED:
            response = _post(tiny_stack, path, body)
            assert response.status_code == status, (str(body)[:200], response.text[:300])
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"]
            if param is not None:
                assert error["param"] == param, error
            _serves(client)
    assert streams.texts == [reference] * 3
    health = httpx.get(f"{tiny_stack.base_url}/health").json()
    assert health["reader"] == {"alive": True, "restarts": 0}


def test_hostile_streams_end_cleanly(tiny_stack: Stack) -> None:
    body = chat(repetition_penalty=1e-300, logprobs=True, top_logprobs=2, temperature=0,
                stream=True, max_tokens=16)
    with httpx.stream("POST", f"{tiny_stack.base_url}{CHAT}", json=body, timeout=60) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [orjson.loads(line[6:]) for line in lines[:-1]]
    assert all(_finite(c) and "error" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


# --- the result reader ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def scripted(redis_url: str, tiny_model: Path) -> Iterator[Stack]:
    """An API replica with no worker: the test writes the worker's side."""
    stack = Stack(redis_url, tiny_model, served_name=MODEL, workers=0,
                  env={"REDSERVE_BODY_TIMEOUT_S": "1", "REDSERVE_KEEP_ALIVE_S": "1"}).start()
    yield stack
    stack.stop()


@pytest.mark.parametrize("bad", [
    {"kind": "tokens", "index": "0", "ids": "12,x"},
    {"kind": "tokens", "index": "0", "ids": "12", "logprobs": "[[null, []]]"},
    {"kind": "finish", "finish_reason": "exploded", "prompt_tokens": "1"},
    {"kind": "mystery"},
])
def test_a_malformed_result_entry_ends_only_its_request(
    scripted: Stack, sync_redis: Any, bad: dict[str, str]
) -> None:
    keys = Keys(scripted.prefix)
    sync_redis.delete(keys.requests(MODEL))
    results: dict[int, httpx.Response] = {}

    def ask(i: int) -> None:
        results[i] = httpx.post(f"{scripted.base_url}{TEXT}", json=text(prompt=[5, 6, i + 1]),
                                timeout=30)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    victim, bystander = sorted(queued_requests(sync_redis, keys.requests(MODEL), 2),
                               key=lambda r: r.prompt_ids[-1])
    publish(sync_redis, keys, victim.id, bad)
    publish(sync_redis, keys, bystander.id, Tokens(0, (31, 32)), Finish("length", 3, 2))
    for t in threads:
        t.join(30)
    error = results[0].json()["error"]
    assert results[0].status_code == 500 and error["code"] == "malformed_result"
    assert "x" not in error["message"] and "exploded" not in error["message"]
    assert results[1].status_code == 200 and results[1].json()["usage"]["completion_tokens"] == 2
    assert httpx.get(f"{scripted.base_url}/health").json()["reader"] == {"alive": True,
                                                                        "restarts": 0}
    for rid in (victim.id, bystander.id):
        sync_redis.delete(keys.out(rid), keys.state(rid))


def test_a_body_that_never_finishes_gets_408_and_holds_nothing_up(scripted: Stack) -> None:
    with socket.create_connection(("127.0.0.1", scripted.port), timeout=10) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"mo")
        # Meanwhile the replica answers others at once.
        assert httpx.get(f"{scripted.base_url}/v1/models", timeout=2).status_code == 200
        # The replica closes the connection after its reply, which may come in several packets.
        reply = b"".join(iter(lambda: conn.recv(4096), b"")).decode()
    assert reply.startswith("HTTP/1.1 408") and '"code":"request_timeout"' in reply
    assert "connection: close" in reply.lower()  # the rest of that body is never read


def test_an_idle_connection_is_kept_for_the_keep_alive_setting_then_closed(
    scripted: Stack
) -> None:
    """The replica, not the client, ends an idle keep-alive connection, once
    `REDSERVE_KEEP_ALIVE_S` has passed (by default 75 s: past the 60 s that nginx and cloud
    load balancers keep idle upstream connections, so that they close theirs first)."""
    assert ApiSettings().keep_alive_s > 60
    conn = http.client.HTTPConnection("127.0.0.1", scripted.port, timeout=10)
    try:
        conn.request("GET", "/health")
        reply = conn.getresponse()
        reply.read()  # the whole reply: the connection is idle from here on
        answered = time.monotonic()
        assert reply.status == 200 and not reply.will_close
        assert conn.sock is not None
        rest = conn.sock.recv(4096)  # blocks until the replica closes the idle connection
        idle = time.monotonic() - answered
    finally:
        conn.close()
    # Closed by the setting's 1 s, not uvicorn's own 5 s.
    assert rest == b"" and 0.9 <= idle < 4, (rest, idle)


def test_oversized_headers_get_431_and_trace_ids_are_bounded(
    scripted: Stack, sync_redis: Any
) -> None:
    huge = httpx.get(f"{scripted.base_url}/health", headers={"X-Junk": "j" * 70_000})
    assert huge.status_code == 431 and huge.json()["error"]["code"] == "headers_too_large"
    keys = Keys(scripted.prefix)
    sync_redis.delete(keys.requests(MODEL))
    for trace in ("t" * 10_000, "ok-trace.1"):
        with pytest.raises(httpx.ReadTimeout):  # no worker: it only waits in the queue
            httpx.post(f"{scripted.base_url}{TEXT}", json=text(), timeout=0.5,
                       headers={"X-Trace-Id": trace})
    # A trace id travels with each choice's queue entry only when it looks like one.
    queued = queued_requests(sync_redis, keys.requests(MODEL), 2)
    assert [r.trace_id for r in queued] == ["", "ok-trace.1"]


def test_a_token_entry_published_twice_shows_once(scripted: Stack, sync_redis: Any) -> None:
    keys = Keys(scripted.prefix)
    sync_redis.delete(keys.requests(MODEL))
    result: dict[str, httpx.Response] = {}
    thread = threading.Thread(target=lambda: result.setdefault("r", httpx.post(
        f"{scripted.base_url}{TEXT}", json=text(prompt=[5, 6]), timeout=30)))
    thread.start()
    [request] = queued_requests(sync_redis, keys.requests(MODEL), 1)
    # A retried publish repeats entries.
    publish(sync_redis, keys, request.id, Tokens(0, (31, 32)), Tokens(0, (31, 32)),
            Tokens(1, (32, 33)), Finish("length", 2, 3))
    thread.join(30)
    reply = result["r"].json()
    assert reply["choices"][0]["text"] == _decode([31, 32, 33]), reply
    sync_redis.delete(keys.out(request.id), keys.state(request.id))


def _decode(ids: list[int]) -> str:
    from transformers import AutoTokenizer

    from shared.models import resolve_model
    from shared.settings import DEFAULT_MODEL, Settings
    path = resolve_model(DEFAULT_MODEL, Settings().cache_dir).path
    return str(AutoTokenizer.from_pretrained(str(path)).decode(ids))


class _FailsOnce(ResultReader):
    """A reader whose routing fails once, as an unforeseen bug would."""

    failed = False

    def _route_feed(self, fields: Mapping[bytes, bytes]) -> None:
        if not self.failed:
            self.failed = True
            raise RuntimeError("unforeseen")
        super()._route_feed(fields)


async def test_the_reader_restarts_after_a_failure_and_loses_nothing(redis_url: str) -> None:
    clients = connect(redis_url, name="reader-test")
    keys = Keys("rstest-reader")
    reader = _FailsOnce(clients, keys, "feedbeef", buffer=64, slow_after_s=30)
    sync = redis.Redis.from_url(redis_url)
    await reader.start(60)
    try:
        sub = reader.open("feedbeef-1")
        # The first feed entry makes it fail; restarted, the request catches up from its
        # stream: nothing is lost.
        await asyncio.to_thread(publish, sync, keys, "feedbeef-1", Tokens(0, (1, 2)),
                                Finish("length", 1, 2))
        first = await asyncio.wait_for(sub.queue.get(), 10)
        second = await asyncio.wait_for(sub.queue.get(), 10)
        assert first == Tokens(0, (1, 2)) and isinstance(second, Finish)
        assert reader.restarts == 1 and reader.alive
    finally:
        await reader.stop()
        await clients.commands.delete(keys.out("feedbeef-1"), reader.feed_key)
        sync.close()
        await clients.close()
        assert eventually(lambda: True)
