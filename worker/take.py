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
its weight; output tokens are charged by the worker's `Tally`, sent with its next take (or
heartbeat): no command per token.

Entries admission did not queue (added to the stream by hand, or while the group was gone) are
taken first, as they come (today's FIFO). Then entries with no member left (cancelled while
queued: the API removes the member; trimmed past the queue timeout), ahead of the rest: the
worker ends each at once (abort or queue timeout), so every request still ends with one
terminal entry and leaves its stream.
The reply also says where the stream ends (the worker blocks on XREAD from there, so no entry
added after the take is missed) and how soon a member placed on another worker becomes anyone's.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

import redis.asyncio as aioredis

from shared.keys import QUEUE_STALE_MARGIN_S, QUEUED_CONSUMER, WORKER_GROUP, Keys
from shared.messages import MEMBER_LUA
from shared.redis_conn import StreamEntries
from shared.settings import Settings

# KEYS: queued set, entries hash, request stream, live workers, service counters.
# ARGV: now, stale before, worker, room, fair (1|0), placement wait, starving before,
#       service TTL, group, queue consumer, then (tenant, weighted tokens) pairs to charge.
_TAKE = MEMBER_LUA + """
local now, me, room = tonumber(ARGV[1]), ARGV[3], tonumber(ARGV[4])
local fair, wait, starving = ARGV[5] == '1', tonumber(ARGV[6]), tonumber(ARGV[7])
local group, queued = ARGV[9], ARGV[10]
-- Entries admission did not queue (added by hand, or while the group was gone) are taken
-- first, as they come; no group (it expired with its stream): NOGROUP before anything is
-- written, and the worker makes it anew.
local entries = {}
if room > 0 then
  local fresh = redis.call('XREADGROUP', 'GROUP', group, me, 'COUNT', room,
                           'STREAMS', KEYS[3], '>')
  for _, e in ipairs(fresh and fresh[1][2] or {}) do
    table.insert(entries, e)
    if e[2][1] == 'id' then redis.call('HDEL', KEYS[2], e[2][2]) end
  end
end
for i = 11, #ARGV, 2 do redis.call('HINCRBYFLOAT', KEYS[5], ARGV[i], ARGV[i + 1]) end
if #ARGV > 10 then redis.call('EXPIRE', KEYS[5], ARGV[8]) end
room = room - #entries
if room <= 0 then return {entries, '', -1} end

local members = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
local present, candidates, live = {}, {}, {}
local stale, listed, retry = false, 0, -1
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
if stale then redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[2]) end

local taken, gone = {}, {}
-- Entries whose member is gone (cancelled, or past the queue timeout): ended at once.
if redis.call('HLEN', KEYS[2]) > listed then
  local fields = redis.call('HGETALL', KEYS[2])
  for i = 1, #fields, 2 do
    if #taken < room and not present[fields[i]] then table.insert(taken, fields[i]) end
  end
end

local served = {}
local function service(tenant)
  if served[tenant] == nil then
    served[tenant] = tonumber(redis.call('HGET', KEYS[5], tenant) or '0')
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
while #taken < room and #candidates > 0 do
  local best = 1
  for i = 2, #candidates do
    if before(candidates[i], candidates[best]) then best = i end
  end
  local m = table.remove(candidates, best)
  table.insert(taken, m.id)
  table.insert(gone, m.member)
  local charge = m.tokens / m.weight
  served[m.tenant] = service(m.tenant) + charge
  redis.call('HINCRBYFLOAT', KEYS[5], m.tenant, tostring(charge))
end
if #gone > 0 then
  redis.call('ZREM', KEYS[1], unpack(gone))
  redis.call('EXPIRE', KEYS[5], ARGV[8])
end

for _, id in ipairs(taken) do
  local entry_id = redis.call('HGET', KEYS[2], id)
  redis.call('HDEL', KEYS[2], id)
  if entry_id then
    for _, e in ipairs(redis.call('XCLAIM', KEYS[3], group, me, 0, entry_id,
                                  'RETRYCOUNT', 1)) do
      table.insert(entries, e)
    end
  end
end
local last = ''
if #taken < room then
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[3])) do
    local info = {}
    for i = 1, #g, 2 do info[g[i]] = g[i + 1] end
    if info['name'] == group then last = info['last-delivered-id'] end
  end
end
return {entries, last, retry}
"""


@dataclass(frozen=True)
class Taken:
    entries: StreamEntries  # the requests now this worker's, as stream entries
    # Where the stream ended, when fewer than `room` were taken (nothing else is this
    # worker's yet): block on XREAD from here. "" when the take filled the room.
    last_id: str
    # Milliseconds until a member placed on another worker becomes anyone's; -1: none.
    retry_ms: int


@dataclass(frozen=True)
class TakePolicy:
    fair: bool
    starvation_after_s: float
    placement_wait_s: float
    queue_timeout_s: float
    service_ttl_s: int

    @classmethod
    def of(cls, settings: Settings) -> TakePolicy:
        return cls(settings.queue_policy == "fair", settings.starvation_after_s,
                   settings.placement_wait_s, settings.queue_timeout_s, settings.request_ttl_s)


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

    async def take(self, room: int) -> Taken:
        """Up to `room` queued requests, now pending under this worker's name (with room 0:
        only charge the tally)."""
        p, now = self.policy, time.time()
        owed = self.tally.drain()
        charges: list[str | float] = []
        for tenant, tokens in owed.items():
            charges += [tenant, repr(tokens)]
        try:
            entries, last, retry = await self._script(keys=self._keys, args=[
                now, now - p.queue_timeout_s - QUEUE_STALE_MARGIN_S, self.name, room,
                1 if p.fair else 0, p.placement_wait_s, now - p.starvation_after_s,
                p.service_ttl_s, WORKER_GROUP, QUEUED_CONSUMER, *charges])
        except BaseException:
            self.tally.restore(owed)
            raise
        return Taken([(e[0], _pairs(e[1])) for e in entries],
                     last.decode() if isinstance(last, bytes) else str(last), int(retry))


def _pairs(flat: list[bytes]) -> dict[bytes, bytes]:
    return dict(zip(flat[0::2], flat[1::2], strict=True))
