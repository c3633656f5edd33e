"""Everything a route needs, built once per replica in the app's lifespan.

The modules that serve requests (`api.queue.generation`, `api.queue.replay`, ...) import this one,
never the other way round: what it keeps of a live request is only the `LiveRequest` protocol.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Protocol

from api.protocol.served_model import ServedModel
from api.queue.admission import Admission
from api.queue.limits.reservation import RateLimits
from api.queue.loras import LoraRegistry
from api.queue.metrics import APIMetrics
from api.queue.placement import Placement
from api.queue.reader import ResultReader
from api.queue.worker_watch import WorkerWatch
from shared.keys import Keys
from shared.messages import Error
from shared.redis_conn import RedisClients
from shared.settings import ApiSettings
from shared.tenants import TenantPolicies


class LiveRequest(Protocol):
    """A request this replica is serving: `api.queue.generation.Generation`, or the `Replay` of a
    resumed stream (a drain waits for both)."""

    @property
    def request_id(self) -> str: ...

    def fail(self, error: Error) -> None: ...

    def stop_here(self) -> None:
        """This replica stops: end the client's reply, leaving the request running where it
        can be resumed elsewhere."""


@dataclass
class Live:
    """Requests alive in this replica, and whether it is draining."""

    requests: dict[str, LiveRequest] = field(default_factory=dict)
    # Resumed streams served here (several clients may resume one request).
    resumes: set[LiveRequest] = field(default_factory=set)
    # Cancellations of disconnected streams, waiting out the resume grace.
    deferred: set[asyncio.Task[None]] = field(default_factory=set)
    # Background responses read to their end here (api/endpoints/responses/background.py).
    background: set[asyncio.Task[None]] = field(default_factory=set)
    draining: bool = False
    _idle: asyncio.Event = field(default_factory=asyncio.Event)

    def add(self, live: LiveRequest) -> None:
        self.requests[live.request_id] = live
        self._idle.clear()

    def remove(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self._check_idle()

    def add_resume(self, live: LiveRequest) -> None:
        self.resumes.add(live)
        self._idle.clear()

    def remove_resume(self, live: LiveRequest) -> None:
        self.resumes.discard(live)
        self._check_idle()

    def all(self) -> list[LiveRequest]:
        return [*self.requests.values(), *self.resumes]

    def stop_all(self) -> None:
        """This replica stops: each request still open here ends its part here."""
        for request in self.all():
            request.stop_here()

    def _check_idle(self) -> None:
        if not self.requests and not self.resumes:
            self._idle.set()

    async def wait_idle(self) -> None:
        if self.requests or self.resumes:
            await self._idle.wait()


@dataclass(frozen=True)
class AppContext:
    settings: ApiSettings
    keys: Keys
    models: dict[str, ServedModel]  # by the name clients use
    clients: RedisClients
    reader: ResultReader
    admission: Admission
    metrics: APIMetrics
    replica: str
    policies: TenantPolicies  # each tenant's rate limits and weight (shared/tenants.py)
    limits: RateLimits
    placement: Placement  # which worker a new request goes to
    workers: WorkerWatch  # whether each model has a live worker, and since when not
    # The LoRA adapters loaded at run time, as this replica last read them from Redis.
    loras: LoraRegistry
    live: Live = field(default_factory=Live)
    # LoRA adapters declared at start, by the name clients use, each served over one of
    # `models` (its base).
    adapters: dict[str, ServedModel] = field(default_factory=dict)

    def served(self, name: str) -> ServedModel | None:
        """The model or adapter clients call `name`, as this replica knows them now (a
        request names one through `api.endpoints.common.served`, which also asks the
        registry)."""
        return self.models.get(name) or self.adapters.get(name) or self.loras.get(name)

    def all_served(self) -> list[ServedModel]:
        """The models, then the declared adapters, then the runtime ones."""
        return [*self.models.values(), *self.adapters.values(), *self.loras.adapters.values()]
