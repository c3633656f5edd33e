"""What a reply asks of its tenant's rate limits, and what the admission script said of them.

The buckets themselves are Lua (shared/scripts/limits.py): checked and charged inside the
admission script, settled by their own script. Here is the replica's side: a reply's `Charge`
(the bucket, the tenant's limits, the tokens reserved), the admission script's `limit`
arguments made from it, and `BucketReply`, the script's answer read for a client: which limit
refused it, if one did, and the levels its `x-ratelimit-*` headers report
(api/queue/limits/replies.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shared.scripts.admit import AdmitReply, AdmitStatus
from shared.scripts.limits import LimitArgs

_REFUSED: dict[AdmitStatus, Literal["requests", "tokens"]] = {
    AdmitStatus.RATE_REQUESTS: "requests", AdmitStatus.RATE_TOKENS: "tokens",
    AdmitStatus.TOO_LARGE: "tokens"}


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

    def args(self) -> LimitArgs:
        """The admission script's `limit` arguments."""
        return LimitArgs(self.requests_per_minute, self.tokens_per_minute, self.tokens)


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
    def of(cls, charge: Charge, reply: AdmitReply) -> BucketReply:
        levels = reply.bucket
        return cls(charge, levels.remaining_requests, levels.remaining_tokens,
                   levels.reset_requests_ms, levels.reset_tokens_ms, levels.retry_after_ms,
                   _REFUSED.get(reply.status), reply.status is AdmitStatus.TOO_LARGE)
