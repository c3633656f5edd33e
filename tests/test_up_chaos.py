"""Chaos under `redserve up`: its worker is killed every few seconds while 100 greedy requests
run. `up` restarts it each time under the same name; the new process takes back the requests
pending under that name and resumes each from the tokens already published. Every request
finishes with exactly the text of an undisturbed run, and the request stream is empty after.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import redis

from ops.embedded_redis import free_port
from shared.keys import WORKER_GROUP, Keys
from tests.stack import child_env, eventually, redserve_up

MODEL = "tiny-llama"
REQUESTS = 100
# Each restart waits longer (the supervisor's backoff): four kills keep the test short.
MAX_KILLS = 4


def _children(ppid: int, role: str) -> list[int]:
    """Pids of the `redserve <role>` children of `ppid`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            argv = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(fields[1]) == ppid and fields[0] != "Z" and role.encode() in argv:
            found.append(int(stat.parent.name))
    return found


async def _run_all(url: str) -> list[str]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        replies = await asyncio.gather(*(client.post("/v1/completions", json={
            "model": MODEL, "prompt": [60 + i, 7, 400 + 7 * i, 9, 1500 + 11 * i],
            "max_tokens": 200, "temperature": 0, "ignore_eos": True}) for i in range(REQUESTS)))
    assert [r.status_code for r in replies] == [200] * REQUESTS, [
        r.text for r in replies if r.status_code != 200][:3]
    return [r.json()["choices"][0]["text"] for r in replies]


def test_worker_killed_every_few_seconds_under_up_loses_and_changes_nothing(
    redis_url: str, tiny_model: Path, sync_redis: redis.Redis
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = child_env(redis_url, f"rstest-up-{port}", REDSERVE_HEARTBEAT_TTL_S="2",
                    REDSERVE_DTYPE="float32", REDSERVE_MAX_DELIVERIES="1000",
                    REDSERVE_QUEUE_TIMEOUT_S="300", REDSERVE_REQUEST_TIMEOUT_S="300")
    keys = Keys(env["REDSERVE_KEY_PREFIX"])
    with redserve_up(env, port, tiny_model, MODEL) as up:
        undisturbed = asyncio.run(_run_all(url))

        kills: list[int] = []

        def killer(done: threading.Event) -> None:
            """Once the (re)started worker serves (each start logs "serving" once), let it
            work a second, then kill it; again, up to MAX_KILLS times or until the load is
            over."""
            while not done.is_set() and len(kills) < MAX_KILLS:
                if up.said().count(" serving ") <= len(kills):
                    done.wait(0.2)
                    continue
                if done.wait(1.0):
                    return
                for pid in _children(up.proc.pid, "worker"):
                    os.kill(pid, signal.SIGKILL)
                    kills.append(pid)

        done = threading.Event()
        chaos = threading.Thread(target=killer, args=(done,))
        t0 = time.monotonic()
        chaos.start()
        try:
            texts = asyncio.run(_run_all(url))
        finally:
            done.set()
            chaos.join()
        print(f"{len(kills)} kills in {time.monotonic() - t0:.0f}s")  # shown with -s
        assert len(kills) >= 2, f"only {len(kills)} kill(s) in {time.monotonic() - t0:.0f}s"
        assert texts == undisturbed
        said = up.said()
        assert said.count("killed by SIGKILL") >= len(kills) and "restarting in" in said
        stream = keys.requests(MODEL)
        assert eventually(lambda: sync_redis.xlen(stream) == 0
                          and sync_redis.xpending(stream, WORKER_GROUP)["pending"] == 0, 30)
        assert up.proc.poll() is None  # `up` itself never stopped
