"""A Responses API conversation as items, and as the chat body the generation path runs.

A conversation is a list of items in one normal form (what `input_items` lists and what is
stored): messages with typed parts, function calls and their outputs, each with an id. A
request's input is put in that form (`input_items`), appended to the stored conversation of
its `previous_response_id` (that response's input, then its output), and the whole becomes one
chat body (`chat_body`): instructions as the system message, function calls as an assistant
turn's `tool_calls`, their outputs as tool turns. So a follow-up renders the same prompt as the
turn before it plus the new turn, whichever replica serves it, and the prefix cache and
placement find it.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from api.protocol.bodies import ChatCompletionRequest
from api.protocol.errors import APIError
from api.protocol.responses_body import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ResponsesRequest,
)

Item = dict[str, Any]
# A chat check's field, as the Responses body names it.
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens",
           "max_completion_tokens": "max_output_tokens", "response_format": "text.format"}


def input_items(body: ResponsesRequest, response_id: str) -> list[Item]:
    """The request's input in normal form; an item without an id gets one derived from the
    response's (`<kind>_<response id>_<n>`)."""
    out = []
    for n, item in enumerate(body.items()):
        fallback = f"{_ID_PREFIX[item.type]}_{response_id}_{n}"
        out.append(_normal(item, item.id or fallback))
    return out


_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


def _normal(item: MessageItem | FunctionCallItem | FunctionCallOutputItem, item_id: str) -> Item:
    if isinstance(item, MessageItem):
        part = "output_text" if item.role == "assistant" else "input_text"
        parts = ([{"type": part, "text": item.content}] if isinstance(item.content, str)
                 else [p.model_dump(exclude_none=True) for p in item.content])
        return {"id": item_id, "type": "message", "role": item.role, "status": "completed",
                "content": parts}
    if isinstance(item, FunctionCallItem):
        return {"id": item_id, "type": "function_call", "call_id": item.call_id,
                "name": item.name, "arguments": item.arguments, "status": "completed"}
    return {"id": item_id, "type": "function_call_output", "call_id": item.call_id,
            "output": item.text(), "status": "completed"}


def chat_body(body: ResponsesRequest, items: list[Item], stream: bool) -> ChatCompletionRequest:
    """The chat body that generates the reply to `items` as `body` asks."""
    messages: list[dict[str, Any]] = []
    if body.instructions is not None:
        messages.append({"role": "system", "content": body.instructions})
    messages += chat_messages(items)
    tools = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
             for t in body.tools or ()]
    choice = body.tool_choice
    # A forced call (tool_choice required or a named function) leaves no text for `text.format`
    # to shape, so only the call's grammar applies. OpenAI accepts the two together, and the
    # Agents SDK sends both on every turn of an agent with tools and an `output_type`.
    forced = bool(tools) and choice not in ("none", "auto")
    fields: dict[str, Any] = {
        "model": body.model, "messages": messages, "temperature": body.temperature,
        "top_p": body.top_p, "stream": stream, "parallel_tool_calls": body.parallel_tool_calls,
        "max_completion_tokens": body.max_output_tokens, "user": body.user,
        "response_format": None if forced else body.text.format.as_chat(),
        "tools": tools or None, "logprobs": body.logprobs() is not None,
        "top_logprobs": body.logprobs(),
        "tool_choice": (None if not tools else choice if isinstance(choice, str)
                        else {"type": "function", "function": {"name": choice.name}}),
    }
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        error = e.errors()[0]
        where = ".".join(str(p) for p in error["loc"]) or "input"
        raise APIError(400, f"{where}: {error['msg']}", param=_PARAMS.get(where, "input"),
                       code="invalid_value") from None


def chat_messages(items: list[Item]) -> list[dict[str, Any]]:
    """Items as chat turns: consecutive calls join one assistant turn (with the text the
    model wrote before them)."""
    messages: list[dict[str, Any]] = []
    for item in items:
        kind = item["type"]
        if kind == "message":
            text = "".join(p["text"] for p in item["content"])
            messages.append({"role": item["role"], "content": text})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": item["output"]})
    return messages


def renamed(error: APIError) -> APIError:
    """A chat check's error, naming the Responses field."""
    if error.param in _PARAMS:
        error.param = _PARAMS[error.param]
        error.message = error.message.replace("max_tokens", "max_output_tokens")
    elif error.param and error.param.startswith("tools[") and ".function." in error.param:
        error.message = error.message.replace(".function.", ".")
        error.param = error.param.replace(".function.", ".")
    return error
