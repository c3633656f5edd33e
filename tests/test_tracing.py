"""OpenTelemetry tracing (shared/tracing.py), received for real: the replicas and workers run
as processes exporting OTLP over HTTP to a receiver in this test, which decodes the spans with
opentelemetry-proto. One request with a client's `traceparent` is one trace, from the replica
through Redis to the worker, with a takeover by a second worker and a resume on the other
replica as links; with tracing off (or a request not sampled) nothing is added to Redis."""

from __future__ import annotations

import json
import secrets
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from ops.testkit.otlp_receiver import OTLPGrpcReceiver, OTLPReceiver, Received
from shared.keys import Keys
from tests.stack import Stack, eventually

MODEL = "tiny-llama"


class Receiver(OTLPReceiver):
    def wait(self, check: Callable[[], object], timeout: float = 15.0) -> None:
        assert eventually(check, timeout), json.dumps(
            [(s.service, s.name, s.trace_id, s.span_id, s.parent) for s in self.spans],
            indent=1)


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    server = Receiver().start()
    yield server
    server.stop()


def _traced_env(receiver: Receiver) -> dict[str, str]:
    return {"OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_BSP_SCHEDULE_DELAY": "100"}


def _traceparent(trace_id: str, span_id: str, sampled: bool = True) -> str:
    return f"00-{trace_id}-{span_id}-{'01' if sampled else '00'}"


def _body(max_tokens: int) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}


def _one(spans: list[Received], name: str, **where: str) -> Received:
    found = [s for s in spans if s.name == name
             and all(getattr(s, k) == v for k, v in where.items())]
    assert len(found) == 1, (name, where, [(s.service, s.name, s.parent) for s in spans])
    return found[0]


def test_one_trace_from_the_client_through_both_workers_and_a_resume(
    redis_url: str, tiny_model: Path, sync_redis: redis.Redis, receiver: Receiver
) -> None:
    # The stand-in model (20 ms a step, one token a step) so that the request outlives its
    # first worker's stop; no drain grace, so that worker hands it back at once.
    stack = Stack(redis_url, tiny_model, served_name=MODEL, replicas=2, env={
        **_traced_env(receiver), "REDSERVE_SYNTHETIC_STEP_MS": "20",
        "REDSERVE_SPECULATION": "off", "REDSERVE_DRAIN_GRACE_S": "0"}).start()
    keys = Keys(stack.prefix)
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    try:
        with httpx.stream("POST", f"{stack.url(0)}/v1/chat/completions", json=_body(150),
                          timeout=60,
                          headers={"traceparent": _traceparent(trace_id, client_span)}) as reply:
            assert reply.status_code == 200
            request_id = reply.headers["x-request-id"]
            lines = reply.iter_lines()
            data: list[str] = []
            for line in lines:
                if line.startswith("data: "):
                    data.append(line)
                    if len(data) == 10:
                        break
            # Its worker stops mid-stream: it hands the request back, and a new worker takes
            # it over and finishes it.
            stack.worker_proc().send_signal(signal.SIGTERM)
            assert stack.worker_proc().wait(20) == 0
            stack._spawn("worker")
            data += [line for line in lines if line.startswith("data: ")]
        usage = json.loads(data[-2][6:])["usage"]
        assert usage["completion_tokens"] == 150
        # The stream is resumed on the other replica, with a trace of its own.
        resume_trace = secrets.token_hex(16)
        with httpx.stream("GET", f"{stack.url(1)}/v1/requests/{request_id}/stream", timeout=30,
                          headers={"Last-Event-ID": "140", "traceparent": _traceparent(
                              resume_trace, secrets.token_hex(8))}) as resumed:
            assert resumed.status_code == 200
            resumed.read()

        receiver.wait(lambda: len([s for s in receiver.of(trace_id)
                                   if s.service == "redserve-worker"]) >= 6
                      and any(s.name == "redserve.resume" for s in receiver.of(trace_id))
                      and any(s.parent == client_span for s in receiver.of(trace_id))
                      and receiver.of(resume_trace))
        spans = receiver.of(trace_id)
        # The replica's span covers the HTTP request, a child of the client's span.
        server = _one(spans, "POST /v1/chat/completions", parent=client_span)
        assert server.service == "redserve-api" and server.kind == 2  # SERVER
        assert server.attributes["http.route"] == "/v1/chat/completions"
        assert server.attributes["redserve.request_id"] == request_id
        assert server.attributes["gen_ai.request.model"] == MODEL
        assert server.attributes["gen_ai.response.id"] == f"chatcmpl-{request_id}"
        assert server.attributes["gen_ai.usage.output_tokens"] == 150
        assert server.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
        assert server.attributes["gen_ai.latency.time_to_first_token"] > 0
        assert server.attributes["redserve.tenant"] == "anonymous"  # no API keys
        for name in ("redserve.tokenize", "redserve.placement", "redserve.admit",
                     "redserve.queue_wait"):
            assert _one(spans, name).parent == server.span_id
        # The worker's spans: one per worker that ran it, each a child of the replica's span,
        # the second linked to the first (a takeover).
        first, second = sorted(
            (s for s in spans if s.name == "redserve.worker.request"),
            key=lambda s: s.attributes["redserve.deliveries"])
        assert first.parent == second.parent == server.span_id
        assert (first.service, first.kind) == ("redserve-worker", 5)  # CONSUMER
        assert first.attributes["redserve.outcome"] == "handed_back"
        assert second.attributes["redserve.outcome"] == "length"
        assert second.attributes["redserve.deliveries"] == 2
        assert second.links == [(trace_id, first.span_id, {"redserve.link": "takeover"})]
        assert second.attributes["gen_ai.usage.output_tokens"] == 150
        assert _one(spans, "redserve.queued").parent == first.span_id
        for name in ("redserve.prefill", "redserve.decode", "redserve.publish"):
            assert _one(spans, name).parent == second.span_id
        # The resume: its HTTP span links to the request's, and a span in the request's
        # trace links back to it.
        [resume_server] = receiver.of(resume_trace)
        assert resume_server.name == "GET /v1/requests/{request_id}/stream"
        assert resume_server.links == [(trace_id, server.span_id,
                                        {"redserve.link": "resumed"})]
        resume = _one(spans, "redserve.resume")
        assert resume.parent == server.span_id
        assert resume.links == [(resume_trace, resume_server.span_id,
                                 {"redserve.link": "resume"})]
        # The hash keeps the replica's span, for such a resume.
        saved = sync_redis.hget(keys.state(request_id), "trace")
        assert saved is not None and saved.decode().startswith(f"00-{trace_id}-{server.span_id}-")

        # A request its client's trace does not sample is not traced: nothing in Redis.
        unsampled = secrets.token_hex(16)
        reply = httpx.post(f"{stack.url(0)}/v1/chat/completions",
                           json={**_body(3), "stream": False, "stream_options": None},
                           timeout=30,
                           headers={"traceparent": _traceparent(unsampled, client_span, False)})
        assert reply.status_code == 200
        state = sync_redis.hgetall(keys.state(reply.headers["x-request-id"]))
        assert b"trace" not in state and b"worker_trace" not in state
        assert not receiver.of(unsampled)
    finally:
        stack.stop()


