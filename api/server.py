"""uvicorn with a drain: the first SIGTERM/SIGINT drains (see `api.app.drain`) before uvicorn's
own shutdown and the process exits 0, as a completed drain should; a second signal stops at
once, the way uvicorn does. Once it listens and Redis answers it logs one `ready:` line (what an
operator watching `docker compose logs` waits for; the worker logs its own)."""

from __future__ import annotations

import asyncio
import logging
import socket
from types import FrameType

import uvicorn
from fastapi import FastAPI

from api.app import create_app, drain
from shared import tracing
from shared.settings import ApiSettings

log = logging.getLogger("redserve.api")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: FastAPI, grace_s: float) -> None:
        super().__init__(config)
        self.app = app
        self.grace_s = grace_s
        self._draining: asyncio.Task[None] | None = None
        self._ready_line: asyncio.Task[None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            self._ready_line = asyncio.get_running_loop().create_task(self._say_ready())

    async def _say_ready(self) -> None:
        """The `ready:` line, once the replica listens and Redis answers (a replica started
        before Redis listens first, its /ready 503 until then)."""
        ctx = self.app.state.ctx
        await ctx.reader.until_connected()
        log.info("ready: replica %s listening on http://%s:%d for %s", ctx.replica,
                 self.config.host, self.config.port, ", ".join(ctx.models))

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._draining is not None or not self.started:
            super().handle_exit(sig, frame)
            return
        self._draining = asyncio.get_event_loop().create_task(self._drain_then_exit(sig, frame))

    async def _drain_then_exit(self, sig: int, frame: FrameType | None) -> None:
        try:
            await drain(self.app, self.grace_s)
        finally:
            # Not super().handle_exit: uvicorn would re-raise the signal after shutting down,
            # and a drained replica exits 0.
            self.should_exit = True


def run(settings: ApiSettings) -> None:
    tracing.configure("redserve-api")  # before the app: it adds the tracing middleware
    app = create_app(settings)
    keys = app.state.api_keys
    if keys.enabled:
        log.info("authentication on: %d API key(s) of %d tenant(s)", len(keys.by_digest),
                 len(keys.tenants))
    else:
        log.warning("authentication is OFF (REDSERVE_NO_AUTH): any caller may use this "
                    "replica; set REDSERVE_API_KEYS to require keys")
    # No logging configuration of uvicorn's own: its loggers propagate to the handler that
    # shared.logs.setup_logging installed (JSON stays JSON). No access log unless asked for:
    # one line per request at any load, and the `request.finished` event says more.
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_config=None,
                            access_log=settings.access_log, timeout_graceful_shutdown=5,
                            timeout_keep_alive=settings.keep_alive_s)
    try:
        DrainingServer(config, app, settings.drain_grace_s).run()
    finally:
        tracing.shutdown()  # the spans still buffered go out
