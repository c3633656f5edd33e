"""The bounded queue: a request enters only while its model's queue has room.

Admission is one script (shared/scripts/admit.py): the tenant's rate limits checked, a place
in the queue reserved, the request put on the model's stream and handed off for a worker to
take, and the limits charged, atomically, so two replicas can never both take the last place
or spend a tenant's last request. Here is the replica's side of it: the queue's bounds, the
arguments the script is called with, and the words of each refusal.

The queue holds at most `max_requests` requests and `max_tokens` prompt tokens. One tenant may
hold at most `max_per_tenant` of its places, so no single tenant can fill it and have every
other tenant's requests refused. A member older than the queue timeout (and
`QUEUE_STALE_MARGIN_S`) is stale: trimmed by the script, never counted, so a crashed process
can never leave the queue looking full.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from api.limits.bucket import BucketReply, Charge
from shared.keys import QUEUE_STALE_MARGIN_S, Keys
from shared.messages import GenerateRequest
from shared.scripts.admit import ADMIT, AdmitArgs, AdmitKeys, AdmitStatus
from shared.scripts.handoff import ModelQueue
from shared.scripts.limits import NO_LIMIT


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
        self._script = ADMIT.bind(redis)
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
        model = request.model
        reply = await self._script(
            AdmitKeys.of(ModelQueue.of(self.keys, model),
                         bucket=self.keys.limits(model, request.tenant)),
            AdmitArgs(now=now, stale_before=now - limits.timeout_s - QUEUE_STALE_MARGIN_S,
                      member=request.queue_member, prompt_tokens=len(request.prompt_ids),
                      max_requests=limits.max_requests, max_tokens=limits.max_tokens,
                      queued_ttl_s=int(limits.timeout_s) + 10,
                      max_per_tenant=limits.max_per_tenant, tenant=request.tenant,
                      min_id=f"{max(oldest_ms, 0)}-0", request_ttl_s=self.request_ttl_s,
                      request_id=request.id, body=request.model_dump_json(),
                      limit=charge.args() if charge else NO_LIMIT))
        bucket = BucketReply.of(charge, reply) if charge and charge.limited else None
        return Admitted(self._why(reply.status), bucket)

    def _why(self, status: AdmitStatus) -> str | None:
        """The queue's refusal (None: admitted, or refused by a limit, which the bucket's
        reply tells)."""
        limits = self.limits
        if status is AdmitStatus.QUEUE_FULL:
            return f"the queue is full ({limits.max_requests} requests waiting)"
        if status is AdmitStatus.TENANT_SHARE_FULL:
            return (f"this API key's tenant holds its whole share of the queue "
                    f"({limits.max_per_tenant} waiting requests)")
        if status is AdmitStatus.QUEUE_TOKENS_FULL:
            return f"the queue is full ({limits.max_tokens} prompt tokens waiting)"
        return None
