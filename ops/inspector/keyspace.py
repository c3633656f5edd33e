"""Finding a deployment's keys without KEYS: one SCAN walk, classified by name; and reading
them in pipelines of one-key commands (`batched`).

One walk with `MATCH <prefix>:*` and a COUNT (so Redis never blocks on a large keyspace) finds
every key of the deployment, and each is recognised by the key builders of shared/keys.py:
request hashes, stored responses, the keys of each model, its tenants' rate-limit buckets,
worker heartbeats.
One walk rather than one per kind, because a walk costs a pass over the whole keyspace
whatever it matches. On Redis Cluster, redis-py's `RedisCluster.scan_iter` walks every primary
in turn (each with its own cursor), so the same call sees the keys of every node.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared.keys import Keys, is_request_id

SCAN_COUNT = 1000
BATCH = 200
T = TypeVar("T")


@dataclass(frozen=True)
class Found:
    request_ids: frozenset[str]  # every request with a hash, finished or not
    models: frozenset[str]  # every model with a stream, queue, live set or service counters
    workers: frozenset[str]  # every worker with a heartbeat
    # (model, tenant) of every rate-limit bucket (tenants that used a limit this minute)
    limits: frozenset[tuple[str, str]] = field(default_factory=frozenset)
    responses: frozenset[str] = frozenset()  # the request ids of stored `/v1/responses` replies


def _shape(builder_output: str) -> tuple[str, str]:
    """The constant head and tail around the variable part of a key builder's output."""
    head, _, tail = builder_output.partition("\0")
    return head, tail


def classify(keys: Keys, names: list[str]) -> Found:
    model_shapes = [_shape(build("\0")) for build in (keys.requests, keys.queued, keys.workers,
                                                      keys.entries, keys.service)]
    worker_head = keys.worker("")
    limits_head, limits_mid = _shape(keys.limits("\0", ""))  # `<model>`, then the tenant
    requests, models, workers, limits, responses = set(), set(), set(), set(), set()
    for key in names:
        base, _, candidate = key.rpartition(":")
        if is_request_id(candidate) and keys.state(candidate) == key:
            requests.add(candidate)
            continue
        owner = base.rpartition(":")[2]  # `<base>:<id>:response`
        if is_request_id(owner) and keys.response(owner) == key:
            responses.add(owner)
            continue
        if key.startswith(worker_head):
            workers.add(key[len(worker_head):])
            continue
        if key.startswith(limits_head) and limits_mid in key[len(limits_head):]:
            model, _, tenant = key[len(limits_head):].partition(limits_mid)
            if model and tenant:
                limits.add((model, tenant))
                continue
        for head, tail in model_shapes:
            if key.startswith(head) and key.endswith(tail) and len(key) > len(head) + len(tail):
                models.add(key[len(head):len(key) - len(tail)])
                break
    return Found(frozenset(requests), frozenset(models), frozenset(workers), frozenset(limits),
                 frozenset(responses))


async def walk(redis: aioredis.Redis, keys: Keys) -> Found:
    """Every key under the deployment's prefix, on every node."""
    names = [text(k) async for k in redis.scan_iter(match=f"{keys.prefix}:*", count=SCAN_COUNT)]
    return classify(keys, names)


def text(value: bytes | str) -> str:
    """A key or value as read from Redis (bytes, unless the client decodes replies)."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


async def batched(redis: aioredis.Redis, items: Sequence[T], per_item: int,
                   stage: Callable[[Any, T], object]) -> list[list[Any]]:
    """For each item, the replies of the `per_item` commands `stage` adds for it, `BATCH`
    items a pipeline. A command that fails answers None (XINFO of a stream that does not
    exist, a key of another type than ours); Redis being unreachable raises."""
    replies: list[list[Any]] = []
    for start in range(0, len(items), BATCH):
        pipe = redis.pipeline(transaction=False)
        for item in items[start:start + BATCH]:
            stage(pipe, item)
        flat = [None if isinstance(r, RedisError) else r
                for r in await pipe.execute(raise_on_error=False)]
        replies += [flat[i:i + per_item] for i in range(0, len(flat), per_item)]
    return replies
