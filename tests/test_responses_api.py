"""The Responses API (`/v1/responses`) through the official `openai` client, against two real
API replicas, a worker and Redis: plain, streamed, structured and tool-calling responses, their
stored copies read, listed and deleted from the other replica, a `previous_response_id` chain
whose turns alternate replicas (the conversation lives in Redis only), tenant isolation, and
bad input refused naming its field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import orjson
import pytest

from api.protocol.tools.syntax import START
from tests.responses_stack import MODEL, client, two_replicas
from tests.stack import Stack

KEYS = {"REDSERVE_API_KEYS": "owner:sk-responses-owner,stranger:sk-responses-stranger",
        # A stream whose client left runs on this long, for a resume on any replica.
        "REDSERVE_RESUME_GRACE_S": "20",
        # What the tests store outlives them by no more than this.
        "REDSERVE_RESPONSE_TTL_S": "600"}
LOGPROBS: Any = "message.output_text.logprobs"
AUTH = {"Authorization": "Bearer sk-responses-owner"}
OWNER, STRANGER = "sk-responses-owner", "sk-responses-stranger"
# Finite by construction, whatever the random model picks (as in tests/test_structured.py).
BOUNDED: dict[str, Any] = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
    "required": ["color", "ok"], "additionalProperties": False,
}
WEATHER: Any = {"type": "function", "name": "get_weather", "description": "Weather in a city",
                "parameters": {"type": "object", "properties": {
                    "city": {"enum": ["Paris", "Tokyo"]}}, "required": ["city"],
                    "additionalProperties": False}}


@pytest.fixture(scope="module")
def stack(redis_url: str, tiny_model: Path) -> Iterator[Stack]:
    with two_replicas(redis_url, tiny_model, KEYS) as stack:
        yield stack


@pytest.fixture(scope="module")
def one(stack: Stack) -> openai.OpenAI:
    return client(stack, 0, OWNER)


@pytest.fixture(scope="module")
def two(stack: Stack) -> openai.OpenAI:
    return client(stack, 1, OWNER)


def _tokens(stack: Stack, messages: list[dict[str, str]]) -> int:
    reply = httpx.post(f"{stack.url(0)}/tokenize", json={"model": MODEL, "messages": messages},
                       headers={"Authorization": f"Bearer {OWNER}"}, timeout=30)
    assert reply.status_code == 200, reply.text
    count: int = reply.json()["count"]
    return count


def _accepted(stack: Stack) -> dict[str, float]:
    """Replica 0's count of accepted requests, by endpoint."""
    samples = stack.metrics(f"{stack.url(0)}/metrics")
    return {e: samples.get(f'redserve_api_requests_total{{endpoint="{e}",model="{MODEL}"}}', 0)
            for e in ("chat", "completions", "responses")}


def test_plain_response_is_the_chat_reply(one: openai.OpenAI, two: openai.OpenAI,
                                          stack: Stack) -> None:
    before = _accepted(stack)
    r = one.responses.create(model=MODEL, input="Hello there", instructions="Be brief.",
                             max_output_tokens=12, temperature=0, metadata={"k": "v"})
    assert r.id.startswith("resp_") and r.object == "response"
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    [message] = r.output
    assert message.type == "message" and message.role == "assistant"
    assert r.usage is not None and r.usage.output_tokens == 12
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hello there"}]
    assert r.usage.input_tokens == _tokens(stack, messages)
    # The same generation path: greedy, the chat route writes the same text.
    chat = one.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                       max_tokens=12, temperature=0)
    assert r.output_text == chat.choices[0].message.content
    # Counted apart in the metrics, by endpoint.
    after = _accepted(stack)
    assert {e: after[e] - before[e] for e in after} == {"chat": 1, "completions": 0,
                                                        "responses": 1}
    # Stored, and read back on the other replica exactly as it was answered.
    again = two.responses.retrieve(r.id)
    assert again.model_dump() == r.model_dump()
    assert again.metadata == {"k": "v"}


def test_streamed_response_events(one: openai.OpenAI) -> None:
    body: Any = dict(model=MODEL, input="Tell me a story", max_output_tokens=10,
                     temperature=0)
    events = list(one.responses.create(**body, stream=True))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    final = events[-1].response  # type: ignore[union-attr]
    assert deltas == done.text == final.output_text  # type: ignore[union-attr]
    assert final.usage is not None and final.usage.output_tokens == 10
    assert final.output_text == one.responses.create(**body, store=False).output_text


