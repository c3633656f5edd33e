"""Rollouts lose no stream: a replica stopped mid-stream (its drain grace passed) ends each
open stream with `replica_shutdown` and leaves its request running, and the client resumes it
on another replica with the identical rest of the text; `redserve up`'s rolling restart
(SIGUSR2) restarts every worker and replica in turn under load, losing and cancelling nothing.
Read by hand, with the official `openai` client through docs/http-api.md's helper, and by
`redserve bench`'s client, which counts its resumes."""

from __future__ import annotations

import asyncio
import re
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import redis
from tokenizers import Tokenizer

from ops.embedded_redis import free_port
from ops.loadtest.client import Target, headers, send
from ops.loadtest.dataset import Prompt, load_tokenizer
from ops.loadtest.stats import RequestRecord
from shared.keys import Keys
from tests.stack import Stack, Up, child_env, eventually, redserve_up

MODEL = "tiny-llama"
# Speculation off: at temperature 0 the tiny model repeats itself, and its drafts would make
# the streams short work.
LONG = {"model": MODEL, "prompt": "count", "max_tokens": 480, "ignore_eos": True,
        "temperature": 0, "speculation": False}

STREAMS = 16  # read as raw SSE, resumed by hand
CHATS = 4  # read with the official client and docs/http-api.md's `stream_resuming`
BENCHED = 3  # read by `redserve bench`'s client, which resumes them itself
ROLLED = 32  # streams under `redserve up`'s rolling restart
DOCS = Path(__file__).resolve().parents[1] / "docs" / "http-api.md"


def _docs_helper() -> Callable[..., Iterator[Any]]:
    """`stream_resuming`, as docs/http-api.md gives it to `openai` users."""
    text = DOCS.read_text()
    block = re.search(r"```python\n(.*?def stream_resuming.*?)```", text, re.S)
    assert block is not None, "docs/http-api.md lost its stream_resuming example"
    scope: dict[str, Any] = {}
    exec(compile(block.group(1), str(DOCS), "exec"), scope)  # our own docs
    return scope["stream_resuming"]  # type: ignore[no-any-return]


# Before its response headers: the request never started on that replica.
_NOT_TAKEN = (httpx.ConnectError, httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)


class _Balancer(httpx.BaseTransport, httpx.AsyncBaseTransport):
    """What nginx does in front of the replicas (ops/nginx.conf, `proxy_next_upstream error
    http_503 non_idempotent`): each request goes to the first replica that takes it; one that
    refuses or drops the connection before its response headers (it is exiting), or answers
    503 (draining), has not started it."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = [httpx.URL(url) for url in urls]
        self.inner = httpx.HTTPTransport()
        self.inner_async = httpx.AsyncHTTPTransport()

    def _to(self, request: httpx.Request, i: int) -> bool:
        """Address `request` to replica `i`; whether it is the last."""
        request.url = request.url.copy_with(host=self.urls[i].host, port=self.urls[i].port)
        return i + 1 == len(self.urls)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        for i in range(len(self.urls)):
            last = self._to(request, i)
            try:
                response = self.inner.handle_request(request)
            except _NOT_TAKEN:
                if last:
                    raise
                continue
            if response.status_code != 503 or last:
                return response
            response.close()
        raise AssertionError("unreachable")

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        for i in range(len(self.urls)):
            last = self._to(request, i)
            try:
                response = await self.inner_async.handle_async_request(request)
            except _NOT_TAKEN:
                if last:
                    raise
                continue
            if response.status_code != 503 or last:
                return response
            await response.aclose()
        raise AssertionError("unreachable")


class _Read:
    """One SSE stream as a resuming client reads it: the text, the id of the last token event,
    and how it ended (`[DONE]` after a finish, or the error it got)."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.last_id = 0
        self.finish: str | None = None
        self.error: dict[str, str] | None = None
        self.error_had_id = False
        self.has_text = asyncio.Event()

    async def read(self, response: httpx.Response) -> None:
        event_id: str | None = None
        async for line in response.aiter_lines():
            if line.startswith("id: "):
                event_id = line[4:]
            elif line.startswith("data: ") and line != "data: [DONE]":
                data = orjson.loads(line[6:])
                if "error" in data:
                    self.error, self.error_had_id = data["error"], event_id is not None
                else:
                    assert event_id is not None
                    self.last_id = int(event_id)
                    choice = data["choices"][0]
                    self.text.append(choice["text"])
                    self.has_text.set()
                    self.finish = choice["finish_reason"] or self.finish
            elif not line:
                event_id = None


