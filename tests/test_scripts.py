"""Every Lua script through its typed interface (shared/scripts/), against the real Redis.

Each test builds a script's KEYS and ARGV by name and asserts on its typed reply and on what
it left in Redis, so a name read from the wrong position (a key or an argument swapped, a
group flattened out of order) fails here. No replica, no worker: the keys are this test's own
prefix, deleted afterwards.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
import redis.asyncio as aioredis

from shared.keys import QUEUED_CONSUMER, WORKER_GROUP, Keys
from shared.messages import Bucket, BucketField, QueueMember, ServiceCounters
from shared.scripts.admit import ADMIT, AdmitArgs, AdmitKeys, AdmitReply, AdmitStatus
from shared.scripts.base import Script
from shared.scripts.handoff import ModelQueue, QueuedEntries
from shared.scripts.limits import NO_LIMIT, SETTLE, LimitArgs, SettleArgs, Settled, SettleKeys
from shared.scripts.request_flag import SET_FLAG, FlagArgs, FlagKeys
from shared.scripts.take import TAKE, TakeArgs, TakeKeys, Taken
from shared.scripts.terminal import TERMINAL_ONCE, Terminal, TerminalArgs, TerminalKeys

MODEL = "m"


@dataclass
class Env:
    r: aioredis.Redis
    keys: Keys

    @property
    def queue(self) -> ModelQueue:
        return ModelQueue.of(self.keys, MODEL)

    def bucket(self, tenant: str) -> str:
        return self.keys.limits(MODEL, tenant)

    async def admit(self, tenant: str, *, prompt: int = 4, worker: str = "",
                    limit: LimitArgs = NO_LIMIT, **bounds: int) -> tuple[str, AdmitReply]:
        """A new request of `tenant`, admitted under `bounds` (roomy by default)."""
        request_id = uuid.uuid4().hex
        now = time.time()
        args = AdmitArgs(
            now=now, stale_before=now - 65, member=QueueMember(
                request_id, tenant, prompt, worker=worker).encode(),
            prompt_tokens=prompt, max_requests=100, max_tokens=10_000, queued_ttl_s=70,
            max_per_tenant=100, tenant=tenant, min_id="0-0", request_ttl_s=600,
            request_id=request_id, body=f"body of {request_id}", limit=limit)
        reply = await ADMIT.bind(self.r)(AdmitKeys.of(self.queue, self.bucket(tenant)),
                                         dataclasses.replace(args, **bounds))
        return request_id, reply

    async def take(self, worker: str, room: int, *, burst: int = 0, slots: int = 8,
                   held: dict[str, int] | None = None,
                   charges: dict[str, float] | None = None) -> Taken:
        now = time.time()
        return await TAKE.bind(self.r)(TakeKeys.of(self.queue), TakeArgs(
            now=now, stale_before=now - 65, worker=worker, room=room, fair=True,
            placement_wait_s=30.0, starving_before=now - 30, service_ttl_s=600, burst=burst,
            slots=slots, held=held or {}, charges=charges or {}))


@pytest.fixture
async def env(redis_url: str) -> AsyncIterator[Env]:
    r = aioredis.Redis.from_url(redis_url)
    keys = Keys(f"rsscripts-{uuid.uuid4().hex[:8]}")
    yield Env(r, keys)
    found = [k async for k in r.scan_iter(match=f"{keys.prefix}:*")]
    if found:
        await r.delete(*found)
    await r.aclose()


def _taken_ids(taken: Taken) -> list[str]:
    return [fields[b"id"].decode() for _, fields in taken.entries]


async def test_admitted_leaves_the_handoff_for_take(env: Env) -> None:
    rid, reply = await env.admit("a", prompt=7)
    assert reply.status is AdmitStatus.ADMITTED
    q = env.queue
    [(member, score)] = await env.r.zrange(q.queued, 0, -1, withscores=True)
    assert QueueMember.decode(member) == QueueMember(rid, "a", 7)
    assert abs(score - time.time()) < 5
    assert 60 < await env.r.ttl(q.queued) <= 70  # queued_ttl_s, not the request TTL
    assert 590 < await env.r.ttl(q.requests) <= 600
    [(entry_id, fields)] = await env.r.xrange(q.requests)
    assert fields == {b"id": rid.encode(), b"body": f"body of {rid}".encode()}
    assert QueuedEntries.decode(await env.r.hgetall(q.entries)).by_request == {
        rid: entry_id.decode()}
    [pending] = await env.r.xpending_range(q.requests, WORKER_GROUP, "-", "+", 10)
    assert pending["consumer"].decode() == QUEUED_CONSUMER
    assert not await env.r.exists(env.bucket("a"))  # no limit: the bucket is never written


async def test_each_queue_bound_refuses_with_its_own_status(env: Env) -> None:
    await env.admit("a", prompt=10)
    assert (await env.admit("b", max_requests=1))[1].status is AdmitStatus.QUEUE_FULL
    assert (await env.admit("a", max_per_tenant=1))[1].status is AdmitStatus.TENANT_SHARE_FULL
    assert (await env.admit("b", prompt=5, max_tokens=14))[1].status \
        is AdmitStatus.QUEUE_TOKENS_FULL
    assert (await env.admit("b", prompt=4, max_tokens=14))[1].status is AdmitStatus.ADMITTED
    assert await env.r.zcard(env.queue.queued) == 2
    assert await env.r.xlen(env.queue.requests) == 2  # the refused are not on the stream


async def test_a_tenant_back_in_the_queue_is_lifted_to_the_least_served(env: Env) -> None:
    await env.r.hset(env.queue.service, mapping={"heavy": 100.0, "light": 3.0})
    await env.admit("heavy")
    await env.admit("light")
    counters = ServiceCounters.decode(await env.r.hgetall(env.queue.service))
    assert counters.by_tenant == {"heavy": 100.0, "light": 100.0}


async def test_rate_limits_refuse_charge_and_report_levels(env: Env) -> None:
    _, first = await env.admit("a", limit=LimitArgs(2, 100, 30))
    assert first.status is AdmitStatus.ADMITTED
    assert (first.bucket.remaining_requests, first.bucket.remaining_tokens) == (1, 70)
    assert 0 < first.bucket.reset_tokens_ms <= 18_000 and first.bucket.retry_after_ms == 0
    raw = await env.r.hgetall(env.bucket("a"))
    stored = Bucket.decode({f.decode(): v.decode() for f, v in raw.items()})
    assert (stored.requests_limit, stored.tokens_limit) == (2, 100)
    _, tokens = await env.admit("a", limit=LimitArgs(2, 100, 80))
    assert tokens.status is AdmitStatus.RATE_TOKENS and tokens.bucket.retry_after_ms > 0
    _, large = await env.admit("a", limit=LimitArgs(2, 100, 101))
    assert large.status is AdmitStatus.TOO_LARGE
    await env.admit("a", limit=LimitArgs(2, 100, 1))
    _, requests = await env.admit("a", limit=LimitArgs(2, 100, 1))
    assert requests.status is AdmitStatus.RATE_REQUESTS
    assert requests.bucket.remaining_requests == 0 and requests.bucket.retry_after_ms > 0
    assert await env.r.zcard(env.queue.queued) == 2  # only the two admitted


async def test_a_full_queue_charges_no_limit(env: Env) -> None:
    _, reply = await env.admit("a", limit=LimitArgs(5, 0, 3), max_requests=0)
    assert reply.status is AdmitStatus.QUEUE_FULL
    assert reply.bucket.remaining_requests == 5  # checked, not charged
    assert not await env.r.exists(env.bucket("a"))


async def test_take_chooses_the_least_served_and_claims_it(env: Env) -> None:
    heavy, _ = await env.admit("heavy", prompt=4)
    light, _ = await env.admit("light", prompt=2)
    # heavy's output tokens, charged with the take, put it behind light.
    taken = await env.take("w1", 1, charges={"heavy": 10.0})
    assert _taken_ids(taken) == [light] and taken.waiting == 1 and taken.retry_ms == -1
    [(newest, _)] = await env.r.xrevrange(env.queue.requests, count=1)
    assert taken.last_id == newest.decode()
    [pending] = await env.r.xpending_range(env.queue.requests, WORKER_GROUP, "-", "+", 10,
                                           consumername="w1")
    assert pending["times_delivered"] == 1
    assert [QueueMember.decode(m).request_id
            for m in await env.r.zrange(env.queue.queued, 0, -1)] == [heavy]
    assert set(QueuedEntries.decode(await env.r.hgetall(env.queue.entries)).by_request) == {
        heavy}
    counters = ServiceCounters.decode(await env.r.hgetall(env.queue.service))
    assert counters.by_tenant == {"heavy": 10.0, "light": 2.0}
    assert 590 < await env.r.ttl(env.queue.service) <= 600


async def test_burst_goes_to_a_tenant_under_its_share(env: Env) -> None:
    await env.admit("heavy")
    light, _ = await env.admit("light")
    # No room, one burst: heavy holds the whole batch of 2, so only light's request goes.
    taken = await env.take("w1", 0, burst=1, slots=2, held={"heavy": 2})
    assert _taken_ids(taken) == [light]
    assert (await env.take("w1", 0, burst=1, slots=2, held={"heavy": 2, "light": 1})
            ).entries == []


async def test_a_member_placed_on_a_live_worker_waits_for_it(env: Env) -> None:
    await env.r.zadd(env.queue.workers, {"w2": time.time() + 30})
    placed, _ = await env.admit("a", worker="w2")
    taken = await env.take("w1", 1)
    assert taken.entries == [] and 0 < taken.retry_ms <= 30_000
    assert _taken_ids(await env.take("w2", 1)) == [placed]


async def test_terminal_once_writes_once(env: Env) -> None:
    rid = f"0badcafe-{uuid.uuid4().hex[:24]}"
    keys = TerminalKeys(env.keys.out(rid), env.keys.state(rid), env.keys.abort(rid),
                        env.keys.resumed(rid))
    await env.r.set(keys.abort, "1", ex=3600)  # cancelled before its end
    await env.r.set(keys.resumed, "1", ex=3600)  # and resumed
    args = TerminalArgs(ttl_s=120, entry={"kind": "finish", "finish_reason": "stop"},
                        state={"state": "finished"},
                        chunks=[{"kind": "tokens", "index": "0", "ids": "1,2"},
                                {"kind": "tokens", "index": "2", "ids": "3"}])
    terminal_once = TERMINAL_ONCE.bind(env.r)
    assert await terminal_once(keys, args) is Terminal.ADDED
    entries = [fields for _, fields in await env.r.xrange(keys.out)]
    assert [e[b"kind"] for e in entries] == [b"tokens", b"tokens", b"finish"]
    assert entries[1][b"ids"] == b"3"
    assert await env.r.hgetall(keys.state) == {b"state": b"finished"}
    assert 110 < await env.r.ttl(keys.out) <= 120 and 110 < await env.r.ttl(keys.state) <= 120
    assert 110 < await env.r.ttl(keys.abort) <= 120  # it expires with them
    assert 110 < await env.r.ttl(keys.resumed) <= 120
    again = dataclasses.replace(args, ttl_s=300, state={"state": "failed"})
    assert await terminal_once(keys, again) is Terminal.ENDED_ALREADY
    assert await env.r.xlen(keys.out) == 3
    assert await env.r.hgetall(keys.state) == {b"state": b"failed"}  # written either way
    assert await env.r.ttl(keys.out) > 200


async def test_an_abort_key_lives_no_longer_than_its_request_hash(env: Env) -> None:
    rid = f"0badcafe-{uuid.uuid4().hex[:24]}"
    keys = FlagKeys(env.keys.abort(rid), env.keys.state(rid))
    pipe = env.r.pipeline(transaction=False)
    SET_FLAG.stage(pipe, keys, FlagArgs(ttl_s=3600))  # no hash: the whole TTL
    [reply] = await pipe.execute()
    assert SET_FLAG.parse(reply) == 3_600_000
    assert await env.r.get(keys.flag) == b"1" and 3590 < await env.r.ttl(keys.flag) <= 3600
    await env.r.hset(keys.state, "state", "done")
    await env.r.expire(keys.state, 300)  # ended: its hash lives 300 s more
    pipe = env.r.pipeline(transaction=False)
    SET_FLAG.stage(pipe, keys, FlagArgs(ttl_s=3600))
    await pipe.execute()
    flag_ms, state_ms = await env.r.pttl(keys.flag), await env.r.pttl(keys.state)
    # Read one after the other: the hash's TTL may have run a millisecond or two meanwhile.
    assert 290_000 < flag_ms <= state_ms + 50
    await env.r.persist(keys.state)  # a hash without a TTL lends none
    pipe = env.r.pipeline(transaction=False)
    SET_FLAG.stage(pipe, keys, FlagArgs(ttl_s=60))
    await pipe.execute()
    assert 50 < await env.r.ttl(keys.flag) <= 60


async def test_settle_gives_back_up_to_the_limit(env: Env) -> None:
    settle = SETTLE.bind(env.r)
    missing = SettleKeys(env.bucket("nobody"))
    assert await settle(missing, SettleArgs(10, 100, 1, 5)) is Settled.NO_BUCKET
    assert not await env.r.exists(missing.bucket)
    await env.admit("a", limit=LimitArgs(10, 100, 60))
    await env.admit("a", limit=LimitArgs(10, 100, 30))
    key = SettleKeys(env.bucket("a"))
    assert await settle(key, SettleArgs(10, 100, requests_back=1, tokens_back=25)) \
        is Settled.SETTLED
    levels = {f.decode(): float(v) for f, v in (await env.r.hgetall(key.bucket)).items()}
    assert 9 <= levels[BucketField.REQUESTS] < 9.1  # 8 left, one given back
    assert 35 <= levels[BucketField.TOKENS] < 36  # 10 left, 25 given back
    await settle(key, SettleArgs(10, 100, requests_back=0, tokens_back=1000))
    assert float(await env.r.hget(key.bucket, BucketField.TOKENS) or 0) == 100  # capped


@dataclass(frozen=True)
class _Keys:
    one: str


@dataclass(frozen=True)
class _Args:
    n: int
    group: _Keys


def test_the_lua_may_read_only_declared_names_and_must_read_them_all() -> None:
    script = Script("ok", _Keys, _Args, "return {K.one, A.n, A.group.one}", list)
    assert script.lua.splitlines()[1:3] == ["local K = {one = KEYS[1]}",
                                            "local A = {n = ARGV[1], group = {one = ARGV[2]}}"]
    assert script.args(_Args(3, _Keys("x"))) == [3, "x"]
    with pytest.raises(ValueError, match=r"A\.m, which is not declared"):
        Script("typo", _Keys, _Args, "return {K.one, A.m, A.n, A.group.one}", list)
    with pytest.raises(ValueError, match=r"declares group\.one, never read"):
        Script("unread", _Keys, _Args, "return {K.one, A.n}", list)
    with pytest.raises(TypeError, match="takes _Keys as its KEYS"):
        script.keys(_Args(3, _Keys("x")))  # type: ignore[arg-type]
