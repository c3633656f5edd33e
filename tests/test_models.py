"""Several models on one Redis: one API replica serves two models, each with its own worker.

Each model has its own request stream and consumer group, so under interleaved load every
request is answered by its own model's worker (the same text as that model gives alone, and
not the other model's), neither worker touches the other's requests, and both streams are
empty once the load is done. /v1/models lists the models with a live worker; a request for
a model whose workers are gone waits its queue deadline, then gets 503 naming the model.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import httpx
import redis

from ops.embedded_redis import free_port
from shared.keys import WORKER_GROUP, Keys
from tests.stack import Stack, eventually

A, B = "tiny-a", "tiny-b"
PROMPTS = [[50 + i, 7, 300 + 11 * i, 9, 1000 + 37 * i] for i in range(6)]


def _body(model: str, prompt: list[int]) -> dict[str, object]:
    return {"model": model, "prompt": prompt, "max_tokens": 24, "temperature": 0,
            "ignore_eos": True}


async def _texts(url: str, jobs: list[tuple[str, list[int]]]) -> list[tuple[str, str]]:
    """(text, request id) of each job, all sent at once."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        replies = await asyncio.gather(*(client.post("/v1/completions", json=_body(m, p))
                                         for m, p in jobs))
    assert [r.status_code for r in replies] == [200] * len(jobs), [r.text for r in replies]
    return [(r.json()["choices"][0]["text"], r.headers["x-request-id"]) for r in replies]


def test_two_models_share_one_redis_without_touching_each_others_requests(
    redis_url: str, tiny_model: Path, tiny_model_b: Path, sync_redis: redis.Redis
) -> None:
    stack = Stack(redis_url, tiny_model, workers=0, api=False, env={
        "REDSERVE_DTYPE": "float32", "REDSERVE_HEARTBEAT_TTL_S": "2",
        "REDSERVE_QUEUE_TIMEOUT_S": "3"})
    keys = Keys(stack.prefix)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    models = {A: tiny_model, B: tiny_model_b}
    workers = {name: stack.spawn("worker", "--model", f"{name}={path}", "--name",
                                 f"worker-{name}") for name, path in models.items()}
    stack.spawn("api", "--host", "127.0.0.1", "--port", str(port),
                *(arg for name, path in models.items() for arg in ("--model", f"{name}={path}")))
    try:
        stack.wait_http(120, url)
        assert eventually(lambda: httpx.get(f"{url}/ready").json().get("models") == {A: 1, B: 1},
                          60), stack.output()
        assert {m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]} == {A, B}

        solo = {(m, i): asyncio.run(_texts(url, [(m, p)]))[0][0]
                for m in models for i, p in enumerate(PROMPTS)}
        assert solo[(A, 0)] != solo[(B, 0)]  # the two models answer differently
        # Interleaved: A, B, A, B, ... all at once.
        jobs = [(m, p) for p in PROMPTS for m in (A, B)]
        mixed = asyncio.run(_texts(url, jobs))
        for (model, prompt), (text, request_id) in zip(jobs, mixed, strict=True):
            assert text == solo[(model, PROMPTS.index(prompt))]
            assert sync_redis.hget(keys.state(request_id), "worker") == f"worker-{model}".encode()
        # Each stream holds only unfinished work: nothing, once the load is done.
        for model in models:
            stream = keys.requests(model)
            assert eventually(lambda s=stream: sync_redis.xlen(s) == 0
                              and sync_redis.xpending(s, WORKER_GROUP)["pending"] == 0, 10)

        # Model B loses its worker: it leaves /v1/models, and its requests wait their queue
        # deadline, then end with a 503 (no_worker) that names it. Model A serves on.
        workers[B].send_signal(signal.SIGTERM)
        assert workers[B].wait(30) == 0
        assert eventually(lambda: [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]
                          == [A], 10)
        ready = httpx.get(f"{url}/ready")
        assert ready.status_code == 200 and ready.json()["models"] == {A: 1, B: 0}
        orphan = httpx.post(f"{url}/v1/completions", json=_body(B, PROMPTS[0]), timeout=30)
        assert orphan.status_code == 503, orphan.text
        error = orphan.json()["error"]
        assert error["code"] == "no_worker" and repr(B) in error["message"]
        assert asyncio.run(_texts(url, [(A, PROMPTS[0])]))[0][0] == solo[(A, 0)]
        unknown = httpx.post(f"{url}/v1/completions", json=_body("tiny-c", PROMPTS[0]))
        assert unknown.status_code == 404
        assert all(repr(m) in unknown.json()["error"]["message"] for m in models)
    finally:
        stack.stop()