async def _stream_all(stack: Stack, bodies: list[dict[str, object]], stop: Callable[[], None],
                      also: list[threading.Event], tokenizer: Tokenizer
                      ) -> tuple[list[tuple[str, _Read]], list[RequestRecord]]:
    """Every body streamed from replica 0, and BENCHED more by `redserve bench`'s client through
    the balancer; `stop` called once each has some text, and each of `also` is set."""
    reads = [_Read() for _ in bodies]
    ids: list[str] = [""] * len(bodies)
    async with httpx.AsyncClient(timeout=120) as client, httpx.AsyncClient(
            timeout=120, headers=headers(None),
            transport=_Balancer([stack.url(0), stack.url(1)])) as balanced:
        target = Target(f"{stack.url(0)}/v1", MODEL, "completions", True, 0.0, 120.0)

        async def one(i: int) -> None:
            async with client.stream("POST", f"{stack.url(0)}/v1/completions",
                                     json={**bodies[i], "stream": True}) as response:
                ids[i] = response.headers["x-request-id"]
                await reads[i].read(response)

        async def stopper() -> None:
            await asyncio.gather(*(r.has_text.wait() for r in reads),
                                 *(asyncio.to_thread(event.wait, 60) for event in also))
            stop()

        done = await asyncio.gather(
            stopper(), *(one(i) for i in range(len(bodies))),
            *(send(balanced, target, Prompt(f"bench {i}", None, 3, 300), i, 0.0, tokenizer)
              for i in range(BENCHED)))
    return list(zip(ids, reads, strict=True)), list(done[1 + len(bodies):])


async def _resume(url: str, request_id: str, read: _Read, *more: str) -> None:
    """Resume after the last event read, on `url` (or the first of `more` that takes it)."""
    async with httpx.AsyncClient(timeout=120, transport=_Balancer([url, *more])) as client, \
            client.stream("GET", f"{url}/v1/requests/{request_id}/stream",
                          headers={"Last-Event-ID": str(read.last_id)}) as response:
        assert response.status_code == 200, await response.aread()
        read.error = None
        await read.read(response)


async def _whole(url: str, bodies: list[dict[str, object]]) -> list[str]:
    """Each body's text, all sent at once, undisturbed."""
    async with httpx.AsyncClient(timeout=120) as client:
        replies = await asyncio.gather(*(client.post(f"{url}/v1/completions", json=body)
                                         for body in bodies))
    return [r.json()["choices"][0]["text"] for r in replies]


def test_a_replica_stopped_mid_stream_hands_its_streams_to_another(
    redis_url: str, tiny_model: Path, sync_redis: redis.Redis
) -> None:
    """A rollout's stop of one of two replicas, with a 1 s grace, under 23 long greedy streams:
    no request is cancelled, each stream cut at the grace ends with `replica_shutdown` (an event
    without an id, so the client's last event id is its last token's), and its resume on the
    other replica gives exactly the text an undisturbed run gives: by hand, with the `openai`
    client through the docs' helper, and by `redserve bench`'s client (both behind a
    balancer), which counts its resumes."""
    stack = Stack(redis_url, tiny_model, served_name=MODEL, replicas=2, env={
        "REDSERVE_DRAIN_GRACE_S": "1", "REDSERVE_DTYPE": "float32"}).start()
    keys = Keys(stack.prefix)
    bodies: list[dict[str, object]] = [
        {**LONG, "prompt": [30 + i, 900 + 13 * i, 7, 2100 + i], "max_tokens": 300}
        for i in range(STREAMS)]
    chats = [{"model": MODEL, "messages": [{"role": "user", "content": f"story {i}"}],
              "max_tokens": 300, "temperature": 0, "extra_body": {"ignore_eos": True,
                                                                  "speculation": False}}
             for i in range(CHATS)]
    balanced = openai.OpenAI(base_url=f"{stack.url(0)}/v1", api_key="x", max_retries=0,
                             http_client=httpx.Client(transport=_Balancer(
                                 [stack.url(0), stack.url(1)]), timeout=120))
    direct = openai.OpenAI(base_url=f"{stack.url(1)}/v1", api_key="x", max_retries=0)
    stream_resuming = _docs_helper()
    chat_texts: list[str] = [""] * CHATS
    chat_started = [threading.Event() for _ in range(CHATS)]

    def chat(i: int) -> None:
        parts = []
        for chunk in stream_resuming(balanced, **chats[i]):
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
                chat_started[i].set()
        chat_texts[i] = "".join(parts)

    try:
        undisturbed = asyncio.run(_whole(stack.url(1), bodies))
        undisturbed_chats = [direct.chat.completions.create(**body).choices[0].message.content
                             for body in chats]
        threads = [threading.Thread(target=chat, args=(i,)) for i in range(CHATS)]
        for t in threads:
            t.start()
        cut, benched = asyncio.run(_stream_all(
            stack, bodies, lambda: stack.replica_proc(0).send_signal(signal.SIGTERM),
            chat_started, load_tokenizer(str(tiny_model))))
        moved = [(rid, read) for rid, read in cut if read.error is not None]
        assert moved, "every stream ended within the 1 s grace: nothing was handed over"
        for rid, read in moved:
            assert read.error is not None and read.error["code"] == "replica_shutdown", read.error
            assert rid in read.error["message"] and not read.error_had_id
            assert not sync_redis.exists(keys.abort(rid))
            asyncio.run(_resume(stack.url(1), rid, read))
        assert [read.error for _, read in cut] == [None] * STREAMS
        assert ["".join(read.text) for _, read in cut] == undisturbed
        assert [read.finish for _, read in cut] == ["length"] * STREAMS
        for t in threads:
            t.join(120)
        assert chat_texts == undisturbed_chats
        assert [(r.ok, r.error, r.output_tokens) for r in benched] == [(True, None, 300)] * BENCHED
        assert sum(r.resumes for r in benched) >= 1
        assert stack.replica_proc(0).wait(15) == 0
        assert not [rid for rid, _ in cut if sync_redis.exists(keys.abort(rid))]
    finally:
        stack.stop()


