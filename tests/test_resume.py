"""Resumable streams: every SSE event has an id, and `GET /v1/requests/{id}/stream` with
`Last-Event-ID` continues a stream from any replica with no gap and no duplicate: after the
replica that served it was killed, and, with a resume grace, after the client's own
connection dropped."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
import redis
from transformers import AutoTokenizer

from ops.testkit.probe import scrape
from shared.keys import Keys
from tests.stack import Stack, eventually

MODEL = "tiny-llama"
# Two tenants: the one that makes the requests, and a stranger.
KEYS = {"REDSERVE_API_KEYS": "resume:sk-resume-test,stranger:sk-someone-else"}
AUTH = {"Authorization": "Bearer sk-resume-test"}


def _body(**extra: object) -> dict[str, object]:
    return {"model": MODEL, "prompt": [11, 22, 33, 44], "max_tokens": 300, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "stop": ["zzz-never"], **extra}


def _events(lines: Iterator[str]) -> Iterator[tuple[int, str]]:
    """(id, data) of each SSE event."""
    event_id = None
    for line in lines:
        if line.startswith("id: "):
            event_id = int(line[4:])
        elif line.startswith("data: "):
            assert event_id is not None, "an event without an id"
            yield event_id, line[6:]
            event_id = None


def _text(events: list[tuple[int, str]]) -> str:
    out = []
    for _, data in events:
        if data != "[DONE]" and "choices" in (chunk := orjson.loads(data)) and chunk["choices"]:
            out.append(chunk["choices"][0]["text"])
    return "".join(out)


def _resume(base_url: str, request_id: str, after: int) -> list[tuple[int, str]]:
    with httpx.stream("GET", f"{base_url}/v1/requests/{request_id}/stream", timeout=60,
                      headers={**AUTH, "Last-Event-ID": str(after)}) as response:
        assert response.status_code == 200, response.read()
        return list(_events(response.iter_lines()))


@pytest.fixture(scope="module")
def two_replicas(redis_url: str, tiny_model: Path) -> Iterator[Stack]:
    stack = Stack(redis_url, tiny_model, served_name=MODEL, replicas=2, env=KEYS).start()
    yield stack
    stack.stop()


def test_a_finished_stream_replays_identically_from_any_replica(two_replicas: Stack) -> None:
    with httpx.stream("POST", f"{two_replicas.url(0)}/v1/completions", json=_body(max_tokens=40),
                      headers=AUTH, timeout=60) as response:
        assert response.status_code == 200, response.read()
        request_id = response.headers["x-request-id"]
        whole = list(_events(response.iter_lines()))
    assert [i for i, _ in whole] == list(range(1, len(whole) + 1))
    assert whole[-1][1] == "[DONE]"

    assert _resume(two_replicas.url(1), request_id, 0) == whole
    assert _resume(two_replicas.url(1), request_id, 7) == whole[7:]
    assert _resume(two_replicas.url(0), request_id, len(whole)) == []

    # Someone else's request looks like a missing one; a non-streamed one is not resumable.
    other = httpx.get(f"{two_replicas.url(1)}/v1/requests/{request_id}/stream",
                      headers={"Authorization": "Bearer sk-someone-else"})
    assert other.status_code == 404
    plain = httpx.post(f"{two_replicas.url(0)}/v1/completions", headers=AUTH, timeout=60,
                       json={**_body(max_tokens=4), "stream": False, "stream_options": None})
    assert plain.status_code == 200, plain.text
    refused = httpx.get(f"{two_replicas.url(1)}/v1/requests/{plain.headers['x-request-id']}/stream",
                        headers=AUTH)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "not_resumable"


def test_a_resumed_stream_keeps_every_rendering_setting(two_replicas: Stack,
                                                        tiny_model: Path) -> None:
    """The stored view keeps each setting in its own place: a special token that the first
    stream skipped (`skip_special_tokens` is true by default) is skipped on a resume too.
    (The view once stored `skip_special_tokens` and `one_call` swapped.)"""
    special = AutoTokenizer.from_pretrained(str(tiny_model)).eos_token_id
    body = _body(max_tokens=6, logit_bias={str(special): 100})
    with httpx.stream("POST", f"{two_replicas.url(0)}/v1/completions", json=body,
                      headers=AUTH, timeout=60) as response:
        assert response.status_code == 200, response.read()
        request_id = response.headers["x-request-id"]
        whole = list(_events(response.iter_lines()))
    assert _text(whole) == ""  # six special tokens, none shown
    assert _resume(two_replicas.url(1), request_id, 0) == whole


def test_killed_replica_stream_resumes_on_the_other(redis_url: str, tiny_model: Path) -> None:
    stack = Stack(redis_url, tiny_model, served_name=MODEL, replicas=2, env=KEYS).start()
    try:
        with httpx.stream("POST", f"{stack.url(0)}/v1/completions", json=_body(), headers=AUTH,
                          timeout=60) as response:
            reference = list(_events(response.iter_lines()))
        assert reference[-1][1] == "[DONE]"

        seen: list[tuple[int, str]] = []
        with httpx.stream("POST", f"{stack.url(0)}/v1/completions", json=_body(), headers=AUTH,
                          timeout=60) as response:
            request_id = response.headers["x-request-id"]
            events = _events(response.iter_lines())
            seen = [next(events) for _ in range(10)]
            stack.replica_proc(0).send_signal(signal.SIGKILL)
            stack.replica_proc(0).wait()
            try:
                seen.extend(events)  # what was in flight; then the connection breaks
            except httpx.HTTPError:
                pass
        assert seen[-1][1] != "[DONE]"

        rest = _resume(stack.url(1), request_id, seen[-1][0])
        assert [i for i, _ in seen + rest] == list(range(1, len(reference) + 1))
        assert _text(seen + rest) == _text(reference)
        assert rest[-2][1] != "[DONE]" and rest[-1][1] == "[DONE]"
        usage = orjson.loads(rest[-2][1])["usage"]
        assert usage["completion_tokens"] == 300
        assert eventually(lambda: scrape(f"{stack.url(1)}/metrics")
                          ["redserve_api_inflight_requests"] == 0)
    finally:
        stack.stop()


def test_with_a_resume_grace_a_dropped_client_resumes_and_an_absent_one_cancels(
    redis_url: str, tiny_model: Path, sync_redis: redis.Redis
) -> None:
    # A worker with a fixed 10 ms step (the synthetic stand-in model), so that a request
    # outlives the grace whatever the machine's speed.
    stack = Stack(redis_url, tiny_model, served_name=MODEL, replicas=2,
                  env={**KEYS, "REDSERVE_RESUME_GRACE_S": "2",
                       "REDSERVE_SYNTHETIC_STEP_MS": "10"}).start()
    keys = Keys(stack.prefix)
    try:
        with httpx.stream("POST", f"{stack.url(0)}/v1/completions", json=_body(), headers=AUTH,
                          timeout=60) as response:
            reference = list(_events(response.iter_lines()))

        # The client's own connection drops after 10 events; it comes back on the other
        # replica within the grace and reads on: the whole text, nothing cancelled.
        with httpx.stream("POST", f"{stack.url(0)}/v1/completions", json=_body(), headers=AUTH,
                          timeout=60) as response:
            request_id = response.headers["x-request-id"]
            events = _events(response.iter_lines())
            seen = [next(events) for _ in range(10)]
        rest = _resume(stack.url(1), request_id, seen[-1][0])
        assert [i for i, _ in seen + rest] == list(range(1, len(reference) + 1))
        assert _text(seen + rest) == _text(reference)
        assert sync_redis.hget(keys.state(request_id), "state") == b"done"

        # One that never comes back is cancelled once the grace has passed.
        with httpx.stream("POST", f"{stack.url(0)}/v1/completions", headers=AUTH, timeout=60,
                          json={**_body(), "max_tokens": 500 - 4}) as response:
            gone_id = response.headers["x-request-id"]
            next(_events(response.iter_lines()))
        assert sync_redis.hget(keys.state(gone_id), "state") == b"running"
        assert eventually(lambda: sync_redis.hget(keys.state(gone_id), "state") == b"aborted",
                          15)
        assert scrape(f"{stack.url(0)}/metrics")["redserve_api_inflight_requests"] == 0
    finally:
        stack.stop()


def test_a_resume_keeps_the_queue_deadline_and_a_drain_waits_for_it(
    redis_url: str, tiny_model: Path, sync_redis: redis.Redis
) -> None:
    # No worker: the request stays queued. Its client leaves (the grace keeps it alive) and
    # resumes on the other replica, which ends it at the queue deadline like the first would
    # (no_worker: the model has no live worker).
    stack = Stack(redis_url, tiny_model, served_name=MODEL, replicas=2, workers=0, env={
        **KEYS, "REDSERVE_RESUME_GRACE_S": "30", "REDSERVE_QUEUE_TIMEOUT_S": "3",
        "REDSERVE_DRAIN_GRACE_S": "20"}).start()
    try:
        with httpx.stream("POST", f"{stack.url(0)}/v1/completions", json=_body(), headers=AUTH,
                          timeout=30) as response:
            request_id = response.headers["x-request-id"]
        resumed = _resume(stack.url(1), request_id, 0)
        assert orjson.loads(resumed[-2][1])["error"]["code"] == "no_worker"
        assert repr(MODEL) in orjson.loads(resumed[-2][1])["error"]["message"]
        assert sync_redis.exists(Keys(stack.prefix).abort(request_id))  # told any late worker

        # A replica told to stop while a resumed stream is open drains it before it exits.
        with httpx.stream("POST", f"{stack.url(0)}/v1/completions", json=_body(), headers=AUTH,
                          timeout=30) as response:
            second = response.headers["x-request-id"]
        with httpx.stream("GET", f"{stack.url(1)}/v1/requests/{second}/stream", timeout=60,
                          headers={**AUTH, "Last-Event-ID": "0"}) as response:
            assert eventually(lambda: scrape(f"{stack.url(1)}/metrics")[
                "redserve_api_inflight_requests"] == 1)
            stack.replica_proc(1).send_signal(signal.SIGTERM)
            events = list(_events(response.iter_lines()))
        # It ran to its own end (the queue deadline), not cut short by the shutdown.
        assert orjson.loads(events[-2][1])["error"]["code"] == "no_worker"
        assert stack.replica_proc(1).wait(30) == 0
    finally:
        stack.stop()
