"""The FastAPI application of one API replica: built (`create_app`), and drained before it
stops (`drain`); its start-up and shut-down are `api.lifespan`'s."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import FastAPI

from api.auth.guard import Guard
from api.auth.keys import APIKeys, AuthConfigError
from api.endpoints import chat, completions, lora_adapters, requests, status, tokenize
from api.endpoints.responses import routes as responses_routes
from api.lifespan import Lifespan
from api.protocol import errors
from api.queue.context import AppContext
from api.queue.metrics import APIMetrics, CountResponses
from api.queue.trace import RouteNamedSpans
from shared import tracing
from shared.settings import ApiSettings
from shared.tenants import TenantPolicies, tenant_policies

log = logging.getLogger("redserve.api")


def create_app(settings: ApiSettings) -> FastAPI:
    """The app of one replica: settings and keys checked now (a bad one stops it starting),
    Redis and the models left to its lifespan (`api.lifespan`)."""
    url = redis_url(settings)
    api_keys = load_api_keys(settings)
    policies = load_policies(settings, api_keys)
    # Made here, not in the lifespan: the response counter wraps the app from the start.
    metrics = APIMetrics()
    app = FastAPI(title="redserve", lifespan=Lifespan(settings, url, policies, metrics))
    app.state.api_keys = api_keys
    install(app, settings, api_keys, metrics)
    return app


def redis_url(settings: ApiSettings) -> str:
    """Where the queue is: a replica cannot serve without one."""
    if settings.redis_url is None:
        raise ValueError("the API needs REDIS_URL (redserve up starts a server when it is unset)")
    return settings.redis_url


def load_api_keys(settings: ApiSettings) -> APIKeys:
    """The keys callers authenticate with; none is an error unless serving without
    authentication was asked for."""
    api_keys = APIKeys.load(settings.api_keys, settings.api_keys_file)
    if not api_keys.enabled and not settings.no_auth:
        raise AuthConfigError(
            "no API keys: set REDSERVE_API_KEYS or REDSERVE_API_KEYS_FILE, or set "
            "REDSERVE_NO_AUTH=true to serve without authentication")
    return api_keys


def install(app: FastAPI, settings: ApiSettings, api_keys: APIKeys, metrics: APIMetrics) -> None:
    """The error handlers, the routes, and the middleware around them."""
    errors.install(app)
    app.include_router(status.router)
    app.include_router(requests.router)
    app.include_router(chat.router)
    app.include_router(completions.router)
    app.include_router(tokenize.router)
    app.include_router(responses_routes.router)
    app.include_router(lora_adapters.router)
    app.add_middleware(Guard, keys=api_keys, max_body_bytes=settings.max_body_bytes,
                       body_timeout_s=settings.body_timeout_s)
    # Added last, so outermost: it sees the guard's refusals too.
    app.add_middleware(CountResponses, metrics=metrics)
    if tracing.enabled():
        trace_requests(app)


def trace_requests(app: FastAPI) -> None:
    """Outermost of all when tracing is on (shared/tracing.py): one server span per HTTP
    request, a child of the client's `traceparent` if it sent one, covering a stream to its
    end, named by its route once routed (`api.queue.trace.RouteNamedSpans`). No span per ASGI
    message (one per SSE event would be its cost), none for the probes and the metrics
    scrape."""
    from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware

    app.add_middleware(RouteNamedSpans)
    app.add_middleware(OpenTelemetryMiddleware, exclude_spans=["receive", "send"],
                       excluded_urls="/health,/ready,/metrics",
                       default_span_details=lambda scope: (scope.get("method", "HTTP"), {}))


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
    end this replica's part of the rest (`Live.stop_all`: a stream that can be resumed goes on
    and its client is told where to resume it) and give their handlers a moment to send it."""
    ctx: AppContext = app.state.ctx
    ctx.live.draining = True
    log.info("draining: replica %s takes no new requests and gives the %d open %.0f s to end",
             ctx.replica, len(ctx.live.all()), grace_s)
    try:
        async with asyncio.timeout(grace_s):
            await ctx.live.wait_idle()
        log.info("drained: replica %s, every request ended", ctx.replica)
        return
    except TimeoutError:
        pass
    left = ctx.live.all()
    log.info("drained: replica %s ends its part of the %d request(s) still open (their "
             "streams resume on another replica)", ctx.replica, len(left))
    ctx.live.stop_all()
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(2.0):
            await ctx.live.wait_idle()
