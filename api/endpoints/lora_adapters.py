"""vLLM's `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`: LoRA adapters over
the replica's model added and removed at run time, for every replica at once (the registry in
Redis, `api.queue.loras`).

Off unless the replica was started with `--allow-runtime-lora` (`REDSERVE_ALLOW_RUNTIME_LORA`,
vLLM's `VLLM_ALLOW_RUNTIME_LORA_UPDATING`): off, both answer 404 `not_found`, saying how to turn
them on, as vLLM, which then has no such route, answers 404. On, only an admin tenant may call
them (`admin = true` in the tenants file, `shared/tenants.py`; without API keys every caller is
the one tenant `anonymous`, and may): a path on the workers' disks and the set of adapters every
tenant sees are an operator's to change, so any other tenant gets 403 `permission_denied`.

An adapter is checked as `--lora` checks one, against the base model, by the replica that loads
it (`shared/lora.py`: its files, rank, target modules, shapes): a bad one is a 400 naming the
problem, and so is a name already in use, by a model or an adapter. Its directory must be an
absolute path, the same on every worker, which loads the adapter from it when a request names
it. Unloading ends nothing: requests already running finish with it; new ones get 404
`model_not_found`, at once on this replica and within `LORA_REFRESH_S` on the others. Adapters
declared with `--lora` are part of the replicas' configuration and cannot be unloaded.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TypeVar

import redis.asyncio as aioredis
from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ValidationError

from api.endpoints.common import app_context, state_unavailable, tenant_of
from api.protocol.errors import APIError
from api.protocol.lora_body import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from api.protocol.served_model import ServedModel
from api.queue.context import AppContext
from api.queue.loras import RegistryFull
from shared.logs import log_event
from shared.lora import LoraError, named_spec, read_adapters
from shared.messages import RuntimeLora

router = APIRouter()
B = TypeVar("B", bound=BaseModel)
log = logging.getLogger("redserve.api")


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request) -> PlainTextResponse:
    ctx = _allowed(request)
    body = _parsed(LoadLoraAdapterRequest, await request.body())
    base = _base(ctx)
    name = body.lora_name
    if ctx.served(name) is not None:
        raise _in_use(name)
    if not body.lora_path.startswith("/"):
        raise APIError(400, f"lora_path {body.lora_path[:256]!r} is not an absolute path: the "
                       "workers load the adapter from it, each from its own working directory",
                       param="lora_path", code="invalid_value")
    try:
        spec = named_spec(name, body.lora_path)
        checked = await asyncio.to_thread(read_adapters, [spec], {base.name: base.info.path},
                                          ctx.settings.max_lora_rank)
    except LoraError as e:
        raise APIError(400, str(e), param="lora_path", code="invalid_lora_adapter") from None
    record = RuntimeLora(base.name, checked[name][1], int(time.time()), tenant_of(request))
    try:
        added = await ctx.loras.add(record)
    except RegistryFull as e:
        raise APIError(400, str(e), param="lora_name", code="too_many_adapters") from None
    except aioredis.RedisError as e:
        raise state_unavailable(e) from e
    if not added:
        raise _in_use(name)
    log_event(log, "lora.loaded", adapter=name, model=base.name, path=body.lora_path,
              rank=record.adapter.rank, tenant=record.loaded_by)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> PlainTextResponse:
    ctx = _allowed(request)
    name = _parsed(UnloadLoraAdapterRequest, await request.body()).lora_name
    if name in ctx.adapters:
        raise APIError(400, f"The LoRA adapter '{name}' was declared with --lora (or "
                       "REDSERVE_LORA) and cannot be unloaded: restart the replicas and workers "
                       "without it", param="lora_name", code="invalid_value")
    if name in ctx.models:
        raise APIError(400, f"'{name}' is a model, not a LoRA adapter", param="lora_name",
                       code="invalid_value")
    _base(ctx)
    try:
        removed = await ctx.loras.remove(name)
    except aioredis.RedisError as e:
        raise state_unavailable(e) from e
    if not removed:
        raise APIError(404, f"The LoRA adapter '{name[:200]}' cannot be found.",
                       param="lora_name", code="model_not_found")
    log_event(log, "lora.unloaded", adapter=name, tenant=tenant_of(request))
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def _allowed(request: Request) -> AppContext:
    """The replica's context if runtime adapters are on and the caller is an admin."""
    ctx = app_context(request)
    if not ctx.settings.allow_runtime_lora:
        raise APIError(404, "Loading and unloading LoRA adapters at run time is off: start the "
                       "replicas with --allow-runtime-lora (REDSERVE_ALLOW_RUNTIME_LORA=true) to "
                       "allow it", code="not_found")
    tenant = tenant_of(request)
    if request.app.state.api_keys.enabled and not ctx.policies.of(tenant).admin:
        raise APIError(403, f"tenant {tenant!r} may not load or unload LoRA adapters: only a "
                       "tenant with `admin = true` in the tenants file may",
                       code="permission_denied")
    return ctx


def _parsed(kind: type[B], raw: bytes) -> B:
    """The body, read only once the caller is known to be allowed; a bad one is a 400 as any
    route's (`api.protocol.errors`)."""
    try:
        return kind.model_validate_json(raw)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None


def _base(ctx: AppContext) -> ServedModel:
    """The replica's one model, which runtime adapters apply to."""
    if ctx.loras.base is None:
        raise APIError(400, f"this replica serves {len(ctx.models)} models; LoRA adapters need "
                       "a single base model: load them on the replicas of their model",
                       param="lora_name", code="invalid_value")
    return ctx.loras.base


def _in_use(name: str) -> APIError:
    return APIError(400, f"The name '{name}' is already in use by a model or a loaded LoRA "
                    "adapter.", param="lora_name", code="invalid_value")
