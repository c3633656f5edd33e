"""`redserve inspect` against a real stack with requests held in flight, and the redis-cli
recipes of docs/observability.md run against the same keys.

A worker with room for three requests and a 100 ms stand-in step runs a streaming request, a
non-streaming one and a stream whose client went away (resume grace on), while a fourth waits
in the queue; every long request asks for 480 tokens, so all of them are still in flight
while the tests look. `inspect` runs as a subprocess, as an operator runs it.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis
from redis.cluster import RedisCluster

from ops.embedded_redis import free_port
from ops.inspector.keyspace import Found, classify
from ops.inspector.snapshot import request_state
from shared.keys import QUEUED_CONSUMER, Keys, replica_of
from tests.stack import Stack, eventually, inspect, inspect_json
from tests.test_cluster import CLI as CLUSTER_CLI
from tests.test_cluster import SERVER as CLUSTER_SERVER
from tests.test_cluster import Cluster, cluster  # noqa: F401 (`cluster`: the fixture)

MODEL = "tiny-llama"
TTL_S = 3  # the worker's heartbeat TTL
# Speculation off: at temperature 0 the tiny model repeats itself, and its drafts would end a
# request meant to stay busy within a few steps.
LONG = {"model": MODEL, "prompt": "count", "max_tokens": 480, "ignore_eos": True,
        "temperature": 0, "speculation": False}
OBSERVABILITY = Path(__file__).resolve().parent.parent / "docs" / "observability.md"
REDIS_CLI = shutil.which("redis-cli") or shutil.which("valkey-cli")


@dataclass(frozen=True)
class Busy:
    stack: Stack
    worker: str
    streaming: str  # a worker runs it, its client reads the stream
    running: str  # a worker runs it for one JSON reply
    resumable: str  # a stream whose client went away; it runs on under the resume grace
    queued: str  # no worker has room for it


def _hash(r: redis.Redis, keys: Keys, request_id: str) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in r.hgetall(keys.state(request_id)).items()}


def _new_id(r: redis.Redis, keys: Keys, known: set[str]) -> str:
    """The id of the one request that entered the model's stream since `known`."""
    found: list[str] = []

    def arrived() -> bool:
        ids = {f[b"id"].decode() for _, f in r.xrange(keys.requests(MODEL))}
        found[:] = sorted(ids - known)
        return bool(found)

    assert eventually(arrived, 30)
    [request_id] = found
    known.add(request_id)
    return request_id


def _background(action: Any) -> None:
    threading.Thread(target=action, daemon=True).start()


def _read_all(url: str) -> None:
    try:
        with httpx.stream("POST", url, json={**LONG, "stream": True}, timeout=120) as response:
            for _ in response.iter_lines():
                pass
    except httpx.HTTPError:
        pass  # the stack stopped under it


def _post(url: str) -> None:
    try:
        httpx.post(url, json=LONG, timeout=120)
    except httpx.HTTPError:
        pass


