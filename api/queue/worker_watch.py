"""Whether each served model still has a live worker, and since when it has had none.

A worker that is killed (`docker kill`, a node lost) writes nothing more: the requests it held
stay pending under its name, and their streams fall silent. Another live worker of the model
takes them over (worker/broker/recovery.py), but with none left nobody would, and a client
would wait out the request deadline (600 s by default) in silence. So a request of a model
that has had no live worker for the queue deadline ends on its replica with `no_worker`
(api/queue/generation.py, api/queue/replay.py): a retryable error, unless a worker comes back, or
another starts, and takes it over first.

One task per replica reads each model's live set (its workers scored by heartbeat expiry, see
worker/broker/presence.py) every `REFRESH_S`: one ZREVRANGE per model, the newest score. A
score past now is a live worker. Otherwise the model has had none since that worker's last
beat (its score less the heartbeat TTL), which is when it was last known to be alive: a
request's wait is counted from there, not from when its heartbeat expired, so that a worker
gone for good ends its requests within the queue deadline of its death. A set that is gone (no
worker since its TTL passed, or ever) counts from when this replica first saw it so. A failed
read keeps the last view: Redis's own outage is the result reader's to report.

A model with no live worker is logged as a warning at once when this replica saw one of its
workers live and lost it. One it has not seen a live worker of yet (its workers are still
starting, as under `redserve up` or in a fresh deployment) is warned about only once the queue
deadline has passed since the replica started: the first moment its requests can end with
`no_worker` for want of one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from shared.keys import Keys

log = logging.getLogger("redserve.api.workers")

REFRESH_S = 1.0


@dataclass
class WorkerWatch:
    redis: aioredis.Redis
    keys: Keys
    models: Sequence[str]
    heartbeat_ttl_s: float
    # How long after this replica's start a model it has seen no live worker of is quiet.
    starting_s: float = 0.0
    # model -> unix time since which it has had no live worker; absent while it has one.
    _gone_since: dict[str, float] = field(default_factory=dict)
    _seen: set[str] = field(default_factory=set)  # models it has seen a live worker of
    _warned: set[str] = field(default_factory=set)  # models it warned of, not live since
    _started: float = field(default_factory=time.time)

    async def run(self) -> None:
        """Refresh the view until cancelled."""
        while True:
            try:
                await self.refresh()
            except aioredis.RedisError as e:
                log.debug("could not read the live workers: %s", e)
            except Exception:
                log.exception("could not read the live workers")
            await asyncio.sleep(REFRESH_S)

    async def refresh(self) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for model in self.models:
            pipe.zrevrange(self.keys.workers(model), 0, 0, withscores=True)
        newest = await pipe.execute()
        now = time.time()
        for model, found in zip(self.models, newest, strict=True):
            expiry = float(found[0][1]) if found else None
            if expiry is not None and expiry > now:
                self._seen.add(model)
                self._gone_since.pop(model, None)
                if model in self._warned:
                    self._warned.discard(model)
                    log.info("model %s has a live worker again", model)
                continue
            if model not in self._gone_since:
                since = expiry - self.heartbeat_ttl_s if expiry is not None else now
                self._gone_since[model] = since
            if model not in self._warned and (
                    model in self._seen or now - self._started >= self.starting_s):
                self._warned.add(model)
                log.warning("model %s has no live worker (its requests end with no_worker "
                            "unless one takes them within the queue deadline)", model)

    def gone_since(self, model: str) -> float | None:
        """Since when `model` has had no live worker (unix time), or None while it has one."""
        return self._gone_since.get(model)

    def abandoned(self, model: str, heard: float, wait_s: float) -> bool:
        """Whether a request of `model`, last heard of at `heard` (unix time), has waited
        `wait_s` with no live worker of its model."""
        since = self._gone_since.get(model)
        return since is not None and time.time() - max(since, heard) >= wait_s
