"""Everything a route needs, built once per replica in the app's lifespan."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from api.admission import Admission
from api.metrics import APIMetrics
from api.reader import ResultReader
from api.text import TextCodec
from shared.keys import Keys
from shared.models import ModelInfo
from shared.redis_conn import RedisClients
from shared.settings import Settings

if TYPE_CHECKING:
    from api.generation import Generation


@dataclass
class Live:
    """Requests alive in this replica, and whether it is draining."""

    requests: dict[str, Generation] = field(default_factory=dict)
    # Cancellations of disconnected streams, waiting out the resume grace.
    deferred: set[asyncio.Task[None]] = field(default_factory=set)
    draining: bool = False
    _idle: asyncio.Event = field(default_factory=asyncio.Event)

    def add(self, generation: Generation) -> None:
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