def test_json_schema_output_follows_the_schema(one: openai.OpenAI) -> None:
    r = one.responses.create(model=MODEL, input="A color, please", temperature=1.0,
                             max_output_tokens=200, text={"format": {
                                 "type": "json_schema", "name": "color", "schema": BOUNDED,
                                 "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), BOUNDED)
    assert r.text is not None and r.text.format is not None
    assert r.text.format.type == "json_schema"


def test_function_call_and_its_output_fed_back(one: openai.OpenAI, two: openai.OpenAI) -> None:
    first = one.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER],
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 temperature=0, max_output_tokens=60)
    assert first.status == "completed"
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments)["city"] in ("Paris", "Tokyo")
    # The streamed call is the same call, its arguments in the delta and the done event.
    events = list(one.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER],
                                       tool_choice={"type": "function", "name": "get_weather"},
                                       temperature=0, max_output_tokens=60, stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [call.arguments]  # type: ignore[union-attr]
    # The output fed back on the other replica, by reference and by value.
    result: Any = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    chained = two.responses.create(model=MODEL, previous_response_id=first.id, input=[result],
                                   tools=[WEATHER], max_output_tokens=8, temperature=0)
    by_value = two.responses.create(
        model=MODEL, store=False, tools=[WEATHER], max_output_tokens=8, temperature=0,
        input=[{"role": "user", "content": "Weather in Paris?"},
               call.model_dump(exclude_none=True), result])  # type: ignore[list-item]
    assert chained.usage is not None and by_value.usage is not None
    assert chained.usage.input_tokens == by_value.usage.input_tokens
    assert chained.output_text == by_value.output_text
    items = two.responses.input_items.list(chained.id, order="asc").data
    assert [i.type for i in items] == ["message", "function_call", "function_call_output"]


def test_a_forced_call_cut_inside_its_name_is_that_call(one: openai.OpenAI) -> None:
    """max_output_tokens ends a forced call before its name is whole: the call can only be the
    forced function's, and comes back as it with empty arguments (its syntax is no text for
    the user); the response, and chat's reply, alike."""
    named: Any = {"type": "function", "name": "get_weather"}
    chat_tool = {"type": "function", "function": {k: WEATHER[k] for k in (
        "name", "description", "parameters")}}
    body: Any = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                     tools=[chat_tool], temperature=0,
                     tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = one.chat.completions.create(**body, max_tokens=60, logprobs=True).choices[0]
    assert whole.logprobs is not None
    tokens = [t.token for t in whole.logprobs.content or []]
    quote = "".join(tokens).index('"get_weather"')
    cut = next(n for n in range(len(tokens)) if len("".join(tokens[:n])) > quote + 1)
    assert '"get_weather"' not in "".join(tokens[:cut])  # inside the name
    assert START.startswith("".join(tokens[:2])) and "".join(tokens[:2]) != START
    for most in (2, cut):  # inside the opening tag `<tool_call>`, inside the name
        for choice in ("required", body["tool_choice"]):  # one tool: either forces it
            chat = one.chat.completions.create(**{**body, "tool_choice": choice},
                                               max_tokens=most).choices[0]
            assert chat.finish_reason == "length" and not chat.message.content
            [call] = chat.message.tool_calls or []
            assert (call.function.name, call.function.arguments) == ("get_weather", "")
    for stream in (False, True):
        kwargs: Any = dict(model=MODEL, input="Weather in Paris?", tools=[WEATHER],
                           tool_choice=named, temperature=0, max_output_tokens=cut)
        events: Any = list(one.responses.create(**kwargs, stream=True)) if stream else None
        r = events[-1].response if stream else one.responses.create(**kwargs)
        assert r.status == "incomplete" and r.usage is not None
        assert r.usage.output_tokens == cut
        [call] = [i for i in r.output if i.type == "function_call"]
        assert (call.name, call.arguments) == ("get_weather", "")
        assert r.output_text == "", r.output


def test_chain_of_three_turns_across_replicas(stack: Stack, one: openai.OpenAI,
                                              two: openai.OpenAI) -> None:
    common: Any = dict(model=MODEL, max_output_tokens=6, temperature=0)
    t1 = one.responses.create(input="First question", **common)
    t2 = two.responses.create(input="Second question", previous_response_id=t1.id, **common)
    t3 = one.responses.create(input="Third question", previous_response_id=t2.id, **common)
    history = [{"role": "user", "content": "First question"},
               {"role": "assistant", "content": t1.output_text},
               {"role": "user", "content": "Second question"},
               {"role": "assistant", "content": t2.output_text},
               {"role": "user", "content": "Third question"}]
    assert t3.usage is not None and t3.usage.input_tokens == _tokens(stack, history)
    assert t3.previous_response_id == t2.id
    listed = two.responses.input_items.list(t3.id, order="asc", limit=100).data
    assert [(i.type, getattr(i, "role", None)) for i in listed] == [
        ("message", "user"), ("message", "assistant"), ("message", "user"),
        ("message", "assistant"), ("message", "user")]
    newest = one.responses.input_items.list(t3.id, limit=2)
    assert [i.id for i in newest.data] == [listed[-1].id, listed[-2].id] and newest.has_more
    # The conversation outlives a deleted earlier turn (each stores its own).
    two.responses.delete(t1.id)
    with pytest.raises(openai.NotFoundError):
        one.responses.retrieve(t1.id)
    t4 = two.responses.create(input="Fourth", previous_response_id=t3.id, **common)
    assert t4.usage is not None and t4.usage.input_tokens > t3.usage.input_tokens


