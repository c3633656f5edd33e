"""The leak audit: 500 mixed requests through the real stack leave nothing behind.

Finished, cancelled at random points (streaming and not), over-long, refused by the bounded
queue, and hit by an injected worker error. Afterwards the API's request maps and the worker's
batch and KV are empty (read from their /metrics, as an operator would), every accepted request
ended with exactly one terminal entry, every key carries a TTL, and after the TTLs no key of
theirs remains.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections import Counter
from pathlib import Path

import httpx
import pytest
import redis

from ops.embedded_redis import free_port
from ops.testkit.probe import scrape
from shared.keys import Keys
from tests.stack import Stack, eventually

MODEL = "tiny-llama"
FAULT = 777
KINDS = ["stream", "whole", "stream_cancel", "whole_cancel", "too_long", "fault"]


async def _one(client: httpx.AsyncClient, rng: random.Random) -> str:
    kind = rng.choices(KINDS, weights=[35, 20, 15, 10, 10, 5])[0]
    prompt = [rng.randrange(3, 5000) for _ in range(rng.randrange(1, 40))]
    body: dict[str, object] = {"model": MODEL, "prompt": prompt, "temperature": 0.8,
                               "max_tokens": rng.randrange(1, 40)}
    if kind == "too_long":
        body["prompt"] = [rng.randrange(3, 5000) for _ in range(600)]
    if kind == "fault":
        body["prompt"] = [*prompt, FAULT]
    try:
        if kind.startswith("stream"):
            body["stream"] = True
            keep = rng.randrange(0, 6) if kind == "stream_cancel" else None
            async with client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    return f"{kind}:{response.status_code}"
                events = 0
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        events += 1
                        if keep is not None and events > keep:
                            return f"{kind}:cancelled"
                        if '"error"' in line:
                            return f"{kind}:error_event"
            return f"{kind}:done"
        timeout = rng.uniform(0.01, 0.3) if kind == "whole_cancel" else 60
        response = await client.post("/v1/completions", json=body, timeout=timeout)
        return f"{kind}:{response.status_code}"
    except httpx.TimeoutException:
        return f"{kind}:cancelled"


@pytest.mark.timeout(300)
def test_500_mixed_requests_leave_nothing_behind(
    redis_url: str, tiny_model: Path, sync_redis: redis.Redis
) -> None:
    worker_metrics = f"http://127.0.0.1:{free_port()}/metrics"
    stack = Stack(redis_url, tiny_model, served_name=MODEL, env={
        "REDSERVE_FAULT_TOKEN_ID": str(FAULT),
        "REDSERVE_MAX_RUNNING": "8",
        "REDSERVE_MAX_QUEUED_REQUESTS": "12",
        "REDSERVE_QUEUE_TIMEOUT_S": "5",
        "REDSERVE_REQUEST_TTL_S": "45", "REDSERVE_REQUEST_TIMEOUT_S": "40",
        "REDSERVE_FINISHED_TTL_S": "30",
        "REDSERVE_METRICS_PORT": worker_metrics.split(":")[2].split("/")[0],
    }).start()
    keys = Keys(stack.prefix)
    stream = keys.requests(MODEL)
    # Finished entries leave the request stream: note every one as it is added.
    accepted: set[str] = set()
    sniffing = threading.Event()
    sniffer = threading.Thread(target=_sniff, args=(redis_url, stream, accepted, sniffing))
    sniffer.start()
    try:
        async def run_all() -> Counter[str]:
            rng = random.Random(0)
            # 400 requests 16 at a time (the queue never fills), then a burst of 100 at once
            # (the bounded queue refuses part of it).
            limit = asyncio.Semaphore(16)
            async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
                async def bounded() -> str:
                    async with limit:
                        return await _one(client, rng)
                steady = await asyncio.gather(*(bounded() for _ in range(400)))
                burst = await asyncio.gather(*(_one(client, rng) for _ in range(100)))
            return Counter(steady + burst)

        outcomes = asyncio.run(run_all())
        sniffing.set()
        sniffer.join()
        print(sorted(outcomes.items()))  # shown with -s
        assert sum(outcomes.values()) == 500
        for expected in ("stream:done", "whole:200", "stream_cancel:cancelled",
                         "whole_cancel:cancelled", "too_long:400"):
            assert outcomes[expected] > 0, expected
        assert sum(n for o, n in outcomes.items() if o.endswith(":429")) > 0
        assert outcomes["fault:500"] + outcomes["fault:error_event"] > 0

        # In-memory state drains to zero, seen from outside through /metrics.
        api_metrics = f"{stack.base_url}/metrics"
        assert eventually(lambda: scrape(api_metrics)["redserve_api_inflight_requests"] == 0)
        api = scrape(api_metrics)
        assert api["redserve_api_result_queues"] == 0
        assert api["redserve_api_buffered_results"] == 0
        # The worker may still be ending cancelled or timed-out requests on a loaded machine:
        # once it holds none, not one KV page may be left referenced.
        assert eventually(lambda: (lambda w: w["redserve_worker_running_requests"] == 0
                                   and w["redserve_worker_waiting_requests"] == 0)(
                                       scrape(worker_metrics)), 30)
        worker = scrape(worker_metrics)
        assert worker["redserve_worker_kv_pages_used"] == 0
        assert worker["redserve_worker_step_failures_total"] > 0

        # Every accepted request ended with exactly one terminal entry, and the request stream
        # holds none of them any more.
        assert len(accepted) > 100
        assert eventually(lambda: sync_redis.xlen(stream) == 0, 10)
        assert eventually(lambda: all(
            sync_redis.hget(keys.state(rid), "state") in (b"done", b"aborted", b"error")
            for rid in accepted), 10)
        pipe = sync_redis.pipeline()
        for rid in accepted:
            pipe.xrange(keys.out(rid))
        for rid, entries in zip(accepted, pipe.execute(), strict=True):
            kinds = [f[b"kind"] for _, f in entries]
            assert kinds and kinds.count(b"finish") + kinds.count(b"error") == 1, rid
            assert kinds[-1] in (b"finish", b"error"), rid

        # Every key carries a TTL; those of the model, the worker (heartbeat, prefix summary)
        # and the replica's feed are refreshed while they live.
        refreshed = (keys.worker("").encode(), keys.prefixes("").encode(),
                     keys.workers(MODEL).encode(), stream.encode(),
                     keys.queued(MODEL).encode(), keys.entries(MODEL).encode(),
                     keys.service(MODEL).encode(), keys.aborts.encode())

        def request_keys() -> list[bytes]:
            return [k for k in sync_redis.scan_iter(match=f"{stack.prefix}:*", count=1000)
                    if not k.startswith(refreshed) and not k.endswith(b":feed")]

        everything = list(sync_redis.scan_iter(match=f"{stack.prefix}:*", count=1000))
        for key in everything:
            assert sync_redis.ttl(key) != -1, key  # -1: no TTL (-2: expired meanwhile)
        # And after the TTLs nothing of theirs remains.
        assert eventually(lambda: not request_keys(), 60), request_keys()[:5]
    finally:
        sniffing.set()
        stack.stop()


def _sniff(url: str, stream: str, ids: set[str], stop: threading.Event) -> None:
    r = redis.Redis.from_url(url)
    last: bytes | str = "$"
    while not stop.is_set():
        for _, entries in r.xread({stream: last}, block=200) or []:
            for entry_id, fields in entries:
                last = entry_id
                ids.add(fields[b"id"].decode())
    r.close()
