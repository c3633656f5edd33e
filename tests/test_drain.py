"""A replica or worker told to stop (SIGTERM) drains: the replica turns not-ready, refuses new
requests and lets its open streams end within its grace; the worker finishes what it runs and
hands back what it had not started, which the next worker serves."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
import redis

from shared.keys import WORKER_GROUP, Keys
from shared.messages import Finish, RequestField, Tokens
from tests.stack import Stack, eventually, publish, queued_requests

MODEL = "tiny-llama"
# Speculation off: at temperature 0 the tiny model repeats itself, and its drafts would end a
# request meant to stay busy within a few steps.
LONG = {"model": MODEL, "prompt": "count", "max_tokens": 480, "ignore_eos": True,
        "temperature": 0, "speculation": False}


def _sse(response: httpx.Response) -> Iterator[dict]:
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield orjson.loads(line[6:])


def _api_only(redis_url: str, tiny_model: Path, grace: str) -> Stack:
    return Stack(redis_url, tiny_model, served_name=MODEL, workers=0,
                 env={"REDSERVE_DRAIN_GRACE_S": grace}).start()


@pytest.mark.parametrize("finishes_in_grace", [True, False])
def test_sigterm_drains_the_api_replica(
    redis_url: str, tiny_model: Path, sync_redis: redis.Redis, finishes_in_grace: bool
) -> None:
    """Not ready and refusing at once; an open stream finishes within the grace, or at the
    grace ends with `replica_shutdown` (resumable, its worker not told); a JSON request still
    waiting then gets a retryable 503 and its worker is told to stop."""
    stack = _api_only(redis_url, tiny_model, "3" if finishes_in_grace else "1")
    keys = Keys(stack.prefix)
    replies: list[httpx.Response] = []
    waiting = threading.Thread(target=lambda: replies.append(httpx.post(
        f"{stack.base_url}/v1/completions", json={"model": MODEL, "prompt": "y"}, timeout=30)))
    try:
        with httpx.stream("POST", f"{stack.base_url}/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": "x", "max_tokens": 4, "stream": True}
                          ) as response:
            request_id = response.headers["x-request-id"]
            publish(sync_redis, keys, request_id, Tokens(0, (42,)))
            events = _sse(response)
            first = next(events)
            if not finishes_in_grace:
                waiting.start()
                [json_request] = [r for r in queued_requests(sync_redis, keys.requests(MODEL), 2)
                                  if r.id != request_id]
            stack.api_proc.send_signal(signal.SIGTERM)
            assert eventually(lambda: httpx.get(f"{stack.base_url}/ready").status_code == 503, 3)
            refused = httpx.post(f"{stack.base_url}/v1/completions",
                                 json={"model": MODEL, "prompt": "x"})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
            if finishes_in_grace:
                publish(sync_redis, keys, request_id, Finish("length", 1, 2))
            rest = list(events)
        assert first["choices"][0]["text"]
        if finishes_in_grace:
            assert rest[-1]["choices"][0]["finish_reason"] == "length"
        else:
            error = rest[-1]["error"]
            assert error["code"] == "replica_shutdown" and error["type"] == "server_error"
            assert f"/v1/requests/{request_id}/stream" in error["message"]
            assert not sync_redis.exists(keys.abort(request_id))  # its worker goes on
            assert sync_redis.hget(keys.state(request_id), RequestField.DETACHED)  # resumable
            waiting.join(10)
            [reply] = replies
            assert reply.status_code == 503 and reply.headers["retry-after"] == "1"
            assert reply.json()["error"]["code"] == "server_shutdown"
            assert sync_redis.exists(keys.abort(json_request.id))
        assert stack.api_proc.wait(15) == 0
        said = stack.output()
        assert said.count("draining: replica") == 1 and said.count("drained: replica") == 1
    finally:
        stack.stop()


def test_sigterm_lets_the_worker_finish_running_and_hand_back_the_rest(
    redis_url: str, tiny_model: Path, sync_redis: redis.Redis
) -> None:
    # 16 KV pages of 32 tokens (1,024 bytes a token in fp32). The first request's 250-token
    # prompt takes 8; the second's 300-token prompt needs 10, so it waits inside the worker.
    stack = Stack(redis_url, tiny_model, served_name=MODEL, env={
        "REDSERVE_KV_CACHE_MEMORY": str(1024 * 512), "REDSERVE_DRAIN_GRACE_S": "30",
        "REDSERVE_DTYPE": "float32",
    }).start()
    replies: dict[int, httpx.Response] = {}
    bodies = [{**LONG, "prompt": [100 + i % 50 for i in range(250)], "max_tokens": 250},
              {**LONG, "prompt": [200 + i % 50 for i in range(300)], "max_tokens": 200}]

    def ask(i: int) -> None:
        replies[i] = httpx.post(f"{stack.base_url}/v1/completions", json=bodies[i], timeout=60)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    keys = Keys(stack.prefix)
    stream = keys.requests(MODEL)
    try:
        # Both are the worker's before it is told to stop: the first takes its pages first
        # (the worker admits in arrival order), so the second waits inside the worker.
        for i, t in enumerate(threads, start=1):
            t.start()
            assert eventually(
                lambda n=i: sync_redis.xpending(stream, WORKER_GROUP)["pending"] == n, 30)
        [(waiting_entry, waiting)] = [
            (entry_id, f[b"id"]) for entry_id, f in sync_redis.xrange(stream)
            if orjson.loads(f[b"body"])["params"]["max_tokens"] == 200]
        assert httpx.get(f"{stack.base_url}/ready").status_code == 200
        stack.worker_proc().send_signal(signal.SIGTERM)
        # A draining worker no longer makes the replica ready.
        assert eventually(lambda: httpx.get(f"{stack.base_url}/ready").status_code == 503, 5)
        assert stack.worker_proc().wait(30) == 0
        # The finished request's entry is gone; the waiting one's stays, handed back: idle past
        # the reclaim threshold, so the next worker claims it at once.
        assert [entry_id for entry_id, _ in sync_redis.xrange(stream)] == [waiting_entry]
        [pending] = sync_redis.xpending_range(stream, WORKER_GROUP, "-", "+", 10)
        assert pending["message_id"] == waiting_entry and pending["time_since_delivered"] >= 4000
        assert sync_redis.hget(keys.state(waiting.decode()), "state") == b"queued"
        # The handed-back request is served by the next worker to come.
        stack._spawn("worker")
        for t in threads:
            t.join(60)
        assert [replies[i].status_code for i in range(2)] == [200, 200]
        assert [replies[i].json()["usage"]["completion_tokens"] for i in range(2)] == [250, 200]
        assert eventually(lambda: sync_redis.xlen(stream) == 0)
    finally:
        stack.stop()
