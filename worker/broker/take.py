"""Which queued requests a worker with room takes: the policy around the take script.

The take script (shared/scripts/take.py) reads the model's queued set, chooses up to `room`
members, removes them and XCLAIMs their entries to the worker in one atomic step: one round
trip, no prompt read, and two workers never take the same request. Here is the worker's side:
what it asks for and why.

Which members: those placed on no worker or on this one; those placed on a worker that is not
live (not in the model's live set: dead or draining); and any that waited `placement_wait_s`
(its worker is overloaded). In what order, with the `fair` policy:
1. a request queued longer than `starvation_after_s` first, oldest first (nothing starves);
2. the lowest `priority` (vLLM's: lower runs first);
3. the tenant with the least service (the Virtual Token Counter, shared/messages/queue.py);
4. the oldest.
The `fifo` policy takes the oldest. Each take charges the tenant its prompt tokens divided by
its weight; output tokens are charged by the worker's `Tally`, sent with a take at most every
`CHARGE_EVERY_S` (and with each heartbeat): no command per token.

A fair order alone still leaves a light tenant waiting for a slot of a batch a heavy tenant
fills. So beyond its room a worker may take a `burst` (`fair_burst`) of requests, each of a
tenant holding less than an equal share of its batch (among the tenants with requests on it or
queued for it): the light tenant starts at the next step; a heavy one never gets the burst.

Entries with no member left (cancelled while queued: the API removes the member; trimmed past
the queue timeout) are taken ahead of the rest: the worker ends each at once (abort or queue
timeout), so every request still ends with one terminal entry and leaves its stream. The
reply (`Taken`) also says where the stream ends (the worker blocks on XREAD from there, so no
entry added after the take is missed) and how soon a member placed on another worker becomes
anyone's.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from shared.keys import QUEUE_STALE_MARGIN_S, Keys
from shared.scripts.handoff import ModelQueue
from shared.scripts.take import TAKE, TakeArgs, TakeKeys, Taken
from shared.settings import WorkerSettings

# Output tokens are charged to the service counters with a take at most this often (and with
# every heartbeat): a few commands a second at most, however many requests are taken.
CHARGE_EVERY_S = 0.25


@dataclass(frozen=True)
class Room:
    """What a worker can take now."""

    regular: int  # requests of any tenant
    # Beyond those, requests of tenants holding less than an equal share of `slots` among
    # the tenants with requests on the worker or queued for it (the fair share's burst).
    burst: int = 0
    slots: int = 1  # the worker's batch (max_running)
    held: Mapping[str, int] = field(default_factory=dict)  # tenant -> requests on the worker

    def __bool__(self) -> bool:
        return self.regular > 0 or self.burst > 0


@dataclass(frozen=True)
class TakePolicy:
    fair: bool
    starvation_after_s: float
    placement_wait_s: float
    queue_timeout_s: float
    service_ttl_s: int
    burst: int  # see `Room.burst`

    @classmethod
    def of(cls, settings: WorkerSettings) -> TakePolicy:
        fair = settings.queue_policy == "fair"
        return cls(fair, settings.starvation_after_s, settings.placement_wait_s,
                   settings.queue_timeout_s, settings.request_ttl_s,
                   settings.fair_burst if fair else 0)


class Tally:
    """Output tokens served per tenant (each divided by its request's weight) since the
    last take: charged to the service counters with the next one."""

    def __init__(self) -> None:
        self._owed: defaultdict[str, float] = defaultdict(float)

    def add(self, tenant: str, tokens: float) -> None:
        self._owed[tenant] += tokens

    def drain(self) -> dict[str, float]:
        owed, self._owed = dict(self._owed), defaultdict(float)
        return owed

    def restore(self, owed: dict[str, float]) -> None:
        """A take that failed: charge these with a later one."""
        for tenant, tokens in owed.items():
            self._owed[tenant] += tokens


class Taker:
    def __init__(self, redis: aioredis.Redis, keys: Keys, model: str, name: str,
                 policy: TakePolicy) -> None:
        self._script = TAKE.bind(redis)
        self._keys = TakeKeys.of(ModelQueue.of(keys, model))
        self.name = name
        self.policy = policy
        self.tally = Tally()
        self._charged_at = 0.0

    async def take(self, room: Room, *, charge: bool = False) -> Taken:
        """Queued requests up to `room`, now pending under this worker's name. The tally
        goes with it at most every `CHARGE_EVERY_S`, or with `charge`."""
        p, now = self.policy, time.time()
        owed: dict[str, float] = {}
        if charge or now - self._charged_at >= CHARGE_EVERY_S:
            owed, self._charged_at = self.tally.drain(), now
        try:
            return await self._script(self._keys, TakeArgs(
                now=now, stale_before=now - p.queue_timeout_s - QUEUE_STALE_MARGIN_S,
                worker=self.name, room=max(room.regular, 0), fair=p.fair,
                placement_wait_s=p.placement_wait_s,
                starving_before=now - p.starvation_after_s, service_ttl_s=p.service_ttl_s,
                burst=max(room.burst, 0), slots=room.slots, held=room.held, charges=owed))
        except BaseException:
            self.tally.restore(owed)
            raise

    async def charge(self) -> None:
        """Send the tally now (the heartbeat: a full or idle worker takes nothing)."""
        await self.take(Room(0), charge=True)

