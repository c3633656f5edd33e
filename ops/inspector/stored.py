"""The stored `/v1/responses` replies (`api/endpoints/responses/store.py`): how many there
are, whose, and the memory they take, which grows with each chain (a response stores its whole
conversation so far) and stays for the retention TTL, whatever happens to the requests.

One HGET of the tenant field per response, and MEMORY USAGE of each while there are at most
`MEMORY_SAMPLE`; past that, of that many chosen at random, each tenant's measured bytes scaled
to its count (a tenant none of whose responses was drawn, by the mean of those measured). Both
in pipelines of one-key commands (`keyspace.batched`), so Redis Cluster routes them node by
node.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import redis.asyncio as aioredis

from ops.inspector.keyspace import batched, text
from shared.keys import Keys
from shared.messages import StoredResponseField

MEMORY_SAMPLE = 500


@dataclass(frozen=True)
class TenantResponses:
    tenant: str
    count: int
    memory_bytes: int  # measured, or estimated from a sample (see `StoredResponses.measured`)


@dataclass(frozen=True)
class StoredResponses:
    count: int
    memory_bytes: int
    measured: int  # responses whose memory was measured: all of them, or a random sample
    tenants: tuple[TenantResponses, ...]  # most memory first


async def read(redis: aioredis.Redis, keys: Keys, ids: list[str],
               sample: int = MEMORY_SAMPLE) -> StoredResponses:
    """`ids`: the request ids of the responses the walk found. One that has no tenant field
    now (deleted or expired since the walk, or a key of another type) is left out."""
    replies = await batched(redis, ids, 1, lambda p, i: p.hget(keys.response(i),
                                                               StoredResponseField.TENANT))
    owners = {i: text(t) for i, [t] in zip(ids, replies, strict=True) if t is not None}
    counts = Counter(owners.values())
    drawn = sorted(owners) if len(owners) <= sample else sorted(
        random.sample(sorted(owners), sample))
    sizes = await batched(redis, drawn, 1, lambda p, i: p.memory_usage(keys.response(i)))
    measured: Counter[str] = Counter()
    bytes_by: Counter[str] = Counter()
    for i, [size] in zip(drawn, sizes, strict=True):
        if size is not None:  # deleted or expired since
            measured[owners[i]] += 1
            bytes_by[owners[i]] += int(size)
    mean = sum(bytes_by.values()) / max(sum(measured.values()), 1)
    tenants = [TenantResponses(t, n, round(bytes_by[t] * n / measured[t] if measured[t]
                                           else mean * n))
               for t, n in counts.items()]
    tenants.sort(key=lambda v: (-v.memory_bytes, v.tenant))
    return StoredResponses(count=len(owners), memory_bytes=sum(t.memory_bytes for t in tenants),
                           measured=sum(measured.values()), tenants=tuple(tenants))
