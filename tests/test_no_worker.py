"""A worker gone for good: its requests end with a definite, retryable `no_worker` error within
the queue deadline, instead of a silent stream until the request deadline; while one of the
model's workers lives, it takes them over instead.

One stack, two workers, real processes. The workers run the synthetic stand-in model at a fixed
step time (one token per step), so a stream is surely mid-way when its worker is killed. The
queue deadline (4 s) is shorter than a takeover (a pending entry idle for 2 x the 2 s heartbeat
TTL): a request whose model still has a live worker must not end with `no_worker` meanwhile.
The request deadline stays at its default (600 s), so only `no_worker` can end the others.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import orjson
import pytest
import redis
import redis.asyncio as aioredis

from api.queue.worker_watch import WorkerWatch
from shared.keys import Keys
from shared.messages import RequestField
from tests.stack import Stack, eventually

MODEL = "tiny-llama"
QUEUE_TIMEOUT_S = 4.0
HEARTBEAT_TTL_S = 2
MAX_TOKENS = 100
STEP_MS = 40  # so a stream of MAX_TOKENS runs about 4 s on a free worker


@pytest.fixture(scope="module")
def stack(redis_url: str, tiny_model: Path) -> Iterator[Stack]:
    stack = Stack(redis_url, tiny_model, served_name=MODEL, workers=2, env={
        "REDSERVE_HEARTBEAT_TTL_S": str(HEARTBEAT_TTL_S),
        "REDSERVE_QUEUE_TIMEOUT_S": str(QUEUE_TIMEOUT_S),
        "REDSERVE_SSE_PING_S": "0.5",
        "REDSERVE_SYNTHETIC_STEP_MS": str(STEP_MS),
        "REDSERVE_SPECULATION": "off",
    }).start()
    yield stack
    stack.stop()


def _body(i: int) -> dict[str, object]:
    return {"model": MODEL, "prompt": [50 + i, 7, 300, 9], "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


def _kill_holder(stack: Stack, r: redis.Redis, request_id: str) -> int:
    """SIGKILL the worker that runs `request_id` (as its hash names it); its index."""
    state = Keys(stack.prefix).state(request_id)
    assert eventually(lambda: r.hget(state, RequestField.WORKER), 10)
    holder = (r.hget(state, RequestField.WORKER) or b"").decode()
    for i in range(stack.workers):
        proc = stack.worker_proc(i)
        if holder == f"{socket.gethostname()}-{proc.pid}":
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return i
    raise AssertionError(f"no worker of the stack is {holder!r}")


def _stream_killing_its_worker(stack: Stack, r: redis.Redis, i: int
                               ) -> tuple[list[str], float, int]:
    """Stream request `i`, SIGKILL its worker once its first token came; the stream's lines
    after the kill, the seconds from the kill to the stream's end, and the killed worker."""
    lines: list[str] = []
    killed_at, victim = 0.0, -1
    with httpx.stream("POST", f"{stack.base_url}/v1/completions", json=_body(i),
                      timeout=60) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if victim < 0 and line.startswith("data: {") and '"text"' in line:
                victim = _kill_holder(stack, r, reply.headers["x-request-id"])
                killed_at = time.monotonic()
            elif victim >= 0 and line:
                lines.append(line)
    return lines, time.monotonic() - killed_at, victim


def _events(lines: list[str]) -> list[dict[str, object]]:
    return [orjson.loads(line[6:]) for line in lines
            if line.startswith("data: ") and line != "data: [DONE]"]


