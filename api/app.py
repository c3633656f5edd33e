"""The FastAPI application of one API replica."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from api import errors
from api.context import AppContext
from api.reader import ResultReader
from api.routes import router
from api.text import TextCodec
from shared.keys import Keys, new_replica_tag
from shared.models import resolve_model
from shared.redis_conn import connect
from shared.settings import Settings


def create_app(settings: Settings) -> FastAPI:
    if settings.redis_url is None:
        raise ValueError("the API needs REDIS_URL (redserve up starts a server when it is unset)")
    redis_url = settings.redis_url

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        info = await asyncio.to_thread(
            resolve_model, settings.model, settings.cache_dir, settings.served_model_name
        )
        codec = await asyncio.to_thread(TextCodec, str(info.path))
        replica = new_replica_tag()
        keys = Keys(settings.key_prefix)
        clients = connect(redis_url, name=f"redserve-api-{replica}")
        reader = ResultReader(clients, keys, replica, settings.per_request_buffer)
        await reader.start(settings.request_ttl_s)
        app.state.ctx = AppContext(settings, keys, info, codec, clients, reader, replica)
        try:
            yield
        finally:
            await reader.stop()
            await clients.close()

    app = FastAPI(title="redserve", lifespan=lifespan)
    errors.install(app)
    app.include_router(router)
    return app
