"""How a worker learns that requests it holds were cancelled, in O(1) Redis commands per step.

Three paths, all ending in the same set of known-aborted ids that the step loop applies between
steps (so a cancelled request's pages are freed at the end of the step during which its abort
was set):
- `listen`: a blocking XREAD on the abort announcement stream (see shared/aborts.py) in the
  background. No command per step; one per batch of announcements (or per idle block).
- `check`: the abort keys themselves, one GET each in one pipeline (redis-py refuses MGET in
  a Cluster pipeline). Run on the requests a worker takes, before they are admitted, and on every
  request it holds once per heartbeat, which catches any announcement that was missed.
- announcements of requests not (yet) here are remembered for a while: a request may be taken
  just after its announcement was heard.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import redis.asyncio as aioredis

from shared.keys import Keys
from shared.redis_conn import stream_reply
from shared.retry import RedisBackoff

log = logging.getLogger("redserve.worker")

LISTEN_BLOCK_MS = 5000
# Announcements heard are kept this long (a request announced aborted may be taken later).
REMEMBER_S = 300.0
# The listener starts this far back: announcements made while the worker was starting count.
LOOKBACK_MS = 60_000


class AbortWatch:
    def __init__(self, keys: Keys) -> None:
        self.keys = keys
        self._known: dict[str, float] = {}  # request id -> when it was found aborted

    def note(self, request_ids: Iterable[str]) -> None:
        now = time.monotonic()
        for request_id in request_ids:
            self._known.setdefault(request_id, now)

    def aborted(self, request_ids: Iterable[str]) -> set[str]:
        """Which of these requests are known to be aborted."""
        return {rid for rid in request_ids if rid in self._known}

    def forget_old(self) -> None:
        cutoff = time.monotonic() - REMEMBER_S
        self._known = {rid: t for rid, t in self._known.items() if t >= cutoff}

    async def check(self, redis: aioredis.Redis, request_ids: Iterable[str]) -> set[str]:
        """Read the abort keys of these requests (one GET each, in one pipeline: a Cluster
        pipeline refuses MGET, and its GETs still go out one batch per node); note and return
        the aborted ones."""
        ids = list(request_ids)
        if not ids:
            return set()
        pipe = redis.pipeline(transaction=False)
        for rid in ids:
            pipe.get(self.keys.abort(rid))
        replies = await pipe.execute()
        found = {rid for rid, value in zip(ids, replies, strict=True) if value is not None}
        self.note(found)
        return found

    async def listen(self, redis: aioredis.Redis) -> None:
        """Hear announcements until cancelled (on its own blocking connection)."""
        last: bytes | str = f"{max(int(time.time() * 1000) - LOOKBACK_MS, 0)}-0"
        backoff = RedisBackoff("abort announcements", start=0.1, cap=5.0, log=log)
        while True:
            try:
                reply = await redis.xread({self.keys.aborts: last}, block=LISTEN_BLOCK_MS)
                backoff.reset()
            except aioredis.RedisError as e:
                await backoff.wait(e)
                continue
            for _, entries in stream_reply(reply):
                for entry_id, fields in entries:
                    last = entry_id
                    ids = fields.get(b"ids", b"").decode()
                    self.note(i for i in ids.split(",") if i)
            self.forget_old()
