"""The bounded queue: a request enters only while its model's queue has room.

The model's queued set (see `shared.keys`) holds one member per request no worker has taken yet
(`QueueMember`: id, tenant, prompt tokens, priority, weight, placed worker), scored by enqueue
time. Workers remove members as they take requests; members older than the queue timeout are
trimmed here, so a crashed process can never leave the queue looking full. The check and the
insert are one script: two replicas cannot both take the last slot. The same script appends the
request to the model's stream (both keys share the model's Cluster slot), trimming entries
older than the request TTL, and extends the stream's TTL to a request TTL from now: so a place
is never held by a request that is not on the stream, no prompt outlives its TTL there, and a
stream no worker refreshes (none runs: scaled to zero) cannot expire under a request that just
joined it.

One tenant may hold at most `max_per_tenant` of the queue's places, so no single tenant can
fill it and have every other tenant's requests refused.

The tenant's rate limits run in the same script (`api.limits.bucket`): checked before the
queue, charged only when the queue admits the request. The script's sections are kept apart:
the limits' Lua, then the queue's (a function returning the queue's status), then the charge;
the limits take the last KEY and the last ARGV.

For the take script (worker/broker/take.py), the same script delivers the new entry at once to the
group's queue consumer (`QUEUED_CONSUMER`; the group is made if missing) and records its entry
id under the request id in the model's entries hash: a worker then claims the request it
chooses, not the next in the stream. And it lifts the tenant's service counter (VTC's lift,
see shared/messages/queue.py): a tenant with nothing queued starts again at no less than the
least-served tenant that has requests waiting, so time spent idle banks no credit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from api.limits.bucket import CHARGE, CHECK, NO_LIMIT_ARGS, BucketReply, Charge
from shared.keys import QUEUE_STALE_MARGIN_S, QUEUED_CONSUMER, WORKER_GROUP, Keys
from shared.messages import MEMBER_LUA, GenerateRequest

_QUEUE = """
local members = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
local stale, count, mine, tokens = false, 0, 0, tonumber(ARGV[4])
local waiting = {}  -- tenants with requests queued
for i = 1, #members, 2 do
  local m = parse_member(members[i])
  if tonumber(members[i + 1]) <= tonumber(ARGV[2]) or not m then
    stale = true
  else
    count = count + 1
    tokens = tokens + m.tokens
    if m.tenant == ARGV[9] then mine = mine + 1 end
    waiting[m.tenant] = true
  end
end
if stale then redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[2]) end
if count >= tonumber(ARGV[5]) then return 0 end
if mine >= tonumber(ARGV[8]) then return -2 end
if tokens > tonumber(ARGV[6]) then return -1 end
redis.call('ZADD', KEYS[1], ARGV[1], ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[7])
local entry = {'*', 'id', ARGV[12], 'body', ARGV[13]}
if not redis.call('XADD', KEYS[2], 'NOMKSTREAM', 'MINID', ARGV[10], unpack(entry)) then
  redis.call('XADD', KEYS[2], unpack(entry))
end
redis.call('EXPIRE', KEYS[2], ARGV[11])
-- Queued: pending under the queue's consumer, found by request id (worker/broker/take.py). Any
-- other entry not delivered yet (added by hand) is delivered with it, findable the same way.
local group, queued = ARGV[14], ARGV[15]
local read = redis.pcall('XREADGROUP', 'GROUP', group, queued, 'STREAMS', KEYS[2], '>')
if type(read) == 'table' and read.err then
  redis.call('XGROUP', 'CREATE', KEYS[2], group, '0')
  read = redis.call('XREADGROUP', 'GROUP', group, queued, 'STREAMS', KEYS[2], '>')
end
for _, e in ipairs(read and read[1][2] or {}) do
  if e[2][1] == 'id' then redis.call('HSET', KEYS[3], e[2][2], e[1]) end
end
redis.call('EXPIRE', KEYS[3], ARGV[11])
-- VTC's lift: back in the queue at no less than the least-served tenant waiting.
if mine == 0 then
  local least = nil
  for tenant in pairs(waiting) do
    local served = tonumber(redis.call('HGET', KEYS[4], tenant) or '0')
    if least == nil or served < least then least = served end
  end
  if least ~= nil and tonumber(redis.call('HGET', KEYS[4], ARGV[9]) or '0') < least then
    redis.call('HSET', KEYS[4], ARGV[9], tostring(least))
    redis.call('EXPIRE', KEYS[4], ARGV[11])
  end
end
return 1
"""

_ADMIT = (f"{MEMBER_LUA}\n-- rate limits: check\n{CHECK}\n"
          f"-- the queue\nlocal function enqueue()\n{_QUEUE}end\n"
          f"local status = enqueue()\n-- rate limits: charge\n{CHARGE}")


@dataclass(frozen=True)
class Admitted:
    """The script's answer: why the queue refused the request (None: it is enqueued), and
    the tenant's buckets (None: no rate limit applies)."""

    refused: str | None
    limits: BucketReply | None


@dataclass(frozen=True)
class QueueLimits:
    max_requests: int
    max_tokens: int
    timeout_s: float
    max_per_tenant: int


class Admission:
    def __init__(self, redis: aioredis.Redis, keys: Keys, limits: QueueLimits,
                 request_ttl_s: int) -> None:
        self._script = redis.register_script(_ADMIT)
        self.keys = keys
        self.limits = limits
        self.request_ttl_s = request_ttl_s

    async def try_enqueue(self, request: GenerateRequest, charge: Charge | None = None
                          ) -> Admitted:
        """Check the tenant's limits (`charge`), reserve a queue place and enqueue the
        request, and charge the limits if it is enqueued. Refused by a limit, `refused` is
        None and `limits.refused` says which."""
        now = time.time()
        limits = self.limits
        oldest_ms = int((now - self.request_ttl_s) * 1000)
        fields = request.to_fields()
        model = request.model
        reply = await self._script(
            keys=[self.keys.queued(model), self.keys.requests(model), self.keys.entries(model),
                  self.keys.service(model), self.keys.limits(model, request.tenant)],
            args=[now, now - limits.timeout_s - QUEUE_STALE_MARGIN_S, request.queue_member,
                  len(request.prompt_ids), limits.max_requests, limits.max_tokens,
                  int(limits.timeout_s) + 10, limits.max_per_tenant, request.tenant,
                  f"{max(oldest_ms, 0)}-0", self.request_ttl_s, fields["id"],
                  fields["body"], WORKER_GROUP, QUEUED_CONSUMER,
                  *(charge.args() if charge else NO_LIMIT_ARGS)],
        )
        bucket = BucketReply.parse(charge, reply) if charge and charge.limited else None
        return Admitted(self._why(int(reply[0])), bucket)

    def _why(self, status: int) -> str | None:
        """The queue's refusal, from the script's status (None: admitted, or refused by a
        limit, which the bucket's reply tells)."""
        limits = self.limits
        if status == 0:
            return f"the queue is full ({limits.max_requests} requests waiting)"
        if status == -2:
            return (f"this API key's tenant holds its whole share of the queue "
                    f"({limits.max_per_tenant} waiting requests)")
        if status == -1:
            return f"the queue is full ({limits.max_tokens} prompt tokens waiting)"
        return None