def test_a_live_worker_takes_over_then_the_last_ones_requests_end_with_no_worker(
    stack: Stack, sync_redis: redis.Redis
) -> None:
    # Two workers: the one killed mid-stream is replaced by the other, past the queue deadline.
    lines, _, victim = _stream_killing_its_worker(stack, sync_redis, 0)
    events = _events(lines)
    assert not [e for e in events if "error" in e], stack.output()
    assert events[-1]["usage"]["completion_tokens"] == MAX_TOKENS  # type: ignore[index]
    assert lines[-1] == "data: [DONE]"
    assert stack.worker_proc(1 - victim).poll() is None

    # The last worker killed mid-stream: the stream stays open (pinged), then ends with
    # no_worker within the queue deadline of the worker's last heartbeat.
    lines, after_kill, _ = _stream_killing_its_worker(stack, sync_redis, 1)
    error = _events(lines)[-1]["error"]
    assert isinstance(error, dict)
    assert error["code"] == "no_worker" and error["type"] == "server_error", error
    assert repr(MODEL) in error["message"]
    assert lines[-1] == "data: [DONE]"
    print(f"no_worker {after_kill:.1f}s after the last worker's SIGKILL")  # shown with -s
    assert QUEUE_TIMEOUT_S - HEARTBEAT_TTL_S <= after_kill <= QUEUE_TIMEOUT_S + 3, after_kill
    assert lines.count(": ping") >= 2, lines  # the wait was kept alive for proxies


def test_a_queued_request_with_no_worker_ends_with_no_worker(
    stack: Stack, sync_redis: redis.Redis
) -> None:
    for i in range(stack.workers):
        proc = stack.worker_proc(i)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    assert eventually(lambda: httpx.get(f"{stack.base_url}/ready").status_code == 503,
                      3 * HEARTBEAT_TTL_S)
    keys = Keys(stack.prefix)

    def aborts() -> int:
        return len(list(sync_redis.scan_iter(match=f"{stack.prefix}:*:abort")))

    before = aborts()
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="x", max_retries=0)
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as refused:
        client.completions.create(model=MODEL, prompt="hello", max_tokens=4)
    waited = time.monotonic() - started
    print(f"queued request: no_worker after {waited:.1f}s")  # shown with -s
    assert refused.value.status_code == 503
    assert refused.value.response.headers["retry-after"] == "1"
    body = refused.value.response.json()["error"]
    assert body["code"] == "no_worker" and body["type"] == "server_error", body
    assert QUEUE_TIMEOUT_S - 0.5 <= waited <= QUEUE_TIMEOUT_S + 3, waited
    # Any worker that comes later drops it: its abort key is set, its queue place freed.
    assert aborts() == before + 1
    assert sync_redis.zcard(keys.queued(MODEL)) == 0


async def test_a_model_is_warned_of_at_once_when_its_worker_is_lost_and_once_it_cannot_be_starting(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The replica's watch, in process against the real Redis: a model whose workers are
    still starting (none seen live yet) is not warned of while the queue deadline since the
    replica's start has not passed, though its requests' wait counts all the same; a model
    whose live worker this replica saw is warned of as soon as it goes."""
    keys = Keys(f"rstest-watch-{uuid.uuid4().hex[:8]}")
    r = aioredis.Redis.from_url(redis_url)
    starting_s = 0.5
    watch = WorkerWatch(r, keys, ["starting", "lost"], HEARTBEAT_TTL_S, starting_s=starting_s)
    caplog.set_level(logging.INFO, logger="redserve.api.workers")

    def said() -> list[str]:
        return [m.getMessage() for m in caplog.records]

    try:
        await r.zadd(keys.workers("lost"), {"w": time.time() + 60})
        await watch.refresh()
        assert said() == [] and watch.gone_since("lost") is None
        assert watch.gone_since("starting") is not None  # no_worker still counts from here
        await r.zadd(keys.workers("lost"), {"w": time.time() - 1})  # its heartbeat expired
        await watch.refresh()
        assert [m.split(" (")[0] for m in said()] == ["model lost has no live worker"]
        await asyncio.sleep(starting_s)  # the window under test
        await watch.refresh()
        await watch.refresh()  # once, not at every refresh
        assert [m.split(" (")[0] for m in said()] == ["model lost has no live worker",
                                                     "model starting has no live worker"]
        await r.zadd(keys.workers("lost"), {"w": time.time() + 60})
        await watch.refresh()
        assert said()[-1] == "model lost has a live worker again"
    finally:
        await r.delete(keys.workers("lost"))
        await r.aclose()
