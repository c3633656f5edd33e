"""From a request's constraint fields to the grammar its worker enforces, checked before it is
queued.

One request has at most one constraint (the protocol refuses two): forced tool calls
(`tool_choice` required or a named function), OpenAI's `response_format` (json_object or
json_schema), or vLLM's `structured_outputs` and its older `guided_*` fields (JSON schema,
regex, choice, Lark or GBNF grammar). Each becomes an llguidance grammar (`shared.request_grammar`)
that is compiled against the model's tokenizer here, off the event loop, so an invalid or
unsupported schema is a 400 naming the problem, and a worker never meets a bad one.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from functools import partial
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark
from starlette.concurrency import run_in_threadpool
from transformers import PreTrainedTokenizerBase

from api.protocol.bodies import ChatCompletionRequest, CompletionRequest, StructuredOutputs
from api.protocol.errors import APIError
from api.protocol.tools.call_grammar import forced_calls
from shared import request_grammar

ANY_OBJECT: dict[str, Any] = {"type": "object"}
CHECKED_CACHE = 1024  # grammars known to pass

_views: weakref.WeakKeyDictionary[PreTrainedTokenizerBase, llguidance.LLTokenizer] = (
    weakref.WeakKeyDictionary())
_view_lock = asyncio.Lock()
_passed: OrderedDict[tuple[bytes, int], None] = OrderedDict()  # (grammar digest, id(view))
_passed_lock = threading.Lock()  # checks run in the thread pool


def requested(body: ChatCompletionRequest | CompletionRequest
              ) -> tuple[str, Callable[[], str]] | None:
    """The field that asks for a constraint and how to build its grammar, or None."""
    if isinstance(body, ChatCompletionRequest) and body.tools and body.calls_forced():
        tools, choice = body.tools, body.tool_choice
        return "tool_choice", lambda: forced_calls(tools, choice, body.parallel_tool_calls)
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        return "response_format", lambda: request_grammar.from_json_schema(ANY_OBJECT)
    if fmt is not None and fmt.json_schema is not None:
        schema, strict = fmt.json_schema.json_schema or ANY_OBJECT, fmt.json_schema.strict
        return "response_format", lambda: request_grammar.from_json_schema(
            request_grammar.closed(schema) if strict else schema)
    if body.structured_outputs is not None:
        so = body.structured_outputs
        return "structured_outputs", lambda: _structured(so)
    if body.guided_json is not None:
        guided_json = body.guided_json
        return "guided_json", lambda: request_grammar.from_json_schema(guided_json)
    if body.guided_regex is not None:
        regex = body.guided_regex
        return "guided_regex", lambda: request_grammar.from_regex(regex)
    if body.guided_choice is not None:
        choices = body.guided_choice
        return "guided_choice", lambda: request_grammar.from_choices(choices)
    if body.guided_grammar is not None:
        lark = body.guided_grammar
        return "guided_grammar", lambda: _lark(lark)
    return None


def _structured(so: StructuredOutputs) -> str:
    if so.json_ is not None:
        return request_grammar.from_json_schema(so.json_)
    if so.regex is not None:
        return request_grammar.from_regex(so.regex)
    if so.choice is not None:
        return request_grammar.from_choices(so.choice)
    if so.grammar is not None:
        return _lark(so.grammar)
    return request_grammar.from_json_schema(ANY_OBJECT)


def _lark(text: str) -> str:
    """vLLM takes Lark or GBNF (llama.cpp's `::=` rules); llguidance reads Lark."""
    if "::=" in text:
        try:
            text = gbnf_to_lark(text)
        except Exception as e:  # the converter's own parse error
            raise request_grammar.GrammarError(f"the GBNF grammar does not parse: {e}") from None
    return request_grammar.from_lark(text)


async def compile_constraint(body: ChatCompletionRequest | CompletionRequest,
                             tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The checked grammar for the request (None: unconstrained), or a 400 naming the field
    and the problem. Every tool's parameter schema is checked too, whatever `tool_choice`
    says, as OpenAI checks them."""
    tools = body.tools if isinstance(body, ChatCompletionRequest) else None
    for i, tool in enumerate(tools or ()):
        if tool.function.parameters is not None:
            await _checked(f"tools[{i}].function.parameters",
                           partial(request_grammar.from_json_schema, tool.function.parameters),
                           tokenizer)
    found = requested(body)
    if found is None:
        return None
    return await _checked(*found, tokenizer)


async def _checked(param: str, build: Callable[[], str],
                   tokenizer: PreTrainedTokenizerBase) -> str:
    try:
        text = build()
        await run_in_threadpool(_check, text, await _view(tokenizer))
    except request_grammar.GrammarError as e:
        raise APIError(400, f"{param}: {e}", param=param, code="invalid_grammar") from None
    return text


def _check(text: str, view: llguidance.LLTokenizer) -> None:
    """`request_grammar.check`, run once for a grammar that passes (a failure is not cached): an
    agent sends the same tools and schemas on every turn. Grammars are remembered by digest, so a
    client cannot fill the replica's memory with large ones."""
    key = (hashlib.sha256(text.encode()).digest(), id(view))
    with _passed_lock:
        if key in _passed:
            _passed.move_to_end(key)
            return
    request_grammar.check(text, view)
    with _passed_lock:
        _passed[key] = None
        if len(_passed) > CHECKED_CACHE:
            _passed.popitem(last=False)


async def _view(tokenizer: PreTrainedTokenizerBase) -> llguidance.LLTokenizer:
    """llguidance's view of the tokenizer, built once (it takes a fraction of a second)."""
    async with _view_lock:
        view = _views.get(tokenizer)
        if view is None:
            view = await run_in_threadpool(request_grammar.tokenizer_view, tokenizer)
            _views[tokenizer] = view
        return view
