"""Taking over the requests of a worker that died.

A request stays pending in the consumer group from the moment a worker reads it until that
worker XACKs it with its terminal entry. Live workers keep their pending entries fresh by
re-claiming them to themselves (XCLAIM with JUSTID resets the idle time) every heartbeat, so
an entry idle for longer than `reclaim_after_s` belongs to a worker that stopped beating. Any
worker with room claims such entries (XAUTOCLAIM) and resumes each request from its prompt plus
the tokens already in its result stream: those are prefilled, not generated again, so the
client sees neither a gap nor a repeat, and seeded sampling continues where it was (the seed of
each token depends only on its position). A request delivered too many times ends with an
error entry instead of taking down worker after worker.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import redis.asyncio as aioredis

from shared.keys import WORKER_GROUP, Keys
from shared.messages import Error, Finish, GenerateRequest, Tokens, decode_result

log = logging.getLogger("redserve.worker")


@dataclass(frozen=True)
class Claimed:
    entry_id: str
    request: GenerateRequest
    generated: tuple[int, ...]  # tokens its earlier worker published
    ended: bool  # its result stream already holds a terminal entry
    deliveries: int


class Recovery:
    def __init__(self, redis: aioredis.Redis, keys: Keys, name: str, reclaim_after_s: float):
        self.redis = redis
        self.keys = keys
        self.name = name
        self.reclaim_after_ms = int(reclaim_after_s * 1000)

    async def touch(self, entry_ids: Iterable[str]) -> None:
        """Reset the idle time of the entries this worker holds: they are alive."""
        ids: list[int | bytes | str | memoryview] = list(entry_ids)
        if ids:
            await self.redis.xclaim(self.keys.requests, WORKER_GROUP, self.name, 0, ids,
                                    justid=True)

    async def claim(self, room: int) -> list[Claimed]:
        """Up to `room` requests abandoned by dead workers, now this worker's."""
        if room <= 0:
            return []
        reply = await self.redis.xautoclaim(self.keys.requests, WORKER_GROUP, self.name,
                                            self.reclaim_after_ms, "0-0", count=room)
        entries = reply[1]
        claimed: list[Claimed] = []
        for raw_id, fields in entries:
            entry_id = raw_id.decode()
            try:
                request = GenerateRequest.from_fields(fields)
            except ValueError:
                log.error("dropping malformed request entry %s", entry_id)
                await self.redis.xack(self.keys.requests, WORKER_GROUP, entry_id)
                continue
            claimed.append(await self._inspect(entry_id, request))
        if claimed:
            log.warning("claimed %d request(s) from a dead worker", len(claimed))
        return claimed

    async def _inspect(self, entry_id: str, request: GenerateRequest) -> Claimed:
        pipe = self.redis.pipeline(transaction=False)
        pipe.xpending_range(self.keys.requests, WORKER_GROUP, entry_id, entry_id, 1)
        pipe.xrange(self.keys.out(request.id))
        pending, results = await pipe.execute()
        deliveries = int(pending[0]["times_delivered"]) if pending else 1
        generated: list[int] = []
        ended = False
        for _, fields in results:
            entry = decode_result(fields)
            if isinstance(entry, Tokens) and entry.index == len(generated):
                generated.extend(entry.ids)
            elif isinstance(entry, Finish | Error):
                ended = True
        return Claimed(entry_id, request, tuple(generated), ended, deliveries)


def too_many_deliveries(claimed: Claimed, limit: int) -> Error | None:
    if claimed.deliveries <= limit:
        return None
    return Error(f"the request was taken by {claimed.deliveries - 1} workers that all stopped "
                 "before finishing it", "server_error", "worker_failed")
