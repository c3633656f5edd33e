"""From a validated, tokenized request to its reply: one `Generation` per choice (`n` per
prompt), merged into one SSE stream or one JSON object."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.background import BackgroundTask

from api.choices import Choice, StopStrings, chat_logprobs, text_logprobs
from api.context import AppContext, ServedModel
from api.errors import APIError, error_body
from api.generation import Generation
from api.protocol import ChatCompletionRequest, CompletionRequest
from api.responses import Kind, ResponseFormat, json_response, usage
from api.resume import Replay, StreamView
from shared.keys import new_request_id
from shared.messages import Error, Finish, GenerateRequest, SamplingParams, Tokens

_TRACE_ID = re.compile(r"^[A-Za-z0-9._:/-]{1,128}$")

# Worker error codes that are the client's fault or a capacity problem, not a server bug.
_ERROR_STATUS = {
    "context_length": 400,
    "model_not_found": 404,
    "queue_timeout": 503,
    "worker_shutdown": 503,
    "server_shutdown": 503,
    "request_timeout": 504,
    "redis_unavailable": 503,
    "sampling_failed": 400,
}


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
            ))
    stops = body.stop_strings()
    prompt_tokens = sum(len(p) for p in prompts)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    view = None
    if body.stream and len(requests) == 1:  # resumable (see api/resume.py)
        view = StreamView(kind, base_id, model.name, int(now), prompt_tokens,
                          echoes[0] if echoes else "", tuple(stops or ()),
                          body.include_stop_str_in_output, include_usage, requests[0].deadline,
                          requests[0].queue_deadline)
    generations = [Generation(ctx, req, siblings=len(requests) if i == 0 else 0, view=view)
                   for i, req in enumerate(requests)]
    choices = [
        Choice(
            index=i,
            generation=generations[i],
            decoder=model.codec.decoder(),
            stops=StopStrings(stops, body.include_stop_str_in_output) if stops else None,
            chat=kind == "chat",
            codec=model.codec,
            prefix=echoes[i // body.n] if echoes else "",
            prompt_index=i // body.n,
        )
        for i, req in enumerate(requests)
    ]
    # All choices enter the queue concurrently; if any is refused (or the client leaves
    # meanwhile), none stays.
    try:
        started = await asyncio.gather(*(g.start() for g in generations),
                                       return_exceptions=True)
        failure = next((r for r in started if isinstance(r, BaseException)), None)
        if failure is not None:
            raise failure
    except BaseException:
        await _close_all(choices)
        raise
    fmt = ResponseFormat(kind, base_id, model.name, int(now))
    headers = {"X-Request-Id": base_id}
    if body.stream:
        return _sse(choices, fmt, prompt_tokens, include_usage, headers)
    try:
        reply = await _collect_unless_disconnected(request, choices, fmt, prompt_tokens)
    finally:
        await _close_all(choices)
    return json_response(reply, headers=headers)


def resume(ctx: AppContext, model: ServedModel, request_id: str, view: StreamView,
           after: int) -> Response:
    """A single-choice stream replayed from its result stream; only events after `after`
    are sent."""
    choice = Choice(
        index=0,
        generation=Replay(ctx, request_id, view),
        decoder=model.codec.decoder(),
        stops=StopStrings(list(view.stops), view.include_stop) if view.stops else None,
        chat=view.kind == "chat",
        codec=model.codec,
        prefix=view.prefix,
    )
    fmt = ResponseFormat(view.kind, view.base_id, view.model, view.created)
    return _sse([choice], fmt, view.prompt_tokens, view.include_usage,
                {"X-Request-Id": view.base_id}, after)


def _sse(choices: list[Choice], fmt: ResponseFormat, prompt_tokens: int, include_usage: bool,
         headers: dict[str, str], after: int = 0) -> Response:
    return EventSourceResponse(
        _numbered(_stream(choices, fmt, prompt_tokens, include_usage), after),
        headers=headers, sep="\n", ping=15,
        background=BackgroundTask(_close_all, choices),
    )


async def _numbered(events: AsyncIterator[ServerSentEvent], after: int
                    ) -> AsyncIterator[ServerSentEvent]:
    """Give each event its ordinal as `id:`, and skip those a resuming client has seen."""
    n = 0
    async for event in events:
        n += 1
        if n > after:
            event.id = str(n)
            yield event


async def _close_all(choices: list[Choice]) -> None:
    for choice in choices:
        await choice.generation.close()


async def _entries(choices: list[Choice]) -> AsyncIterator[tuple[Choice, Any]]:
    """Every choice's result entries as they arrive, interleaved."""
    if len(choices) == 1:
        async for entry in choices[0].generation:
            yield choices[0], entry
        return
    merged: asyncio.Queue[tuple[Choice, Any] | None] = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        try:
            async for entry in choice.generation:
                await merged.put((choice, entry))
        finally:
            await merged.put(None)

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    try:
        running = len(tasks)
        while running:
            item = await merged.get()
            if item is None:
                running -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()


