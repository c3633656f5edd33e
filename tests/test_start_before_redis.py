"""A replica started before Redis answers waits for it, as a worker does, instead of crashing
(in Kubernetes, a crash loop): meanwhile /health says why it is unavailable, /ready is 503 and a
request gets 503 with Retry-After; once Redis answers on that address, the same process serves.
`redserve up` against an external Redis that is not up yet does likewise: no child exits, and
`ready` comes once Redis answers.

Real processes: a replica and a worker (or `redserve up`) pointed at a free port where nothing
listens, then the embedded Valkey the tests use started on that port.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import openai

from ops.embedded_redis import EmbeddedRedis, free_port
from tests.stack import Stack, child_env, eventually

MODEL = "tiny-llama"


def test_a_replica_started_before_redis_waits_then_serves(tiny_model: Path) -> None:
    port = free_port()
    stack = Stack(f"redis://127.0.0.1:{port}/0", tiny_model, served_name=MODEL)
    redis_server = EmbeddedRedis(port)
    url = stack.base_url
    try:
        api = stack.spawn("api", "--host", "127.0.0.1", "--port", str(stack.port),
                          "--model", f"{MODEL}={tiny_model}")
        worker = stack.spawn("worker", "--model", str(tiny_model), "--served-model-name", MODEL)

        def answers() -> bool:
            try:
                return httpx.get(f"{url}/health", timeout=2).status_code == 503
            except httpx.HTTPError:
                return False

        assert eventually(answers, 120), stack.output()
        health = httpx.get(f"{url}/health").json()
        assert health["status"] == "unavailable" and health["redis"] == "unreachable"
        assert f"waiting for Redis at redis://127.0.0.1:{port}/0 since" in health["reason"], health
        assert httpx.get(f"{url}/ready").status_code == 503
        refused = httpx.post(f"{url}/v1/completions",
                             json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "redis_unavailable"
        assert api.poll() is None and worker.poll() is None

        redis_server.start()
        assert eventually(lambda: httpx.get(f"{url}/ready").status_code == 200, 60), \
            stack.output()
        assert httpx.get(f"{url}/health").json()["status"] == "ok"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        reply = client.completions.create(model=MODEL, prompt="hi", max_tokens=3,
                                          extra_body={"ignore_eos": True})
        assert reply.usage is not None and reply.usage.completion_tokens == 3
        # One line said what it waits for, and one that it serves: no traceback.
        said = stack.output()
        assert said.count("does not answer") == 1 and "answers; serving" in said, said
        # The replica's ready line waits for Redis, though it listened before.
        assert said.count("ready: replica") == 1, said
        assert said.index("answers; serving") < said.index("ready: replica"), said
        assert "Traceback" not in said, said
    finally:
        stack.stop()
        redis_server.stop()


def test_up_against_an_external_redis_not_up_yet_waits_for_it(tiny_model: Path,
                                                               tmp_path: Path) -> None:
    redis_port, port = free_port(), free_port()
    redis_server = EmbeddedRedis(redis_port)
    log = tmp_path / "up.log"
    env = child_env(f"redis://127.0.0.1:{redis_port}/0", f"rsup-{uuid.uuid4().hex[:8]}",
                    COLUMNS="300")  # wide enough that rich wraps no line of the log
    with log.open("wb") as out:
        up = subprocess.Popen([sys.executable, "-m", "ops.cli", "up", "--port", str(port),
                               "--model", str(tiny_model), "--served-model-name", MODEL],
                              env=env, start_new_session=True, stdout=out,
                              stderr=subprocess.STDOUT)

    def said() -> str:
        return " ".join(log.read_text().split())

    def waiting() -> bool:
        try:
            reply = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
        except httpx.HTTPError:
            return False
        return reply.status_code == 503 and "waiting for Redis" in reply.json()["reason"]

    try:
        assert eventually(waiting, 120), said()
        assert "does not answer yet" in said() and "restarting in" not in said()
        assert " ready: " not in said()
        redis_server.start()
        assert eventually(lambda: " ready: http" in said(), 60), said()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                               max_retries=0)
        reply = client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert reply.choices[0].finish_reason in ("length", "stop")
        assert "restarting in" not in said() and "Traceback" not in said()  # no child exited
        up.send_signal(signal.SIGTERM)
        assert up.wait(60) == 0
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
        redis_server.stop()
