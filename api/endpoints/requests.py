"""A request by its id, from any replica, by its tenant only: `POST
/v1/requests/{id}/cancel` (or `DELETE /v1/requests/{id}`) cancels it, `GET
/v1/requests/{id}/stream` resumes its stream after `Last-Event-ID` (`api.queue.replay`)."""

from __future__ import annotations

import redis.asyncio as aioredis
from fastapi import APIRouter, Request
from fastapi.responses import Response

from api.endpoints.common import (
    app_context,
    known,
    mark_resumed,
    owned_state,
    state_unavailable,
)
from api.endpoints.serving import resume
from api.protocol.errors import APIError
from api.protocol.http import json_response
from api.queue.replay import StreamView, last_event_id
from api.queue.trace import resumed
from shared.aborts import stage_aborts
from shared.messages import RequestState

router = APIRouter()


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
            raise state_unavailable(e) from e
        ctx.metrics.aborts.labels("cancel").inc(len(ids))
    return json_response({"id": request_id, "object": "request", "state": current,
                          "cancelled": cancelled})


@router.get("/v1/requests/{request_id}/stream")
async def resume_stream(request_id: str, request: Request) -> Response:
    """Replay a streaming request's events after `Last-Event-ID`, from any replica, while its
    result stream lives. Only its tenant may."""
    ctx = app_context(request)
    if ctx.live.draining:  # a load balancer sends it to another replica, as a new request
        raise APIError(503, "this replica is draining; resume the stream on another",
                       type="server_error", code="draining", headers={"Retry-After": "1"})
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
    model = await known(ctx, view.spec.model)
    if model is None:
        raise APIError(404, f"request {request_id!r} is for model {view.spec.model!r}, which "
                       "this replica does not serve; resume it on one that does",
                       param="request_id", code="model_not_found")
    after = last_event_id(request.headers.get("last-event-id")
                          or request.query_params.get("last_event_id"))
    await mark_resumed(ctx, request_id)
    resumed(record.trace, request_id, after)
    return resume(ctx, model, request_id, view, after)