def _logprobs(fmt: ResponseFormat, items: list[Any], offset: int) -> dict[str, Any] | None:
    if not items:
        return None
    return chat_logprobs(items) if fmt.kind == "chat" else text_logprobs(items, offset)


def _event(payload: dict[str, Any] | str) -> ServerSentEvent:
    data = payload if isinstance(payload, str) else orjson.dumps(payload).decode()
    return ServerSentEvent(data=data, sep="\n")


async def _stream(
    choices: list[Choice], fmt: ResponseFormat, prompt_tokens: int, include_usage: bool
) -> AsyncIterator[ServerSentEvent]:
    offsets = {c.index: len(c.prefix) for c in choices}
    failed = False
    try:
        for c in choices:
            if fmt.kind == "chat":
                yield _event(fmt.chunk(c.index, "", role=True))
            elif c.prefix:
                yield _event(fmt.chunk(c.index, c.prefix))
        async for choice, entry in _entries(choices):
            if choice.finish_reason is not None:
                continue  # ended here by a stop string; the worker's late entries are moot
            if isinstance(entry, Tokens):
                text, items = choice.on_tokens(entry)
                if text or items:
                    yield _event(fmt.chunk(choice.index, text,
                                           logprobs=_logprobs(fmt, items, offsets[choice.index])))
                    offsets[choice.index] += len(text)
                if choice.finish_reason is not None:
                    yield _event(fmt.chunk(choice.index, _final_text(fmt), "stop"))
                    await choice.generation.close("stop")  # tells the worker to stop now
            elif isinstance(entry, Finish):
                tail = choice.on_finish(entry)
                if tail:
                    yield _event(fmt.chunk(choice.index, tail))
                yield _event(fmt.chunk(choice.index, _final_text(fmt), choice.finish_reason))
            elif isinstance(entry, Error):
                yield _event(error_body(entry.message, entry.type, None, entry.code))
                failed = True
                break
        if include_usage and not failed:
            yield _event(fmt.usage_chunk(_usage(choices, prompt_tokens)))
        yield _event("[DONE]")
    finally:
        await _close_all(choices)


def _final_text(fmt: ResponseFormat) -> str | None:
    return None if fmt.kind == "chat" else ""


async def _collect_unless_disconnected(
    request: Request, choices: list[Choice], fmt: ResponseFormat, prompt_tokens: int
) -> dict[str, Any]:
    """A client waiting for one JSON reply may hang up too: watch the ASGI disconnect message
    while collecting, and stop (closing then aborts the work) as soon as it comes."""
    collect = asyncio.create_task(_collect(choices, fmt, prompt_tokens))
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


async def _collect(choices: list[Choice], fmt: ResponseFormat, prompt_tokens: int
                   ) -> dict[str, Any]:
    texts: dict[int, list[str]] = {c.index: [c.prefix] for c in choices}
    logprobs: dict[int, list[Any]] = {c.index: [] for c in choices}
    async for choice, entry in _entries(choices):
        if choice.finish_reason is not None:
            continue
        if isinstance(entry, Tokens):
            text, items = choice.on_tokens(entry)
            texts[choice.index].append(text)
            logprobs[choice.index] += items
            if choice.finish_reason is not None:
                await choice.generation.close("stop")
        elif isinstance(entry, Finish):
            texts[choice.index].append(choice.on_finish(entry))
        else:
            raise APIError(_ERROR_STATUS.get(entry.code, 500), entry.message, type=entry.type,
                           code=entry.code)
    missing = [c.index for c in choices if c.finish_reason is None]
    if missing:
        raise APIError(500, "result stream ended without a terminal entry", type="server_error")
    whole = [
        ("".join(texts[c.index]), c.finish_reason or "stop",
         _logprobs(fmt, logprobs[c.index], len(c.prefix)))
        for c in choices
    ]
    return fmt.whole(whole, _usage(choices, prompt_tokens))


def _usage(choices: list[Choice], prompt_tokens: int) -> dict[str, Any]:
    # Each prompt is counted once however many choices share it; so is its cache reuse.
    cached: dict[int, int] = {}
    for c in choices:
        cached[c.prompt_index] = max(cached.get(c.prompt_index, 0), c.cached_tokens)
    completion = sum(c.completion_tokens for c in choices)
    return usage(prompt_tokens, completion, sum(cached.values()))
