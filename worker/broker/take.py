"""Which queued request a worker with room takes: one script, one round trip, no prompt read.

Every waiting request is pending in the model's consumer group under the queue's own consumer
(the admission script delivers it there, see api/admission.py), with its entry id in the
model's entries hash and its member in the queued set (`QueueMember`: tenant, prompt size,
priority, weight, placed worker). The take script reads the queued set, chooses up to `room`
members, removes them and XCLAIMs their entries to the worker in one atomic step (every key in
the model's Cluster slot), so two workers never take the same request and a request is in the
queued set exactly until a worker holds it. The claim sets the delivery counter to 1: a
first take is a first delivery (recovery's claims count on from there).

Which members: those placed on no worker or on this one; those placed on a worker that is not
live (not in the model's live set: dead or draining); and any that waited `placement_wait_s`
(its worker is overloaded). In what order, with the `fair` policy:
1. a request queued longer than `starvation_after_s` first, oldest first (nothing starves);
2. the lowest `priority` (vLLM's: lower runs first);
3. the tenant with the least service (the Virtual Token Counter, shared/messages/queue.py);
4. the oldest.
The `fifo` policy takes the oldest. Each take charges the tenant its prompt tokens divided by
its weight; output tokens are charged by the worker's `Tally`, sent with a take at most every
`CHARGE_EVERY_S` (and with each heartbeat): no command per token. The script's writes are
batched: one XCLAIM, one ZREM, one HDEL and one HINCRBYFLOAT per tenant a take, however many
requests it takes (the commands inside scripts count in ops/benchmarks/redis_cost.py).

A fair order alone still leaves a light tenant waiting for a slot of a batch a heavy tenant
fills. So beyond its room a worker may take a `burst` (`fair_burst`) of requests, each of a
tenant holding less than an equal share of its batch (among the tenants with requests on it or
queued for it): the light tenant starts at the next step; a heavy one never gets the burst.

Entries with no member left (cancelled while queued: the API removes the member; trimmed past
the queue timeout) are taken ahead of the rest: the worker ends each at once (abort or queue
timeout), so every request still ends with one terminal entry and leaves its stream. Entries
admission did not queue (added to the stream by hand) are taken as they come when nothing is
queued. The reply also says where the stream ends (the worker blocks on XREAD from there, so no
entry added after the take is missed) and how soon a member placed on another worker becomes
anyone's.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from shared.keys import QUEUE_STALE_MARGIN_S, QUEUED_CONSUMER, WORKER_GROUP, Keys
from shared.messages import MEMBER_LUA
from shared.redis_conn import StreamEntries
from shared.settings import WorkerSettings

# Output tokens are charged to the service counters with a take at most this often (and with
# every heartbeat): a few commands a second at most, however many requests are taken.
CHARGE_EVERY_S = 0.25

# KEYS: queued set, entries hash, request stream, live workers, service counters.
# ARGV: now, stale before, worker, room, fair (1|0), placement wait, starving before,
#       service TTL, group, queue consumer, burst, batch slots, N, then N (tenant, requests
#       held on the worker) pairs, then (tenant, weighted tokens) pairs to charge.
_TAKE = MEMBER_LUA + """
local now, me, room = tonumber(ARGV[1]), ARGV[3], tonumber(ARGV[4])
local fair, wait, starving = ARGV[5] == '1', tonumber(ARGV[6]), tonumber(ARGV[7])
local group, queued, burst, slots = ARGV[9], ARGV[10], tonumber(ARGV[11]), tonumber(ARGV[12])
local held, charges = {}, 14 + 2 * tonumber(ARGV[13])
for i = 14, charges - 1, 2 do held[ARGV[i]] = tonumber(ARGV[i + 1]) end
-- tenant -> weighted tokens to add to its service counter: its output tokens so far (the
-- worker's tally), then the prompts taken here.
local owed, charged = {}, {}
for i = charges, #ARGV, 2 do
  owed[ARGV[i]] = tonumber(ARGV[i + 1])
  charged[ARGV[i]] = owed[ARGV[i]]
end
-- Reads and the claim first, writes after: a missing group (NOGROUP, the worker makes it
-- anew) stops the script before it has changed anything.
local members = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
-- taken: request ids to claim; gone: their members; fields: the entries hash's to delete.
local entries, taken, gone, fields, present = {}, {}, {}, {}, {}
if room > 0 and #members == 0 then
  -- Entries admission did not queue (added by hand) are taken as they come, when nothing is
  -- queued.
  local fresh = redis.call('XREADGROUP', 'GROUP', group, me, 'COUNT', room,
                           'STREAMS', KEYS[3], '>')
  for _, e in ipairs(fresh and fresh[1][2] or {}) do
    table.insert(entries, e)
    if e[2][1] == 'id' then present[e[2][2]] = true; table.insert(fields, e[2][2]) end
  end
  room = room - #entries
end

local candidates, live, stale, listed, retry = {}, {}, false, 0, -1
for i = 1, #members, 2 do
  local m, at = parse_member(members[i]), tonumber(members[i + 1])
  if not m or at <= tonumber(ARGV[2]) then
    stale = true
  else
    listed = listed + 1
    present[m.id] = true
    m.at = at
    local mine = m.worker == '' or m.worker == me or at + wait <= now
    if not mine then
      if live[m.worker] == nil then
        local expiry = redis.call('ZSCORE', KEYS[4], m.worker)
        live[m.worker] = expiry ~= false and tonumber(expiry) > now
      end
      mine = not live[m.worker]
      if not mine then
        local ms = math.ceil((at + wait - now) * 1000)
        if retry < 0 or ms < retry then retry = ms end
      end
    end
    if mine then table.insert(candidates, m) end
  end
end

-- Entries whose member is gone (cancelled, or past the queue timeout): ended at once.
if room > 0 and redis.call('HLEN', KEYS[2]) > listed then
  local queue = redis.call('HGETALL', KEYS[2])
  for i = 1, #queue, 2 do
    if #taken < room and not present[queue[i]] then table.insert(taken, queue[i]) end
  end
end

local served = {}
local function service(tenant)
  if served[tenant] == nil then
    served[tenant] = tonumber(redis.call('HGET', KEYS[5], tenant) or '0') + (owed[tenant] or 0)
  end
  return served[tenant]
end
local function before(a, b)
  if not fair then return a.at < b.at end
  local sa, sb = a.at <= starving, b.at <= starving
  if sa ~= sb then return sa end
  if sa then return a.at < b.at end
  if a.priority ~= b.priority then return a.priority < b.priority end
  local ca, cb = service(a.tenant), service(b.tenant)
  if ca ~= cb then return ca < cb end
  return a.at < b.at
end
-- A tenant's equal share of the batch, among those with requests here or queued for it.
local tenants, count = {}, 0
local function counted(tenant)
  if not tenants[tenant] then tenants[tenant] = true; count = count + 1 end
end
for tenant in pairs(held) do counted(tenant) end
for _, c in ipairs(candidates) do counted(c.tenant) end
local share = slots / math.max(count, 1)
-- The next candidate in order; `under_share`: only of a tenant holding less than its share.
local function next_one(under_share)
  local best = nil
  for i, c in ipairs(candidates) do
    if (not under_share or (held[c.tenant] or 0) < share)
       and (best == nil or before(c, candidates[best])) then best = i end
  end
  if best == nil then return false end
  local m = table.remove(candidates, best)
  table.insert(taken, m.id)
  table.insert(gone, m.member)
  held[m.tenant] = (held[m.tenant] or 0) + 1
  local charge = m.tokens / m.weight
  if fair then served[m.tenant] = service(m.tenant) + charge end
  charged[m.tenant] = (charged[m.tenant] or 0) + charge
  return true
end
while #taken < room and next_one(false) do end
-- The burst (fair share): beyond the room, for tenants holding less than their share.
local extra = 0
while extra < burst and next_one(true) do extra = extra + 1 end

if #taken > 0 then
  local claim = {'XCLAIM', KEYS[3], group, me, 0}
  for _, entry_id in ipairs(redis.call('HMGET', KEYS[2], unpack(taken))) do
    if entry_id then table.insert(claim, entry_id) end
  end
  if #claim > 5 then
    table.insert(claim, 'RETRYCOUNT')
    table.insert(claim, 1)
    for _, e in ipairs(redis.call(unpack(claim))) do table.insert(entries, e) end
  end
  for _, id in ipairs(taken) do table.insert(fields, id) end
end
if #fields > 0 then redis.call('HDEL', KEYS[2], unpack(fields)) end
if #gone > 0 then redis.call('ZREM', KEYS[1], unpack(gone)) end
if stale then redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[2]) end
if next(charged) then
  for tenant, tokens in pairs(charged) do
    redis.call('HINCRBYFLOAT', KEYS[5], tenant, tostring(tokens))
  end
  redis.call('EXPIRE', KEYS[5], ARGV[8])
