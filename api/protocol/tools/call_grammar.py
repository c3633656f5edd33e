"""The grammar of forced tool calls: with `tool_choice` "required" or a named function, the
output is one call (several with `parallel_tool_calls`) in the tool-call syntax, whose
arguments follow the function's parameter schema, so it always parses."""

from __future__ import annotations

import json
from typing import Any

from api.protocol.fields import NamedToolChoice, Tool, ToolChoice
from api.protocol.tools.syntax import END, START
from shared import request_grammar


def _arguments(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """The parameter schema, each of its objects closed to undeclared properties unless it
    says otherwise (`request_grammar.closed`): what OpenAI's strict mode requires, and what keeps a
    small model from inventing arguments until max_tokens cuts the call short."""
    schema: dict[str, Any] = request_grammar.closed(
        parameters or {"type": "object", "properties": {}})
    return schema


def call_schema(tool: Tool) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name},
                       "arguments": _arguments(tool.function.parameters)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def forced_calls(tools: list[Tool], choice: ToolChoice | None, parallel: bool) -> str:
    """A named function: exactly one call. `required`: one call, or with `parallel` up to one
    per tool (a model left free to go on may repeat its calls until max_tokens)."""
    if isinstance(choice, NamedToolChoice):
        tools = [t for t in tools if t.function.name == choice.function.name]
        parallel = False
    defs: dict[str, Any] = {}
    schemas = []
    for tool in tools:
        schema = call_schema(tool)
        # References such as "#/$defs/Pet" (what pydantic writes) point at the root: the
        # definitions move there from under "arguments".
        for key in ("$defs", "definitions"):
            defs.update(schema["properties"]["arguments"].pop(key, {}) or {})
        schemas.append(schema)
    root: dict[str, Any] = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    if defs:
        root["$defs"] = defs
    root["x-guidance"] = dict(request_grammar.JSON_OPTIONS)
    call = f"{json.dumps(START + chr(10))} %json {json.dumps(root)} {json.dumps(chr(10) + END)}"
    most = len(tools) if parallel else 1
    start = " | ".join(" \"\\n\" ".join(["call"] * k) for k in range(1, most + 1))
    return request_grammar.from_lark(f"start: {start}\ncall: {call}\n")