@pytest.fixture(scope="module")
def busy(redis_url: str, tiny_model: Path, sync_redis: redis.Redis) -> Iterator[Busy]:
    stack = Stack(redis_url, tiny_model, served_name=MODEL, env={
        "REDSERVE_MAX_RUNNING": "3", "REDSERVE_SYNTHETIC_STEP_MS": "100",
        "REDSERVE_RESUME_GRACE_S": "120", "REDSERVE_HEARTBEAT_TTL_S": str(TTL_S)}).start()
    try:
        r, keys = sync_redis, Keys(stack.prefix)
        url = f"{stack.base_url}/v1/completions"
        # One finished request: its keys live on, but it is not in flight.
        assert httpx.post(url, json={**LONG, "max_tokens": 1}, timeout=60).status_code == 200
        known: set[str] = {f[b"id"].decode() for _, f in r.xrange(keys.requests(MODEL))}
        _background(lambda: _read_all(url))
        streaming = _new_id(r, keys, known)
        _background(lambda: _post(url))
        running = _new_id(r, keys, known)
        with httpx.stream("POST", url, json={**LONG, "stream": True}, timeout=60) as response:
            resumable = response.headers["x-request-id"]
            next(line for line in response.iter_lines() if line.startswith("data:"))
        known.add(resumable)
        assert eventually(lambda: "detached" in _hash(r, keys, resumable), 30)
        assert eventually(lambda: all(_hash(r, keys, i)["state"] == "running"
                                      for i in (streaming, running, resumable)), 30)
        _background(lambda: _post(url))
        queued = _new_id(r, keys, known)
        [worker] = [k.decode().rpartition(":")[2]
                    for k in r.scan_iter(match=keys.worker("*"))]
        # A beat since all three run and their tokens flow, so the worker's row has its
        # figures (an earlier beat may still count the batch as it filled up).
        def beat() -> dict[str, Any]:
            return dict(orjson.loads(r.get(keys.worker(worker)) or b"{}"))

        assert eventually(lambda: beat().get("running") == 3
                          and beat().get("tokens_per_s", 0) > 0, 10)
        # And the worker's queue release (with the flush after it takes them) has gone out for
        # all three.
        assert eventually(lambda: r.zcard(keys.queued(MODEL)) == 1, 10)
        yield Busy(stack, worker, streaming, running, resumable, queued)
    finally:
        stack.stop()


def test_every_request_in_flight_with_its_state_worker_and_replica(
        busy: Busy, sync_redis: redis.Redis) -> None:
    keys = Keys(busy.stack.prefix)
    # The flag names the deployment, whatever the environment says.
    snap = inspect_json(busy.stack, "--key-prefix", busy.stack.prefix,
                        REDSERVE_KEY_PREFIX="rs-elsewhere")
    assert (snap["in_flight"], snap["omitted"], snap["finished"]) == (4, 0, 1)
    rows = {row["id"]: row for row in snap["requests"]}
    expected = {busy.streaming: "streaming", busy.running: "running",
                busy.resumable: "resumable", busy.queued: "queued"}
    assert {i: row["state"] for i, row in rows.items()} == expected
    # Oldest first: in the order they were sent.
    assert [row["id"] for row in snap["requests"]] == [
        busy.streaming, busy.running, busy.resumable, busy.queued]
    for request_id, row in rows.items():
        stored = _hash(sync_redis, keys, request_id)
        assert row["model"] == MODEL and row["tenant"] == "anonymous"
        assert row["replica"] == stored["replica"] == replica_of(request_id)
        assert row["prompt_tokens"] == int(stored["prompt_tokens"]) > 0
        assert row["age_s"] >= 0
    for request_id in (busy.streaming, busy.running, busy.resumable):
        assert rows[request_id]["worker"] == busy.worker
        assert rows[request_id]["generated_tokens"] > 0
    assert rows[busy.queued]["worker"] is None
    assert rows[busy.queued]["generated_tokens"] == 0


def test_queue_depth_lag_pending_and_the_worker_row(busy: Busy) -> None:
    snap = inspect_json(busy.stack)
    [model] = snap["models"]
    served = model.pop("served")
    assert model == {"name": MODEL, "queued": 1, "stream_length": 4, "lag": 1, "pending": 3,
                     "live_workers": [busy.worker]}
    assert list(served) == ["anonymous"] and served["anonymous"] > 0
    [worker] = snap["workers"]
    assert worker["name"] == busy.worker and worker["model"] == MODEL
    # A live worker's heartbeat is younger than its TTL (else its key would be gone).
    assert 0 <= worker["heartbeat_age_s"] <= TTL_S
    assert (worker["running"], worker["waiting"], worker["capacity"]) == (3, 0, 3)
    assert worker["kv_pages_used"] >= 3  # one page at least for each running request
    assert worker["kv_pages_used"] + worker["kv_pages_free"] == worker["kv_pages_total"]
    assert worker["tokens_per_s"] > 0
    assert worker["draining"] is False
    # The stand-in step (REDSERVE_SYNTHETIC_STEP_MS) names itself, with no thread policy.
    assert (worker["kernels"], worker["batch_invariant"], worker["threads"]) == (
        "synthetic", False, 0)