end
local newest = redis.call('XREVRANGE', KEYS[3], '+', '-', 'COUNT', 1)[1]
return {entries, newest and newest[1] or '0-0', retry, #candidates}
"""


@dataclass(frozen=True)
class Room:
    """What a worker can take now."""

    regular: int  # requests of any tenant
    # Beyond those, requests of tenants holding less than an equal share of `slots` among
    # the tenants with requests on the worker or queued for it (the fair share's burst).
    burst: int = 0
    slots: int = 1  # the worker's batch (max_running)
    held: Mapping[str, int] = field(default_factory=dict)  # tenant -> requests on the worker

    def __bool__(self) -> bool:
        return self.regular > 0 or self.burst > 0


@dataclass(frozen=True)
class Taken:
    entries: StreamEntries  # the requests now this worker's, as stream entries
    # The stream's newest entry: block on XREAD from here for what comes next ("": not looked
    # at, the room went to entries added by hand).
    last_id: str
    # Milliseconds until a member placed on another worker becomes anyone's; -1: none.
    retry_ms: int
    waiting: int  # queued requests this worker could take with more room


@dataclass(frozen=True)
class TakePolicy:
    fair: bool
    starvation_after_s: float
    placement_wait_s: float
    queue_timeout_s: float
    service_ttl_s: int
    burst: int  # see `Room.burst`

    @classmethod
    def of(cls, settings: WorkerSettings) -> TakePolicy:
        fair = settings.queue_policy == "fair"
        return cls(fair, settings.starvation_after_s, settings.placement_wait_s,
                   settings.queue_timeout_s, settings.request_ttl_s,
                   settings.fair_burst if fair else 0)


class Tally:
    """Output tokens served per tenant (each divided by its request's weight) since the
    last take: charged to the service counters with the next one."""

    def __init__(self) -> None:
        self._owed: defaultdict[str, float] = defaultdict(float)

    def add(self, tenant: str, tokens: float) -> None:
        self._owed[tenant] += tokens

    def drain(self) -> dict[str, float]:
        owed, self._owed = dict(self._owed), defaultdict(float)
        return owed

    def restore(self, owed: dict[str, float]) -> None:
        """A take that failed: charge these with a later one."""
        for tenant, tokens in owed.items():
            self._owed[tenant] += tokens


class Taker:
    def __init__(self, redis: aioredis.Redis, keys: Keys, model: str, name: str,
                 policy: TakePolicy) -> None:
        self._script = redis.register_script(_TAKE)
        self._keys = [keys.queued(model), keys.entries(model), keys.requests(model),
                      keys.workers(model), keys.service(model)]
        self.name = name
        self.policy = policy
        self.tally = Tally()
        self._charged_at = 0.0

    async def take(self, room: Room, *, charge: bool = False) -> Taken:
        """Queued requests up to `room`, now pending under this worker's name. The tally
        goes with it at most every `CHARGE_EVERY_S`, or with `charge`."""
        p, now = self.policy, time.time()
        owed: dict[str, float] = {}
        if charge or now - self._charged_at >= CHARGE_EVERY_S:
            owed, self._charged_at = self.tally.drain(), now
        charges: list[str | float] = []
        for tenant, tokens in owed.items():
            charges += [tenant, repr(tokens)]
        try:
            entries, last, retry, waiting = await self._script(keys=self._keys, args=[
                now, now - p.queue_timeout_s - QUEUE_STALE_MARGIN_S, self.name,
                max(room.regular, 0), 1 if p.fair else 0, p.placement_wait_s,
                now - p.starvation_after_s, p.service_ttl_s, WORKER_GROUP, QUEUED_CONSUMER,
                max(room.burst, 0), room.slots, len(room.held),
                *(x for pair in room.held.items() for x in pair), *charges])
        except BaseException:
            self.tally.restore(owed)
            raise
        return Taken([(e[0], _pairs(e[1])) for e in entries],
                     last.decode() if isinstance(last, bytes) else str(last), int(retry),
                     int(waiting))

    async def charge(self) -> None:
        """Send the tally now (the heartbeat: a full or idle worker takes nothing)."""
        await self.take(Room(0), charge=True)


def _pairs(flat: list[bytes]) -> dict[bytes, bytes]:
    return dict(zip(flat[0::2], flat[1::2], strict=True))
