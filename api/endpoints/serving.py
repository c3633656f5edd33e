"""From a tokenized request to its reply: checked against its model (`prepare`, with the
checks `api.protocol.bodies` owns), then one `Generation` per choice (`n` per prompt), rendered as
one SSE stream or one JSON object (`api.render`) (`generate`). `start` is the part every wire
format shares: the Responses API (`api.endpoints.responses`) renders the same choices its own
way."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response

from api.protocol.bodies import ChatCompletionRequest, CompletionRequest
from api.protocol.errors import APIError
from api.protocol.reply_spec import Kind, ReplySpec
from api.protocol.served_model import ServedModel
from api.protocol.structured_output import compile_constraint
from api.protocol.text import ChatOptions, TemplateRefused
from api.protocol.tokenize_body import TokenizeChatRequest
from api.protocol.tools.prompt import conversation, native_tools
from api.queue.context import AppContext
from api.queue.generation import Generation
from api.queue.limits.reservation import Reservation
from api.queue.metrics import Endpoint, ReplyTimer
from api.queue.replay import Replay, StreamView
from api.queue.trace import ReplyTrace
from api.render import collect
from api.render.choices import Choice, reply_choice
from api.render.formats import renderer, reply_id
from api.render.stream import sse
from api.render.walk import close_all
from shared.keys import new_request_id
from shared.logs import log_event
from shared.messages import GenerateRequest

log = logging.getLogger("redserve.api.requests")

_TRACE_ID = re.compile(r"^[A-Za-z0-9._:/-]{1,128}$")


@dataclass(frozen=True)
class Prepared:
    """A body tokenized and checked against the model that serves it (`prepare`): what
    `generate` builds its requests from."""

    model: ServedModel
    body: ChatCompletionRequest | CompletionRequest
    prompts: list[list[int]]
    max_tokens: list[int]  # each prompt's choices', fitted to the context
    constraint: str | None  # the grammar its output follows, compiled


async def prepare(model: ServedModel, body: ChatCompletionRequest | CompletionRequest,
                  prompts: list[list[int]]) -> Prepared:
    """The body's checks against `model` (`api.protocol.bodies`): its token ids, then its constraint
    (compiled off the event loop), then each prompt against the context."""
    body.validate_for(model)
    constraint = await compile_constraint(body, model.codec.tokenizer)
    max_tokens = [body.max_tokens_for(model, ids) for ids in prompts]
    return Prepared(model, body, prompts, max_tokens, constraint)


@dataclass(frozen=True)
class Started:
    """A reply's choices, all queued, and what rendering them needs: a renderer per wire
    format (`api.render`) takes it from here."""

    choices: list[Choice]
    spec: ReplySpec
    headers: dict[str, str]


async def start(ctx: AppContext, request: Request, prepared: Prepared, kind: Kind,
                tenant: str, endpoint: Endpoint, echoes: list[str] | None = None,
                responses: str | None = None, base_id: str | None = None) -> Started:
    """Queue one request per choice (rate limits, placement, admission as for any reply),
    counted by `endpoint` once all are queued; `echoes`: each prompt's text, when the body
    asks for it back; `responses`: a Responses API stream's rendering state, stored for its
    resumption (`api.queue.replay.StreamView`); `base_id`: the request id, when the caller needed
    it first (`new_request_id`)."""
    body, model, now = prepared.body, prepared.model, time.time()
    base_id = base_id or new_request_id(ctx.replica)
    spec = ReplySpec.from_body(body, kind, base_id, model.name, int(now), prepared.prompts,
                               echoes)
    trace = ReplyTrace.start(body, spec, reply_id(spec), tenant)  # None unless traced
    requests = _requests(ctx, prepared, base_id, now, tenant,
                         _trace_id(request.headers.get("x-trace-id", "")), trace)
    _log_received(ctx, body, base_id, tenant, model.name)
    reservation = ctx.limits.reserve(ctx.policies.of(tenant), requests, spec.prompt_tokens)
    generations = _generations(ctx, requests, spec, body.stream, reservation, responses,
                               trace)
    choices = [reply_choice(spec, g, model.codec, i, i // body.n)
               for i, g in enumerate(generations)]
    await _start_all(generations, choices, one_first=reservation is not None)
    # Metrics count an adapter's requests as its base model's (its queue's), and per adapter.
    ctx.metrics.accepted.labels(model.base, endpoint).inc()
    ctx.metrics.adapter_request(model.base, model.name)
    _time_reply(ctx, generations, spec, model, tenant, now, body.stream, trace)
    headers = {"X-Request-Id": base_id,
               **(reservation.headers() if reservation is not None else {})}
    return Started(choices, spec, headers)


async def generate(ctx: AppContext, request: Request, prepared: Prepared, kind: Kind,
                   tenant: str, echoes: list[str] | None = None) -> Response:
    """Queue one request per choice and answer with their merged chat or completions reply
    (SSE or JSON)."""
    endpoint: Endpoint = kind
    started = await start(ctx, request, prepared, kind, tenant, endpoint, echoes)
    rendering = renderer(started.choices, started.spec, whole=not prepared.body.stream)
    if prepared.body.stream:
        return sse(rendering, started.headers, 0, ctx.settings.sse_ping_s)
    return await collect.reply(request, rendering, started.headers)


def _trace_id(header: str) -> str:
    """A caller's trace id travels with its request only if it looks like one (it is copied
    into every choice's queue entry)."""
    return header if _TRACE_ID.match(header) else ""


