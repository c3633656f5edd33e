"""A tenant's rate limits as Lua inside the admission script, and the script that settles them.

The limits cost no round trip of their own: the admission script (`api.admission`) opens with
`CHECK`, which refills the tenant's two buckets (requests, tokens: see
`shared.messages.limits`) to the Redis clock and refuses a request they cannot pay for before
the queue is even looked at; it ends with `CHARGE`, which takes the request's cost only if the
queue admitted it. One script, so two replicas can never both spend a tenant's last request.
Redis's own clock (TIME), not a replica's: replicas whose clocks disagree still refill one
bucket at one rate.

These sections take the script's last KEY (the bucket) and its last three ARGV (requests per
minute, tokens per minute, tokens asked for; a limit of 0 is none, and with no limit at all
the bucket is never read or written), so the queue's own keys and arguments keep their places.

A reply's token cost is reserved whole at admission (every prompt, and `max_tokens` for each
choice) and settled when it ends (`api.limits.reservation`): `SETTLE` gives back what it did
not use, capped at the limit, onto a bucket refilled to now.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shared.messages import BUCKET_TTL_MS, WINDOW_MS, BucketField

_FIELDS = (f"'{BucketField.REQUESTS}', '{BucketField.TOKENS}', '{BucketField.AT}'")

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

# Script statuses of the limits (the queue's own are 1, 0, -1 and -2: see api/admission.py).
REFUSED_REQUESTS, REFUSED_TOKENS, TOO_LARGE = -3, -4, -5

CHECK = _REFILL + f"""
local rl_key, rl_arg = KEYS[#KEYS], #ARGV - 2
local rl_limit = {{tonumber(ARGV[rl_arg]), tonumber(ARGV[rl_arg + 1])}}
local rl_need = {{1, tonumber(ARGV[rl_arg + 2])}}
local rl_level, rl_now = {{0, 0}}, 0
local rl_on = rl_limit[1] > 0 or rl_limit[2] > 0
local function rl_answer(status, wait)
  return {{status, math.floor(rl_level[1]), math.floor(rl_level[2]),
          rl_reset(rl_level[1], rl_limit[1]), rl_reset(rl_level[2], rl_limit[2]), wait}}
end
if rl_on then
  rl_now = rl_clock()
  local stored = redis.call('HMGET', rl_key, {_FIELDS})
  local wait = {{0, 0}}
  for i = 1, 2 do
    rl_level[i] = rl_refill(stored[i], stored[3], rl_limit[i], rl_now)
    if rl_limit[i] > 0 and rl_level[i] < rl_need[i] then
      wait[i] = math.ceil((rl_need[i] - rl_level[i]) * {WINDOW_MS} / rl_limit[i])
    end
  end
  if rl_limit[2] > 0 and rl_need[2] > rl_limit[2] then return rl_answer({TOO_LARGE}, 0) end
  if wait[1] > 0 then return rl_answer({REFUSED_REQUESTS}, math.max(wait[1], wait[2])) end
  if wait[2] > 0 then return rl_answer({REFUSED_TOKENS}, wait[2]) end
end
"""

# `status`: the queue's answer (1: admitted).
CHARGE = """
if rl_on and status == 1 then
  for i = 1, 2 do
    if rl_limit[i] > 0 then rl_level[i] = rl_level[i] - rl_need[i] end
  end
  rl_store(rl_key, rl_level, rl_limit, rl_now)
end
return rl_answer(status, 0)
"""

# KEYS[1]: the bucket; ARGV: requests per minute, tokens per minute, requests and tokens given
# back. A bucket that expired is full: nothing to give back.
SETTLE = _REFILL + """
local stored = redis.call('HMGET', KEYS[1], """ + _FIELDS + """)
if not stored[3] then return 0 end
local now = rl_clock()
local limit = {tonumber(ARGV[1]), tonumber(ARGV[2])}
local level = {0, 0}
for i = 1, 2 do
  level[i] = math.min(rl_refill(stored[i], stored[3], limit[i], now) + tonumber(ARGV[2 + i]),
                      limit[i])
end
rl_store(KEYS[1], level, limit, now)
return 1
"""


@dataclass(frozen=True)
class Charge:
    """What a reply asks of its tenant's buckets for one model: one request and `tokens`."""

    key: str  # the bucket (`Keys.limits`)
    requests_per_minute: int  # 0: no limit
    tokens_per_minute: int  # 0: no limit
    tokens: int

    @property
    def limited(self) -> bool:
        return self.requests_per_minute > 0 or self.tokens_per_minute > 0

    def args(self) -> list[int]:
        """The admission script's last three arguments."""
        return [self.requests_per_minute, self.tokens_per_minute, self.tokens]


NO_LIMIT_ARGS = [0, 0, 0]


@dataclass(frozen=True)
class BucketReply:
    """What the admission script says of a tenant's buckets: the levels after the charge (or,
    refused, before it), each bucket's time to full, and why it refused, if it did."""

    charge: Charge
    remaining_requests: int
    remaining_tokens: int
    reset_requests_ms: int  # until the bucket is full again
    reset_tokens_ms: int
    retry_after_ms: int  # refused: until the request would fit
    refused: Literal["requests", "tokens"] | None
    too_large: bool  # refused: it asks more tokens than a whole minute holds

    @classmethod
    def parse(cls, charge: Charge, reply: list[int]) -> BucketReply:
        status, requests, tokens, reset_r, reset_t, wait = (int(v) for v in reply)
        refused: Literal["requests", "tokens"] | None = (
            "requests" if status == REFUSED_REQUESTS
            else "tokens" if status in (REFUSED_TOKENS, TOO_LARGE) else None)
        return cls(charge, requests, tokens, reset_r, reset_t, wait, refused,
                   status == TOO_LARGE)
