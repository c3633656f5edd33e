"""HTTP routes: validate and tokenize, hand the request to a `Generation`, shape the reply."""

from __future__ import annotations

import logging
import time
from typing import Any, cast

import orjson
import redis.asyncio as aioredis
from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from api.context import AppContext
from api.errors import APIError
from api.protocol import ChatCompletionRequest, CompletionRequest
from api.responses import json_response
from api.resume import StreamView, last_event_id
from api.serving import generate, resume
from shared.keys import is_request_id
from shared.messages import RequestState

router = APIRouter()
log = logging.getLogger("redserve.api")


def _ctx(request: Request) -> AppContext:
    ctx: AppContext = request.app.state.ctx
    return ctx


@router.get("/health")
async def health(request: Request) -> Response:
    """Liveness: the process answers, reaches Redis, and its result reader runs. Also lists the
    model's live workers as they announce themselves (device, dtype, batch, KV pages)."""
    ctx = _ctx(request)
    reader = {"alive": ctx.reader.alive, "restarts": ctx.reader.restarts}
    try:
        workers = await _live_workers(ctx)
    except Exception as e:
        log.warning("health: Redis unreachable: %s", e)
        return json_response({"status": "unavailable", "redis": "unreachable",
                              "reader": reader}, status_code=503)
    if not ctx.reader.alive:
        return json_response({"status": "unavailable", "reader": reader}, status_code=503)
    return json_response({"status": "ok", "reader": reader,
                          "auth": "on" if request.app.state.api_keys.enabled else "off",
                          "workers": workers})


async def _live_workers(ctx: AppContext) -> dict[str, Any]:
    """name -> status of each worker of the model whose heartbeat is current (bounded: a
    model's workers are few, and each status is one small key)."""
    found = await ctx.clients.commands.zrangebyscore(ctx.keys.workers(ctx.model.name),
                                                     time.time(), "+inf")
    names = [_text(n) for n in found]
    if not names:
        return {}
    pipe = ctx.clients.commands.pipeline(transaction=False)
    for name in names:
        pipe.get(ctx.keys.worker(name))
    bodies = await pipe.execute()
    return {n: orjson.loads(b) for n, b in zip(names, bodies, strict=True) if b}


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@router.get("/ready")
async def ready(request: Request) -> Response:
    """Readiness: Redis answers, at least one live worker serves the model, and this replica
    is not draining (so load balancers stop sending it new requests)."""
    ctx = _ctx(request)
    if ctx.live.draining:
        return json_response({"status": "draining"}, status_code=503)
    workers = ctx.keys.workers(ctx.model.name)
    pipe = ctx.clients.commands.pipeline(transaction=False)
    pipe.zremrangebyscore(workers, "-inf", time.time())
    pipe.zcard(workers)
    try:
        _, live = await pipe.execute()
    except Exception as e:
        log.warning("ready: Redis unreachable: %s", e)
        return json_response({"status": "unavailable", "redis": "unreachable"}, status_code=503)
    if not live:
        return json_response({"status": "no live worker for the model"}, status_code=503)
    return json_response({"status": "ok", "workers": live})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(generate_latest(_ctx(request).metrics.registry),
                    media_type=CONTENT_TYPE_LATEST)


@router.post("/v1/requests/{request_id}/cancel")
@router.delete("/v1/requests/{request_id}")
async def cancel(request_id: str, request: Request) -> Response:
    """Cancel a request by id, from any replica. Only its tenant may."""
    ctx = _ctx(request)
    state = await _owned_state(ctx, request_id, request)
    current = state[b"state"].decode()
    cancelled = current in (RequestState.QUEUED, RequestState.RUNNING)
    if cancelled:
        # A reply with several choices is cancelled whole: `<id>` and `<id>-1`..`<id>-<n-1>`.
        ids = [request_id] + [f"{request_id}-{i}" for i in range(1, int(state[b"choices"]))]
        pipe = ctx.clients.commands.pipeline(transaction=False)
        for rid in ids:
            pipe.set(ctx.keys.abort(rid), "1", ex=ctx.settings.request_ttl_s)
        await pipe.execute()
    return json_response({"id": request_id, "object": "request", "state": current,
                          "cancelled": cancelled})


