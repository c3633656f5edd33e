"""One reply's rate-limit reservation: charged at admission, settled once when it ends.

A reply is charged one request and its whole possible token cost (every prompt once, plus
`max_tokens` for each of its `n` choices) by its first choice's admission script, before any
other choice is queued. Each choice reports how it ended as it closes (however it ended:
finished, cancelled, disconnected, timed out, refused); when the last one has, one call of
the settle script (shared/scripts/limits.py) gives back what the reply did not use: each
choice's `max_tokens` less what it generated, and the prompts too if no choice produced
anything (it failed before its first token). A reply refused at admission (a later choice
found the queue full) gets its request back as well.

A stream whose client left while it runs on for a resume (`api.queue.replay`) keeps its choice's
whole reservation: the tokens it goes on producing reach another replica, which cannot settle
them here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import redis.asyncio as aioredis

from api.queue.limits.bucket import BucketReply, Charge
from api.queue.limits.replies import headers
from shared.keys import Keys
from shared.messages import GenerateRequest
from shared.scripts.limits import SETTLE, SettleArgs, SettleKeys
from shared.tenants import TenantPolicy

log = logging.getLogger("redserve.api")


class Reservation:
    def __init__(self, limits: RateLimits, charge: Charge, choices: int,
                 prompt_tokens: int) -> None:
        self._limits = limits
        self.charge = charge
        self.bucket: BucketReply | None = None  # set once the admission script charged it
        self._open = choices
        self._prompt_tokens = prompt_tokens
        self._unused = 0  # completion tokens reserved and not generated, summed
        self._answered = False  # some choice produced a token or finished
        self._refused = False

    def headers(self) -> dict[str, str]:
        """The reply's `x-ratelimit-*` headers, once charged."""
        return {} if self.bucket is None else headers(self.bucket)

    def refused(self) -> None:
        """A choice was refused at admission: the whole reply is."""
        self._refused = True

    async def ended(self, unused: int, answered: bool) -> None:
        """A choice closed, `unused` of its `max_tokens` never generated; the last one
        settles the reply."""
        self._open -= 1
        self._unused += unused
        self._answered |= answered
        if self._open or self.bucket is None:
            return
        tokens = self._unused if self._answered and not self._refused else self.charge.tokens
        requests = 1 if self._refused else 0
        if tokens > 0 or requests:
            await self._limits.settle(self.charge, requests, tokens)


@dataclass
class RateLimits:
    """The replica's side of the rate limits: what a reply is charged, and settling it."""

    redis: aioredis.Redis
    keys: Keys

    def __post_init__(self) -> None:
        self._settle = SETTLE.bind(self.redis)

    def reserve(self, policy: TenantPolicy, requests: list[GenerateRequest],
                prompt_tokens: int) -> Reservation | None:
        """The reservation of a reply made of `requests` (its choices) on prompts of
        `prompt_tokens` in all (each counted once, however many choices share it), or None
        when its tenant has no limit."""
        if not policy.requests_per_minute and not policy.tokens_per_minute:
            return None
        first = requests[0]
        tokens = prompt_tokens + sum(r.params.max_tokens for r in requests)
        charge = Charge(self.keys.limits(first.model, first.tenant),
                        policy.requests_per_minute, policy.tokens_per_minute, tokens)
        return Reservation(self, charge, len(requests), prompt_tokens)

    async def settle(self, charge: Charge, requests: int, tokens: int) -> None:
        try:
            await self._settle(SettleKeys(charge.key), SettleArgs(
                charge.requests_per_minute, charge.tokens_per_minute, requests_back=requests,
                tokens_back=tokens))
        except aioredis.RedisError as e:  # the bucket refills anyway: only the refund is lost
            log.warning("rate limit not settled (%d requests, %d tokens kept): %s", requests,
                        tokens, e)
