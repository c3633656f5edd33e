"""The FastAPI application of one API replica."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from api import errors, routes, status, tokenization
from api.admission import Admission, QueueLimits
from api.auth.guard import Guard
from api.auth.keys import APIKeys, AuthConfigError
from api.context import AppContext, Live, ServedModel
from api.limits.reservation import RateLimits
from api.metrics import APIMetrics, CountResponses, QueueDepths
from api.placement import Placement
from api.reader import ResultReader
from api.text import TextCodec
from shared.keys import Keys, new_replica_tag
from shared.messages import Error
from shared.models import parse_specs, resolve_models
from shared.redis_conn import connect
from shared.settings import ApiSettings
from shared.tenants import TenantPolicies, tenant_policies

log = logging.getLogger("redserve.api")

SHUTDOWN_ERROR = Error("the server is shutting down", "server_error", "server_shutdown")


def create_app(settings: ApiSettings) -> FastAPI:
    if settings.redis_url is None:
        raise ValueError("the API needs REDIS_URL (redserve up starts a server when it is unset)")
    redis_url = settings.redis_url
    api_keys = APIKeys.load(settings.api_keys, settings.api_keys_file)
    if not api_keys.enabled and not settings.no_auth:
        raise AuthConfigError(
            "no API keys: set REDSERVE_API_KEYS or REDSERVE_API_KEYS_FILE, or set "
            "REDSERVE_NO_AUTH=true to serve without authentication")
    policies = load_policies(settings, api_keys)
    # Made here, not in the lifespan: the response counter wraps the app from the start.
    metrics = APIMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        specs = parse_specs(settings.model, settings.served_model_name, settings.models_file)
        infos = await asyncio.to_thread(resolve_models, specs, settings.cache_dir)
        models = {}
        for info in infos:
            models[info.name] = ServedModel(info, await asyncio.to_thread(TextCodec,
                                                                          str(info.path)))
        replica = new_replica_tag()
        keys = Keys(settings.key_prefix)
        clients = connect(redis_url, name=f"redserve-api-{replica}",
                          cluster=settings.redis_cluster)
        live = Live()

        def on_slow_client(request_id: str) -> None:
            generation = live.requests.get(request_id)
            if generation is not None:
                metrics.slow_clients.inc()
                generation.fail(Error(
                    f"the client read too slowly: its {settings.per_request_buffer} buffered "
                    f"results waited over {settings.slow_client_timeout_s:g}s",
                    "server_error", "client_too_slow"))

        reader = ResultReader(clients, keys, replica, settings.per_request_buffer,
                              settings.slow_client_timeout_s, on_slow_client)
        admission = Admission(clients.commands, keys, QueueLimits(
            settings.max_queued_requests, settings.max_queued_tokens, settings.queue_timeout_s,
            settings.max_queued_per_tenant), settings.request_ttl_s)
        placement = Placement(clients.commands, keys, list(models), settings.placement,
                              metrics, remember_s=settings.heartbeat_ttl_s)
        ctx = AppContext(settings, keys, models, clients, reader, admission, metrics, replica,
                         policies, RateLimits(clients.commands, keys), placement, live)
        metrics.watch(
            inflight=lambda: len(ctx.live.requests) + len(ctx.live.resumes),
            queues=lambda: len(reader.subscriptions),
            buffered=lambda: sum(s.queue.qsize() for s in reader.subscriptions.values()),
        )
        metrics.watch_queues(QueueDepths(clients.commands,
                                         {name: keys.queued(name) for name in models},
                                         settings.queue_timeout_s))
        await reader.start(settings.request_ttl_s)
        placing = asyncio.create_task(placement.run())
        app.state.ctx = ctx
        try:
            yield
        finally:
            placing.cancel()
            # Requests still open here are past the drain: end them, then stop reading.
            for request in ctx.live.all():
                request.fail(SHUTDOWN_ERROR)
            # Disconnected streams still in their resume grace run on to their end (another
            # replica may be serving their resume); only the pending cancellation goes.
            for deferred in list(ctx.live.deferred):
                deferred.cancel()
            await reader.stop()
            await clients.close()

    app = FastAPI(title="redserve", lifespan=lifespan)
    app.state.api_keys = api_keys
    errors.install(app)
    app.include_router(status.router)
    app.include_router(routes.router)
    app.include_router(tokenization.router)
    app.add_middleware(Guard, keys=api_keys, max_body_bytes=settings.max_body_bytes,
                       body_timeout_s=settings.body_timeout_s)
    # Added last, so outermost: it sees the guard's refusals too.
    app.add_middleware(CountResponses, metrics=metrics)
    return app


def load_policies(settings: ApiSettings, api_keys: APIKeys) -> TenantPolicies:
    """Each tenant's rate limits and fair-share weight, loaded once, as the replica starts
    (TenantsConfigError: it must not start). A tenant the file names that no API key has is
    most likely a typo: said, not refused (its keys may come with the next rollout)."""
    policies = tenant_policies(settings)
    unknown = sorted(set(policies.tenants) - api_keys.tenants) if api_keys.enabled else []
    if unknown:
        log.warning("the tenants file names tenant(s) no API key belongs to: %s",
                    ", ".join(unknown))
    return policies


async def drain(app: FastAPI, grace_s: float) -> None:
    """Refuse new requests, give open ones (resumed streams too) `grace_s` to finish, then
    end the rest with an error (an SSE error event for streams) and give their handlers a
    moment to send it."""
    ctx: AppContext = app.state.ctx
    ctx.live.draining = True
    try:
        async with asyncio.timeout(grace_s):
            await ctx.live.wait_idle()
        return
    except TimeoutError:
        pass
    for request in ctx.live.all():
        request.fail(SHUTDOWN_ERROR)
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(2.0):
            await ctx.live.wait_idle()
