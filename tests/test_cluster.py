"""redserve against a Redis Cluster started here: three shards, each a primary and a replica.

Each request's keys share the accepting replica's hash tag and each replica's multiplexed XREAD
stays within that slot, so streaming, one-shot replies, cancellation and resuming all work with
the cluster client (`REDSERVE_REDIS_CLUSTER=true`). Last, the primary of the shard holding an
API replica's slot (its feed and its requests' records) is killed under load: the cluster
promotes that shard's replica after `cluster-node-timeout`, and every stream in flight ends
with its undisturbed text or a definite error; none hangs, and service returns."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import redis
from redis.cluster import RedisCluster

from ops.embedded_redis import free_port
from shared.keys import Keys
from tests.disturbed_load import load, summary
from tests.stack import Stack, eventually

MODEL = "tiny-llama"
NODE_TIMEOUT_MS = 1000  # cluster-node-timeout: how long a primary is unreachable before its
# replica may be promoted
SERVER = shutil.which("redis-server") or shutil.which("valkey-server")
CLI = shutil.which("redis-cli") or shutil.which("valkey-cli")

pytestmark = pytest.mark.skipif(SERVER is None or CLI is None,
                                reason="needs redis-server and redis-cli to form a cluster")


@dataclass
class Cluster:
    url: str
    nodes: dict[int, subprocess.Popen[bytes]]  # by port


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    assert SERVER is not None and CLI is not None
    root = Path(tempfile.mkdtemp(prefix="redserve-cluster-"))
    nodes: dict[int, subprocess.Popen[bytes]] = {}
    try:
        for _ in range(6):
            port, proc = _start_node(root)
            nodes[port] = proc
        ports = list(nodes)
        subprocess.run([CLI, "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports),
                        "--cluster-replicas", "1", "--cluster-yes"],
                       check=True, capture_output=True)
        client = redis.Redis(port=ports[0], decode_responses=True)
        assert eventually(lambda: _healthy(client), 30)
        client.close()
        yield Cluster(f"redis://127.0.0.1:{ports[0]}/0", nodes)
    finally:
        for p in nodes.values():
            p.terminate()
            p.wait(10)
        shutil.rmtree(root, ignore_errors=True)


def _healthy(client: redis.Redis) -> bool:
    """The cluster serves every slot, and each of its three shards has a replica in sync."""
    try:
        if client.cluster("info")["cluster_state"] != "ok":
            return False
        shards = client.execute_command("CLUSTER", "SHARDS")
    except redis.RedisError:
        return False
    return len(shards) == 3 and all(
        sum(n["role"] == "replica" and n["health"] == "online" for n in _nodes(s)) >= 1
        for s in shards)


def _nodes(shard: object) -> list[dict[str, object]]:
    """A CLUSTER SHARDS entry's nodes, each a dict (RESP2 gives flat lists)."""
    def pairs(flat: list[object]) -> dict[str, object]:
        return dict(zip(flat[::2], flat[1::2], strict=True))  # type: ignore[arg-type]
    fields = shard if isinstance(shard, dict) else pairs(shard)  # type: ignore[arg-type]
    return [n if isinstance(n, dict) else pairs(n) for n in fields["nodes"]]  # type: ignore[union-attr, index]


