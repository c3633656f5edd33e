"""What a client sees of its rate limits: OpenAI's headers and its 429.

Every completion and chat reply of a tenant with a limit carries, for each limit it has (a
limit of 0 is none, and its headers are left out), `x-ratelimit-limit-*`,
`x-ratelimit-remaining-*` and `x-ratelimit-reset-*` (the time until that bucket is full
again, in OpenAI's duration format: `20ms`, `1.5s`, `6m0s`). A refusal is a 429 with OpenAI's
body (`type` "requests" or "tokens", code `rate_limit_exceeded`, the message naming the limit,
the use and the wait) and `Retry-After` in whole seconds, at least 1; the `openai` client
raises it as `RateLimitError`.
"""

from __future__ import annotations

import math

from api.protocol.errors import APIError
from api.queue.limits.bucket import BucketReply

_PER_MINUTE = {"requests": "requests per min (RPM)", "tokens": "tokens per min (TPM)"}


def duration(ms: int) -> str:
    """OpenAI's (Go's) duration format, to the millisecond: `0s`, `20ms`, `1.5s`, `6m0s`."""
    if ms <= 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    minutes, rest = divmod(ms, 60_000)
    hours, minutes = divmod(minutes, 60)
    seconds = f"{rest // 1000}.{rest % 1000:03d}".rstrip("0").rstrip(".")
    return (f"{hours}h" if hours else "") + (f"{minutes}m" if hours or minutes else "") + \
        f"{seconds}s"


def headers(bucket: BucketReply) -> dict[str, str]:
    charge, out = bucket.charge, {}
    if charge.requests_per_minute:
        out["x-ratelimit-limit-requests"] = str(charge.requests_per_minute)
        out["x-ratelimit-remaining-requests"] = str(max(bucket.remaining_requests, 0))
        out["x-ratelimit-reset-requests"] = duration(bucket.reset_requests_ms)
    if charge.tokens_per_minute:
        out["x-ratelimit-limit-tokens"] = str(charge.tokens_per_minute)
        out["x-ratelimit-remaining-tokens"] = str(max(bucket.remaining_tokens, 0))
        out["x-ratelimit-reset-tokens"] = duration(bucket.reset_tokens_ms)
    return out


def rate_limited(bucket: BucketReply, model: str, tenant: str) -> APIError:
    """The 429 of a request its tenant's limits refused."""
    charge, kind = bucket.charge, bucket.refused or "tokens"
    where = f"for {model} for tenant {tenant!r} on {_PER_MINUTE[kind]}"
    wait_ms = bucket.reset_tokens_ms if bucket.too_large else bucket.retry_after_ms
    if bucket.too_large:
        message = (f"Request too large {where}: Limit {charge.tokens_per_minute}, Requested "
                   f"{charge.tokens}. The input or output tokens must be reduced in order to "
                   "run successfully.")
    else:
        limit, left, asked = ((charge.requests_per_minute, bucket.remaining_requests, 1)
                              if kind == "requests" else
                              (charge.tokens_per_minute, bucket.remaining_tokens,
                               charge.tokens))
        message = (f"Rate limit reached {where}: Limit {limit}, Used {limit - max(left, 0)}, "
                   f"Requested {asked}. Please try again in {duration(wait_ms)}.")
    return APIError(429, message, type=kind, code="rate_limit_exceeded",
                    headers={"Retry-After": retry_after(wait_ms), **headers(bucket)})


def retry_after(ms: int) -> str:
    """`Retry-After`: whole seconds, rounded up, at least 1."""
    return str(max(1, math.ceil(ms / 1000)))
