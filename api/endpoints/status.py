"""What a replica says about itself and the workers behind it: /health, /ready, /v1/models,
/metrics, and /queue/<model> (what an autoscaler reads: see ops/k8s/autoscale/keda.yaml).

Workers announce themselves in their model's live set (see worker/broker/presence.py), scored by
when their heartbeat expires; a worker that stops beating drops out of every answer here once its
score passes, with no one having to notice its death.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from typing import Any

import redis.asyncio as aioredis
from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from api.endpoints.common import tenant_of, visible
from api.protocol.errors import APIError
from api.protocol.http import json_response
from api.protocol.served_model import ServedModel
from api.queue.context import AppContext
from api.queue.metrics import QueueDepths
from shared.messages import Heartbeat

router = APIRouter()
log = logging.getLogger("redserve.api")


def _ctx(request: Request) -> AppContext:
    ctx: AppContext = request.app.state.ctx
    return ctx


async def live_workers(ctx: AppContext) -> dict[str, list[str]]:
    """model -> names of its workers whose heartbeat is current (one pipeline)."""
    now = time.time()
    pipe = ctx.clients.commands.pipeline(transaction=False)
    for name in ctx.models:
        pipe.zrangebyscore(ctx.keys.workers(name), now, "+inf")
    found = await pipe.execute()
    return {name: [_text(n) for n in names] for name, names in zip(ctx.models, found,
                                                                   strict=True)}


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@router.get("/health")
async def health(request: Request) -> Response:
    """Liveness: the process answers, reaches Redis, and its result reader runs (503 with a
    `reason` while it waits for Redis to answer at start). Also lists the
    live workers of its models as they announce themselves (model, device, dtype, KV dtype,
    kernels, batch-invariant mode, thread policy, batch, KV pages: their `Heartbeat`)."""
    ctx = _ctx(request)
    reader = {"alive": ctx.reader.alive, "restarts": ctx.reader.restarts}
    if ctx.reader.waiting is not None:  # started before Redis answered: not serving yet
        return json_response({"status": "unavailable", "redis": "unreachable",
                              "reason": ctx.reader.waiting, "reader": reader}, status_code=503)
    try:
        workers = await _worker_status(ctx)
    except Exception as e:
        log.warning("health: Redis unreachable: %s", e)
        return json_response({"status": "unavailable", "redis": "unreachable",
                              "reader": reader}, status_code=503)
    if not ctx.reader.alive:
        return json_response({"status": "unavailable", "reader": reader}, status_code=503)
    return json_response({"status": "ok", "reader": reader,
                          "auth": "on" if request.app.state.api_keys.enabled else "off",
                          "models": list(ctx.models), "workers": workers})


async def _worker_status(ctx: AppContext) -> dict[str, Any]:
    """name -> status of each live worker (bounded: workers are few, each status small)."""
    names = [n for found in (await live_workers(ctx)).values() for n in found]
    if not names:
        return {}
    pipe = ctx.clients.commands.pipeline(transaction=False)
    for name in names:
        pipe.get(ctx.keys.worker(name))
    bodies = await pipe.execute()
    return {n: _shown(b) for n, b in zip(names, bodies, strict=True) if b}


def _shown(raw: bytes) -> dict[str, Any]:
    """A worker's heartbeat as /health lists it; one that is not a heartbeat is shown as such
    (Redis answered: the replica is healthy whatever one key holds)."""
    try:
        return asdict(Heartbeat.from_json(raw))
    except ValueError as e:
        return {"unreadable": str(e)}


@router.get("/ready")
async def ready(request: Request) -> Response:
    """Readiness: Redis answers, the result reader reads this replica's feed (on a Redis
    Cluster, the node of its slot may be down while the others answer), this replica is not
    draining (so load balancers stop sending it new requests), and a live worker serves at
    least one of its models; `models` gives the live workers of each (a model without one
    still takes requests, which wait for a worker up to their queue deadline)."""
    ctx = _ctx(request)
    if ctx.live.draining:
        return json_response({"status": "draining"}, status_code=503)
    if not ctx.reader.connected or ctx.reader.failing is not None:
        return json_response({"status": "unavailable", "redis": "unreachable",
                              "reason": ctx.reader.waiting or ctx.reader.failing
                              or "connecting to Redis"}, status_code=503)
    try:
        found = await live_workers(ctx)
    except Exception as e:
        log.warning("ready: Redis unreachable: %s", e)
        return json_response({"status": "unavailable", "redis": "unreachable"}, status_code=503)
    counts = {model: len(names) for model, names in found.items()}
    total = sum(counts.values())
    if not total:
        return json_response({"status": "no live worker", "workers": 0, "models": counts},
                             status_code=503)
    return json_response({"status": "ok", "workers": total, "models": counts})


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    """The models of this replica that a live worker serves now, and their LoRA adapters
    (declared, and loaded at run time as this replica last read the registry) that the
    caller's tenant may use."""
    ctx = _ctx(request)
    try:
        found = await live_workers(ctx)
    except aioredis.RedisError as e:
        log.warning("models: Redis unreachable: %s", e)
        raise APIError(503, "the list of live models is unavailable; retry shortly",
                       type="server_error", code="redis_unavailable",
                       headers={"Retry-After": "1"}) from e
    served = visible(ctx, tenant_of(request))  # of the adapters, those its tenant may use
    return {"object": "list", "data": [_card(m, _created(ctx, m)) for m in served
                                       if found[m.base]]}


def _created(ctx: AppContext, model: ServedModel) -> int:
    """When a runtime adapter was loaded; else when its directory last changed (a runtime
    adapter's need not exist where the replica runs: only where the workers do)."""
    record = ctx.loras.records.get(model.name)
    if record is not None:
        return record.loaded_at
    return int((model.lora.path if model.lora else model.info.path).stat().st_mtime)


def _card(model: ServedModel, created: int) -> dict[str, Any]:
    """A model's entry; a LoRA adapter's names its base (`parent`) and its directory
    (`root`), as vLLM's does."""
    card: dict[str, Any] = {
        "id": model.name,
        "object": "model",
        "created": created,
        "owned_by": "redserve",
        "max_model_len": model.info.max_model_len,
    }
    if model.lora is not None:
        card |= {"parent": model.base, "root": str(model.lora.path)}
    return card


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(await _ctx(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/queue/{model}")
async def queue(request: Request, model: str) -> dict[str, Any]:
    """How many of the model's requests wait for a worker: KEDA's metrics-api trigger reads
    `waiting` (the consumer group's lag cannot tell: waiting requests are pending under the
    queue's consumer, see shared/scripts/handoff.py). Like /metrics, it names no tenant or
    request."""
    ctx = _ctx(request)
    if model not in ctx.models:
        raise APIError(404, f"The model {model!r} does not exist", code="model_not_found",
                       param="model")
    depths = QueueDepths(ctx.clients.commands, {model: ctx.keys.queued(model)},
                         ctx.settings.queue_timeout_s)
    try:
        waiting = (await depths.read())[model]
    except aioredis.RedisError as e:
        log.warning("queue: Redis unreachable: %s", e)
        raise APIError(503, "the queue depth is unavailable; retry shortly",
                       type="server_error", code="redis_unavailable",
                       headers={"Retry-After": "1"}) from e
    return {"model": model, "waiting": waiting}
