"""Tool calling on the real SmolLM2, through the official client, as an agent loop uses it.

A forced call (a named function, or "required") comes back as OpenAI's `tool_calls` with
finish_reason "tool_calls" and arguments that satisfy the function's parameter schema, whole
or streamed (accumulated by index, as clients do); the call and its result, sent back as
history, reach the model, which then answers in words. `tool_choice` "none" hides the tools;
a choice that names no tool is refused. SmolLM2's chat template has no tool format, so the
tools are taught in the prompt: its token count shows they are there.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from api.protocol.tools.parse import ToolCallParser
from shared.models import ModelInfo

pytestmark = pytest.mark.smollm2
MODEL = "SmolLM2-135M-Instruct"

WEATHER: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    }, "required": ["city", "unit"]},
}}
CLOCK: dict[str, Any] = {"type": "function", "function": {
    "name": "get_time", "description": "Current local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]},
}}
TOOLS: Any = [WEATHER, CLOCK]
ASK: Any = [{"role": "user", "content": "What's the weather in Paris?"}]
BOTH: Any = [{"role": "user", "content": "What's the weather and the time in Tokyo?"}]
NAMED: Any = {"type": "function", "function": {"name": "get_weather"}}
RESULT = "22 degrees celsius, sunny"


@pytest.fixture(scope="module")
def client(smol_client: openai.OpenAI) -> openai.OpenAI:
    return smol_client  # this module's tests talk to the real model


def _checked(name: str, arguments: str) -> dict[str, Any]:
    """The call's arguments, held to its function's parameters (closed, as forced calls are)."""
    [tool] = [t for t in (WEATHER, CLOCK) if t["function"]["name"] == name]
    args = json.loads(arguments)
    jsonschema.validate(args, {**tool["function"]["parameters"], "additionalProperties": False})
    return args


def _streamed(client: openai.OpenAI, **body: Any) -> tuple[str, list[dict[str, Any]], str]:
    """Content, tool calls and finish_reason of a streamed reply, the calls accumulated from
    `delta.tool_calls` by index as OpenAI's clients do (a call may come in pieces)."""
    content, finish = "", ""
    calls: dict[int, dict[str, Any]] = {}
    for chunk in client.chat.completions.create(**body, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {
                    "id": "", "type": "function", "function": {"name": "", "arguments": ""}})
                call["id"] = delta.id or call["id"]
                if delta.function is not None:
                    call["function"]["name"] += delta.function.name or ""
                    call["function"]["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_named_call_round_trip_whole_and_streamed(client: openai.OpenAI,
                                                   smollm2: ModelInfo) -> None:
    body: dict[str, Any] = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                temperature=0, max_tokens=100)
    first = client.chat.completions.create(**body)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    _checked("get_weather", call.function.arguments)

    content, calls, finish = _streamed(client, **body)
    assert finish == "tool_calls" and content == ""
    [streamed_call] = calls
    assert streamed_call["id"].startswith("call_")
    # Greedy: the same call, streamed or whole.
    assert streamed_call["function"] == {"name": "get_weather",
                                         "arguments": call.function.arguments}

    # The agent runs the tool and sends the call and its result back.
    history = [*ASK, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    again: dict[str, Any] = dict(model=MODEL, messages=history, tools=TOOLS, tool_choice="auto",
                                 temperature=0, max_tokens=100)
    final = client.chat.completions.create(**again)
    assert final.choices[0].finish_reason == "stop"
    assert final.choices[0].message.tool_calls is None
    answer = final.choices[0].message.content or ""
    assert answer.strip()
    # The call and the result are in the prompt now.
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2.path))
    grown = final.usage.prompt_tokens - first.usage.prompt_tokens
    assert grown > first.usage.completion_tokens + len(tokenizer.encode(RESULT))

    # The same second turn streamed, the history built from the streamed call.
    streamed_history = [*ASK, {"role": "assistant", "content": None, "tool_calls": calls},
                        {"role": "tool", "tool_call_id": streamed_call["id"], "content": RESULT}]
    content, calls_after, finish = _streamed(client, **{**again, "messages": streamed_history})
    assert (content, calls_after, finish) == (answer, [], "stop")


