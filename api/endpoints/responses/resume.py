"""A Responses API stream resumed on any replica: `GET /v1/responses/{id}?stream=true&
starting_after=N` replays the request's result stream (`api.queue.replay.Replay`) through the same
renderer, so its events, and their sequence numbers, are those of the first stream, and sends
those after N.

What the renderer needs beyond the chat `ReplySpec` rides in the request's `StreamView`: the
body (less its input, which the prompt already holds) and the conversation to store the
response with. A replay stores the finished response as the first stream would have, so a
conversation survives the replica that started its turn dying mid-stream.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from api.endpoints.common import known, mark_resumed, owned_state, tenant_of
from api.endpoints.responses import store
from api.protocol.errors import APIError
from api.protocol.responses_body import ResponsesRequest
from api.queue.context import AppContext
from api.queue.replay import Replay, StreamView
from api.render.choices import reply_choice
from api.render.responses import RESPONSE_PREFIX, ResponseMeta, ResponsesRenderer, unstored
from api.render.stream import sse
from shared.messages import ResponsesStream


def view_state(body: ResponsesRequest, items: list[dict[str, Any]]) -> str:
    """What a replay of this stream needs, as stored in its `StreamView`."""
    echoed = body.model_copy(update={"input": ""})
    return ResponsesStream(echoed.model_dump(mode="json", by_alias=True, exclude_none=True),
                           items).to_json()


async def resume(ctx: AppContext, request: Request, response_id: str, after: int) -> Response:
    request_id = store.request_id_of(response_id)
    missing = APIError(404, f"Response with id {response_id[:140]!r} not found.",
                       param="response_id", code="not_found")
    if request_id is None:
        raise missing
    try:
        raw_view = (await owned_state(ctx, request_id, request)).stream
    except APIError as e:  # another tenant's, or gone: named as the response it was asked as
        if e.status == 404:
            raise missing from None
        raise
    view = StreamView.from_json(raw_view) if raw_view is not None else None
    if view is None or view.responses is None:
        raise APIError(400, f"response {response_id!r} was not streamed, so it cannot be "
                       "resumed", param="stream", code="not_resumable")
    spec = view.spec
    model = await known(ctx, spec.model)
    if model is None:
        raise APIError(404, f"response {response_id!r} is for model {spec.model!r}, which "
                       "this replica does not serve; resume it on one that does",
                       param="response_id", code="model_not_found")
    state = ResponsesStream.from_json(view.responses)
    body = ResponsesRequest.model_validate(state.body)
    await mark_resumed(ctx, request_id)
    # A client leaving a background response's stream leaves it running.
    choice = reply_choice(spec, Replay(ctx, request_id, view, cancels=not body.background),
                         model.codec)
    meta = ResponseMeta(RESPONSE_PREFIX + request_id, spec.created, spec.model, body)
    finished = (partial(store.save, ctx, tenant_of(request), state.items)
                if body.store and not body.background else unstored)  # its task stores it
    reply = ResponsesRenderer(choice, meta, spec.prompt_tokens, finished)
    return sse(reply, {"X-Request-Id": request_id}, after, ctx.settings.sse_ping_s)
