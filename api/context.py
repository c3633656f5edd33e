"""Everything a route needs, built once per replica in the app's lifespan."""

from __future__ import annotations

from dataclasses import dataclass

from api.reader import ResultReader
from api.text import TextCodec
from shared.keys import Keys
from shared.models import ModelInfo
from shared.redis_conn import RedisClients
from shared.settings import Settings


@dataclass(frozen=True)
class AppContext:
    settings: Settings
    keys: Keys
    model: ModelInfo
    codec: TextCodec
    clients: RedisClients
    reader: ResultReader
    replica: str
