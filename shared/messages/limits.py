"""A tenant's rate-limit bucket for one model: a hash per (model, tenant) (see `shared.keys`).

Two token buckets in one hash, requests and tokens, each holding at most its per-minute limit
and refilling at limit/60 a second (so a tenant idle for a minute has its whole minute back).
The API replicas' admission script refills, checks and charges them, the settle script gives
back what a finished reply did not use (both: shared/scripts/limits.py), and `redserve
inspect` reads them.
A level is stored with the Redis time (ms) it was true at, so a reader computes the level now
without writing; a missing hash is a full bucket. Every write sets the hash's TTL to the
window and a second: past it the bucket would be full again anyway, so it may go.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

WINDOW_MS = 60_000  # the limits are per minute
BUCKET_TTL_MS = WINDOW_MS + 1_000


class BucketField(StrEnum):
    """The fields of a bucket hash (`shared.keys`: `{prefix}:model:{<model>}:limits:<tenant>`).
    Flat numbers, so `redis-cli HGETALL` reads it."""

    REQUESTS = "requests"  # requests left at `at` (fractional while it refills)
    TOKENS = "tokens"  # tokens left at `at`
    AT = "at"  # Redis time of the levels, ms
    REQUESTS_LIMIT = "rpm"  # the limits the last write applied (0: none); for readers
    TOKENS_LIMIT = "tpm"


@dataclass(frozen=True)
class Bucket:
    """A bucket hash, decoded: its levels at `at_ms` and the limits they were charged under."""

    requests: float
    tokens: float
    at_ms: int
    requests_limit: int
    tokens_limit: int

    @classmethod
    def decode(cls, fields: Mapping[str, str | None]) -> Bucket:
        """ValueError naming what is wrong, for a hash that is not what redserve writes."""
        try:
            return cls(float(fields[BucketField.REQUESTS] or ""),
                       float(fields[BucketField.TOKENS] or ""),
                       int(float(fields[BucketField.AT] or "")),
                       int(fields[BucketField.REQUESTS_LIMIT] or ""),
                       int(fields[BucketField.TOKENS_LIMIT] or ""))
        except (KeyError, ValueError):
            raise ValueError("a rate-limit bucket without numeric "
                             f"{', '.join(BucketField)} fields") from None

    def at(self, now_ms: int) -> Bucket:
        """The levels refilled to `now_ms` (the same arithmetic as the scripts')."""
        elapsed = max(now_ms - self.at_ms, 0)
        return Bucket(_refill(self.requests, self.requests_limit, elapsed),
                      _refill(self.tokens, self.tokens_limit, elapsed), now_ms,
                      self.requests_limit, self.tokens_limit)


def _refill(level: float, limit: int, elapsed_ms: int) -> float:
    return min(float(limit), level + elapsed_ms * limit / WINDOW_MS) if limit > 0 else 0.0
