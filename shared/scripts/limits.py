"""A tenant's rate limits in Lua: two sections of the admission script, and the settle script.

The limits cost no round trip of their own: the admission script (`shared.scripts.admit`)
opens with `CHECK`, which refills the tenant's two buckets (requests, tokens: see
`shared.messages.limits`) to the Redis clock and refuses a request they cannot pay for before
the queue is even looked at; it ends with `CHARGE`, which takes the request's cost only if the
queue admitted it. One script, so two replicas can never both spend a tenant's last request.
Redis's own clock (TIME), not a replica's: replicas whose clocks disagree still refill one
bucket at one rate.

The sections read the admission script's `bucket` KEY and its `limit` ARGV group
(`LimitArgs`: a limit of 0 is none, and with no limit at all the bucket is never read or
written), answer with its status codes (`R.*`, `AdmitStatus`), and report the bucket's
levels in the last five places of its reply (`BucketLevels`). The admission script's
construction checks each name they use.

A reply's token cost is reserved whole at admission and settled when it ends
(api/queue/limits/reservation.py): `SETTLE` gives back what it did not use, capped at the limit,
onto a bucket refilled to now.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

from shared.messages import BUCKET_TTL_MS, WINDOW_MS, BucketField
from shared.scripts.base import Script


@dataclass(frozen=True)
class LimitArgs:
    """The admission script's `limit` group: the tenant's limits and what the request asks."""

    requests_per_minute: int  # 0: no limit
    tokens_per_minute: int  # 0: no limit
    tokens: int  # the request's whole possible cost (one request is always asked)


NO_LIMIT = LimitArgs(0, 0, 0)


@dataclass(frozen=True)
class BucketLevels:
    """The admission reply's part from the buckets: the levels after the charge (or, refused,
    before it), each bucket's time to full, and a refused request's wait. Zeros when no limit
    applies."""

    remaining_requests: int
    remaining_tokens: int
    reset_requests_ms: int  # until the bucket is full again
    reset_tokens_ms: int
    retry_after_ms: int  # refused: until the request would fit

    @classmethod
    def parse(cls, values: Sequence[int]) -> BucketLevels:
        return cls(*(int(v) for v in values))


_FIELDS = f"'{BucketField.REQUESTS}', '{BucketField.TOKENS}', '{BucketField.AT}'"

# Shared by both scripts: a level refilled to `now` (ms), and the ms until it is full again.
_REFILL = f"""
local function rl_refill(level, at, limit, now)
  if limit <= 0 then return 0 end
  if not level or not at then return limit end
  local value = tonumber(level) + math.max(now - tonumber(at), 0) * limit / {WINDOW_MS}
  if value > limit then return limit end
  return value
end
local function rl_reset(level, limit)
  if limit <= 0 then return 0 end
  return math.ceil((limit - level) * {WINDOW_MS} / limit)
end
local function rl_clock()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function rl_store(key, level, limit, now)
  redis.call('HSET', key, '{BucketField.REQUESTS}', level[1], '{BucketField.TOKENS}', level[2],
             '{BucketField.AT}', now, '{BucketField.REQUESTS_LIMIT}', limit[1],
             '{BucketField.TOKENS_LIMIT}', limit[2])
  redis.call('PEXPIRE', key, {BUCKET_TTL_MS})
end
"""

# The admission script's opening: refused here, it returns before the queue is read.
CHECK = _REFILL + f"""
local rl_limit = {{tonumber(A.limit.requests_per_minute), tonumber(A.limit.tokens_per_minute)}}
local rl_need = {{1, tonumber(A.limit.tokens)}}
local rl_level, rl_now = {{0, 0}}, 0
local rl_on = rl_limit[1] > 0 or rl_limit[2] > 0
local function rl_answer(status, wait)
  return {{status, math.floor(rl_level[1]), math.floor(rl_level[2]),
          rl_reset(rl_level[1], rl_limit[1]), rl_reset(rl_level[2], rl_limit[2]), wait}}
end
if rl_on then
  rl_now = rl_clock()
  local stored = redis.call('HMGET', K.bucket, {_FIELDS})
  local wait = {{0, 0}}
  for i = 1, 2 do
    rl_level[i] = rl_refill(stored[i], stored[3], rl_limit[i], rl_now)
    if rl_limit[i] > 0 and rl_level[i] < rl_need[i] then
      wait[i] = math.ceil((rl_need[i] - rl_level[i]) * {WINDOW_MS} / rl_limit[i])
    end
  end
  if rl_limit[2] > 0 and rl_need[2] > rl_limit[2] then return rl_answer(R.TOO_LARGE, 0) end
  if wait[1] > 0 then return rl_answer(R.RATE_REQUESTS, math.max(wait[1], wait[2])) end
  if wait[2] > 0 then return rl_answer(R.RATE_TOKENS, wait[2]) end
end
"""

# The admission script's end; `status`: the queue's answer.
CHARGE = """
if rl_on and status == R.ADMITTED then
  for i = 1, 2 do
    if rl_limit[i] > 0 then rl_level[i] = rl_level[i] - rl_need[i] end
  end
  rl_store(K.bucket, rl_level, rl_limit, rl_now)
end
return rl_answer(status, 0)
"""


@dataclass(frozen=True)
class SettleKeys:
    bucket: str  # the tenant's bucket for the model (`Keys.limits`)


@dataclass(frozen=True)
class SettleArgs:
    requests_per_minute: int  # the limits the reply was charged under (0: none)
    tokens_per_minute: int
    requests_back: int  # given back: the reply's request, if it was refused after all
    tokens_back: int  # given back: what it reserved and did not use


class Settled(IntEnum):
    SETTLED = 1
    NO_BUCKET = 0  # the bucket had expired: full again, nothing to give back


# A bucket that expired is full: nothing to give back.
SETTLE = Script("settle", SettleKeys, SettleArgs, _REFILL + f"""
local stored = redis.call('HMGET', K.bucket, {_FIELDS})
if not stored[3] then return R.NO_BUCKET end
local now = rl_clock()
local limit = {{tonumber(A.requests_per_minute), tonumber(A.tokens_per_minute)}}
local back = {{tonumber(A.requests_back), tonumber(A.tokens_back)}}
local level = {{0, 0}}
for i = 1, 2 do
  level[i] = math.min(rl_refill(stored[i], stored[3], limit[i], now) + back[i], limit[i])
end
rl_store(K.bucket, level, limit, now)
return R.SETTLED
""", lambda reply: Settled(int(reply)), Settled)
