"""What every endpoint reads from its request: the replica's `AppContext`, the model a body
names, the caller's tenant, and a request's stored state when a caller names one by id (only
its tenant may see it). The endpoints share these here, so none imports another."""

from __future__ import annotations

import logging
from typing import cast

import redis.asyncio as aioredis
from fastapi import Request

from api.protocol.errors import APIError
from api.protocol.served_model import ServedModel
from api.queue.context import AppContext
from shared.keys import is_request_id
from shared.messages import RequestHash
from shared.scripts.request_flag import SET_FLAG, FlagArgs, FlagKeys

log = logging.getLogger("redserve.api")
# The most names a 404 for an unknown model lists (/v1/models lists them all).
LISTED = 16


def app_context(request: Request) -> AppContext:
    ctx: AppContext = request.app.state.ctx
    return ctx


async def owned_state(ctx: AppContext, request_id: str, request: Request) -> RequestHash:
    """The request's hash, if the caller's tenant owns it; another tenant's request looks
    exactly like a missing one."""
    missing = APIError(404, f"no request {request_id[:64]!r}", param="request_id",
                       code="not_found")
    if not is_request_id(request_id):
        raise missing
    state_key = ctx.keys.state(request_id)
    try:
        state = cast(dict[bytes, bytes], await ctx.clients.commands.hgetall(state_key))
    except aioredis.RedisError as e:
        raise state_unavailable(e) from e
    try:
        record = RequestHash.decode(state)
    except ValueError:  # none (expired), or not what redserve writes
        raise missing from None
    if record.tenant != tenant_of(request):
        raise missing
    return record


def state_unavailable(e: Exception) -> APIError:
    log.warning("request state unavailable: %s", e)
    return APIError(503, "request state is unavailable; retry shortly", type="server_error",
                    code="redis_unavailable", headers={"Retry-After": "1"})


async def served(ctx: AppContext, name: str, tenant: str) -> ServedModel:
    """The model or LoRA adapter a body names, or 404 `model_not_found`: for a name this
    replica does not know, after asking the registry of runtime adapters (`api.queue.loras`),
    and for an adapter the tenant may not use (`shared/tenants.py`), exactly as for a name
    that does not exist."""
    model = await known(ctx, name)
    policy = ctx.policies.of(tenant)
    if model is None or (model.lora is not None and not policy.may_use(model.name)):
        raise APIError(404, f"The model '{name[:200]}' does not exist; this server serves "
                       f"{served_names(ctx, tenant)}.", param="model", code="model_not_found")
    return model


async def known(ctx: AppContext, name: str) -> ServedModel | None:
    """The model or adapter `name`, as this replica knows it, else from the registry of
    runtime adapters (one loaded on another replica a moment ago). For a request already
    accepted (resumed, rendered), as for a new one."""
    model = ctx.served(name)
    if model is None:
        try:
            model = await ctx.loras.lookup(name)
        except aioredis.RedisError as e:
            raise state_unavailable(e) from e
    return model


def visible(ctx: AppContext, tenant: str) -> list[ServedModel]:
    """The models and the adapters `tenant` may use, as this replica knows them now."""
    policy = ctx.policies.of(tenant)
    return [m for m in ctx.all_served() if m.lora is None or policy.may_use(m.name)]


def served_names(ctx: AppContext, tenant: str) -> str:
    """What a 404 lists: the names `tenant` may use, the first `LISTED` of them."""
    names = [m.name for m in visible(ctx, tenant)]
    more = f" and {len(names) - LISTED} more" if len(names) > LISTED else ""
    return ", ".join(f"'{n}'" for n in names[:LISTED]) + more


def tenant_of(request: Request) -> str:
    """Set by `api.auth.guard` for every /v1/ route."""
    tenant: str = request.state.tenant
    return tenant


async def mark_resumed(ctx: AppContext, request_id: str) -> None:
    """Tells the replica that served the first stream not to cancel it after its grace. The
    mark lives no longer than the request (shared/scripts/request_flag.py)."""
    try:
        await SET_FLAG.bind(ctx.clients.commands)(
            FlagKeys(ctx.keys.resumed(request_id), ctx.keys.state(request_id)),
            FlagArgs(ctx.settings.request_ttl_s))
    except aioredis.RedisError as e:
        raise state_unavailable(e) from e
