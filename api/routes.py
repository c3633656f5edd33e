"""HTTP routes: tokenize the body and check it against its model (`api.protocol` says what is
checked), then hand it to `api.serving`."""

from __future__ import annotations

import logging
from typing import cast

import redis.asyncio as aioredis
from fastapi import APIRouter, Request
from fastapi.responses import Response

from api.context import AppContext, ServedModel
from api.errors import APIError
from api.protocol import ChatCompletionRequest, CompletionRequest
from api.render.http import json_response
from api.resume import StreamView, last_event_id
from api.serving import generate, prepare, resume
from api.tokenization import chat_prompt_ids
from api.trace import resumed
from shared import tracing
from shared.aborts import stage_aborts
from shared.keys import is_request_id
from shared.messages import RequestHash, RequestState

router = APIRouter()
log = logging.getLogger("redserve.api")


def app_context(request: Request) -> AppContext:
    ctx: AppContext = request.app.state.ctx
    return ctx


@router.post("/v1/requests/{request_id}/cancel")
@router.delete("/v1/requests/{request_id}")
async def cancel(request_id: str, request: Request) -> Response:
    """Cancel a request by id, from any replica. Only its tenant may."""
    ctx = app_context(request)
    record = await owned_state(ctx, request_id, request)
    current = record.state
    cancelled = current in (RequestState.QUEUED, RequestState.RUNNING)
    if cancelled:
        # A reply with several choices is cancelled whole: `<id>` and `<id>-1`..`<id>-<n-1>`.
        ids = [request_id] + [f"{request_id}-{i}" for i in range(1, record.choices)]
        pipe = ctx.clients.commands.pipeline(transaction=False)
        stage_aborts(pipe, ctx.keys, ids, ctx.settings.request_ttl_s)
        try:
            await pipe.execute()
        except aioredis.RedisError as e:
            raise _state_unavailable(e) from e
        ctx.metrics.aborts.labels("cancel").inc(len(ids))
    return json_response({"id": request_id, "object": "request", "state": current,
                          "cancelled": cancelled})


@router.get("/v1/requests/{request_id}/stream")
async def resume_stream(request_id: str, request: Request) -> Response:
    """Replay a streaming request's events after `Last-Event-ID`, from any replica, while its
    result stream lives. Only its tenant may."""
    ctx = app_context(request)
    record = await owned_state(ctx, request_id, request)
    raw_view = record.stream
    if raw_view is None:
        raise APIError(400, f"request {request_id!r} is not a single-choice stream, so it "
                       "cannot be resumed", param="request_id", code="not_resumable")
    view = StreamView.from_json(raw_view)
    if view.responses is not None:
        raise APIError(400, f"request {request_id!r} is a Responses API stream: resume it "
                       f"with GET /v1/responses/resp_{request_id}?stream=true",
                       param="request_id", code="not_resumable")
    model = ctx.models.get(view.spec.model)
    if model is None:
        raise APIError(404, f"request {request_id!r} is for model {view.spec.model!r}, which "
                       "this replica does not serve; resume it on one that does",
                       param="request_id", code="model_not_found")
    after = last_event_id(request.headers.get("last-event-id")
                          or request.query_params.get("last_event_id"))
    await mark_resumed(ctx, request_id)
    resumed(record.trace, request_id, after)
    return resume(ctx, model, request_id, view, after)


async def mark_resumed(ctx: AppContext, request_id: str) -> None:
    """Tells the replica that served the first stream not to cancel it after its grace."""
    try:
        await ctx.clients.commands.set(ctx.keys.resumed(request_id), "1",
                                       ex=ctx.settings.request_ttl_s)
    except aioredis.RedisError as e:
        raise _state_unavailable(e) from e


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    ctx = app_context(request)
    model = served(ctx, body.model)
    with tracing.span("redserve.tokenize"):
        prompt_ids = await chat_prompt_ids(model, body)
    prepared = await prepare(model, body, [prompt_ids])
    return await generate(ctx, request, prepared, "chat", tenant_of(request))


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    ctx = app_context(request)
    model = served(ctx, body.model)
    body.check_prompts(model)
    with tracing.span("redserve.tokenize"):
        prompts = [await model.codec.encode_text(p, body.add_special_tokens)
                   if isinstance(p, str) else p for p in body.prompts()]
    echoes = [model.codec.decode(p) if not isinstance(raw, str) else raw
              for raw, p in zip(body.prompts(), prompts, strict=True)] if body.echo else None
    prepared = await prepare(model, body, prompts)
    return await generate(ctx, request, prepared, "text", tenant_of(request), echoes)


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
        raise _state_unavailable(e) from e
    try:
        record = RequestHash.decode(state)
    except ValueError:  # none (expired), or not what redserve writes
        raise missing from None
    if record.tenant != tenant_of(request):
        raise missing
    return record


def _state_unavailable(e: Exception) -> APIError:
    log.warning("request state unavailable: %s", e)
    return APIError(503, "request state is unavailable; retry shortly", type="server_error",
                    code="redis_unavailable", headers={"Retry-After": "1"})


def served(ctx: AppContext, name: str) -> ServedModel:
    model = ctx.models.get(name)
    if model is None:
        served = ", ".join(f"'{n}'" for n in ctx.models)
        raise APIError(404, f"The model '{name[:200]}' does not exist; this server serves "
                       f"{served}.", param="model", code="model_not_found")
    return model


def tenant_of(request: Request) -> str:
    """Set by `api.auth.guard` for every /v1/ route."""
    tenant: str = request.state.tenant
    return tenant
