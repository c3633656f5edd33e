"""redserve against a Redis Cluster of three nodes started here (cluster mode on, no replicas).

Each request's keys share the accepting replica's hash tag and each replica's multiplexed XREAD
stays within that slot, so streaming, one-shot replies, cancellation and resuming all work with
the cluster client (`REDSERVE_REDIS_CLUSTER=true`)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import redis
from redis.cluster import RedisCluster

from ops.embedded_redis import free_port
from shared.keys import Keys
from tests.stack import Stack, eventually

MODEL = "tiny-llama"
SERVER = shutil.which("redis-server") or shutil.which("valkey-server")
CLI = shutil.which("redis-cli") or shutil.which("valkey-cli")

pytestmark = pytest.mark.skipif(SERVER is None or CLI is None,
                                reason="needs redis-server and redis-cli to form a cluster")


@pytest.fixture(scope="module")
def cluster_url() -> Iterator[str]:
    assert SERVER is not None and CLI is not None
    ports = [_node_port() for _ in range(3)]
    root = Path(tempfile.mkdtemp(prefix="redserve-cluster-"))
    procs = []
    for port in ports:
        (root / str(port)).mkdir()
        procs.append(subprocess.Popen(
            [SERVER, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
             "--cluster-config-file", "nodes.conf", "--save", "", "--appendonly", "no"],
            cwd=root / str(port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    try:
        for port, proc in zip(ports, procs, strict=True):
            assert eventually(lambda p=port: _pings(p), 10), proc.poll()
        subprocess.run([CLI, "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports),
                        "--cluster-replicas", "0", "--cluster-yes"],
                       check=True, capture_output=True)
        client = redis.Redis(port=ports[0], decode_responses=True)
        assert eventually(lambda: client.cluster("info")["cluster_state"] == "ok", 20)
        client.close()
        yield f"redis://127.0.0.1:{ports[0]}/0"
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
        shutil.rmtree(root, ignore_errors=True)


def _node_port() -> int:
    """A free port whose cluster bus port (+10000) is free and valid too."""
    while True:
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


def _pings(port: int) -> bool:
    try:
        return bool(redis.Redis(port=port, socket_connect_timeout=0.2).ping())
    except redis.ConnectionError:
        return False


def test_requests_stream_cancel_and_resume_on_a_cluster(cluster_url: str,
                                                         tiny_model: Path) -> None:
    # One request at a time, so a second one waits in the queue long enough to be cancelled.
    stack = Stack(cluster_url, tiny_model, served_name=MODEL, replicas=2,
                  env={"REDSERVE_REDIS_CLUSTER": "true", "REDSERVE_MAX_RUNNING": "1",
                       "REDSERVE_API_KEYS": "cluster:sk-cluster-test"}).start()
    cluster = RedisCluster.from_url(cluster_url)
    auth = {"Authorization": "Bearer sk-cluster-test"}
    try:
        for i in range(2):
            client = openai.OpenAI(base_url=f"{stack.url(i)}/v1", api_key="sk-cluster-test")
            reply = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8,
                                              temperature=0)
            assert reply.usage is not None and reply.usage.completion_tokens == 8
            streamed = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8,
                                                 temperature=0, stream=True)
            assert "".join(c.choices[0].text for c in streamed) == reply.choices[0].text

        # A finished stream resumed on the other replica (another hash tag, another slot).
        body = {"model": MODEL, "prompt": "Count", "max_tokens": 40, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", f"{stack.url(0)}/v1/completions", json=body, headers=auth,
                          timeout=30) as response:
            request_id = response.headers["x-request-id"]
            whole = [line for line in response.iter_lines() if line.startswith(("id:", "data:"))]
        with httpx.stream("GET", f"{stack.url(1)}/v1/requests/{request_id}/stream",
                          headers={**auth, "Last-Event-ID": "3"}, timeout=30) as resumed:
            rest = [line for line in resumed.iter_lines() if line.startswith(("id:", "data:"))]
        assert rest == whole[6:]  # an id line and a data line per event

        # A queued request cancelled through the other replica ends as aborted.
        with ThreadPoolExecutor(1) as pool:
            busy = pool.submit(httpx.post, f"{stack.url(0)}/v1/completions", timeout=60,
                               headers=auth, json={**body, "max_tokens": 400, "stream": False,
                                                  "speculation": False})
            requests = Keys(stack.prefix).requests(MODEL)
            assert eventually(lambda: cluster.xpending(requests, "workers")["pending"] == 1)
            with httpx.stream("POST", f"{stack.url(0)}/v1/completions", json=body,
                              headers=auth, timeout=60) as response:
                waiting_id = response.headers["x-request-id"]
                cancel = httpx.post(f"{stack.url(1)}/v1/requests/{waiting_id}/cancel",
                                    headers=auth)
                assert cancel.json() == {"id": waiting_id, "object": "request",
                                         "state": "queued", "cancelled": True}
                events = "".join(response.iter_lines())
            assert '"finish_reason":"abort"' in events
            assert busy.result().status_code == 200
        state_key = f"{stack.prefix}:{{{waiting_id.split('-')[0]}}}:{waiting_id}"
        assert eventually(lambda: cluster.hget(state_key, "state") == b"aborted", 10)
        assert cluster.ttl(state_key) > 0
    finally:
        cluster.close()
        stack.stop()
