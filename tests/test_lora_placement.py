"""Placement by LoRA adapter (api/queue/placement.py): a request naming an adapter goes to a
live worker whose heartbeat says it holds it, unless that worker has no room; a request for an
adapter no worker holds goes to the least loaded, and the next one for it follows there before
any heartbeat shows it. The heartbeats are written to a real Redis as a worker writes them
(worker/broker/presence.py); a real worker's own heartbeat is in tests/test_lora_stack.py.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import redis.asyncio as aioredis

from api.queue.metrics import APIMetrics
from api.queue.placement import Placement
from shared.keys import Keys
from shared.messages import Heartbeat

PROMPT = list(range(1, 40))


async def _placement(redis_url: str, beats: dict[str, Heartbeat]) -> Placement:
    redis = aioredis.Redis.from_url(redis_url)
    keys = Keys(f"rstest-lora-place-{uuid.uuid4().hex[:8]}")
    for name, beat in beats.items():
        await redis.set(keys.worker(name), beat.to_json(), ex=30)
        await redis.zadd(keys.workers("m"), {name: time.time() + 30})
    placement = Placement(redis, keys, ["m"], "prefix", APIMetrics(), remember_s=10.0)
    await placement.refresh()
    return placement


def _beat(running: int, loras: tuple[str, ...], capacity: int = 8) -> Heartbeat:
    return Heartbeat(model="m", capacity=capacity, running=running, loras=loras)


def test_a_request_goes_to_the_worker_holding_its_adapter(redis_url: str) -> None:
    async def main() -> None:
        placement = await _placement(redis_url, {
            "w1": _beat(0, ("a",)), "w2": _beat(5, ("b", "c"))})
        assert placement.place("m", "", PROMPT, "b") == "w2"  # though w1 is less loaded
        assert placement.place("m", "", PROMPT, "a") == "w1"
        assert placement.place("m", "", PROMPT, "") == "w1"  # a base request: the least loaded
        await placement.redis.aclose()

    asyncio.run(main())


def test_a_full_holder_loses_to_the_least_loaded(redis_url: str) -> None:
    async def main() -> None:
        placement = await _placement(redis_url, {
            "w1": _beat(8, ("a",)), "w2": _beat(2, ())})
        assert placement.place("m", "", PROMPT, "a") == "w2"  # w1 has no room: a cold load
        await placement.redis.aclose()

    asyncio.run(main())


def test_an_adapter_no_worker_holds_is_loaded_on_one_worker(redis_url: str) -> None:
    """A burst for a new adapter: the first goes to the least loaded, the rest follow it there
    (it loads it) while they fit, though the other worker becomes the less loaded."""
    async def main() -> None:
        placement = await _placement(redis_url, {
            "w1": _beat(1, ("a",)), "w2": _beat(2, ("b",))})
        first = placement.place("m", "", PROMPT, "new")
        assert first == "w1"
        assert [placement.place("m", "", [7, *PROMPT], "new") for _ in range(3)] == ["w1"] * 3
        await placement.redis.aclose()

    asyncio.run(main())


def test_the_heartbeat_carries_the_adapters() -> None:
    beat = Heartbeat(model="m", loras=("a", "b"))
    assert Heartbeat.from_json(beat.to_json()).loras == ("a", "b")
    assert Heartbeat.from_json(b'{"model": "m"}').loras == ()  # a worker of an older version
    with pytest.raises(ValueError, match="'loras' is not a list of names"):
        Heartbeat.from_json(b'{"loras": "a"}')
