"""Which queued request a worker takes (worker/broker/take.py), against a real Redis: a light
tenant's request ahead of a heavy tenant's backlog, weights, priority, the starvation bound, placed
requests honoured and released, FIFO when asked, the VTC lift at admission, recovery leaving
queued entries alone; and through a real worker, the take order end to end."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
import redis
import redis.asyncio as aioredis

from api.queue.admission import Admission, QueueLimits
from shared.keys import QUEUED_CONSUMER, WORKER_GROUP, Keys
from shared.messages import (
    GenerateRequest,
    QueueMember,
    SamplingParams,
    ServiceCounters,
    Tokens,
    decode_result,
    expand,
    is_terminal,
)
from tests.stack import Stack, eventually
from worker.broker.recovery import Recovery
from worker.broker.take import Room, TakePolicy, Taker

MODEL = "fair-model"


def _policy(fair: bool = True, starvation_after_s: float = 30.0,
            placement_wait_s: float = 1.5) -> TakePolicy:
    return TakePolicy(fair, starvation_after_s, placement_wait_s, queue_timeout_s=60.0,
                      service_ttl_s=600, burst=0)


def _request(tenant: str, *, prompt: int = 4, priority: int = 0, weight: float = 1.0,
             worker: str = "", created: float | None = None) -> GenerateRequest:
    now = time.time() if created is None else created
    return GenerateRequest(
        id=f"{uuid.uuid4().hex[:8]}-{uuid.uuid4().hex[:24]}", model=MODEL,
        prompt_ids=tuple(range(1, prompt + 1)), params=SamplingParams(max_tokens=4),
        created=now, queue_deadline=now + 60, deadline=now + 120, tenant=tenant,
        priority=priority, weight=weight, worker=worker)


class Queue:
    """The API's admission and workers' takers over one test's own key prefix."""

    def __init__(self, r: aioredis.Redis, keys: Keys) -> None:
        self.r = r
        self.keys = keys
        self.admission = Admission(r, keys, QueueLimits(1000, 10**9, 60.0, 1000), 600)

    async def add(self, *requests: GenerateRequest, at: float | None = None) -> None:
        for req in requests:
            assert (await self.admission.try_enqueue(req)).refused is None
            if at is not None:  # backdate its place in the queue
                await self.r.zadd(self.keys.queued(MODEL), {req.queue_member: at})

    def taker(self, name: str = "w1", **policy: object) -> Taker:
        return Taker(self.r, self.keys, MODEL, name, _policy(**policy))  # type: ignore[arg-type]

    async def take(self, taker: Taker, room: int | Room) -> list[str]:
        taken = await taker.take(room if isinstance(room, Room) else Room(room), charge=True)
        return [GenerateRequest.from_fields(f).id for _, f in taken.entries]


@pytest_asyncio.fixture
async def queue(redis_url: str) -> AsyncIterator[Queue]:
    r = aioredis.Redis.from_url(redis_url)
    keys = Keys(f"rsfair-{uuid.uuid4().hex[:8]}")
    yield Queue(r, keys)
    found = [k async for k in r.scan_iter(f"{keys.prefix}:*")]
    if found:
        await r.delete(*found)
    await r.aclose()


@pytest.fixture
def sync(redis_url: str) -> Iterator[redis.Redis]:
    r = redis.Redis.from_url(redis_url)
    yield r
    r.close()


async def test_a_light_tenant_is_taken_ahead_of_a_heavy_backlog(queue: Queue) -> None:
    flood = [_request("heavy") for _ in range(6)]
    await queue.add(*flood)
    taker = queue.taker()
    assert await queue.take(taker, 2) == [flood[0].id, flood[1].id]
    light = _request("light")
    await queue.add(light)  # lifted to heavy's 8 prompt tokens: idle time banks no credit
    # heavy's two requests generate 10 tokens, charged with the next take: light goes first,
    # then heavy's oldest.
    taker.tally.add("heavy", 10.0)
    assert await queue.take(taker, 2) == [light.id, flood[2].id]
    counters = ServiceCounters.decode(await queue.r.hgetall(queue.keys.service(MODEL)))
    assert counters.by_tenant == {"heavy": 22.0, "light": 12.0}