def _start_node(root: Path, tries: int = 5) -> tuple[int, subprocess.Popen[bytes]]:
    """A cluster node answering on a free port. The ports are free when chosen, but a node may
    still lose one to another process before it binds (its bus port lies in the range the OS
    gives clients' connections, which the parallel tests open by the thousand): it exits at
    once, and the next try takes other ports."""
    assert SERVER is not None
    for _ in range(tries):
        port = _node_port()
        (root / str(port)).mkdir()
        proc = subprocess.Popen(
            [SERVER, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
             "--cluster-config-file", "nodes.conf", "--save", "", "--appendonly", "no",
             "--cluster-node-timeout", str(NODE_TIMEOUT_MS)],
            cwd=root / str(port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        def settled(p: int = port, n: subprocess.Popen[bytes] = proc) -> bool:
            return _pings(p) or n.poll() is not None

        assert eventually(settled, 10)
        if proc.poll() is None:
            return port, proc
    pytest.fail(f"no cluster node started in {tries} tries (each exited at once)")


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


def test_requests_stream_cancel_and_resume_on_a_cluster(cluster: Cluster,
                                                         tiny_model: Path) -> None:
    cluster_url = cluster.url
    # One request at a time, so a second one waits in the queue long enough to be cancelled.
    stack = Stack(cluster_url, tiny_model, served_name=MODEL, replicas=2,
                  env={"REDSERVE_REDIS_CLUSTER": "true", "REDSERVE_MAX_RUNNING": "1",
                       "REDSERVE_API_KEYS": "cluster:sk-cluster-test"}).start()
    rc = RedisCluster.from_url(cluster_url)
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
            assert eventually(lambda: rc.xpending(requests, "workers")["pending"] == 1)
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
        assert eventually(lambda: rc.hget(state_key, "state") == b"aborted", 10)
        assert rc.ttl(state_key) > 0
    finally:
        rc.close()
        stack.stop()


def test_a_shard_primary_killed_mid_load_fails_over_to_its_replica(cluster: Cluster,
                                                                   tiny_model: Path) -> None:
    """SIGKILL of the primary that holds an API replica's slot (its feed, its requests'
    records and hashes), a third of the way into 16 streams. Runs last: it leaves the
    cluster with that shard's replica as its primary and no replica."""
    stack = Stack(cluster.url, tiny_model, served_name=MODEL, workers=2, env={
        "REDSERVE_REDIS_CLUSTER": "true", "REDSERVE_HEARTBEAT_TTL_S": "2",
        "REDSERVE_DTYPE": "float32", "REDSERVE_KERNELS": "torch",
        "REDSERVE_MAX_RUNNING": "16"}).start()
    urls, streams = [stack.url(0)], 16
    probe = redis.Redis(port=next(iter(cluster.nodes)), decode_responses=True)
    try:
        first = httpx.post(f"{urls[0]}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "Hello", "max_tokens": 1})
        tag = first.headers["x-request-id"].split("-")[0]
        slot = int(probe.cluster("keyslot", tag))
        port = _owner(probe, slot)
        probe.close()
        probe = redis.Redis(port=next(p for p in cluster.nodes if p != port),
                            decode_responses=True)
        started = asyncio.run(load(urls, MODEL, None, 0, streams=streams))
        undisturbed = [o.text for o in started if o is not None]
        assert len(undisturbed) == streams

        killed = threading.Thread(target=lambda: (cluster.nodes[port].kill(),
                                                  cluster.nodes[port].wait()))
        t0 = time.monotonic()
        outcomes = asyncio.run(load(urls, MODEL, killed, 1.0, spread_s=1.0, streams=streams))
        kinds, _, text = summary("cluster shard primary killed", outcomes, undisturbed)
        print(f"{text}\n  {time.monotonic() - t0:.1f}s")
        assert kinds["hung"] == 0 and kinds["changed"] == 0, (text, stack.output())
        assert eventually(lambda: _serves(probe), 30)
        assert _owner(probe, slot) != port, "the shard's replica was not promoted"
        assert eventually(lambda: httpx.get(f"{urls[0]}/ready", timeout=2).status_code == 200,
                          30), stack.output()
        again = asyncio.run(load(urls, MODEL, None, 0, streams=streams))
        assert [o.text if o else None for o in again] == undisturbed, stack.output()
    finally:
        probe.close()
        stack.stop()


def _owner(client: redis.Redis, slot: int) -> int:
    """The port of the primary serving `slot`."""
    for start, end, primary, *_ in client.execute_command("CLUSTER", "SLOTS"):
        if int(start) <= slot <= int(end):
            return int(primary[1])
    raise AssertionError(f"no node serves slot {slot}")


def _serves(client: redis.Redis) -> bool:
    try:
        return bool(client.cluster("info")["cluster_state"] == "ok")
    except redis.RedisError:
        return False