def test_required_single_call_names_a_tool(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=BOTH, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, temperature=1.0, n=4, seed=1, max_tokens=100)
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        [call] = choice.message.tool_calls or []  # exactly one
        _checked(call.function.name, call.function.arguments)  # type: ignore[union-attr]


def test_required_parallel_calls_each_name_a_tool(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=BOTH, tools=TOOLS, tool_choice="required", temperature=1.0,
        n=2, seed=2, max_tokens=120)
    for choice in reply.choices:
        calls = choice.message.tool_calls or []
        assert calls, choice.message.content
        for call in calls:
            assert call.function.name in ("get_weather", "get_time")  # type: ignore[union-attr]
            _checked(call.function.name, call.function.arguments)  # type: ignore[union-attr]
        assert len({c.id for c in calls}) == len(calls)


def test_required_parallel_calls_end_cleanly(client: openai.OpenAI) -> None:
    """Greedy, the model answers "weather and time" with calls; the reply must end as a tool
    call reply (not run to max_tokens), and no half-written call shows as content."""
    reply = client.chat.completions.create(
        model=MODEL, messages=BOTH, tools=TOOLS, tool_choice="required", temperature=0,
        max_tokens=150)
    choice = reply.choices[0]
    assert choice.message.tool_calls
    assert "<tool_call>" not in (choice.message.content or ""), choice.message.content
    assert choice.finish_reason == "tool_calls", (
        f"{len(choice.message.tool_calls)} calls and still going at max_tokens")


def test_a_forced_call_cut_short_comes_back_as_a_call(client: openai.OpenAI) -> None:
    """max_tokens ends a named call inside its arguments: the reply is still that call (as
    OpenAI returns one cut short), its arguments the JSON text written so far, never the
    model's raw tags as content."""
    body: dict[str, Any] = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                temperature=0)
    whole = client.chat.completions.create(**body, max_tokens=100, logprobs=True)
    assert whole.choices[0].logprobs is not None
    tokens = [t.token for t in whole.choices[0].logprobs.content or []]
    written = "".join(tokens)
    key = written.index('"arguments"') + len('"arguments"')
    args_begun = next(n for n in range(len(tokens)) if len("".join(tokens[:n])) > key + 4)
    raw_arguments = written[key:].partition(":")[2]
    for stream in (False, True):
        if stream:
            content, calls, finish = _streamed(client, **body, max_tokens=args_begun)
            assert content == "", content
            [(name, arguments)] = [(c["function"]["name"], c["function"]["arguments"])
                                   for c in calls]
        else:
            [choice] = client.chat.completions.create(**body, max_tokens=args_begun).choices
            assert choice.message.content is None, choice.message.content
            finish = choice.finish_reason
            [call] = choice.message.tool_calls or []
            name, arguments = call.function.name, call.function.arguments  # type: ignore[union-attr]
        assert finish == "length" and name == "get_weather"
        assert arguments and raw_arguments.startswith(arguments), (arguments, raw_arguments)
        with pytest.raises(ValueError):
            json.loads(arguments)  # cut short, as finish_reason says


DEEP = "[" * 5000  # past Python's recursion limit for json


