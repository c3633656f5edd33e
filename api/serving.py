"""From a validated, tokenized request to its reply: its grammar checked, one `Generation` per
choice (`n` per prompt), merged into one SSE stream or one JSON object (`api.replies`)."""

from __future__ import annotations

import asyncio
import logging
import re
import time

from fastapi import Request
from fastapi.responses import Response

from api.context import AppContext, ServedModel
from api.errors import APIError
from api.generation import Generation
from api.metrics import ReplyTimer
from api.protocol import ChatCompletionRequest, CompletionRequest
from api.replies.collected import collect_unless_disconnected
from api.replies.merge import close_all
from api.replies.streamed import sse
from api.reply_spec import ReplySpec
from api.responses import Kind, json_response
from api.resume import Replay, StreamView
from api.structured.grammar import compile_constraint
from shared.keys import new_request_id
from shared.logs import log_event
from shared.messages import GenerateRequest, SamplingParams

log = logging.getLogger("redserve.api.requests")

_TRACE_ID = re.compile(r"^[A-Za-z0-9._:/-]{1,128}$")



def sampling_params(body: ChatCompletionRequest | CompletionRequest, max_tokens: int,
                    seed: int | None) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=max(body.top_k, 0),
        min_p=body.min_p,
        seed=seed,
        ignore_eos=body.ignore_eos,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        # "1" and "01" are one token: the last of them counts, once.
        logit_bias=tuple({int(k): v for k, v in (body.logit_bias or {}).items()}.items()),
        logprobs=body.top_logprobs_count(),
        min_tokens=min(body.min_tokens, max_tokens),
    )


def _trace_id(header: str) -> str:
    """A caller's trace id travels with its request only if it looks like one (it is copied
    into every choice's queue entry)."""
    return header if _TRACE_ID.match(header) else ""


def fit_context(model: ServedModel, prompt_tokens: int, requested: int | None) -> int:
    limit = model.info.max_model_len
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


async def generate(
    ctx: AppContext,
    model: ServedModel,
    request: Request,
    body: ChatCompletionRequest | CompletionRequest,
    prompts: list[list[int]],
    kind: Kind,
    tenant: str,
    echoes: list[str] | None = None,
) -> Response:
    now = time.time()
    base_id = new_request_id(ctx.replica)
    vocab = len(model.codec.tokenizer)
    for param, ids in (("logit_bias", [int(k) for k in body.logit_bias or {}]),
                       ("stop_token_ids", body.stop_token_ids or [])):
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise APIError(400, f"{param}: token id {bad} is outside the vocabulary "
                           f"(0..{vocab - 1})", param=param, code="invalid_value")
    constraint = await compile_constraint(body, model.codec.tokenizer)
    requests = []
    for p_index, prompt_ids in enumerate(prompts):
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", param="prompt", code="invalid_value")
        max_tokens = fit_context(model, len(prompt_ids), body.requested_max_tokens())
        for j in range(body.n):
            index = p_index * body.n + j
            seed = None if body.seed is None else body.seed + index
            requests.append(GenerateRequest(
                id=base_id if index == 0 else f"{base_id}-{index}",
                model=model.name,
                prompt_ids=tuple(prompt_ids),
                params=sampling_params(body, max_tokens, seed),
                created=now,
                queue_deadline=now + ctx.settings.queue_timeout_s,
                deadline=now + ctx.settings.request_timeout_s,
                tenant=tenant,
                trace_id=_trace_id(request.headers.get("x-trace-id", "")),
                grammar=constraint,
                priority=body.priority,
                weight=ctx.policies.of(tenant).weight,
                worker=ctx.placement.place(model.name, tenant, prompt_ids),
            ))
    if ctx.settings.log_request_text:  # asked for (as vLLM's --enable-log-requests)
        text = ({"messages": [m.model_dump(exclude_none=True) for m in body.messages]}
                if isinstance(body, ChatCompletionRequest) else {"prompt": body.prompt})
        log_event(log, "request.received", request_id=base_id, tenant=tenant,
                  model=model.name, **text)
    spec = ReplySpec.from_body(body, kind, base_id, model.name, int(now), prompts, echoes)
    view = None
    if body.stream and len(requests) == 1:  # resumable (see api/resume.py)
        view = StreamView(spec, requests[0].deadline, requests[0].queue_deadline)
    reservation = ctx.limits.reserve(ctx.policies.of(tenant), requests,
                                     sum(len(p) for p in prompts))
    generations = [Generation(ctx, req, siblings=len(requests) if i == 0 else 0, view=view,
                              streaming=body.stream, reservation=reservation, charges=i == 0)
                   for i, req in enumerate(requests)]
    choices = [spec.choice(g, model.codec, i, i // body.n) for i, g in enumerate(generations)]
    # All choices enter the queue concurrently; if any is refused (or the client leaves
    # meanwhile), none stays. Under rate limits the first goes alone, charged for the whole
    # reply: a reply its tenant cannot pay for queues nothing.
    try:
        first = generations[:1] if reservation is not None and len(generations) > 1 else []
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
    timer = ReplyTimer(ctx.metrics, request_id=base_id, tenant=tenant, model=model.name,
                       stream=body.stream, created=now, prompt_tokens=spec.prompt_tokens,
                       choices=len(generations))
    for g in generations:
        g.timer = timer
    headers = {"X-Request-Id": base_id,
               **(reservation.headers() if reservation is not None else {})}
    if body.stream:
        return sse(choices, spec, headers)
    try:
        reply = await collect_unless_disconnected(request, choices, spec)
    finally:
        await close_all(choices)
    return json_response(reply, headers=headers)


def resume(ctx: AppContext, model: ServedModel, request_id: str, view: StreamView,
           after: int) -> Response:
    """A single-choice stream replayed from its result stream; only events after `after`
    are sent."""
    spec = view.spec
    choice = spec.choice(Replay(ctx, request_id, view), model.codec)
    return sse([choice], spec, {"X-Request-Id": spec.base_id}, after)