async def test_fifo_takes_the_oldest_whatever_the_tenant(queue: Queue) -> None:
    flood = [_request("heavy") for _ in range(3)]
    light = _request("light", priority=-5)
    await queue.add(*flood, light)
    taker = queue.taker(fair=False)
    assert await queue.take(taker, 4) == [*(r.id for r in flood), light.id]


async def test_weights_and_output_tokens_share_the_service(queue: Queue) -> None:
    a = [_request("a", weight=2.0) for _ in range(4)]
    b = [_request("b") for _ in range(4)]
    await queue.add(*a, *b)
    taker = queue.taker()
    # Each take charges 4 prompt tokens: 2 for a (weight 2), 4 for b; ties go to the oldest.
    order = [await queue.take(taker, 1) for _ in range(6)]
    tenants = ["a" if o[0] in {r.id for r in a} else "b" for o in order]
    assert tenants == ["a", "b", "a", "a", "b", "a"]
    # Output tokens reported by the worker count too: b generated little, a a lot.
    taker.tally.add("a", 100.0)
    assert await queue.take(taker, 1) == [b[2].id]


async def test_priority_comes_before_the_tenant_share(queue: Queue) -> None:
    taker = queue.taker()
    await queue.add(_request("light"))
    await queue.take(taker, 1)  # light now has service, heavy none
    urgent = _request("light", priority=-1)
    later = _request("heavy", priority=3)
    normal = _request("heavy")
    await queue.add(later, normal, urgent)
    assert await queue.take(taker, 3) == [urgent.id, normal.id, later.id]


async def test_a_starving_request_goes_first(queue: Queue) -> None:
    taker = queue.taker(starvation_after_s=5.0)
    old = _request("heavy", priority=9)
    await queue.add(old, at=time.time() - 6)
    fresh = _request("light", priority=-9)
    await queue.add(fresh)
    assert await queue.take(taker, 1) == [old.id]


async def test_placed_requests_wait_for_their_worker_then_anyone_takes_them(
        queue: Queue) -> None:
    w1, w2 = queue.taker("w1", placement_wait_s=0.6), queue.taker("w2", placement_wait_s=0.6)
    await queue.r.zadd(queue.keys.workers(MODEL), {"w1": time.time() + 30,
                                                  "w2": time.time() + 30})
    placed = _request("t", worker="w1")
    await queue.add(placed)
    taken = await w2.take(Room(4))
    assert taken.entries == [] and 0 < taken.retry_ms <= 600 and taken.last_id
    assert await queue.take(w1, 4) == [placed.id]
    # Placed on w1 but w1 does not take it in time: anyone may.
    late = _request("t", worker="w1")
    await queue.add(late)
    await asyncio.sleep(0.7)
    assert await queue.take(w2, 4) == [late.id]
    # Placed on a worker that is not live: anyone's at once.
    orphan = _request("t", worker="gone")
    await queue.add(orphan)
    assert await queue.take(w2, 4) == [orphan.id]


async def test_take_claims_as_a_first_delivery_and_frees_the_place(
        queue: Queue, sync: redis.Redis) -> None:
    req, other = _request("t"), _request("t")
    await queue.add(req, other)
    stream = queue.keys.requests(MODEL)
    pending = sync.xpending_range(stream, WORKER_GROUP, "-", "+", 10)
    assert {p["consumer"].decode() for p in pending} == {QUEUED_CONSUMER}
    assert await queue.take(queue.taker("w1"), 1) == [req.id]
    first, _ = sync.xpending_range(stream, WORKER_GROUP, "-", "+", 10)
    assert (first["consumer"].decode(), first["times_delivered"]) == ("w1", 1)
    assert sync.zrange(queue.keys.queued(MODEL), 0, -1) == [other.queue_member.encode()]
    assert sync.hkeys(queue.keys.entries(MODEL)) == [other.id.encode()]
    for key in (queue.keys.queued(MODEL), queue.keys.entries(MODEL),
                queue.keys.service(MODEL), stream):
        assert sync.ttl(key) > 0, key


async def test_a_cancelled_queued_request_is_handed_out_to_be_ended(
        queue: Queue, sync: redis.Redis) -> None:
    """The API removes a cancelled request's member; its entry still goes to a worker (which
    ends it: abort), ahead of the rest, and nothing of it stays queued."""
    keep, cancelled = _request("t"), _request("t")
    await queue.add(keep, cancelled)
    await queue.r.zrem(queue.keys.queued(MODEL), cancelled.queue_member)
    assert await queue.take(queue.taker(), 1) == [cancelled.id]
    assert sync.hlen(queue.keys.entries(MODEL)) == 1
    assert await queue.take(queue.taker(), 1) == [keep.id]


