"""Following a Sentinel failover within a fraction of a second, not a socket timeout later.

redis-py's Sentinel pools ask the Sentinels where the primary is only when they open a
connection, and drop only idle connections when the answer changed. A connection already open
to the old primary goes on being used until it fails: at once when the old primary closes it
(killed, or demoted by the Sentinels), but not when it stops answering without closing (paused,
frozen, cut off by a partition): then every command and blocked read on it waits for its socket
timeout (10 s, `shared/redis_conn.py`), and a stream stalls that long although the Sentinels
named a new primary after `down-after-milliseconds` and an election. An old primary that
wakes, or that `SENTINEL FAILOVER` left up until the Sentinels reconfigure it, goes on
accepting writes on those connections meanwhile, and loses them when it becomes a replica.

So each process that connects through the Sentinels runs one `PrimaryWatch`: every `EVERY_S`
it asks each of them where the primary is, and once the newest answer changes it
closes every connection of its pools to any other server, in use or not: a command waiting on
one fails at once with a connection error, as if the server had closed it, and the caller's
own retry reconnects, to the new primary. A new connection goes where redis-py's discovery
says (the first Sentinel to answer), except to a primary the watch has seen replaced: a
Sentinel that has not yet heard of the failover, and has not yet marked the old primary down
(its own timers lag on a loaded machine), still names it, and a frozen server's kernel still
accepts the connection, whose first command then waits out the socket timeout
(`superseded`). `failovers` counts the changes seen, so the parts
that must check what a failover may have lost (the result reader, the worker's publisher, a
request waiting in the queue) can tell one happened even where no command of theirs failed.
The cost is one Sentinel command per `EVERY_S` per process, on a Sentinel's connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from redis.asyncio.sentinel import Sentinel
from redis.exceptions import RedisError

log = logging.getLogger("redserve.redis")

EVERY_S = 0.1

Address = tuple[str, int]


class PrimaryWatch:
    """Start with `ensure_running()` (from the event loop; idempotent), end with `stop()`.
    `drops` are the pools' callbacks that close their connections to any server other than
    the given primary."""

    def __init__(self, sentinel: Sentinel, master: str) -> None:
        self._sentinel = sentinel
        self._master = master
        self.drops: list[Callable[[Address], Awaitable[None]]] = []
        self.primary: Address | None = None
        self.failovers = 0
        self._replaced: set[Address] = set()  # earlier primaries, until one is primary again
        self._epoch = 0  # the Sentinels' configuration epoch of `primary`
        self._task: asyncio.Task[None] | None = None

    def ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(),
                                                                name="primary-watch")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, RedisError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            try:
                found = await self._ask()
                if found is not None:
                    await self.seen(*found)
            except Exception:  # a reply not as expected: the watch goes on, and says so
                log.exception("asking the Sentinels for the primary failed")
            await asyncio.sleep(EVERY_S)

    async def _ask(self) -> tuple[Address, int] | None:
        """The primary named by the Sentinel with the newest configuration epoch (a Sentinel
        that has not yet heard of a failover still names the old primary: believing whichever
        answered first would flap between the two), and that epoch; None if none answers."""
        answers: list[Any] = await asyncio.gather(
            *(s.sentinel_master(self._master) for s in self._sentinel.sentinels),
            return_exceptions=True)  # at once: one that does not answer holds up no other
        best: tuple[Address, int] | None = None
        for state in answers:
            if isinstance(state, BaseException):
                if isinstance(state, RedisError):
                    continue
                raise state
            if not state.get("is_master") or state.get("is_sdown") or state.get("is_odown"):
                continue
            epoch = int(state.get("config-epoch", 0))
            if best is None or epoch > best[1]:
                best = (str(state["ip"]), int(state["port"])), epoch
        return best

    def superseded(self, address: Address) -> Address | None:
        """The primary to connect to instead of `address`, if the watch has seen `address`
        replaced (never when the watch is merely behind: then it has not)."""
        return self.primary if address in self._replaced else None

    async def seen(self, address: Address, epoch: int) -> None:
        """The Sentinels name `address` as the primary in configuration `epoch`; an older
        epoch than one seen already is a Sentinel lagging behind, and changes nothing."""
        if self.primary is None or epoch < self._epoch:
            self.primary, self._epoch = self.primary or address, max(epoch, self._epoch)
            return
        if address == self.primary:
            self._epoch = epoch
            return
        log.warning("the Sentinels name a new primary %s:%d (was %s:%d): dropping the "
                    "connections to the old one", *address, *self.primary)
        self._replaced.add(self.primary)
        self._replaced.discard(address)
        self.primary, self._epoch = address, epoch
        self.failovers += 1
        for drop in self.drops:
            try:
                await drop(address)
            except Exception as e:  # a close that fails leaves nothing to do
                log.debug("dropping connections to the old primary: %s", e)
