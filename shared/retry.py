"""The pause between tries of a Redis call that must keep being retried, for as long as it fails.

Five loops ride out a Redis outage instead of giving up: the API's result reader, and the
worker's start, outage recovery, request intake and abort listener. They all wait the same
way: log what failed and how long until the next try, sleep that long on the event loop (other
tasks run meanwhile; a cancel ends the sleep), double the pause up to a cap, and after a call
that succeeds start again from the first pause. `RedisBackoff` is that part, so that each loop
keeps only what is its own: its first pause and cap, its name in the log, and what else it
does on a failure (the reader fails its open requests after a while; the intake remakes a
lost consumer group without pausing).

The pauses themselves are redis-py's `ExponentialBackoff` (first pause x 2**n, capped). Its
`Retry` is not used: `call_with_retry` wraps one call and retries a count of times or forever,
while these loops stop on a condition of their own (the worker stopping), do their own work
between a failure and its pause, and one of them (the outage recovery) pauses before its first
try. The count of failures stops growing at the cap: older redis-py releases, which
pyproject.toml still allows, compute the pause as `base * 2**n` with an int power, which
overflows a float (OverflowError) after about a thousand failures, some 85 minutes into an
outage at a 5 s cap.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Final

from redis.backoff import ExponentialBackoff


class RedisBackoff:
    """Pauses of `start`, 2 x `start`, ... up to `cap` seconds between the tries of one loop,
    each failure logged (a warning on `log`) as `<what>: <error>; retrying in <pause>s`."""

    def __init__(self, what: str, *, start: float, cap: float, log: logging.Logger) -> None:
        self._what: Final = what
        self._curve: Final = ExponentialBackoff(cap=cap, base=start)
        self._cap: Final = cap
        self._log: Final = log
        self._failures = 0

    def reset(self) -> None:
        """After a success: the next failure pauses `start` again."""
        self._failures = 0

    def report(self, error: Exception) -> None:
        """Log `error` with the pause the next `pause` takes."""
        self._log.warning("%s: %s; retrying in %gs", self._what, error, self._delay())

    async def pause(self) -> None:
        """Sleep the current pause; the next one is twice as long, up to the cap."""
        delay = self._delay()
        await asyncio.sleep(delay)
        if delay < self._cap:
            self._failures += 1

    async def wait(self, error: Exception) -> None:
        """After a failed try: log it, then pause."""
        self.report(error)
        await self.pause()

    def _delay(self) -> float:
        return self._curve.compute(self._failures)