def test_another_tenant_cannot_see_a_stored_response(stack: Stack, one: openai.OpenAI) -> None:
    r = one.responses.create(model=MODEL, input="private", max_output_tokens=3)
    stranger = client(stack, 1, STRANGER)
    with pytest.raises(openai.NotFoundError):
        stranger.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        stranger.responses.input_items.list(r.id)
    with pytest.raises(openai.NotFoundError):
        stranger.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError) as chained:
        stranger.responses.create(model=MODEL, input="x", previous_response_id=r.id)
    assert chained.value.body["param"] == "previous_response_id"  # type: ignore[index]
    streamed = stranger.responses.create(model=MODEL, input="x", max_output_tokens=2,
                                         stream=True)
    streamed_id = next(e.response.id for e in streamed if e.type == "response.created")
    with pytest.raises(openai.NotFoundError) as resumed:  # another's stream, asked to resume
        one.responses.retrieve(streamed_id, stream=True, starting_after=0)
    assert resumed.value.body["param"] == "response_id"  # type: ignore[index]
    assert one.responses.retrieve(r.id).id == r.id  # still there for its owner
    unstored = one.responses.create(model=MODEL, input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        one.responses.retrieve(unstored.id)


def _sse(lines: Iterator[str]) -> Iterator[tuple[str, int, dict[str, Any]]]:
    """(event, id, data) of each SSE event."""
    event, event_id = "", -1
    for line in lines:
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("id: "):
            event_id = int(line[4:])
        elif line.startswith("data: "):
            yield event, event_id, orjson.loads(line[6:])


def _replay(stack: Stack, replica: int, response_id: str, after: int
            ) -> list[tuple[str, int, dict[str, Any]]]:
    with httpx.stream("GET", f"{stack.url(replica)}/v1/responses/{response_id}", headers=AUTH,
                      params={"stream": "true", "starting_after": after},
                      timeout=60) as reply:
        assert reply.status_code == 200, reply.read()
        return list(_sse(reply.iter_lines()))


def test_a_cut_stream_resumes_on_the_other_replica(stack: Stack, two: openai.OpenAI) -> None:
    body = {"model": MODEL, "input": "Go on", "max_output_tokens": 40, "temperature": 0,
            "stream": True}
    seen: list[tuple[str, int, dict[str, Any]]] = []
    with httpx.stream("POST", f"{stack.url(0)}/v1/responses", json=body, headers=AUTH,
                      timeout=60) as reply:
        assert reply.status_code == 200
        for event in _sse(reply.iter_lines()):
            seen.append(event)
            if len(seen) == 8:
                break  # the client's connection drops mid-stream
    assert [n for _, n, _ in seen] == list(range(8))
    response_id = seen[0][2]["response"]["id"]
    rest = _replay(stack, 1, response_id, 7)
    assert [n for _, n, _ in rest] == list(range(8, 8 + len(rest)))
    assert [e for e, _, data in rest] == [data["type"] for _, _, data in rest]
    final = rest[-1][2]["response"]
    deltas = "".join(d["delta"] for _, _, d in seen + rest
                     if d["type"] == "response.output_text.delta")
    assert final["status"] == "incomplete" and deltas == final["output"][0]["content"][0]["text"]
    # Stored by the replica that served the first part (or by the replay: the same copy).
    stored = httpx.get(f"{stack.url(1)}/v1/responses/{response_id}", headers=AUTH)
    assert stored.json() == final and two.responses.retrieve(response_id).id == response_id
    # A finished stream replays whole, identical, from either replica.
    whole = _replay(stack, 0, response_id, -1)
    assert whole[8:] == rest and [d for _, _, d in whole[:8]] == [d for _, _, d in seen]
    assert _replay(stack, 1, response_id, len(whole) - 1) == []
    # Not as chat chunks: the request's own resume route points to this one.
    as_chat = httpx.get(f"{stack.url(1)}/v1/requests/{response_id[5:]}/stream", headers=AUTH)
    assert as_chat.status_code == 400 and "?stream=true" in as_chat.json()["error"]["message"]
    plain = two.responses.create(model=MODEL, input="x", max_output_tokens=2)
    refused = httpx.get(f"{stack.url(0)}/v1/responses/{plain.id}", headers=AUTH,
                        params={"stream": "true"})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "not_resumable"


def test_output_text_logprobs_are_chats_items(one: openai.OpenAI, two: openai.OpenAI) -> None:
    """With `include` naming them, each text delta carries its tokens' logprobs, as chat's
    items, and the part (streamed, whole and stored alike) all of them; without, none."""
    asked: Any = {"model": MODEL, "input": "Hello there", "max_output_tokens": 8,
                  "temperature": 0, "top_logprobs": 2}
    chat = one.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello there"}], max_tokens=8,
        temperature=0, logprobs=True, top_logprobs=2)
    assert chat.choices[0].logprobs is not None and chat.choices[0].logprobs.content
    expected = [t.model_dump() for t in chat.choices[0].logprobs.content]
    assert all(len(t["top_logprobs"]) == 2 for t in expected)

    def same(items: list[Any]) -> None:
        got = [i if isinstance(i, dict) else i.model_dump() for i in items]
        assert [g["token"] for g in got] == [e["token"] for e in expected]
        assert [g["bytes"] for g in got] == [e["bytes"] for e in expected]
        for g, e in zip(got, expected, strict=True):
            assert g["logprob"] == pytest.approx(e["logprob"], abs=1e-3)
            assert [t["token"] for t in g["top_logprobs"]] == [
                t["token"] for t in e["top_logprobs"]]

    whole = one.responses.create(**asked, include=[LOGPROBS])
    [message] = whole.output
    assert message.type == "message" and message.content[0].type == "output_text"
    assert message.content[0].text == chat.choices[0].message.content
    same(message.content[0].logprobs or [])
    stored = two.responses.retrieve(whole.id).output[0]
    assert stored.type == "message" and stored.content[0].type == "output_text"
    same(stored.content[0].logprobs or [])
    # A follow-up's history holds the earlier text, not its logprobs.
    follow = two.responses.create(model=MODEL, input="And?", max_output_tokens=2,
                                  previous_response_id=whole.id)
    earlier: Any = two.responses.input_items.list(follow.id, order="asc").data[1]
    assert earlier.content[0].text == message.content[0].text
    assert earlier.content[0].logprobs == []

    events: list[Any] = list(one.responses.create(**asked, include=[LOGPROBS], stream=True))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas and all(d.logprobs for d in deltas)
    same([item for d in deltas for item in d.logprobs])
    [done] = [e for e in events if e.type == "response.output_text.done"]
    same(done.logprobs or [])
    ended = events[-1]  # incomplete, at max_output_tokens
    assert ended.type == f"response.{whole.status}" and ended.response.status == whole.status
    part = ended.response.output[0]
    assert part.type == "message" and part.content[0].type == "output_text"
    same(part.content[0].logprobs or [])

    plain: Any = one.responses.create(**asked).output[0]  # top_logprobs alone: none, as OpenAI
    assert plain.type == "message" and plain.content[0].type == "output_text"
    assert plain.content[0].logprobs == []