def _requests(ctx: AppContext, prepared: Prepared, base_id: str, now: float, tenant: str,
              trace_id: str, trace: ReplyTrace | None) -> list[GenerateRequest]:
    """One queued request per choice, `n` per prompt: `<id>`, then `<id>-1` ..."""
    body, model = prepared.body, prepared.model
    placed = _place(ctx, prepared, tenant, trace)
    requests = []
    for index in range(len(prepared.prompts) * body.n):
        prompt_ids = prepared.prompts[index // body.n]
        requests.append(GenerateRequest(
            id=base_id if index == 0 else f"{base_id}-{index}",
            model=model.base,
            lora=model.lora_name,
            lora_path=str(model.lora.path) if model.lora is not None else "",
            prompt_ids=tuple(prompt_ids),
            params=body.to_sampling_params(prepared.max_tokens[index // body.n], index),
            created=now,
            queue_deadline=now + ctx.settings.queue_timeout_s,
            deadline=now + ctx.settings.request_timeout_s,
            tenant=tenant,
            trace_id=trace_id,
            traceparent=None if trace is None else trace.traceparent,
            grammar=prepared.constraint,
            priority=body.priority,
            weight=ctx.policies.of(tenant).weight,
            worker=placed[index],
        ))
    return requests


def _place(ctx: AppContext, prepared: Prepared, tenant: str,
           trace: ReplyTrace | None) -> list[str]:
    """Each choice's worker (`api.queue.placement`), in a span when traced."""
    model, n = prepared.model, prepared.body.n
    prompts = [prepared.prompts[i // n] for i in range(len(prepared.prompts) * n)]
    if trace is None:
        return [ctx.placement.place(model.base, tenant, p, model.lora_name) for p in prompts]
    with trace.placement() as span:
        placed = [ctx.placement.place(model.base, tenant, p, model.lora_name) for p in prompts]
        span.set_attribute("redserve.worker", placed)
        return placed


def _log_received(ctx: AppContext, body: ChatCompletionRequest | CompletionRequest,
                  base_id: str, tenant: str, model: str) -> None:
    """The request's text, logged only when asked for (as vLLM's --enable-log-requests)."""
    if not ctx.settings.log_request_text:
        return
    text = ({"messages": [m.model_dump(exclude_none=True) for m in body.messages]}
            if isinstance(body, ChatCompletionRequest) else {"prompt": body.prompt})
    log_event(log, "request.received", request_id=base_id, tenant=tenant, model=model,
              **text)


def _generations(ctx: AppContext, requests: list[GenerateRequest], spec: ReplySpec,
                 stream: bool, reservation: Reservation | None,
                 responses: str | None, trace: ReplyTrace | None) -> list[Generation]:
    """One per choice. The first counts its siblings and carries the reply's charge; a
    single-choice stream is resumable (see api/queue/replay.py)."""
    first = requests[0]
    view = (StreamView(spec, first.deadline, first.queue_deadline, responses)
            if stream and len(requests) == 1 else None)
    return [Generation(ctx, req, siblings=len(requests) if i == 0 else 0, view=view,
                       streaming=stream, reservation=reservation, charges=i == 0,
                       trace=trace)
            for i, req in enumerate(requests)]


async def _start_all(generations: list[Generation], choices: list[Choice],
                     one_first: bool) -> None:
    """All choices enter the queue concurrently; if any is refused (or the client leaves
    meanwhile), none stays. Under rate limits (`one_first`) the first goes alone, charged for
    the whole reply: a reply its tenant cannot pay for queues nothing."""
    first = generations[:1] if one_first and len(generations) > 1 else []
    try:
        for g in first:
            await g.start()
        started = await asyncio.gather(*(g.start() for g in generations[len(first):]),
                                       return_exceptions=True)
        failure = next((r for r in started if isinstance(r, BaseException)), None)
        if failure is not None:
            raise failure
    except BaseException:
        await close_all(choices)
        raise


def _time_reply(ctx: AppContext, generations: list[Generation], spec: ReplySpec,
                model: ServedModel, tenant: str, created: float, stream: bool,
                trace: ReplyTrace | None) -> None:
    """One timer for the reply, fed by all its choices (`api.queue.metrics.ReplyTimer`); it ends
    the reply's trace too."""
    timer = ReplyTimer(ctx.metrics, request_id=spec.base_id, tenant=tenant, model=model.base,
                       stream=stream, created=created, prompt_tokens=spec.prompt_tokens,
                       choices=len(generations), trace=trace, adapter=model.name)
    for g in generations:
        g.timer = timer


def resume(ctx: AppContext, model: ServedModel, request_id: str, view: StreamView,
           after: int) -> Response:
    """A single-choice stream replayed from its result stream; only events after `after`
    are sent."""
    spec = view.spec
    choice = reply_choice(spec, Replay(ctx, request_id, view), model.codec)
    return sse(renderer([choice], spec, whole=False), {"X-Request-Id": spec.base_id}, after,
               ctx.settings.sse_ping_s)


async def chat_prompt_ids(model: ServedModel,
                          body: ChatCompletionRequest | TokenizeChatRequest) -> list[int]:
    """A chat's prompt, as chat completion builds it and /tokenize counts it."""
    model.check_size([m.text() for m in body.messages], "messages")
    tools = body.tools if body.tool_choice != "none" else None
    turns, native = conversation(body.messages, tools, native_tools(model.codec.tokenizer))
    options = ChatOptions(tools=native, add_generation_prompt=body.add_generation_prompt,
                          continue_final_message=body.continue_final_message,
                          add_special_tokens=body.add_special_tokens,
                          template_kwargs=body.chat_template_kwargs or {})
    try:
        return await model.codec.encode_turns(turns, options)
    except TemplateRefused as e:
        raise APIError(400, str(e), param="messages", code="invalid_value") from None