def test_limit_and_model_filter(busy: Busy) -> None:
    snap = inspect_json(busy.stack, "--limit", "2")
    assert [row["id"] for row in snap["requests"]] == [busy.streaming, busy.running]
    assert (snap["in_flight"], snap["omitted"]) == (4, 2)
    other = inspect_json(busy.stack, "--model", "no-such-model")
    assert other["requests"] == [] and other["workers"] == [] and other["in_flight"] == 0
    assert other["models"] == [{"name": "no-such-model", "queued": 0, "stream_length": 0,
                                "lag": None, "pending": 0, "live_workers": [],
                                "served": {}}]
    assert inspect_json(busy.stack, "--model", MODEL)["in_flight"] == 4


def test_watch_prints_one_document_per_refresh(busy: Busy) -> None:
    done = inspect(busy.stack, "--watch", "--json", "--count", "2", "--interval", "0.2")
    assert done.returncode == 0, done.stderr
    documents = [json.loads(line) for line in done.stdout.splitlines()]
    assert [d["in_flight"] for d in documents] == [4, 4]
    assert documents[0]["taken_at"] < documents[1]["taken_at"]


def test_tables_are_not_wrapped_when_piped(busy: Busy) -> None:
    done = inspect(busy.stack)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    for request_id, state in ((busy.streaming, "streaming"), (busy.running, "running"),
                              (busy.resumable, "resumable"), (busy.queued, "queued")):
        [line] = [line for line in lines if request_id in line]
        assert state in line and MODEL in line and replica_of(request_id) in line
        assert (busy.worker in line) == (state != "queued")
    [worker_line] = [line for line in lines if line.startswith(f"│ {busy.worker} ")]
    assert "3/3" in worker_line and MODEL in worker_line
    assert max(map(len, lines)) > 80


def test_bad_input_and_unreachable_redis_exit_2(busy: Busy) -> None:
    gone = inspect(busy.stack, REDIS_URL=f"redis://127.0.0.1:{free_port()}/0")
    assert gone.returncode == 2 and "cannot reach Redis" in gone.stderr
    assert inspect(busy.stack, "--key-prefix", "a*b").returncode == 2
    bad = inspect(busy.stack, "--interval", "0")
    assert bad.returncode == 2 and "--interval" in bad.stderr


@pytest.mark.parametrize(("state", "flags", "shown"), [
    ("queued", {}, "queued"),
    ("queued", {"aborted": True}, "cancelling"),
    ("queued", {"streaming": True, "detached": True}, "queued"),
    ("running", {}, "running"),
    ("running", {"streaming": True}, "streaming"),
    ("running", {"streaming": True, "detached": True}, "resumable"),
    ("running", {"streaming": True, "detached": True, "resumed": True}, "streaming"),
    ("running", {"streaming": True, "detached": True, "aborted": True}, "cancelling"),
])
def test_request_state_rules(state: str, flags: dict[str, bool], shown: str) -> None:
    given = {"streaming": False, "detached": False, "aborted": False, "resumed": False, **flags}
    assert request_state(state, **given) == shown


def test_keys_are_recognised_by_the_key_builders() -> None:
    keys, other = Keys("rs:a"), Keys("rs")
    request = "9051c738-3347a48c44e9294cf8eba197"
    names = [keys.state(request), keys.out(request), keys.abort(request), keys.feed("9051c738"),
             keys.state(f"{request}-1"), keys.requests("m/1"), keys.queued("m2"),
             keys.worker("host-1"), keys.aborts, other.state(request), other.worker("x"),
             other.requests("elsewhere")]
    found = classify(keys, names)
    assert found.request_ids == {request, f"{request}-1"}
    assert found.models == {"m/1", "m2"} and found.workers == {"host-1"}
    # A prefix that starts another one's does not take that one's keys.
    assert classify(other, names) == Found(frozenset({request}), frozenset({"elsewhere"}),
                                           frozenset({"x"}))