async def test_a_tenant_back_from_idle_starts_at_the_least_served(queue: Queue) -> None:
    taker = queue.taker()
    await queue.r.hset(queue.keys.service(MODEL), mapping={"busy": 500, "idle": 10})
    await queue.add(_request("busy"), _request("busy"))
    await queue.add(_request("idle"))  # idle had nothing queued: lifted to busy's 500
    counters = ServiceCounters.decode(await queue.r.hgetall(queue.keys.service(MODEL)))
    assert counters.by_tenant["idle"] == 500
    assert len(await queue.take(taker, 3)) == 3


async def test_recovery_never_claims_queued_entries(queue: Queue, sync: redis.Redis) -> None:
    queued = [_request("t") for _ in range(3)]
    await queue.add(*queued)
    await asyncio.sleep(0.05)
    recovery = Recovery(queue.r, queue.keys, MODEL, "w2", reclaim_after_s=0.01)
    # An entry a dead worker held: claimed; the queued ones are not.
    taken = await queue.take(queue.taker("dead"), 1)
    await asyncio.sleep(0.05)
    claimed = await recovery.claim(10)
    assert [c.request.id for c in claimed] == taken
    assert claimed[0].deliveries == 2
    owners = {p["consumer"].decode()
              for p in sync.xpending_range(queue.keys.requests(MODEL), WORKER_GROUP, "-", "+",
                                           10)}
    assert owners == {QUEUED_CONSUMER, "w2"}
    assert sync.zcard(queue.keys.queued(MODEL)) == 2


async def test_the_burst_is_for_tenants_under_their_share_of_the_batch(queue: Queue) -> None:
    heavy = [_request("heavy") for _ in range(3)]
    light, other = [_request("light"), _request("light")], _request("other")
    await queue.add(*heavy, *light, other)
    taker = queue.taker()
    # Full (no regular room) with a batch of 6: three tenants, a share of 2 each. Heavy holds
    # 5, light 1: a burst of three takes light's and other's, not heavy's.
    held = {"heavy": 5, "light": 1}
    assert await queue.take(taker, Room(0, 3, 6, held)) == [light[0].id, other.id]
    # Light now holds its share: only the regular room serves it (the fairest first).
    assert await queue.take(taker, Room(0, 3, 6, {"heavy": 5, "light": 2, "other": 1})) == []
    assert await queue.take(taker, Room(1, 0, 6, {"heavy": 5, "light": 2})) == [heavy[0].id]


# --- through a real worker ----------------------------------------------------------------------

WORKER = "fair-w1"


@pytest.fixture(scope="module")
def one_slot(redis_url: str, tiny_model: Path) -> Iterator[Stack]:
    """A worker with room for one request at a time and a burst of one, steps of 10 ms,
    placement wait 1 s."""
    stack = Stack(redis_url, tiny_model, served_name=MODEL, api=False, env={
        "REDSERVE_MAX_RUNNING": "1", "REDSERVE_FAIR_BURST": "1",
        "REDSERVE_SYNTHETIC_STEP_MS": "10",
        "REDSERVE_WORKER_NAME": WORKER, "REDSERVE_PLACEMENT_WAIT_S": "1.0"}).start()
    try:
        yield stack
    finally:
        stack.stop()


def _first_token(r: redis.Redis, keys: Keys, request_id: str) -> tuple[str, Tokens] | None:
    for entry_id, fields in r.xrange(keys.out(request_id)):
        for entry in expand(decode_result(fields)):
            if isinstance(entry, Tokens):
                return entry_id.decode(), entry
    return None


def _ended(r: redis.Redis, keys: Keys, request_id: str) -> bool:
    last = r.xrevrange(keys.out(request_id), count=1)
    return bool(last) and is_terminal(last[0][1])


async def _admit(stack: Stack, *requests: GenerateRequest) -> None:
    r = aioredis.Redis.from_url(stack.redis_url)
    try:
        await Queue(r, Keys(stack.prefix)).add(*requests)
    finally:
        await r.aclose()


