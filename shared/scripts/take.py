"""The take script: which queued requests a worker with room takes, chosen and claimed at once.

Every waiting request is pending under the queue's consumer, with its entry id in the entries
hash and its member in the queued set (the hand-off: `shared.scripts.handoff`). The script
reads the queued set, chooses up to `room` members, removes them and XCLAIMs their entries to
the worker in one atomic step (every key in the model's Cluster slot), so two workers never
take the same request and a request is in the queued set exactly until a worker holds it.
The claim sets the delivery counter to 1: a first take is a first delivery (recovery's claims
count on from there).

Which members: those placed on no worker or on this one; those placed on a worker that is not
live (dead or draining); and any that waited `placement_wait_s`. In what order, when `fair`:
a member queued before `starving_before` first, oldest first; then the lowest priority; then
the tenant with the least service (its counter plus the output tokens in `charges`, and what
this take charged it so far); then the oldest. Otherwise the oldest. Each member taken charges
its tenant its prompt tokens divided by its weight. Beyond `room`, up to `burst` members of
tenants holding (`held`) less than an equal share of `slots` among the tenants with requests
on the worker or queued for it. The policy and its reasons: worker/broker/take.py.

Entries with no member left (cancelled while queued, or trimmed past the queue timeout) are
taken ahead of the rest, for the worker to end at once; entries admission did not queue (added
to the stream by hand) are taken as they come when nothing is queued. Reads and the claim come
first and writes after, so a missing group (NOGROUP) stops the script before it changed
anything; the writes are batched (one XCLAIM, one ZREM, one HDEL, one HINCRBYFLOAT per tenant
a take: ops/benchmarks/redis_cost.py counts commands inside scripts).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shared.redis_conn import StreamEntries
from shared.scripts.base import Script
from shared.scripts.handoff import MEMBER_LUA, NAMES_LUA, ModelQueue


@dataclass(frozen=True)
class TakeKeys:
    queued: str
    entries: str
    requests: str
    workers: str
    service: str

    @classmethod
    def of(cls, queue: ModelQueue) -> TakeKeys:
        return cls(queue.queued, queue.entries, queue.requests, queue.workers, queue.service)


@dataclass(frozen=True)
class TakeArgs:
    now: float
    stale_before: float  # members scored at or before this are stale: trimmed, not taken
    worker: str  # the consumer the entries are claimed to
    room: int  # requests of any tenant
    fair: bool  # the fair order; else the oldest first
    placement_wait_s: float  # a placed member is anyone's after this long
    starving_before: float  # a member queued before this goes first
    service_ttl_s: int
    burst: int  # beyond `room`, for tenants under their share
    slots: int  # the worker's batch: the shares are of this
    held: Mapping[str, int]  # tenant -> requests on the worker
    charges: Mapping[str, float]  # tenant -> weighted output tokens to add to its counter


@dataclass(frozen=True)
class Taken:
    entries: StreamEntries  # the requests now this worker's, as stream entries
    last_id: str  # the stream's newest entry ("0-0": empty): block on XREAD from here
    retry_ms: int  # until a member placed on another worker becomes anyone's; -1: none
    waiting: int  # queued requests this worker could take with more room

    @classmethod
    def parse(cls, reply: Sequence[Any]) -> Taken:
        entries, last, retry, waiting = reply
        return cls([(e[0], _pairs(e[1])) for e in entries],
                   last.decode() if isinstance(last, bytes) else str(last), int(retry),
                   int(waiting))


def _pairs(flat: list[bytes]) -> dict[bytes, bytes]:
    return dict(zip(flat[0::2], flat[1::2], strict=True))


_TAKE = """
local now, me, room = tonumber(A.now), A.worker, tonumber(A.room)
local fair, wait, starving = A.fair == '1', tonumber(A.placement_wait_s),
  tonumber(A.starving_before)
local burst, slots = tonumber(A.burst), tonumber(A.slots)
local held = cjson.decode(A.held)
-- tenant -> weighted tokens to add to its service counter: its output tokens so far (the
-- worker's tally), then the prompts taken here.
local owed, charged = cjson.decode(A.charges), {}
for tenant, tokens in pairs(owed) do charged[tenant] = tokens end
-- Reads and the claim first, writes after: a missing group (NOGROUP, the worker makes it
-- anew) stops the script before it has changed anything.
local members = redis.call('ZRANGE', K.queued, 0, -1, 'WITHSCORES')
-- taken: request ids to claim; gone: their members; fields: the entries hash's to delete.
local entries, taken, gone, fields, present = {}, {}, {}, {}, {}
if room > 0 and #members == 0 then
  -- Entries admission did not queue (added by hand) are taken as they come, when nothing is
  -- queued.
  local fresh = redis.call('XREADGROUP', 'GROUP', GROUP, me, 'COUNT', room,
                           'STREAMS', K.requests, '>')
  for _, e in ipairs(fresh and fresh[1][2] or {}) do
    table.insert(entries, e)
    if e[2][1] == 'id' then present[e[2][2]] = true; table.insert(fields, e[2][2]) end
  end
  room = room - #entries
end

local candidates, live, stale, listed, retry = {}, {}, false, 0, -1
for i = 1, #members, 2 do
  local m, at = parse_member(members[i]), tonumber(members[i + 1])
  if not m or at <= tonumber(A.stale_before) then
    stale = true
  else
    listed = listed + 1
    present[m.id] = true
    m.at = at
    local mine = m.worker == '' or m.worker == me or at + wait <= now
    if not mine then
      if live[m.worker] == nil then
        local expiry = redis.call('ZSCORE', K.workers, m.worker)
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
if room > 0 and redis.call('HLEN', K.entries) > listed then
  local queue = redis.call('HGETALL', K.entries)
  for i = 1, #queue, 2 do
    if #taken < room and not present[queue[i]] then table.insert(taken, queue[i]) end
  end
end

local served = {}
local function service(tenant)
  if served[tenant] == nil then
    served[tenant] = tonumber(redis.call('HGET', K.service, tenant) or '0') + (owed[tenant] or 0)
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
  local claim = {'XCLAIM', K.requests, GROUP, me, 0}
  for _, entry_id in ipairs(redis.call('HMGET', K.entries, unpack(taken))) do
    if entry_id then table.insert(claim, entry_id) end
  end
  if #claim > 5 then
    table.insert(claim, 'RETRYCOUNT')
    table.insert(claim, 1)
    for _, e in ipairs(redis.call(unpack(claim))) do table.insert(entries, e) end
  end
  for _, id in ipairs(taken) do table.insert(fields, id) end
end
if #fields > 0 then redis.call('HDEL', K.entries, unpack(fields)) end
if #gone > 0 then redis.call('ZREM', K.queued, unpack(gone)) end
if stale then redis.call('ZREMRANGEBYSCORE', K.queued, '-inf', A.stale_before) end
if next(charged) then
  for tenant, tokens in pairs(charged) do
    redis.call('HINCRBYFLOAT', K.service, tenant, tostring(tokens))
  end
  redis.call('EXPIRE', K.service, A.service_ttl_s)
end
local newest = redis.call('XREVRANGE', K.requests, '+', '-', 'COUNT', 1)[1]
return {entries, newest and newest[1] or '0-0', retry, #candidates}
"""

TAKE = Script("take", TakeKeys, TakeArgs, NAMES_LUA + MEMBER_LUA + _TAKE, Taken.parse)
