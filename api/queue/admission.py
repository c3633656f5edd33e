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

With `Replication` on (`REDSERVE_ADMISSION_WAIT_REPLICAS`), the script and a WAIT go in one
pipeline, on one connection (WAIT counts the replicas holding that connection's writes): a
request whose admission too few replicas acknowledged in time raises `NotReplicated`, a
`RedisError`, so it ends as any admission Redis failed does (aborted, 503 with Retry-After):
Redis's replication is asynchronous, and an admission only the primary held is lost if the
primary fails over before it is copied, while its client waits for a request no worker will see.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from api.queue.limits.bucket import BucketReply, Charge
from shared.keys import QUEUE_STALE_MARGIN_S, Keys
from shared.messages import GenerateRequest
from shared.scripts.admit import ADMIT, AdmitArgs, AdmitKeys, AdmitReply, AdmitStatus
from shared.scripts.handoff import ModelQueue
from shared.scripts.limits import NO_LIMIT


@dataclass(frozen=True)
class Admitted:
    """The script's answer: why the queue refused the request (None: it is enqueued), and
    the tenant's buckets (None: no rate limit applies)."""

    refused: str | None
    limits: BucketReply | None


class NotReplicated(aioredis.RedisError):
    """Fewer replicas than asked for acknowledged an admission in time."""


@dataclass(frozen=True)
class Replication:
    replicas: int  # 0: an admission is answered without waiting for any
    timeout_ms: int


NO_WAIT = Replication(0, 1)


@dataclass(frozen=True)
class QueueLimits:
    max_requests: int
    max_tokens: int
    timeout_s: float
    max_per_tenant: int


class Admission:
    def __init__(self, redis: aioredis.Redis, keys: Keys, limits: QueueLimits,
                 request_ttl_s: int, replication: Replication = NO_WAIT) -> None:
        self._redis = redis
        self._script = ADMIT.bind(redis)
        self._replication = replication
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
        reply = await self._run(
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

    async def _run(self, keys: AdmitKeys, args: AdmitArgs) -> AdmitReply:
        """The script, then (if asked) WAIT on its connection."""
        wanted = self._replication
        if not wanted.replicas:
            return await self._script(keys, args)
        pipe = self._redis.pipeline(transaction=False)
        await self._script.queue(pipe, keys, args)
        pipe.wait(wanted.replicas, wanted.timeout_ms)
        raw, acknowledged = await pipe.execute()
        if acknowledged < wanted.replicas:
            raise NotReplicated(f"{acknowledged} of {wanted.replicas} Redis replicas "
                                f"acknowledged the admission within {wanted.timeout_ms} ms")
        return ADMIT.parse(raw)

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