def _long(tenant: str, **fields: object) -> GenerateRequest:
    req = _request(tenant, **fields)  # type: ignore[arg-type]
    return req.model_copy(update={"params": SamplingParams(max_tokens=200, ignore_eos=True)})


def test_a_worker_takes_the_light_tenant_before_the_heavy_backlog(
        one_slot: Stack, sync_redis: redis.Redis) -> None:
    keys = Keys(one_slot.prefix)
    blocker = _long("heavy")
    asyncio.run(_admit(one_slot, blocker))
    assert eventually(lambda: _first_token(sync_redis, keys, blocker.id) is not None, 10)
    backlog = [_request("heavy") for _ in range(3)]
    light = [_request("light"), _request("light")]
    asyncio.run(_admit(one_slot, *backlog, *light))
    everyone = [blocker, *backlog, *light]
    assert eventually(lambda: all(_ended(sync_redis, keys, q.id) for q in everyone), 30), \
        one_slot.output()
    started = sorted(everyone, key=lambda q: _entry_order(sync_redis, keys, q.id))
    # The light requests run beside the blocker, one after the other (the burst: light holds
    # less than its share of the batch, heavy its whole); then the backlog, oldest first.
    assert [q.id for q in started] == [blocker.id, *(q.id for q in light),
                                        *(q.id for q in backlog)]
    [(blocker_end, _)] = sync_redis.xrevrange(keys.out(blocker.id), count=1)
    assert _entry_order(sync_redis, keys, light[1].id) < _order(blocker_end.decode())


def _entry_order(r: redis.Redis, keys: Keys, request_id: str) -> tuple[int, int]:
    first = _first_token(r, keys, request_id)
    assert first is not None
    return _order(first[0])


def _order(entry_id: str) -> tuple[int, int]:
    ms, seq = entry_id.split("-")
    return int(ms), int(seq)


def test_a_worker_honours_placements_and_takes_them_over_when_due(
        one_slot: Stack, sync_redis: redis.Redis) -> None:
    keys = Keys(one_slot.prefix)
    sync_redis.zadd(keys.workers(MODEL), {"other": time.time() + 60})
    mine, theirs, gone = (_request("t", worker=WORKER), _request("t", worker="other"),
                          _request("t", worker="gone"))
    asyncio.run(_admit(one_slot, theirs, mine, gone))
    assert eventually(lambda: all(_ended(sync_redis, keys, q.id) for q in (mine, theirs, gone)),
                      20), one_slot.output()
    waited = {}
    for q in (mine, theirs, gone):
        first = _first_token(sync_redis, keys, q.id)
        assert first is not None and first[1].queued_ms is not None
        waited[q.worker] = first[1].queued_ms
    # Its own and one placed on a worker that is not live: at once; one placed on a live
    # worker that did not take it: after the placement wait (1 s).
    assert waited[WORKER] < 900 and waited["gone"] < 900, waited
    assert waited["other"] >= 950, waited


def test_the_api_queues_the_priority_and_the_tenants_weight(
        redis_url: str, tiny_model: Path, tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text("[tenants.acme]\nweight = 2.5\n")
    # No worker: the request stays queued while its member is read.
    stack = Stack(redis_url, tiny_model, served_name=MODEL, workers=0, env={
        "REDSERVE_API_KEYS": "acme:sk-acme-0123456789,zed:sk-zed-0123456789",
        "REDSERVE_TENANTS_FILE": str(tenants)}).start()
    r = redis.Redis.from_url(redis_url)
    try:
        with ThreadPoolExecutor(2) as pool:
            for key, priority in (("sk-acme-0123456789", -3), ("sk-zed-0123456789", None)):
                body = {"model": MODEL, "prompt": "hi", "max_tokens": 2,
                        **({} if priority is None else {"priority": priority})}
                pool.submit(httpx.post, f"{stack.base_url}/v1/completions", json=body,
                            headers={"Authorization": f"Bearer {key}"}, timeout=5)
            queued = Keys(stack.prefix).queued(MODEL)
            assert eventually(lambda: r.zcard(queued) == 2, 10), stack.output()
            members = {m.tenant: m for m in map(QueueMember.decode, r.zrange(queued, 0, -1))}
            assert (members["acme"].priority, members["acme"].weight) == (-3, 2.5)
            assert (members["zed"].priority, members["zed"].weight) == (0, 1.0)
    finally:
        r.close()
        stack.stop()
