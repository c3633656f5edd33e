"""Speculative decoding through real processes: the official openai client streams the same
text with speculation on and off (the body's `speculation` field), the worker's metrics and
heartbeat count the drafts, and a worker killed while speculating hands its streams to another
that continues them exactly (fp32, the pure-torch kernels: greedy continuation is the same
tokens whatever the batch)."""

from __future__ import annotations

import asyncio
import signal
import socket
from pathlib import Path

import httpx
import openai
import orjson
import pytest
import redis

from ops.embedded_redis import free_port
from ops.testkit.probe import scrape
from shared.keys import WORKER_GROUP, Keys
from tests.stack import Stack, eventually, inspect_json

MODEL = "tiny-llama"
FP32 = {"REDSERVE_DTYPE": "float32", "REDSERVE_KERNELS": "torch"}
# Text that repeats: a random model's greedy continuation of it soon loops too, so drafts are
# proposed and accepted.
PROMPT = "one two three four five six seven eight nine ten " * 6
MID_STREAM = 8  # events every stream has had when its worker is killed


def _stream(client: openai.OpenAI, speculation: bool, chat: bool) -> str:
    extra = {"ignore_eos": True, "speculation": speculation}
    if chat:
        chunks = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=120,
            temperature=0, stream=True, extra_body=extra)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    completions = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=120,
                                            temperature=0, stream=True, extra_body=extra)
    return "".join(c.choices[0].text for c in completions if c.choices)


def test_openai_streams_are_the_same_with_speculation_and_metrics_count_it(
        redis_url: str, tiny_model: Path) -> None:
    port = free_port()
    stack = Stack(redis_url, tiny_model, served_name=MODEL,
                  env={**FP32, "REDSERVE_METRICS_PORT": str(port)}).start()
    try:
        client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused")
        for chat in (False, True):
            off = _stream(client, False, chat)
            assert len(off) > 100
            assert _stream(client, True, chat) == off
        bad = httpx.post(f"{stack.base_url}/v1/completions", json={
            "model": MODEL, "prompt": "hi", "speculation": "sometimes"})
        assert bad.status_code == 400, bad.text

        worker = scrape(f"http://127.0.0.1:{port}/metrics")
        drafts = worker["redserve_worker_draft_tokens_total"]
        accepted = worker["redserve_worker_draft_tokens_accepted_total"]
        assert 0 < accepted <= drafts
        assert worker["redserve_worker_draft_acceptance_ratio"] == pytest.approx(
            accepted / drafts)
        assert worker["redserve_worker_tokens_per_request_step"] > 1.0
        # Every token still observed one gap (zero for those that came with another).
        assert worker[f'redserve_worker_inter_token_seconds_count{{model="{MODEL}"}}'] >= 4 * 119

        def shown() -> bool:
            workers = inspect_json(stack)["workers"]
            return bool(workers) and (workers[0]["draft_acceptance"] or 0) > 0
        assert eventually(shown, 15)
    finally:
        stack.stop()


async def _text(client: httpx.AsyncClient, i: int, speculation: bool, progress: list[int],
                mid_stream: asyncio.Event) -> tuple[str, str]:
    """Stream `i`'s text and finish reason. `progress[i]` counts the events it has had;
    `mid_stream` is set once every stream has had `MID_STREAM`."""
    body = {"model": MODEL, "prompt": f"{i} {PROMPT}", "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True, "speculation": speculation}
    parts, finish = [], ""
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                event = orjson.loads(line[6:])
                if "error" in event:
                    return "".join(parts), event["error"]["code"]
                parts.append(event["choices"][0]["text"])
                finish = event["choices"][0]["finish_reason"] or finish
                progress[i] += 1
                if min(progress) >= MID_STREAM:
                    mid_stream.set()
    return "".join(parts), finish


def test_a_speculating_worker_killed_mid_stream_is_continued_exactly(
        redis_url: str, sync_redis: redis.Redis, tiny_model: Path) -> None:
    streams = 3  # few: every step of theirs drafts
    stack = Stack(redis_url, tiny_model, served_name=MODEL, workers=2,
                  env={**FP32, "REDSERVE_HEARTBEAT_TTL_S": "2"}).start()
    keys = Keys(stack.prefix)
    try:
        async def run(speculation: bool, kill: bool) -> list[tuple[str, str]]:
            progress, mid_stream = [0] * streams, asyncio.Event()
            async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as client:
                texts = asyncio.gather(*(_text(client, i, speculation, progress, mid_stream)
                                         for i in range(streams)))
                if kill:  # whichever worker holds a request (either may hold all three)
                    names = [f"{socket.gethostname()}-{stack.worker_proc(i).pid}"
                             for i in range(2)]

                    def held(name: str) -> list[dict[str, object]]:
                        return sync_redis.xpending_range(keys.requests(MODEL), WORKER_GROUP,
                                                         "-", "+", 100, consumername=name)

                    # Mid-stream: every stream speculating, most of its 400 tokens to go. A
                    # fixed sleep let a fast machine finish them all first (the terminal
                    # entries written, only the batched XACK left), so nothing was continued.
                    await asyncio.wait_for(mid_stream.wait(), 60)
                    victim = next(i for i, n in enumerate(names) if held(n))
                    stack.worker_proc(victim).send_signal(signal.SIGSTOP)  # it ends nothing now
                    assert min(progress) < 100, progress
                    orphans.extend(held(names[victim]))
                    stack.worker_proc(victim).send_signal(signal.SIGKILL)
                    stack.worker_proc(victim).wait()
                    survivors.append(1 - victim)
                return list(await texts)

        orphans: list[dict[str, object]] = []
        survivors: list[int] = []
        plain = asyncio.run(run(False, False))
        assert [finish for _, finish in plain] == ["length"] * streams
        disturbed = asyncio.run(run(True, True))
        assert orphans, "the killed worker held no request: nothing was taken over"
        assert disturbed == plain, stack.output()
        # The survivor speculated on what it took over (its next heartbeat says so).
        pid = stack.worker_proc(survivors[0]).pid
        assert eventually(lambda: scrape_worker_drafts(sync_redis, keys, pid) > 0, 10)
    finally:
        stack.stop()


def scrape_worker_drafts(r: redis.Redis, keys: Keys, pid: int) -> int:
    beat = orjson.loads(r.get(keys.worker(f"{socket.gethostname()}-{pid}")) or b"{}")
    return int(beat.get("draft_tokens", 0))
