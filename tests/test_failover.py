"""Redis failing over under load: every request in flight ends with the text an undisturbed
run gives, or with a definite error; none hangs, none shows a token twice or misses one.

Real processes throughout: a Valkey primary, its replica and three Sentinels on loopback
(`ops/failover_lab.py`), two API replicas and two workers given only the redis+sentinel://
URL, and streams read over HTTP. Three ways the primary goes, one test each, on one shared
deployment (the cases run in order; each leaves the lab settled again): a `SENTINEL FAILOVER`,
the primary SIGKILLed (then started again empty, as an orchestrator would, and made a replica
by the Sentinels), the primary SIGSTOPped past `down-after-milliseconds` and resumed (it
must not go on accepting: the Sentinels demote it as it wakes), and the primary frozen for the
whole load (a partition: its connections answer nothing, until the socket timeouts).
Replica 0 waits for a Redis replica to hold each admission
(`REDSERVE_ADMISSION_WAIT_REPLICAS=1`, a pipeline of the script and WAIT, reloaded by NOSCRIPT
on the new primary like any script); replica 1 does not. Streams start staggered over the
first half of the run, so admissions land during the failover too.
The stalls (the longest gap
between two events of a stream) are printed with -s; ops/benchmarks/failover.py measures them.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson
import pytest

from ops.embedded_redis import free_port
from ops.failover_lab import FailoverLab, LabConfig
from tests.stack import Stack, eventually, inspect, inspect_json, sync_client

MODEL = "tiny-llama"
STREAMS = 32
MAX_TOKENS = 160
HANG_S = 60.0  # a request not ended this long after the disturbance hangs
DOWN_AFTER_MS = 1000


@dataclass(frozen=True)
class Outcome:
    text: str
    finish: str  # the finish reason, or the error's code
    ended_by_error: bool
    ids_in_order: bool  # SSE event ids 0, 1, 2, ... with nothing after the last
    stall_s: float  # the longest wait for an event, from the request's start
    response_id: str = ""


def _body(i: int) -> dict[str, object]:
    return {"model": MODEL, "prompt": [40 + i, 7, 200 + 13 * i, 9, 900 + i],
            "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}


async def _stream(client: httpx.AsyncClient, url: str, body: dict[str, object]) -> Outcome:
    """One stream, read to its end: what a client saw."""
    parts: list[str] = []
    finish, error, response_id = "", False, ""
    ids: list[int] = []
    after_end = 0
    last = time.monotonic()
    stall = 0.0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            detail = orjson.loads(response.content)["error"]
            # Refused before the first byte: an OpenAI error object, and when to retry.
            definite = response.status_code == 503 and "retry-after" in response.headers
            return Outcome("", detail["code"] if definite else f"http {response.status_code}",
                           definite, True, 0.0)
        event_id: int | None = None
        async for line in response.aiter_lines():
            now = time.monotonic()
            stall, last = max(stall, now - last), now
            if line.startswith("id: "):
                event_id = int(line[4:])
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if finish:
                after_end += 1
            event = orjson.loads(line[6:])
            if event_id is not None:
                ids.append(event_id)
            if "error" in event:
                finish, error = event["error"]["code"], True
                continue
            response_id = event["id"]
            choice = event["choices"][0]
            parts.append(choice["text"])
            finish = choice["finish_reason"] or finish
    in_order = ids == list(range(ids[0], ids[0] + len(ids))) if ids else True
    return Outcome("".join(parts), finish, error, in_order and after_end == 0,
                   max(stall, time.monotonic() - last) if not parts else stall, response_id)


async def _load(urls: list[str], disturb: threading.Thread | None, at_s: float,
                spread_s: float = 0.0) -> list[Outcome | None]:
    """STREAMS streams over the replicas in turn, started evenly over `spread_s`; `disturb`
    started `at_s` in. None: hung."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(HANG_S, connect=5.0)) as client:
        async def one(i: int) -> Outcome | None:
            await asyncio.sleep(spread_s * i / STREAMS)
            try:
                async with asyncio.timeout(HANG_S + at_s):
                    return await _stream(client, urls[i % len(urls)], _body(i))
            except (TimeoutError, httpx.ReadTimeout):
                return None

        tasks = [asyncio.create_task(one(i)) for i in range(STREAMS)]
        if disturb is not None:
            await asyncio.sleep(at_s)
            disturb.start()
        return await asyncio.gather(*tasks)


def classify(outcome: Outcome | None, whole: str) -> str:
    """identical, error (a definite error, the text before it a prefix of the whole), hung,
    or changed (a token twice, missing, or different: what must never happen)."""
    if outcome is None:
        return "hung"
    if not outcome.ids_in_order:
        return "changed"
    if outcome.ended_by_error:
        return "error" if whole.startswith(outcome.text) else "changed"
    return "identical" if outcome.finish == "length" and outcome.text == whole else "changed"


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
def deployment(tiny_model: Path) -> Iterator[Deployment]:
    lab = FailoverLab(LabConfig(down_after_ms=DOWN_AFTER_MS)).start()
    stack = Stack(lab.url, tiny_model, served_name=MODEL, workers=2, replicas=1, env={
        "REDSERVE_HEARTBEAT_TTL_S": "2", "REDSERVE_DTYPE": "float32",
        "REDSERVE_KERNELS": "torch", "REDSERVE_MAX_RUNNING": "16"})
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
        first = asyncio.run(_load(urls, None, 0))
        duration = time.monotonic() - t0
        assert all(o is not None and o.finish == "length" and o.ids_in_order for o in first)
        undisturbed = [o.text for o in first if o is not None]
        # Batch composition does not change a greedy text here (fp32, torch kernels).
        assert [o.text for o in asyncio.run(_load(urls, None, 0)) if o] == undisturbed
        yield Deployment(lab, stack, undisturbed, duration)
    finally:
        stack.stop()
        lab.stop()


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
    outcomes = asyncio.run(_load(deployment.urls, thread, deployment.duration_s / 3, spread))
    elapsed = time.monotonic() - started
    load_done.set()
    thread.join()
    kinds = [classify(o, whole) for o, whole in zip(outcomes, deployment.undisturbed,
                                                     strict=True)]
    counts = Counter(kinds)
    stalls = sorted(o.stall_s for o in outcomes if o is not None)
    errors = Counter(o.finish for o in outcomes if o is not None and o.ended_by_error)
    print(f"{case}: {dict(counts)}; errors {dict(errors)}; "
          f"stall p50 {statistics.median(stalls):.2f}s max {stalls[-1]:.2f}s; "
          f"{elapsed:.1f}s (undisturbed {deployment.duration_s:.1f}s)")
    assert lab.primary_port() != old[0], "the primary did not move"
    assert counts["hung"] == 0 and counts["changed"] == 0, (counts, deployment.stack.output())
    # One request per client request: no response id answers two streams.
    ids = [o.response_id for o in outcomes if o is not None and o.response_id]
    assert len(ids) == len(set(ids))
    if case == "kill":
        lab.restart(old[0])
    # The old primary is a replica now, and the deployment serves again unchanged.
    assert lab.wait_settled(), "the lab did not settle"
    assert eventually(deployment.ready, 30), deployment.stack.output()
    again = asyncio.run(_load(deployment.urls, None, 0))
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
        body = {**_body(0), "stream": False, "max_tokens": 400}
        refused = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
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
