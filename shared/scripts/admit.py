"""The admission script: check a tenant's limits, queue a request, charge the limits; one step.

A request enters only while its model's queue has room (`max_requests` requests and
`max_tokens` prompt tokens waiting, `max_per_tenant` of them the tenant's). The queued set's
members older than the queue timeout are trimmed here (scored at or before `stale_before`),
so a crashed process can never leave the queue looking full. The check and the insert are one
script: two replicas cannot both take the last place. The same script appends the request to
the model's stream (every key in the model's Cluster slot), trimming entries older than the
request TTL (`min_id`), and extends the stream's TTL to a request TTL from now: so a place is
never held by a request that is not on the stream, no prompt outlives its TTL there, and a
stream no worker refreshes (none runs: scaled to zero) cannot expire under a request that just
joined it.

Then the hand-off to the take script (`shared.scripts.handoff`): the new entry is delivered at
once to the queue's consumer (the group is made if missing) and its entry id recorded under
its request id in the entries hash, so a worker claims the request it chooses. And the
tenant's service counter is lifted (VTC's lift, see shared/messages/queue.py): a tenant with
nothing queued starts again at no less than the least-served tenant with requests waiting, so
time spent idle banks no credit.

The tenant's rate limits run in the same script (`shared.scripts.limits`): checked before the
queue, charged only when the queue admits the request. The sections are kept apart: the
limits' check, then the queue's (a function returning its status), then the charge.
api/queue/admission.py builds the arguments and words the refusals.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

from shared.scripts.base import Script
from shared.scripts.handoff import MEMBER_LUA, NAMES_LUA, ModelQueue
from shared.scripts.limits import CHARGE, CHECK, BucketLevels, LimitArgs


@dataclass(frozen=True)
class AdmitKeys:
    queued: str
    requests: str
    entries: str
    service: str
    bucket: str  # the tenant's rate-limit bucket: read and written only under a limit

    @classmethod
    def of(cls, queue: ModelQueue, bucket: str) -> AdmitKeys:
        return cls(queue.queued, queue.requests, queue.entries, queue.service, bucket)


@dataclass(frozen=True)
class AdmitArgs:
    now: float  # the member's score: its enqueue time
    stale_before: float  # members scored at or before this are stale: trimmed, not counted
    member: str  # `QueueMember.encode()`
    prompt_tokens: int
    max_requests: int
    max_tokens: int  # prompt tokens waiting, this request's included
    queued_ttl_s: int  # the queued set's TTL
    max_per_tenant: int
    tenant: str
    min_id: str  # stream entries older than this are trimmed (the request TTL)
    request_ttl_s: int  # the stream's, the entries hash's and the service counters' TTL
    request_id: str  # the stream entry: `{"id": request_id, "body": body}`
    body: str
    limit: LimitArgs  # `NO_LIMIT`: no rate limit applies


class AdmitStatus(IntEnum):
    ADMITTED = 1
    QUEUE_FULL = 0  # `max_requests` waiting
    QUEUE_TOKENS_FULL = -1  # `max_tokens` waiting
    TENANT_SHARE_FULL = -2  # `max_per_tenant` of the tenant's waiting
    RATE_REQUESTS = -3  # the requests bucket cannot pay
    RATE_TOKENS = -4  # the tokens bucket cannot pay
    TOO_LARGE = -5  # it asks more tokens than a whole minute holds


@dataclass(frozen=True)
class AdmitReply:
    status: AdmitStatus
    bucket: BucketLevels  # under no limit: zeros

    @classmethod
    def parse(cls, reply: Sequence[int]) -> AdmitReply:
        return cls(AdmitStatus(int(reply[0])), BucketLevels.parse(reply[1:]))


_QUEUE = """
local members = redis.call('ZRANGE', K.queued, 0, -1, 'WITHSCORES')
local stale, count, mine, tokens = false, 0, 0, tonumber(A.prompt_tokens)
local waiting = {}  -- tenants with requests queued
for i = 1, #members, 2 do
  local m = parse_member(members[i])
  if tonumber(members[i + 1]) <= tonumber(A.stale_before) or not m then
    stale = true
  else
    count = count + 1
    tokens = tokens + m.tokens
    if m.tenant == A.tenant then mine = mine + 1 end
    waiting[m.tenant] = true
  end
end
if stale then redis.call('ZREMRANGEBYSCORE', K.queued, '-inf', A.stale_before) end
if count >= tonumber(A.max_requests) then return R.QUEUE_FULL end
if mine >= tonumber(A.max_per_tenant) then return R.TENANT_SHARE_FULL end
if tokens > tonumber(A.max_tokens) then return R.QUEUE_TOKENS_FULL end
redis.call('ZADD', K.queued, A.now, A.member)
redis.call('EXPIRE', K.queued, A.queued_ttl_s)
local entry = {'*', 'id', A.request_id, 'body', A.body}
if not redis.call('XADD', K.requests, 'NOMKSTREAM', 'MINID', A.min_id, unpack(entry)) then
  redis.call('XADD', K.requests, unpack(entry))
end
redis.call('EXPIRE', K.requests, A.request_ttl_s)
-- Queued: pending under the queue's consumer, found by request id (the take script). Any
-- other entry not delivered yet (added by hand) is delivered with it, findable the same way.
local read = redis.pcall('XREADGROUP', 'GROUP', GROUP, QUEUED, 'STREAMS', K.requests, '>')
if type(read) == 'table' and read.err then
  redis.call('XGROUP', 'CREATE', K.requests, GROUP, '0')
  read = redis.call('XREADGROUP', 'GROUP', GROUP, QUEUED, 'STREAMS', K.requests, '>')
end
for _, e in ipairs(read and read[1][2] or {}) do
  if e[2][1] == 'id' then redis.call('HSET', K.entries, e[2][2], e[1]) end
end
redis.call('EXPIRE', K.entries, A.request_ttl_s)
-- VTC's lift: back in the queue at no less than the least-served tenant waiting.
if mine == 0 then
  local least = nil
  for tenant in pairs(waiting) do
    local served = tonumber(redis.call('HGET', K.service, tenant) or '0')
    if least == nil or served < least then least = served end
  end
  if least ~= nil and tonumber(redis.call('HGET', K.service, A.tenant) or '0') < least then
    redis.call('HSET', K.service, A.tenant, tostring(least))
    redis.call('EXPIRE', K.service, A.request_ttl_s)
  end
end
return R.ADMITTED
"""

ADMIT = Script("admit", AdmitKeys, AdmitArgs,
               f"{NAMES_LUA}{MEMBER_LUA}\n-- rate limits: check\n{CHECK}\n"
               f"-- the queue\nlocal function enqueue()\n{_QUEUE}end\n"
               f"local status = enqueue()\n-- rate limits: charge\n{CHARGE}",
               AdmitReply.parse, AdmitStatus)