def test_a_rolling_restart_of_up_loses_and_cancels_nothing(
    redis_url: str, tiny_model: Path, sync_redis: redis.Redis
) -> None:
    """SIGUSR2 to `redserve up --replicas 2` under 32 streams spread over both: its worker, then
    each replica, restarts in turn, the next once the last serves again. A stream whose replica
    stops resumes on the other; every request ends with the text of an undisturbed run, and
    none is cancelled."""
    port = free_port()
    env = child_env(redis_url, f"rstest-roll-{port}", REDSERVE_DRAIN_GRACE_S="1",
                    REDSERVE_DTYPE="float32")
    keys = Keys(env["REDSERVE_KEY_PREFIX"])
    urls = [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"]
    bodies = [{**LONG, "prompt": [50 + i, 700 + 11 * i, 9], "max_tokens": 400}
              for i in range(ROLLED)]

    async def rolled(up: Up) -> list[tuple[str, _Read]]:
        nonlocal resumed
        reads = [_Read() for _ in bodies]
        ids = [""] * len(bodies)

        async def one(i: int, client: httpx.AsyncClient) -> None:
            nonlocal resumed
            here, there = urls[i % 2], urls[(i + 1) % 2]
            async with client.stream("POST", f"{here}/v1/completions",
                                     json={**bodies[i], "stream": True}) as response:
                ids[i] = response.headers["x-request-id"]
                await reads[i].read(response)
            while reads[i].error is not None and reads[i].error["code"] == "replica_shutdown":
                here, there = there, here
                resumed += 1
                await _resume(here, ids[i], reads[i], there)

        async def roll() -> None:
            await asyncio.gather(*(r.has_text.wait() for r in reads))
            up.proc.send_signal(signal.SIGUSR2)

        async with httpx.AsyncClient(timeout=120) as client:
            await asyncio.gather(roll(), *(one(i, client) for i in range(len(bodies))))
        return list(zip(ids, reads, strict=True))

    resumed = 0
    with redserve_up(env, port, tiny_model, MODEL, "--replicas", "2") as up:
        assert eventually(lambda: all(httpx.get(f"{u}/ready").status_code == 200 for u in urls))
        texts = asyncio.run(_whole(urls[0], bodies))
        done = asyncio.run(rolled(up))
        assert eventually(lambda: "rolling restart done" in up.said(), 60), up.said()
        said = up.said()
        assert said.count("rolling restart: stopping") == 3, said  # the worker, both replicas
        assert [read.error for _, read in done] == [None] * ROLLED
        assert ["".join(read.text) for _, read in done] == texts
        assert [read.finish for _, read in done] == ["length"] * ROLLED
        assert not [rid for rid, _ in done if sync_redis.exists(keys.abort(rid))]
        assert "killed by" not in said and "restarting in" not in said  # none crashed
        print(f"{resumed} resumes of {ROLLED} streams")  # shown with -s
