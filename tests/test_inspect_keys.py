"""`redserve inspect` on keys written by hand into the test Redis: names that rich would read
as markup, values that are not what redserve writes, and stale members of a queue.

No stack is needed: to inspect, the keys under a prefix are the deployment. Each test gets
its own prefix and removes its keys afterwards. `inspect` runs as a subprocess, as an
operator runs it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import orjson
import pytest
import redis

from ops.inspector.keyspace import text
from shared.keys import Keys
from tests.stack import inspect, inspect_json

MODEL = "m[/b]"  # a closing tag with no opening one: MarkupError if read as markup
TENANT = "team[/b]"
WORKER = "w[/b]"


@dataclass(frozen=True)
class Odd:
    redis_url: str
    keys: Keys
    queued: str  # a readable queued request, of MODEL and TENANT
    garbled_out: str  # a running request whose result stream's last entry is no count
    garbled_entry: str  # that entry's id
    bad_created: str  # a hash whose `created` is not a number
    bad_prompt: str  # a hash whose `prompt_tokens` is not a number

    @property
    def prefix(self) -> str:
        return self.keys.prefix


def _id(digit: str) -> str:
    return f"0a1b2c3d-{digit * 24}"


@pytest.fixture
def odd(redis_url: str, sync_redis: redis.Redis) -> Iterator[Odd]:
    keys = Keys(f"rstest-{uuid.uuid4().hex[:8]}")
    r, now = sync_redis, time.time()
    garbled_entry = r.xadd(keys.out(_id("2")), {"kind": "tokens", "index": "x", "ids": "1,2"})
    found = Odd(redis_url, keys, _id("1"), _id("2"), text(garbled_entry), _id("3"), _id("4"))
    base: dict[Any, Any] = {"model": MODEL, "tenant": TENANT, "replica": "0a1b2c3d",
                            "streaming": "0", "created": f"{now - 2:.3f}", "prompt_tokens": "7"}
    r.hset(keys.state(found.queued), mapping={**base, "state": "queued"})
    r.hset(keys.state(found.garbled_out), mapping={**base, "state": "running",
                                                   "worker": WORKER, "created": f"{now:.3f}"})
    r.hset(keys.state(found.bad_created), mapping={**base, "state": "queued",
                                                   "created": "yesterday"})
    r.hset(keys.state(found.bad_prompt), mapping={**base, "state": "running",
                                                  "prompt_tokens": "many"})
    # One fresh member, and one left behind 300 s ago: stale under the default 60 s timeout.
    r.zadd(keys.queued(MODEL), {found.queued: now, "gone": now - 300})
    r.set(keys.worker(WORKER), orjson.dumps({
        "model": MODEL, "at": now, "running": 1, "waiting": 0, "capacity": 2,
        "kv_pages_total": 10, "kv_pages_free": 8, "tokens_per_s": 5.0, "device": "cpu[/i]",
        "dtype": "float32", "draining": False}))
    r.set(keys.worker("not-json"), b"{oops")
    r.set(keys.worker("a-list"), b"[1, 2]")
    r.set(keys.worker("bad-field"), orjson.dumps({"model": MODEL, "running": "lots"}))
    try:
        yield found
    finally:
        for key in r.scan_iter(match=f"{keys.prefix}:*"):
            r.delete(key)


def test_unreadable_keys_are_listed_and_the_rest_is_shown(odd: Odd) -> None:
    snap = inspect_json(odd)
    keys = odd.keys
    assert {u["key"]: u["problem"] for u in snap["unreadable"]} == {
        keys.state(odd.bad_created): "field 'created' is not a number: 'yesterday'",
        keys.state(odd.bad_prompt): "field 'prompt_tokens' is not a number: 'many'",
        keys.out(odd.garbled_out): f"its last entry ({odd.garbled_entry}) holds no token count",
        keys.worker("not-json"): "heartbeat is not JSON: '{oops'",
        keys.worker("a-list"): "heartbeat is not a JSON object: '[1, 2]'",
        keys.worker("bad-field"): "heartbeat field 'running' is not a number: 'lots'",
    }
    # The readable requests, oldest first; a stream it cannot count shows no count.
    assert [(r["id"], r["state"], r["tenant"], r["model"], r["prompt_tokens"],
             r["generated_tokens"]) for r in snap["requests"]] == [
        (odd.queued, "queued", TENANT, MODEL, 7, 0),
        (odd.garbled_out, "running", TENANT, MODEL, 7, None)]
    assert (snap["in_flight"], snap["omitted"], snap["finished"]) == (2, 0, 0)
    [worker] = snap["workers"]
    assert (worker["name"], worker["model"], worker["running"], worker["kv_pages_used"]) == (
        WORKER, MODEL, 1, 2)


def test_queue_depth_leaves_out_stale_members_as_the_api_metric_does(odd: Odd) -> None:
    [model] = inspect_json(odd)["models"]
    assert (model["name"], model["queued"], model["live_workers"]) == (MODEL, 1, [])
    # The cutoff follows the deployment's queue timeout: at 600 s, 300 s old is not stale.
    [model] = inspect_json(odd, REDSERVE_QUEUE_TIMEOUT_S="600")["models"]
    assert model["queued"] == 2


def test_names_from_redis_are_printed_as_they_are(odd: Odd) -> None:
    done = inspect(odd)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    [queued] = [line for line in lines if odd.queued in line]
    assert TENANT in queued and MODEL in queued
    [worker] = [line for line in lines if line.startswith(f"│ {WORKER} ")]
    assert MODEL in worker and "cpu[/i]" in worker
    # Its heartbeat (an earlier version's) does not say how it computes, nor holds adapters.
    assert [cell.strip() for cell in worker.split("│")][-4:-1] == ["?", "?", "-"], worker
    assert "unreadable keys" in done.stdout
    assert any(odd.keys.worker("not-json") in line and "not JSON" in line for line in lines)
    # The model filter is printed as text too.
    only = inspect(odd, "--model", MODEL)
    assert only.returncode == 0 and f"model {MODEL}," in only.stdout, only.stderr
