"""`POST /v1/chat/completions`: the messages through the chat template, then the reply
(`api.endpoints.serving`), rendered as chat (`api.render.chat`)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from api.endpoints.common import app_context, served, tenant_of
from api.endpoints.serving import chat_prompt_ids, generate, prepare
from api.protocol.bodies import ChatCompletionRequest
from shared import tracing

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    ctx = app_context(request)
    model = await served(ctx, body.model, tenant_of(request))
    with tracing.span("redserve.tokenize"):
        prompt_ids = await chat_prompt_ids(model, body)
    prepared = await prepare(model, body, [prompt_ids])
    return await generate(ctx, request, prepared, "chat", tenant_of(request))