@pytest.mark.parametrize(("text", "calls"), [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',
     [("get_weather", '{"city": "Pa')]),
    ('<tool_call>\n{"name": "get_time", "argu', [("get_time", "")]),
    ('<tool_call>\n[{"name": "get_time", "arguments": {"city": "Oslo"}}, {"name": "get_time", '
     '"arguments": {"ci', [("get_time", '{"city": "Oslo"}'), ("get_time", '{"ci')]),
    ('<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}{"name": "get_t', []),
    ('<tool_call>\n{"name": "get_time", "description', []),
    ('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool_call>{"na',
     [("get_time", "{}")]),
    (f'<tool_call>\n{{"name": "get_time", "arguments": {DEEP}', [("get_time", DEEP)]),
    (f"<tool_call>{DEEP}</tool_call><tool_call>{DEEP}", []),
])
@pytest.mark.parametrize("cut_short", [True, False])
def test_what_a_call_left_open_becomes(text: str, calls: list[tuple[str, str]],
                                       cut_short: bool) -> None:
    """Cut short by max_tokens, a call is a call once its name is whole (a list's whole
    calls before it too); when it is not a call's shape, the text stays content. Ended any
    other way (a stop string, the model's own end), an open call that does not parse is
    content. Beside a whole call it is dropped. Nesting too deep for Python's json is not
    JSON, never an error."""
    parser = ToolCallParser("req")
    content, made = parser.feed(text)
    rest, more = parser.flush(cut_short)
    whole = [(c.name, c.arguments) for c in made]
    if not cut_short and not whole:
        calls = []
    assert whole + [(c.name, c.arguments) for c in more] == calls
    assert content + rest == ("" if calls else text)


@pytest.mark.parametrize("text", [
    "<", "<tool_", "Sure. <tool_call", "<tool_call>", "<tool_call>\n", '<tool_call>\n{"na',
    '<tool_call>\n{"name": "get_we',
    '<tool_call>\n{"name": "a\\', '<tool_call>\n[{"name": "get_', "<tool_call>" + " " * 100_000,
])
@pytest.mark.parametrize("cut_short", [True, False])
def test_a_call_cut_before_its_name_is_whole_is_neither_call_nor_content(
        text: str, cut_short: bool) -> None:
    """max_tokens cut a call before its name was whole, or inside its opening tag: there is
    no call to name, and its syntax is not words for the user (what a forced call cut after a
    few tokens wrote); words before it stay. Ended any other way, the text stays content."""
    parser = ToolCallParser("req")
    content, made = parser.feed(text)
    rest, more = parser.flush(cut_short)
    assert made == more == []
    assert content + rest == (text.partition("<")[0] if cut_short else text)


@pytest.mark.parametrize("cut_short", [True, False])
def test_a_lone_angle_bracket_after_words_stays_text(cut_short: bool) -> None:
    """A reply cut right after a `<` that follows words ("if a <") keeps it: more likely text
    than a tag begun (a longer start of the tag, `<tool`, is syntax and dropped)."""
    parser = ToolCallParser("req")
    content, made = parser.feed("if a <")
    rest, more = parser.flush(cut_short)
    assert content + rest == "if a <" and made == more == []


@pytest.mark.parametrize("text", [
    "<", "<tool_", "<tool_call>", '<tool_call>\n{"na', '<tool_call>\n{"name": "get_we',
    '<tool_call>\n[{"name": "get_', "<tool_call>" + " " * 100_000,
])
def test_a_forced_call_cut_before_its_name_is_whole_is_the_forced_function(text: str) -> None:
    """When the request forced one function, a call max_tokens cut before its name was whole
    can only be that function's: it comes back with empty arguments. Ended any other way, its
    syntax is still content; beside a call already made, it adds none."""
    parser = ToolCallParser("req", forced="get_time")
    content, made = parser.feed(text)
    rest, more = parser.flush(cut_short=True)
    assert content + rest == "" and made == []
    assert [(c.name, c.arguments) for c in more] == [("get_time", "")]
    ended = ToolCallParser("req", forced="get_time")
    assert ended.feed(text)[0] + ended.flush()[0] == text and ended.made == 0
    after = ToolCallParser("req", forced="get_time")
    content, made = after.feed('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
                               + text)
    assert after.flush(cut_short=True) == ("", []) and len(made) == 1


