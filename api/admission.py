"""The bounded queue: a request enters only while its model's queue has room.

The model's queued set (see `shared.keys`) holds one member per request no worker has taken
yet, `<id>:<tenant>:<prompt tokens>`, scored by enqueue time. Workers remove members as they
take requests; members older than the queue timeout are trimmed here, so a crashed process can
never leave the queue looking full. The check and the insert are one script: two replicas
cannot both take the last slot.

One tenant may hold at most `max_per_tenant` of the queue's places, so no single tenant can
fill it and have every other tenant's requests refused.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from shared.messages import GenerateRequest

_ADMIT = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[2])
local members = redis.call('ZRANGE', KEYS[1], 0, -1)
if #members >= tonumber(ARGV[5]) then return 0 end
local tokens = tonumber(ARGV[4])
local mine = 0
for _, m in ipairs(members) do
  local tenant, n = string.match(m, ':([^:]*):(%d+)$')
  tokens = tokens + tonumber(n)
  if tenant == ARGV[9] then mine = mine + 1 end
end
if mine >= tonumber(ARGV[8]) then return -2 end
if tokens > tonumber(ARGV[6]) then return -1 end
redis.call('ZADD', KEYS[1], ARGV[1], ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[7])
return 1
"""


@dataclass(frozen=True)
class QueueLimits:
    max_requests: int
    max_tokens: int
    timeout_s: float
    max_per_tenant: int


class Admission:
    def __init__(self, redis: aioredis.Redis, limits: QueueLimits) -> None:
        self._script = redis.register_script(_ADMIT)
        self.limits = limits

    async def try_enqueue(self, queued_key: str, request: GenerateRequest) -> str | None:
        """Reserve a queue slot; None if admitted, else why not."""
        now = time.time()
        limits = self.limits
        result = await self._script(
            keys=[queued_key],
            args=[now, now - limits.timeout_s - 5, request.queue_member,
                  len(request.prompt_ids), limits.max_requests, limits.max_tokens,
                  int(limits.timeout_s) + 10, limits.max_per_tenant, request.tenant],
        )
        if result == 1:
            return None
        if result == 0:
            return f"the queue is full ({limits.max_requests} requests waiting)"
        if result == -2:
            return (f"this API key's tenant holds its whole share of the queue "
                    f"({limits.max_per_tenant} waiting requests)")
        return f"the queue is full ({limits.max_tokens} prompt tokens waiting)"