# --- docs/observability.md's redis-cli recipes ------------------------------------------------

EXAMPLE_ID = "9051c738-3347a48c44e9294cf8eba197"
EXAMPLE_MODEL = "SmolLM2-135M-Instruct"
EXAMPLE_WORKER = "gpu-0-4242"


def doc_recipes() -> list[str]:
    """Every `redis-cli` line of docs/observability.md's recipe block (the one after "To look
    at")."""
    text = OBSERVABILITY.read_text()
    block = re.search(r"To look at.*?```sh\n(.*?)```", text, re.S)
    assert block is not None, "the redis-cli recipe block of docs/observability.md is missing"
    return [line for line in block.group(1).splitlines() if line.startswith("redis-cli ")]


def _live(recipe: str, busy: Busy) -> list[str]:
    """The recipe with the example's names replaced by the live request's, and pointed at
    the test's Redis."""
    request_id = busy.streaming
    text = (recipe.replace(EXAMPLE_ID, request_id)
            .replace(replica_of(EXAMPLE_ID), replica_of(request_id))
            .replace(EXAMPLE_MODEL, MODEL).replace(EXAMPLE_WORKER, busy.worker)
            .replace("'rs:", f"'{busy.stack.prefix}:"))
    args = shlex.split(text)[1:]
    scan = args[0] == "--scan"
    assert REDIS_CLI is not None
    return [REDIS_CLI, "-u", busy.stack.redis_url, *([] if scan else ["--json"]), *args]


def _check(command: str, reply: Any, busy: Busy) -> None:
    """What docs/observability.md says each command returns."""
    if command == "HGETALL" and "state" not in reply:  # the model's service counters
        assert float(reply["anonymous"]) > 0
    elif command == "HGETALL":  # the request's hash
        assert reply["state"] == "running" and reply["model"] == MODEL
        assert reply["worker"] == busy.worker and reply["streaming"] == "1"
    elif command in ("XRANGE", "XREVRANGE"):  # result entries: kind=tokens, index, ids
        assert reply and all(dict(zip(f[::2], f[1::2], strict=True))["kind"] == "tokens"
                             for _, f in reply)
    elif command == "TTL":  # seconds until the keys expire
        assert isinstance(reply, int) and reply > 0
    elif command == "ZCARD":  # the queue depth
        assert reply == 1
    elif command == "XINFO":  # the consumer group, with pending and lag
        [group] = reply  # the queued request is pending under the queue's consumer
        assert (group["name"], group["pending"], group["lag"]) == ("workers", 4, 0)
    elif command == "XPENDING":  # count, first and last id, per consumer
        assert reply[0] == 4
        assert sorted(reply[3]) == sorted([[busy.worker, "3"], [QUEUED_CONSUMER, "1"]])

    elif command == "ZRANGE":  # live workers with their heartbeat expiry
        assert reply[0][0] == busy.worker and reply[0][1] > 0
    elif command == "GET":  # a worker's heartbeat, JSON
        assert orjson.loads(reply)["model"] == MODEL
    else:
        raise AssertionError(f"the recipe {command} has no check here: add one")


@pytest.mark.skipif(REDIS_CLI is None, reason="needs redis-cli")
def test_doc_recipes_return_what_the_doc_says(busy: Busy) -> None:
    recipes = doc_recipes()
    assert len(recipes) >= 8
    for recipe in recipes:
        argv = _live(recipe, busy)
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0 and done.stdout.strip(), (recipe, done.stderr)
        if "--scan" in argv:  # one key a line, each matching the pattern
            found = done.stdout.split()
            assert all(fnmatchcase(k, argv[argv.index("--pattern") + 1]) for k in found)
            assert Keys(busy.stack.prefix).worker(busy.worker) in found
            continue
        _check(argv[argv.index("--json") + 1].upper(), json.loads(done.stdout), busy)


