"""Everything a route needs, built once per replica in the app's lifespan.

The modules that serve requests (`api.generation`, `api.resume`, ...) import this one, never
the other way round: what it keeps of a live request is only the `LiveRequest` protocol.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Protocol

from api.admission import Admission
from api.metrics import APIMetrics
from api.reader import ResultReader
from api.text import TextCodec
from shared.keys import Keys
from shared.messages import Error, GenerateRequest
from shared.models import ModelInfo
from shared.redis_conn import RedisClients
from shared.settings import Settings


class LiveRequest(Protocol):
    """A request this replica is serving (`api.generation.Generation`)."""

    @property
    def request(self) -> GenerateRequest: ...

    def fail(self, error: Error) -> None: ...


@dataclass
class Live:
    """Requests alive in this replica, and whether it is draining."""

    requests: dict[str, LiveRequest] = field(default_factory=dict)
    # Cancellations of disconnected streams, waiting out the resume grace.
    deferred: set[asyncio.Task[None]] = field(default_factory=set)
    draining: bool = False
    _idle: asyncio.Event = field(default_factory=asyncio.Event)

    def add(self, generation: LiveRequest) -> None:
        self.requests[generation.request.id] = generation
        self._idle.clear()

    def remove(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        if not self.requests:
            self._idle.set()

    async def wait_idle(self) -> None:
        if self.requests:
            await self._idle.wait()


@dataclass(frozen=True)
class AppContext:
    settings: Settings
    keys: Keys
    model: ModelInfo
    codec: TextCodec
    clients: RedisClients
    reader: ResultReader
    admission: Admission
    metrics: APIMetrics
    replica: str
    live: Live = field(default_factory=Live)
