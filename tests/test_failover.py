"""Redis failing over under load: every request in flight ends with the text an undisturbed
run gives, or with a definite error; none hangs, none shows a token twice or misses one.

Real processes throughout: a Valkey primary, its replica and three Sentinels on loopback
(`ops/testkit/failover_lab.py`), two API replicas and two workers given only the redis+sentinel://
URL, and streams read over HTTP. Three ways the primary goes, one test each, on one shared
deployment (the cases run in order; each leaves the lab settled again): a `SENTINEL FAILOVER`,
the primary SIGKILLed (then started again empty, as an orchestrator would, and made a replica
by the Sentinels), the primary SIGSTOPped past `down-after-milliseconds` and resumed (it
must not go on accepting: the Sentinels demote it as it wakes), and the primary frozen for the
whole load (a partition: its connections answer nothing; the processes close them once the
Sentinels name the new primary, shared/primary_watch.py).
First, `redserve up` given only that URL serves (on the lab, before the deployment starts).
Replica 0 waits for a Redis replica to hold each admission
(`REDSERVE_ADMISSION_WAIT_REPLICAS=1`, a pipeline of the script and WAIT, reloaded by NOSCRIPT
on the new primary like any script); replica 1 does not. Streams start staggered over the
first half of the run, so admissions land during the failover too.
The stalls (the longest gap
between two events of a stream) are printed with -s; ops/benchmarks/failover.py measures them.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from ops.embedded_redis import free_port
from ops.testkit.failover_lab import FailoverLab, LabConfig
from tests.disturbed_load import body, load, summary
from tests.stack import (
    Stack,
    child_env,
    eventually,
    inspect,
    inspect_json,
    redserve_up,
    sync_client,
)

MODEL = "tiny-llama"
DOWN_AFTER_MS = 1000
STALL_MARGIN_S = 3.0  # no stream waits longer than down-after + this (2 s is the target;
# a loaded 2-vCPU machine measured up to 2.3 s past down-after: docs/benchmarks.md)


@dataclass
class Deployment:
    lab: FailoverLab
    stack: Stack
    undisturbed: list[str]
    duration_s: float

    @property
    def urls(self) -> list[str]:
        return [self.stack.url(0), self.stack.url(1)]

    def ready(self) -> bool:
        return all(httpx.get(f"{u}/ready", timeout=2).status_code == 200 for u in self.urls)


@pytest.fixture(scope="module")
def lab() -> Iterator[FailoverLab]:
    lab = FailoverLab(LabConfig(down_after_ms=DOWN_AFTER_MS)).start()
    yield lab
    lab.stop()


def test_up_given_a_sentinel_url_serves_and_is_quiet_while_its_worker_starts(
    lab: FailoverLab, tiny_model: Path
) -> None:
    """`redserve up` with only the redis+sentinel:// URL: it asks the Sentinels (no traceback
    from a parser of plain URLs), becomes ready, and answers the official client. Its API
    replica is up seconds before its worker: no "no live worker" warning for that."""
    port = free_port()
    env = child_env(lab.url, f"rstest-up-{port}")
    with redserve_up(env, port, tiny_model, MODEL) as up:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                               max_retries=0)
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=5)
        assert reply.choices[0].finish_reason in ("length", "stop")
        said = up.said()
        assert "Traceback" not in said and "does not answer" not in said, said
        assert "no live worker" not in said, said


@pytest.fixture(scope="module")
def deployment(lab: FailoverLab, tiny_model: Path) -> Iterator[Deployment]:
    # Speculation off: whether a position is computed as a decode or inside a multi-token
    # verification depends on how full each step is (drafting stops at STEP_TOKENS), which the
    # staggered load and the failover's stall change from run to run, and the torch kernels
    # round the two differently; the random model's near-ties then flipped a token of 2 of 32
    # streams in 2 of 5 full runs. This test is about Redis; a speculating worker continued
    # exactly after a crash is tests/test_speculation_stack.py's.
    stack = Stack(lab.url, tiny_model, served_name=MODEL, workers=2, replicas=1, env={
        "REDSERVE_HEARTBEAT_TTL_S": "2", "REDSERVE_DTYPE": "float32",
        "REDSERVE_KERNELS": "torch", "REDSERVE_MAX_RUNNING": "16",
        "REDSERVE_SPECULATION": "off"})
    try:
        stack.env["REDSERVE_ADMISSION_WAIT_REPLICAS"] = "1"
        stack.start()
        del stack.env["REDSERVE_ADMISSION_WAIT_REPLICAS"]
        stack.more_ports = [free_port()]  # the second replica, without the WAIT
        stack.spawn("api", "--host", "127.0.0.1", "--port", str(stack.more_ports[0]),
                    "--model", str(tiny_model), "--served-model-name", MODEL)
        stack.wait_http(120, stack.url(1))
        urls = [stack.url(0), stack.url(1)]
        t0 = time.monotonic()
        first = asyncio.run(load(urls, MODEL, None, 0))
        duration = time.monotonic() - t0
        assert all(o is not None and o.finish == "length" and o.ids_in_order for o in first)
        undisturbed = [o.text for o in first if o is not None]
        # Batch composition does not change a greedy text here (fp32, torch kernels).
        assert [o.text for o in asyncio.run(load(urls, MODEL, None, 0)) if o] == undisturbed
        yield Deployment(lab, stack, undisturbed, duration)
    finally:
        stack.stop()


def _unfinished(deployment: Deployment) -> str:
    """What the new primary holds of each request not done: its hash, whether it is still
    queued, and its record's length and last entry (how a hung stream is traced)."""
    client = sync_client(deployment.lab.url)
    prefix, lines = deployment.stack.prefix, []
    try:
        entries = client.hgetall(f"{prefix}:model:{{{MODEL}}}:entries")
        for key in client.scan_iter(match=f"{prefix}:{{*}}:*", count=1000):
            name = key.decode()
            if name.count(":") != 2 or name.endswith(":feed"):
                continue
            state = client.hgetall(key)
            if state.get(b"state") == b"done":
                continue
            record = client.xrange(f"{name}:out")
            last = record[-1][1].get(b"kind") if record else None
            rid = name.rsplit(":", 1)[1]
            lines.append(f"{rid}: {state}; queued entry {entries.get(rid.encode())}; record "
                         f"{len(record)} entries, last {last!r}")
    finally:
        client.close()
    return "\n".join(["unfinished requests on the new primary:", *lines])


