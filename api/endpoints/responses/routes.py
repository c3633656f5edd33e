"""OpenAI's Responses API on any replica: `POST /v1/responses` through the same generation
path as chat (`api.endpoints.serving.start`: rate limits, tenants' shares, placement, admission),
and its stored responses, read, listed, chained and deleted from whichever replica a call reaches,
because they live in Redis (`api.endpoints.responses.store`) and nowhere else; background responses
and their cancel (`api.endpoints.responses.background`) likewise.
"""

from __future__ import annotations

from functools import partial
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from api.endpoints.common import app_context, served, tenant_of
from api.endpoints.responses import background, store
from api.endpoints.responses.conversation import chat_body, input_items, renamed
from api.endpoints.responses.resume import resume, view_state
from api.endpoints.serving import Prepared, chat_prompt_ids, prepare, start
from api.protocol.bodies import ChatCompletionRequest
from api.protocol.errors import APIError
from api.protocol.http import json_response
from api.protocol.responses_body import ResponsesRequest
from api.protocol.served_model import ServedModel
from api.queue.context import AppContext
from api.render import collect
from api.render.responses import RESPONSE_PREFIX, ResponseMeta, ResponsesRenderer, unstored
from api.render.stream import sse
from api.render.walk import close_all
from shared.keys import new_request_id

router = APIRouter()
MAX_LIST = 100


@router.post("/v1/responses")
async def create(body: ResponsesRequest, request: Request) -> Response:
    ctx, tenant = app_context(request), tenant_of(request)
    model = await served(ctx, body.model, tenant)
    history = [] if body.previous_response_id is None else (await store.load(
        ctx, body.previous_response_id, tenant, "previous_response_id")).conversation()
    streamed = body.stream or body.background  # a background one is followed as a stream
    chat = chat_body(body, history + input_items(body, ""), streamed)
    prepared = await _prepared(model, chat, body.truncation == "auto")
    request_id = new_request_id(ctx.replica)
    items = history + input_items(body, RESPONSE_PREFIX + request_id)
    state = view_state(body, items) if streamed else None
    started = await start(ctx, request, prepared, "chat", tenant, "responses",
                          responses=state, base_id=request_id)
    spec = started.spec
    meta = ResponseMeta(RESPONSE_PREFIX + request_id, spec.created, model.name, body)
    save = store.finish_background if body.background else store.save
    finished = partial(save, ctx, tenant, items) if body.store else unstored
    reply = ResponsesRenderer(started.choices[0], meta, spec.prompt_tokens, finished)
    if body.background:
        return await _in_background(ctx, request, reply, tenant, items, started.headers)
    if body.stream:
        return sse(reply, started.headers, -1, ctx.settings.sse_ping_s)
    return await collect.reply(request, reply, started.headers)


@router.get("/v1/responses/{response_id}")
async def retrieve(response_id: str, request: Request, stream: bool = False,
                   starting_after: Annotated[int, Query(ge=-1)] = -1) -> Response:
    """The stored response; with `stream`, its stream replayed from the request's result
    stream while that lives (events after the sequence number `starting_after`)."""
    ctx, tenant = app_context(request), tenant_of(request)
    if stream:
        return await resume(ctx, request, response_id, starting_after)
    stored = await store.load(ctx, response_id, tenant, "response_id")
    return json_response(await background.settle(ctx, stored, tenant))


@router.post("/v1/responses/{response_id}/cancel")
async def cancel(response_id: str, request: Request) -> Response:
    """Cancel a background response (through its request's abort key)."""
    return json_response(await background.cancel(app_context(request), response_id,
                                                 tenant_of(request)))


@router.delete("/v1/responses/{response_id}")
async def delete(response_id: str, request: Request) -> Response:
    await store.delete(app_context(request), response_id, tenant_of(request))
    return json_response({"id": response_id, "object": "response.deleted", "deleted": True})


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(
    response_id: str, request: Request,
    limit: Annotated[int, Query(ge=1, le=MAX_LIST)] = 20,
    order: Literal["asc", "desc"] = "desc",
    after: Annotated[str | None, Query(max_length=256)] = None,
) -> Response:
    """The conversation the response answered (earlier turns' items included), a page at a
    time, newest first unless `order=asc`."""
    ctx = app_context(request)
    items = (await store.load(ctx, response_id, tenant_of(request), "response_id")).input_items
    if order == "desc":
        items = items[::-1]
    if after is not None:
        at = next((i for i, item in enumerate(items) if item["id"] == after), None)
        if at is None:
            raise APIError(400, f"after: no input item {after[:140]!r} in this response",
                           param="after", code="invalid_value")
        items = items[at + 1:]
    page = items[:limit]
    return json_response({"object": "list", "data": page,
                          "first_id": page[0]["id"] if page else None,
                          "last_id": page[-1]["id"] if page else None,
                          "has_more": len(items) > limit})


async def _in_background(ctx: AppContext, request: Request, reply: ResponsesRenderer,
                         tenant: str,
                         items: list[dict[str, Any]], headers: dict[str, str]) -> Response:
    """Store the response `queued`, then let it run without the client: answered at once,
    or (with `stream`) followed from its result stream, which a client may leave and resume
    without cancelling it."""
    queued = reply.meta.response("queued", [])
    try:
        await store.save(ctx, tenant, items, queued)
    except APIError:
        await close_all(reply.choices)
        raise
    background.spawn(ctx.live, reply)
    if reply.meta.body.stream:
        return await resume(ctx, request, queued["id"], -1)
    return json_response(queued, headers=headers)


async def _prepared(model: ServedModel, chat: ChatCompletionRequest,
                    truncate: bool) -> Prepared:
    """The chat body tokenized and checked; with `truncation: auto`, the oldest turns are
    dropped (a quarter of them at a time, the instructions kept) until it fits the context."""
    while True:
        try:
            return await prepare(model, chat, [await chat_prompt_ids(model, chat)])
        except APIError as e:
            shorter = _without_oldest(chat) if truncate else None
            if e.code != "context_length_exceeded" or shorter is None:
                raise renamed(e) from None
            chat = shorter


def _without_oldest(chat: ChatCompletionRequest) -> ChatCompletionRequest | None:
    messages = chat.messages
    system = 1 if messages and messages[0].role == "system" else 0
    turns = len(messages) - system
    if turns <= 1:
        return None
    drop = max(turns // 4, 1)
    return chat.model_copy(update={"messages": messages[:system] + messages[system + drop:]})