@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools[0].type"),
    ({"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "what is this?"},
        {"type": "input_image", "image_url": "https://example.com/a.png"}]}]},
     "input[0].content[1].type"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"background": True, "store": False}, "store"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"include": [LOGPROBS, "reasoning.encrypted_content"]}, "include"),
    ({"include": [LOGPROBS], "top_logprobs": 21}, "top_logprobs"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "schema": BOUNDED}}}, "text.format"),
    ({"max_output_tokens": 100_000}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"frobnicate": 1}, "frobnicate"),
])
def test_bad_input_is_refused_naming_the_field(one: openai.OpenAI, extra: dict[str, Any],
                                               param: str) -> None:
    body: Any = {"model": MODEL, "input": "hi", **extra}
    with pytest.raises(openai.BadRequestError) as refused:
        one.post("/responses", body=body, cast_to=httpx.Response)
    assert refused.value.body["param"] == param  # type: ignore[index]


def test_unknown_ids_are_not_found(one: openai.OpenAI) -> None:
    for bad in ("resp_nope", "resp_00000000-000000000000000000000000", "x" * 300):
        with pytest.raises(openai.NotFoundError):
            one.responses.retrieve(bad)
    with pytest.raises(openai.NotFoundError) as chained:
        one.responses.create(model=MODEL, input="x", previous_response_id="resp_nope")
    assert chained.value.body["param"] == "previous_response_id"  # type: ignore[index]
