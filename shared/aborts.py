"""Cancelling a request: its abort key, and an announcement workers hear at once.

The abort key (`Keys.abort`) is the source of truth: whoever cancels sets it, and a worker
checks it when it takes a request. Checking every running request's key every step would cost
one Redis command per running request per step, as much as publishing its tokens. So whoever
sets abort keys also appends their ids to one announcement stream (`Keys.aborts`), which each
worker reads with a blocking XREAD in the background: nothing per step, one read per batch of
aborts. A worker that missed announcements (it was restarting, Redis was away) still finds every
abort key in its periodic check of the keys themselves (see worker/broker/aborts.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import redis.asyncio as aioredis

from shared.keys import Keys
from shared.scripts.request_flag import SET_FLAG, FlagArgs, FlagKeys

# Announcements kept: a worker that reads them late (after a pause) still finds recent ones.
ANNOUNCEMENTS_MAXLEN = 10_000


def stage_aborts(pipe: aioredis.client.Pipeline, keys: Keys, request_ids: Iterable[str],
                 ttl_s: int) -> None:
    """Add to `pipe`: set each request's abort key, then announce them in one entry. A key
    lives `ttl_s` at most, and no longer than its request's hash (shared/scripts/request_flag.py):
    an abort that comes after the request ended expires with it."""
    ids = list(request_ids)
    if not ids:
        return
    for request_id in ids:
        SET_FLAG.stage(pipe, FlagKeys(keys.abort(request_id), keys.state(request_id)),
                        FlagArgs(ttl_s))
    pipe.xadd(keys.aborts, {"ids": ",".join(ids)}, maxlen=ANNOUNCEMENTS_MAXLEN,
              approximate=True)
    pipe.expire(keys.aborts, ttl_s)
