"""`POST /v1/completions`: each prompt's sizes and ids checked, then tokenized (token ids
are taken as they are), then the reply (`api.endpoints.serving`), rendered as text
completions (`api.render.completions`)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from api.endpoints.common import app_context, served, tenant_of
from api.endpoints.serving import generate, prepare
from api.protocol.bodies import CompletionRequest
from shared import tracing

router = APIRouter()


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    ctx = app_context(request)
    model = await served(ctx, body.model, tenant_of(request))
    body.check_prompts(model)
    with tracing.span("redserve.tokenize"):
        prompts = [await model.codec.encode_text(p, body.add_special_tokens)
                   if isinstance(p, str) else p for p in body.prompts()]
    echoes = [model.codec.decode(p) if not isinstance(raw, str) else raw
              for raw, p in zip(body.prompts(), prompts, strict=True)] if body.echo else None
    prepared = await prepare(model, body, prompts)
    return await generate(ctx, request, prepared, "completions", tenant_of(request), echoes)