# --- Redis Cluster ----------------------------------------------------------------------------

def _replicas_on_every_node(stack: Stack, client: RedisCluster, keys: Keys) -> list[int]:
    """Ports of API replicas whose tags (so whose requests' keys) sit on each cluster node.
    A tag is random: replicas start in rounds, two for each node still without one but three
    at least, and one is kept per node (a node is left without one about once in a million)."""
    on_node: dict[str, int] = {}
    for _ in range(10):
        missing = 3 - len(on_node)
        if not missing:
            break
        ports = [free_port() for _ in range(max(2 * missing, 3))]
        procs = [stack.spawn("api", "--host", "127.0.0.1", "--port", str(port), "--model",
                             str(stack.model), "--served-model-name", MODEL) for port in ports]
        for proc, port in zip(procs, ports, strict=True):
            url = f"http://127.0.0.1:{port}"
            stack.wait_http(120, url)
            reply = httpx.post(f"{url}/v1/completions", json={**LONG, "max_tokens": 1},
                               timeout=60)
            tag = replica_of(reply.headers["x-request-id"])
            node = client.get_node_from_key(keys.feed(tag)).name
            if node in on_node:  # that node has one already
                stack.procs.remove(proc)
                proc.terminate()
                proc.wait(30)
            else:
                on_node[node] = port
    assert len(on_node) == 3, "no replica tag landed on some node"
    return list(on_node.values())


@pytest.mark.skipif(CLUSTER_SERVER is None or CLUSTER_CLI is None,
                    reason="needs redis-server and redis-cli to form a cluster")
def test_inspect_sees_the_requests_of_every_cluster_node(
        cluster: Cluster, tiny_model: Path) -> None:  # noqa: F811 (the fixture)
    stack = Stack(cluster.url, tiny_model, served_name=MODEL, api=False, env={
        "REDSERVE_REDIS_CLUSTER": "true", "REDSERVE_MAX_RUNNING": "1",
        "REDSERVE_SYNTHETIC_STEP_MS": "100"}).start()
    client = RedisCluster.from_url(cluster.url)
    keys = Keys(stack.prefix)
    try:
        ports = _replicas_on_every_node(stack, client, keys)
        # The probes' entries are gone once acknowledged: from here on each entry is ours.
        assert eventually(lambda: client.xlen(keys.requests(MODEL)) == 0, 30)
        for n, port in enumerate(ports, 1):  # one request each, in turn
            _background(lambda p=port: _read_all(f"http://127.0.0.1:{p}/v1/completions"))
            assert eventually(lambda n=n: len(client.xrange(keys.requests(MODEL))) == n, 30)
        known = {f[b"id"].decode() for _, f in client.xrange(keys.requests(MODEL))}
        nodes = {n.name for n in client.get_primaries()}
        # A worker frees a request's queue place as it takes it.
        snaps: list[dict[str, Any]] = []
        assert eventually(lambda: snaps.append(inspect_json(stack, REDSERVE_REDIS_CLUSTER="true"))
                          or snaps[-1]["models"][0]["queued"] == 2, 30), snaps[-1:]
        snap = snaps[-1]
        assert {row["id"] for row in snap["requests"]} == known
        assert {client.get_node_from_key(keys.state(i)).name for i in known} == nodes
        assert sorted(row["state"] for row in snap["requests"]) == ["queued", "queued",
                                                                   "streaming"]
        [model] = snap["models"]
        assert (model["stream_length"], model["pending"], model["lag"], model["queued"]) == \
            (3, 1, 2, 2)
        [worker] = snap["workers"]
        assert model["live_workers"] == [worker["name"]] and worker["model"] == MODEL
    finally:
        client.close()
        stack.stop()