@router.get("/v1/requests/{request_id}/stream")
async def resume_stream(request_id: str, request: Request) -> Response:
    """Replay a streaming request's events after `Last-Event-ID`, from any replica, while its
    result stream lives. Only its tenant may."""
    ctx = _ctx(request)
    state = await _owned_state(ctx, request_id, request)
    raw_view = state.get(b"stream")
    if raw_view is None:
        raise APIError(400, f"request {request_id!r} is not a single-choice stream, so it "
                       "cannot be resumed", param="request_id", code="not_resumable")
    after = last_event_id(request.headers.get("last-event-id")
                          or request.query_params.get("last_event_id"))
    # Tells the replica that served the first stream not to cancel it after its grace.
    try:
        await ctx.clients.commands.set(ctx.keys.resumed(request_id), "1",
                                       ex=ctx.settings.request_ttl_s)
    except aioredis.RedisError as e:
        raise _state_unavailable(e) from e
    return resume(ctx, request_id, StreamView.from_json(raw_view), after)


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    ctx = _ctx(request)
    return {
        "object": "list",
        "data": [{
            "id": ctx.model.name,
            "object": "model",
            "created": int(ctx.model.path.stat().st_mtime),
            "owned_by": "redserve",
            "max_model_len": ctx.model.max_model_len,
        }],
    }


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    ctx = _ctx(request)
    _check_model(ctx, body.model)
    _check_size(ctx, [m.text() for m in body.messages], "messages")
    prompt_ids = await ctx.codec.encode_chat(body.messages)
    return await generate(ctx, request, body, [prompt_ids], "chat", _tenant(request))


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    ctx = _ctx(request)
    _check_model(ctx, body.model)
    vocab = len(ctx.codec.tokenizer)
    for prompt in body.prompts():
        if isinstance(prompt, str):
            _check_size(ctx, [prompt], "prompt")
    prompts: list[list[int]] = []
    for prompt in body.prompts():
        if isinstance(prompt, str):
            prompts.append(await ctx.codec.encode_text(prompt))
            continue
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"prompt token id {bad} is outside the vocabulary (0..{vocab - 1})",
                           param="prompt", code="invalid_value")
        prompts.append(prompt)
    echoes = [ctx.codec.decode(p) if not isinstance(raw, str) else raw
              for raw, p in zip(body.prompts(), prompts, strict=True)] if body.echo else None
    return await generate(ctx, request, body, prompts, "text", _tenant(request), echoes)


async def _owned_state(ctx: AppContext, request_id: str, request: Request) -> dict[bytes, bytes]:
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
        raise _state_unavailable(e) from e
    if not state or state.get(b"tenant", b"").decode() != _tenant(request):
        raise missing
    return state


def _state_unavailable(e: Exception) -> APIError:
    log.warning("request state unavailable: %s", e)
    return APIError(503, "request state is unavailable; retry shortly", type="server_error",
                    code="redis_unavailable", headers={"Retry-After": "1"})


def _check_size(ctx: AppContext, texts: list[str], param: str) -> None:
    limit = ctx.model.max_model_len
    size = ctx.codec.surely_too_long(texts, limit)
    if size is not None:
        raise APIError(400, f"This model's maximum context length is {limit} tokens; the "
                       f"{param} text ({size} bytes) is far longer than that.", param=param,
                       code="context_length_exceeded")


def _check_model(ctx: AppContext, model: str) -> None:
    if model != ctx.model.name:
        raise APIError(404, f"The model '{model}' does not exist; this server serves "
                       f"'{ctx.model.name}'.", param="model", code="model_not_found")


def _tenant(request: Request) -> str:
    """Set by `api.auth.guard` for every /v1/ route."""
    tenant: str = request.state.tenant
    return tenant