def test_with_tracing_off_nothing_is_added_to_redis(
    redis_url: str, tiny_model: Path, sync_redis: redis.Redis
) -> None:
    # No worker: the request waits on the stream, where its entry can be read.
    stack = Stack(redis_url, tiny_model, served_name=MODEL, workers=0).start()
    keys = Keys(stack.prefix)
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{stack.base_url}/v1/chat/completions", json=_body(3), timeout=1,
                       headers={"traceparent": _traceparent(secrets.token_hex(16),
                                                            secrets.token_hex(8))})
        [(_, fields)] = sync_redis.xrange(keys.requests(MODEL))
        body = json.loads(fields[b"body"])
        assert "traceparent" not in body and set(fields) == {b"id", b"body"}
        state = sync_redis.hgetall(keys.state(fields[b"id"].decode()))
        assert b"state" in state and b"trace" not in state
    finally:
        stack.stop()


def test_spans_go_over_grpc_when_the_protocol_says_so(redis_url: str, tiny_model: Path) -> None:
    """OTEL_EXPORTER_OTLP_PROTOCOL=grpc (a collector's or Jaeger's 4317): the replica and the
    worker export over gRPC, one trace still."""
    receiver = OTLPGrpcReceiver().start()
    stack = Stack(redis_url, tiny_model, served_name=MODEL, env={
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_BSP_SCHEDULE_DELAY": "100"}).start()
    trace_id = secrets.token_hex(16)
    try:
        reply = httpx.post(f"{stack.base_url}/v1/chat/completions",
                           json={**_body(3), "stream": False, "stream_options": None},
                           timeout=30, headers={"traceparent": _traceparent(
                               trace_id, secrets.token_hex(8))})
        assert reply.status_code == 200, reply.text
        assert eventually(lambda: {s.service for s in receiver.of(trace_id)}
                          == {"redserve-api", "redserve-worker"}, 15), receiver.spans
    finally:
        stack.stop()
        receiver.stop()
