"""The conversation as the chat template receives it, tools included.

A template with a tool format of its own (it reads `tools`) gets the tools and the history in
the form Hugging Face templates expect: an assistant turn's `tool_calls` with their arguments
as objects, a tool turn as role "tool". A template without one (SmolLM2's, like most small
models') would drop them silently, so redserve teaches the tool-call syntax
(`api.protocol.tools.syntax`) in the system message instead, writes earlier calls into the assistant
turns in that syntax, and hands results back as `<tool_response>` user turns.
"""

from __future__ import annotations

import json
from typing import Any

from transformers import PreTrainedTokenizerBase

from api.protocol.fields import AssistantMessage, ChatMessage, Tool, ToolCall, ToolMessage
from api.protocol.tools.parse import NOT_JSON
from api.protocol.tools.syntax import END, RESULT_END, RESULT_START, START

Turn = dict[str, Any]


def native_tools(tokenizer: PreTrainedTokenizerBase) -> bool:
    template = tokenizer.chat_template
    return isinstance(template, str) and "tools" in template


def conversation(messages: list[ChatMessage], tools: list[Tool] | None,
                 native: bool) -> tuple[list[Turn], list[Turn] | None]:
    """The turns to render and, for a template with its own tool format, the tools."""
    if native:
        return [_native(m) for m in messages], [t.model_dump(exclude_defaults=True)
                                                 for t in tools] if tools else None
    turns: list[Turn] = []
    for m in messages:
        if isinstance(m, ToolMessage):
            result = f"{RESULT_START}\n{m.text()}\n{RESULT_END}"
            if turns and turns[-1].get("tool_results"):
                turns[-1]["content"] += "\n" + result
            else:
                turns.append({"role": "user", "content": result, "tool_results": True})
            continue
        text = m.text()
        if isinstance(m, AssistantMessage) and m.tool_calls:
            calls = "\n".join(_written(c) for c in m.tool_calls)
            text = f"{text}\n{calls}" if text else calls
        turns.append({"role": m.role, "content": text})
    for turn in turns:
        turn.pop("tool_results", None)
    if tools:
        _teach(turns, tools)
    return turns, None


def _arguments(call: ToolCall) -> Any:
    try:
        return json.loads(call.function.arguments)
    except NOT_JSON:
        return call.function.arguments


def _native(m: ChatMessage) -> Turn:
    turn: Turn = {"role": m.role, "content": m.text()}
    if isinstance(m, AssistantMessage) and m.tool_calls:
        turn["tool_calls"] = [{"id": c.id, "type": "function",
                               "function": {"name": c.function.name,
                                            "arguments": _arguments(c)}}
                              for c in m.tool_calls]
    if isinstance(m, ToolMessage):
        turn["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        turn["name"] = m.name
    return turn


def _written(call: ToolCall) -> str:
    body = json.dumps({"name": call.function.name, "arguments": _arguments(call)},
                      ensure_ascii=False)
    return f"{START}\n{body}\n{END}"


def _teach(turns: list[Turn], tools: list[Tool]) -> None:
    listing = "\n".join(json.dumps(t.model_dump(exclude_defaults=True), ensure_ascii=False)
                        for t in tools)
    lesson = (
        "You may call functions to help answer. The functions, as JSON signatures:\n"
        f"<tools>\n{listing}\n</tools>\n"
        "To call one, reply with its name and arguments as a JSON object between tags, one "
        f"block per call:\n{START}\n"
        '{"name": "<function name>", "arguments": {<arguments as JSON>}}\n'
        f"{END}\n"
        f"Each function's result comes back between {RESULT_START} tags."
    )
    if turns and turns[0]["role"] in ("system", "developer"):
        turns[0]["content"] = f"{turns[0]['content']}\n\n{lesson}"
    else:
        turns.insert(0, {"role": "system", "content": lesson})