def test_history_with_arguments_nested_too_deep_is_served(client: openai.OpenAI) -> None:
    """A client's past call whose arguments nest past what Python's json decodes goes into
    the prompt as the text it is (not a server error)."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": DEEP}}
    reply = client.chat.completions.create(
        model=MODEL, tools=TOOLS, max_tokens=1, extra_body={"ignore_eos": True}, messages=[
            *ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": RESULT}])
    assert reply.choices[0].finish_reason == "length"


TWO_CALLS = ('<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {"city": "Rome"}}\n</tool_call>')


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("parallel", [True, False])
def test_parallel_tool_calls_false_keeps_one_call(client: openai.OpenAI, parallel: bool,
                                                  stream: bool) -> None:
    # The model made to write two calls (a choice of one text) while left free to call.
    body: dict[str, Any] = dict(
        model=MODEL, messages=BOTH, tools=TOOLS, tool_choice="auto", max_tokens=80,
        parallel_tool_calls=parallel, extra_body={"guided_choice": [TWO_CALLS]})
    if stream:
        calls: list[Any] = []
        finish = None
        for chunk in client.chat.completions.create(**body, stream=True):
            for choice in chunk.choices:
                calls += choice.delta.tool_calls or []
                assert not (choice.delta.content or "").strip(), choice.delta.content
                finish = choice.finish_reason or finish
    else:
        [choice] = client.chat.completions.create(**body).choices
        calls, finish = choice.message.tool_calls or [], choice.finish_reason
        assert choice.message.content is None
    cities = [json.loads(c.function.arguments)["city"] for c in calls]
    assert cities == (["Oslo", "Rome"] if parallel else ["Oslo"]) and finish == "tool_calls"


def test_tool_choice_none_hides_the_tools(client: openai.OpenAI) -> None:
    body: dict[str, Any] = dict(model=MODEL, messages=ASK, temperature=0, max_tokens=30)
    plain = client.chat.completions.create(**body)
    hidden = client.chat.completions.create(**body, tools=TOOLS, tool_choice="none")
    assert hidden.choices[0].message.tool_calls is None
    assert hidden.choices[0].finish_reason in ("stop", "length")
    assert (hidden.choices[0].message.content or "").strip()
    # "none": the model is not shown the tools, so it sees what it sees without them.
    assert hidden.usage.prompt_tokens == plain.usage.prompt_tokens
    assert hidden.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize(("fields", "code", "param"), [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "invalid_value", "tool_choice"),
    ({"tool_choice": "required"}, "invalid_value", "tool_choice"),
    ({"tool_choice": NAMED}, "invalid_value", "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "broken", "parameters": {
        "type": "object", "properties": {"a": {"type": "objekt"}}}}}],
      "tool_choice": "required"}, "invalid_grammar", "tools[0].function.parameters"),
], ids=["missing-function", "required-without-tools", "named-without-tools", "bad-parameters"])
def test_impossible_tool_choice_is_refused(client: openai.OpenAI, fields: dict[str, Any],
                                           code: str, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, **fields)
    error: Any = refused.value.body
    assert refused.value.status_code == 400
    assert error["code"] == code and error["param"] == param, error
    assert "tool_choice" in error["message"] or "objekt" in error["message"], error
    assert "x-guidance" not in error["message"], error  # not redserve's own grammar


def test_prompt_teaches_the_tools(client: openai.OpenAI, smollm2: ModelInfo) -> None:
    """SmolLM2's template has no tool format: the tools are written into the prompt, each
    function's signature in full."""
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2.path))

    def prompt_tokens(**extra: Any) -> int:
        reply = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1, **extra)
        assert reply.usage is not None
        return reply.usage.prompt_tokens

    none, one, two = prompt_tokens(), prompt_tokens(tools=[WEATHER]), prompt_tokens(tools=TOOLS)
    assert one - none > len(tokenizer.encode(json.dumps(WEATHER)))
    assert two - one >= len(tokenizer.encode(json.dumps(CLOCK)))
