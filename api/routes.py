"""HTTP routes: validate and tokenize, hand the request to a `Generation`, shape the reply."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator
from typing import Any, cast

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.background import BackgroundTask

from api.context import AppContext
from api.errors import APIError, error_body
from api.generation import Generation
from api.protocol import ChatCompletionRequest, CompletionRequest
from api.responses import Kind, ResponseFormat, json_response, usage
from shared.keys import new_request_id
from shared.messages import (
    Error,
    Finish,
    GenerateRequest,
    RequestState,
    SamplingParams,
    Tokens,
)

router = APIRouter()

# Worker error codes that are the client's fault or a capacity problem, not a server bug.
_ERROR_STATUS = {
    "context_length": 400,
    "model_not_found": 404,
    "queue_timeout": 503,
    "worker_shutdown": 503,
    "server_shutdown": 503,
    "request_timeout": 504,
}


def _ctx(request: Request) -> AppContext:
    ctx: AppContext = request.app.state.ctx
    return ctx


@router.get("/health")
async def health(request: Request) -> Response:
    """Liveness: the process answers and reaches Redis."""
    try:
        await _ctx(request).clients.commands.ping()
    except Exception as e:
        return json_response({"status": "unavailable", "redis": str(e)}, status_code=503)
    return json_response({"status": "ok"})


@router.get("/ready")
async def ready(request: Request) -> Response:
    """Readiness: false while draining, so load balancers stop sending new requests."""
    if _ctx(request).live.draining:
        return json_response({"status": "draining"}, status_code=503)
    return await health(request)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(generate_latest(_ctx(request).metrics.registry),
                    media_type=CONTENT_TYPE_LATEST)


@router.post("/v1/requests/{request_id}/cancel")
@router.delete("/v1/requests/{request_id}")
async def cancel(request_id: str, request: Request) -> Response:
    """Cancel a request by id, from any replica. Only its owner (same API key) may."""
    ctx = _ctx(request)
    try:
        state_key = ctx.keys.state(request_id)
    except ValueError:
        raise APIError(404, f"no request {request_id!r}", param="request_id",
                       code="not_found") from None
    state = cast(dict[bytes, bytes], await ctx.clients.commands.hgetall(state_key))
    if not state or state.get(b"owner", b"").decode() != _owner(request):
        # Someone else's request looks exactly like a missing one.
        raise APIError(404, f"no request {request_id!r}", param="request_id", code="not_found")
    current = state[b"state"].decode()
    cancelled = current in (RequestState.QUEUED, RequestState.RUNNING)
    if cancelled:
        await ctx.clients.commands.set(ctx.keys.abort(request_id), "1",
                                       ex=ctx.settings.request_ttl_s)
    return json_response({"id": request_id, "object": "request", "state": current,
                          "cancelled": cancelled})


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
    prompt_ids = await ctx.codec.encode_chat(body.messages)
    return await _generate(ctx, request, body, prompt_ids, "chat")


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    ctx = _ctx(request)
    _check_model(ctx, body.model)
    prompt = body.prompt_value()
    if isinstance(prompt, str):
        prompt_ids = await ctx.codec.encode_text(prompt)
    else:
        vocab = len(ctx.codec.tokenizer)
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"prompt token id {bad} is outside the vocabulary (0..{vocab - 1})",
                           param="prompt", code="invalid_value")
        prompt_ids = prompt
    return await _generate(ctx, request, body, prompt_ids, "text")


def _check_model(ctx: AppContext, model: str) -> None:
    if model != ctx.model.name:
        raise APIError(404, f"The model '{model}' does not exist; this server serves "
                       f"'{ctx.model.name}'.", param="model", code="model_not_found")


def _fit_context(ctx: AppContext, prompt_tokens: int, requested: int | None) -> int:
    limit = ctx.model.max_model_len
    if requested is None:
        if prompt_tokens >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens, but the "
                           f"prompt has {prompt_tokens} tokens.", param="messages",
                           code="context_length_exceeded")
        return limit - prompt_tokens
    if prompt_tokens + requested > limit:
        raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you "
                       f"requested {prompt_tokens + requested} tokens ({prompt_tokens} in the "
                       f"prompt, {requested} for the completion).", param="max_tokens",
                       code="context_length_exceeded")
    return requested


def _owner(request: Request) -> str:
    auth = request.headers.get("authorization", "")
    return hashlib.sha256(auth.encode()).hexdigest()[:16] if auth else ""


async def _generate(
    ctx: AppContext,
    request: Request,
    body: ChatCompletionRequest | CompletionRequest,
    prompt_ids: list[int],
    kind: Kind,
) -> Response:
    if not prompt_ids:
        raise APIError(400, "the prompt is empty", param="prompt", code="invalid_value")
    max_tokens = _fit_context(ctx, len(prompt_ids), body.requested_max_tokens())
    now = time.time()
    gen_request = GenerateRequest(
        id=new_request_id(ctx.replica),
        model=ctx.model.name,
        prompt_ids=tuple(prompt_ids),
        params=SamplingParams(
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=max(body.top_k, 0),
            seed=body.seed,
            ignore_eos=body.ignore_eos,
        ),
        created=now,
        queue_deadline=now + ctx.settings.queue_timeout_s,
        deadline=now + ctx.settings.request_timeout_s,
        owner=_owner(request),
        trace_id=request.headers.get("x-trace-id", ""),
    )
    fmt = ResponseFormat(kind, gen_request.id, ctx.model.name, int(now))
    generation = Generation(ctx, gen_request)
    await generation.start()
    headers = {"X-Request-Id": gen_request.id}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return EventSourceResponse(
            _stream(ctx, generation, fmt, include_usage),
            headers=headers,
            sep="\n",
            ping=15,
            background=BackgroundTask(generation.close),
        )
    try:
        reply = await _collect_unless_disconnected(ctx, request, generation, fmt)
    finally:
        await generation.close()
    return json_response(reply, headers=headers)


async def _collect_unless_disconnected(
    ctx: AppContext, request: Request, generation: Generation, fmt: ResponseFormat
) -> dict[str, Any]:
    """A client waiting for one JSON reply may hang up too: watch the ASGI disconnect message
    while collecting, and stop (close() then aborts the work) as soon as it comes."""
    collect = asyncio.create_task(_collect(ctx, generation, fmt))
    gone = asyncio.create_task(_disconnected(request))
    try:
        await asyncio.wait((collect, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not collect.done():
            collect.cancel()
    if collect.cancelled():
        return {}  # nobody is listening for this reply
    return collect.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _event(payload: dict[str, Any] | str) -> ServerSentEvent:
    data = payload if isinstance(payload, str) else orjson.dumps(payload).decode()
    return ServerSentEvent(data=data)


async def _stream(
    ctx: AppContext, generation: Generation, fmt: ResponseFormat, include_usage: bool
) -> AsyncIterator[ServerSentEvent]:
    decoder = ctx.codec.decoder()
    try:
        if fmt.kind == "chat":
            yield _event(fmt.chunk("", role=True))
        async for entry in generation:
            if isinstance(entry, Tokens):
                text = decoder.push(entry.ids)
                if text:
                    yield _event(fmt.chunk(text))
            elif isinstance(entry, Finish):
                tail = decoder.flush()
                if tail:
                    yield _event(fmt.chunk(tail))
                yield _event(fmt.chunk(None if fmt.kind == "chat" else "", entry.finish_reason))
                if include_usage:
                    yield _event(fmt.usage_chunk(usage(entry.prompt_tokens,
                                                       entry.completion_tokens)))
            elif isinstance(entry, Error):
                yield _event(error_body(entry.message, entry.type, None, entry.code))
        yield _event("[DONE]")
    finally:
        await generation.close()


async def _collect(ctx: AppContext, generation: Generation, fmt: ResponseFormat) -> dict[str, Any]:
    decoder = ctx.codec.decoder()
    parts: list[str] = []
    async for entry in generation:
        if isinstance(entry, Tokens):
            parts.append(decoder.push(entry.ids))
        elif isinstance(entry, Finish):
            parts.append(decoder.flush())
            return fmt.whole("".join(parts), entry.finish_reason,
                             usage(entry.prompt_tokens, entry.completion_tokens))
        else:
            raise APIError(_ERROR_STATUS.get(entry.code, 500), entry.message, type=entry.type,
                           code=entry.code)
    raise APIError(500, "result stream ended without a terminal entry", type="server_error")