def _disturbance(case: str, lab: FailoverLab, load_done: threading.Event
                 ) -> tuple[threading.Thread, list[int]]:
    """The thread that makes the primary go, and (filled in as it runs) the old primary. A
    frozen primary wakes only once the load has ended: meanwhile it holds every connection
    open to it, unanswered, as a primary cut off by a partition does."""
    old: list[int] = []

    def run() -> None:
        if case == "failover":
            old.append(lab.primary_port())
            lab.failover()
        elif case == "kill":
            old.append(lab.kill_primary())
        else:
            old.append(lab.pause_primary())
        # Past down-after, until the Sentinels have promoted the replica.
        lab.wait_primary_moved(old[0])
        if case in ("pause", "freeze"):
            if case == "pause":
                time.sleep(0.5)
            else:
                load_done.wait()
            lab.resume(old[0])

    return threading.Thread(target=run), old


@pytest.mark.parametrize("case", ["failover", "kill", "pause", "freeze"])
def test_in_flight_requests_end_identical_or_with_a_definite_error(
    deployment: Deployment, case: str
) -> None:
    lab = deployment.lab
    load_done = threading.Event()
    thread, old = _disturbance(case, lab, load_done)
    started = time.monotonic()
    spread = deployment.duration_s / 2
    outcomes = asyncio.run(load(deployment.urls, MODEL, thread, deployment.duration_s / 3,
                                spread))
    elapsed = time.monotonic() - started
    load_done.set()
    thread.join()
    counts, stall, text = summary(case, outcomes, deployment.undisturbed)
    print(f"{text}\n  {elapsed:.1f}s (undisturbed {deployment.duration_s:.1f}s)")
    if counts["hung"] or counts["changed"]:
        print(_unfinished(deployment))
    assert lab.primary_port() != old[0], "the primary did not move"
    assert counts["hung"] == 0 and counts["changed"] == 0, (text, deployment.stack.output())
    assert stall <= DOWN_AFTER_MS / 1000 + STALL_MARGIN_S, stall
    # One request per client request: no response id answers two streams.
    ids = [o.response_id for o in outcomes if o is not None and o.response_id]
    assert len(ids) == len(set(ids))
    if case == "kill":
        lab.restart(old[0])
    # The old primary is a replica now, and the deployment serves again unchanged.
    assert lab.wait_settled(), "the lab did not settle"
    assert eventually(deployment.ready, 30), deployment.stack.output()
    again = asyncio.run(load(deployment.urls, MODEL, None, 0))
    assert [o.text if o else None for o in again] == deployment.undisturbed, \
        deployment.stack.output()


def test_inspect_reads_the_deployment_through_the_sentinels(deployment: Deployment) -> None:
    """`redserve inspect`, given the same redis+sentinel:// URL, finds the current primary
    (after the failovers above, not the one the deployment started on)."""
    snap = inspect_json(deployment.stack)
    [model] = snap["models"]
    assert model["name"] == MODEL and len(model["live_workers"]) == 2
    gone = inspect(deployment.stack,
                   REDIS_URL=f"redis+sentinel://127.0.0.1:{free_port()}/nobody")
    assert gone.returncode == 2 and "cannot reach Redis" in gone.stderr


def test_an_admission_short_of_its_replicas_is_refused_and_never_runs(
    deployment: Deployment, tiny_model: Path
) -> None:
    """Asked for two Redis replicas where there is one, every admission gets 503 with
    Retry-After (the WAIT's timeout later), and the request it wrote is aborted: a worker
    that took it meanwhile stops it, long before its end."""
    stack = deployment.stack
    port = free_port()
    proc = stack.spawn("api", "--host", "127.0.0.1", "--port", str(port), "--model",
                       str(tiny_model), "--served-model-name", MODEL,
                       env={"REDSERVE_ADMISSION_WAIT_REPLICAS": "2",
                            "REDSERVE_ADMISSION_WAIT_MS": "200"})
    url = f"http://127.0.0.1:{port}"
    client = sync_client(deployment.lab.url)
    try:
        stack.wait_http(120, url)
        before = set(client.scan_iter(match=f"{stack.prefix}:*:abort"))
        request = {**body(0, MODEL), "stream": False, "max_tokens": 400}
        refused = httpx.post(f"{url}/v1/completions", json=request, timeout=30)
        assert refused.status_code == 503, refused.text
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "redis_unavailable"
        # Its request was written, then aborted: no worker runs it to its end.
        [abort] = set(client.scan_iter(match=f"{stack.prefix}:*:abort")) - before
        state = abort.removesuffix(b":abort")
        assert eventually(lambda: client.hget(state, "state") in (b"queued", b"aborted"), 20)
        assert int(client.hget(state, "completion_tokens") or 0) < 400
    finally:
        client.close()
        proc.terminate()
        proc.wait(20)
