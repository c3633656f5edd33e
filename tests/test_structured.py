"""Constrained decoding end to end, through the official client: what a constraint promises
(output that parses, that matches the regex, that is one of the choices) holds for every
choice of a batch, streamed or not, beside logprobs and stop strings (a bad constraint's
refusal: tests/test_structured_refusals.py); OpenAI's no-op fields change nothing;
`min_tokens` and `skip_special_tokens` do what vLLM's do.

The real SmolLM2 shows that sampled (temperature 1.0) structured replies parse and validate
every time; the tiny random model, whose free text is gibberish, shows that the grammar alone
shapes its output, so anything it writes under a constraint obeys the constraint.
"""

from __future__ import annotations

import asyncio
import enum
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import llguidance
import openai
import pytest
from pydantic import BaseModel
from transformers import AutoTokenizer

from api.protocol.bodies import ChatCompletionRequest
from api.protocol.structured_output import requested
from shared import request_grammar as grammar
from tests.stack import Stack

MODEL = "tiny-llama"
SMOL = "SmolLM2-135M-Instruct"

# Finite by construction: whatever the random model picks, the grammar closes the object
# within a few tokens, so the request ends with "stop" (not "length").
BOUNDED: dict[str, Any] = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "sizes": {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 3, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["color", "sizes", "ok"],
    "additionalProperties": False,
}
BOUNDED_FORMAT: Any = {"type": "json_schema", "json_schema": {"name": "bounded", "schema": BOUNDED}}
REGEX = r"[a-z]{3}-[0-9]{2}"
CHOICES = ["yes", "no", "maybe"]
JSON_OBJECT: Any = {"type": "json_object"}


def _msg(text: str) -> Any:  # a chat message list (typed loosely for the client)
    return [{"role": "user", "content": text}]


# --- the real model: pydantic parsing under sampling ---------------------------------------


class Species(enum.StrEnum):
    cat = "cat"
    dog = "dog"
    bird = "bird"


class Pet(BaseModel):
    name: str
    species: Species


class Person(BaseModel):
    name: str
    age: int
    pets: list[Pet]
    nickname: str | None


@pytest.mark.smollm2
async def test_every_sampled_reply_parses_into_the_model(smol_stack: Stack) -> None:
    schema = Person.model_json_schema()
    async with openai.AsyncOpenAI(base_url=f"{smol_stack.base_url}/v1", api_key="x",
                                  max_retries=0) as smol:

        async def ask(seed: int) -> Any:
            return await smol.chat.completions.parse(
                model=SMOL, messages=_msg("Describe a person and their pets as JSON."),
                response_format=Person, temperature=1.0, max_tokens=300, seed=seed, n=2)

        # 4 concurrent requests of 2 choices each: 8 sampled generations batched together.
        replies = await asyncio.gather(*(ask(seed) for seed in range(0, 40, 10)))
    choices = [c for r in replies for c in r.choices]
    assert len(choices) == 8
    for choice in choices:
        assert choice.finish_reason == "stop", choice.message.content
        person = choice.message.parsed
        assert isinstance(person, Person)
        assert all(isinstance(p.species, Species) for p in person.pets)
        jsonschema.validate(json.loads(choice.message.content or ""), schema)
    # Sampled, not one answer repeated.
    assert len({c.message.content for c in choices}) > 1


@pytest.mark.smollm2
def test_json_object_replies_are_objects(smol_client: openai.OpenAI) -> None:
    reply = smol_client.chat.completions.create(
        model=SMOL, messages=_msg("Give the capital of France as JSON."),
        response_format=JSON_OBJECT, n=4, temperature=1.0, seed=7, max_tokens=300)
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(json.loads(choice.message.content or ""), dict)


# --- the tiny model: the grammar alone shapes the output -----------------------------------


def test_json_object_is_forced_and_ends_the_request(client: openai.OpenAI,
                                                    tiny_model: Path) -> None:
    [braces] = AutoTokenizer.from_pretrained(str(tiny_model)).encode("{}")  # one token
    # Biased toward "{}", the model alone writes "{}{}{}..." to max_tokens; under json_object
    # the grammar is complete after the first, and the reply ends there.
    body: dict[str, Any] = dict(model=MODEL, messages=_msg("x"), max_tokens=20, temperature=0,
                                logit_bias={str(braces): 100})
    free = client.chat.completions.create(**body)
    assert (free.choices[0].message.content or "").startswith("{}{}")
    forced = client.chat.completions.create(**body, response_format=JSON_OBJECT)
    assert forced.choices[0].message.content == "{}"
    assert forced.choices[0].finish_reason == "stop"
    # Sampled from the random model: every choice opens an object, and one that ended is one.
    sampled = client.chat.completions.create(
        model=MODEL, messages=_msg("x"), max_tokens=40, temperature=1.0, n=8, seed=3,
        response_format=JSON_OBJECT)
    for choice in sampled.choices:
        assert (choice.message.content or "").startswith("{")
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content or ""), dict)


def test_bounded_schema_holds_for_every_choice(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=_msg("x"), max_tokens=60,
                                           temperature=1.0, n=6, seed=11,
                                           response_format=BOUNDED_FORMAT)
    contents = [c.message.content or "" for c in reply.choices]
    for choice, content in zip(reply.choices, contents, strict=True):
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(content), BOUNDED)
    assert len(set(contents)) > 1


def _stream_chat(client: openai.OpenAI, **body: Any) -> tuple[dict[int, str], dict[int, str],
                                                              dict[int, list[Any]], Any]:
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    logprobs: dict[int, list[Any]] = {}
    usage = None
    for chunk in client.chat.completions.create(**body, stream=True,
                                                stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.logprobs and c.logprobs.content:
                logprobs.setdefault(c.index, []).extend(c.logprobs.content)
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    return texts, finishes, logprobs, usage


def test_streamed_constrained_reply_equals_the_whole_one(client: openai.OpenAI) -> None:
    body: dict[str, Any] = dict(model=MODEL, messages=_msg("colors"), max_tokens=60,
                                temperature=0, response_format=BOUNDED_FORMAT, logprobs=True)
    whole = client.chat.completions.create(**body)
    text = whole.choices[0].message.content or ""
    jsonschema.validate(json.loads(text), BOUNDED)
    texts, finishes, logprobs, usage = _stream_chat(client, **body)
    assert texts == {0: text} and finishes == {0: "stop"}
    # One logprob per generated token, and the tokens spell the text.
    assert len(logprobs[0]) == usage.completion_tokens == whole.usage.completion_tokens
    assert "".join(t.token for t in logprobs[0]) == text
    whole_tokens = [t.token for t in whole.choices[0].logprobs.content]
    assert [t.token for t in logprobs[0]] == whole_tokens


def test_streamed_sampled_choices_each_obey(client: openai.OpenAI) -> None:
    body: dict[str, Any] = dict(model=MODEL, messages=_msg("colors"), max_tokens=60,
                                temperature=1.0, n=3, seed=5, response_format=BOUNDED_FORMAT)
    texts, finishes, _, _ = _stream_chat(client, **body)
    assert finishes == {0: "stop", 1: "stop", 2: "stop"}
    for text in texts.values():
        jsonschema.validate(json.loads(text), BOUNDED)
    whole = client.chat.completions.create(**body)  # the same seeds: the same choices
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_constrained_output(client: openai.OpenAI, stream: bool) -> None:
    body: dict[str, Any] = dict(model=MODEL, messages=_msg("colors"), max_tokens=60,
                                temperature=0, response_format=BOUNDED_FORMAT)
    full = client.chat.completions.create(**body).choices[0].message.content or ""
    cut = full.index('"sizes"')
    if stream:
        texts, finishes, _, _ = _stream_chat(client, **body, stop=['"sizes"'])
        text, finish = texts[0], finishes[0]
    else:
        reply = client.chat.completions.create(**body, stop=['"sizes"'])
        text, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
    assert text == full[:cut] and finish == "stop"


GBNF = 'root ::= [a-z] [a-z] [a-z] "-" [0-9] [0-9]'
LARK = 'start: /[a-z]{3}/ "-" /[0-9]{2}/'
# (extra body, what every output must be)
CONSTRAINTS: list[tuple[dict[str, Any], str]] = [
    ({"guided_choice": CHOICES}, "choice"),
    ({"structured_outputs": {"choice": CHOICES}}, "choice"),
    ({"guided_regex": REGEX}, "regex"),
    ({"structured_outputs": {"regex": REGEX}}, "regex"),
    ({"guided_grammar": GBNF}, "regex"),
    ({"structured_outputs": {"grammar": LARK}}, "regex"),
    ({"guided_json": BOUNDED}, "json"),
    ({"structured_outputs": {"json": BOUNDED}}, "json"),
]


@pytest.mark.parametrize("kind", ["chat", "text"])
@pytest.mark.parametrize(("extra", "shape"), CONSTRAINTS,
                         ids=[f"{next(iter(e))}-{s}" for e, s in CONSTRAINTS])
def test_vllm_constraints_shape_every_output(client: openai.OpenAI, kind: str,
                                             extra: dict[str, Any], shape: str) -> None:
    common: dict[str, Any] = dict(model=MODEL, max_tokens=60, temperature=1.0, n=4, seed=2,
                                  extra_body=extra)
    if kind == "chat":
        reply = client.chat.completions.create(messages=_msg("pick"), **common)
        outputs = [(c.message.content or "", c.finish_reason) for c in reply.choices]
    else:
        done = client.completions.create(prompt="pick:", **common)
        outputs = [(c.text, c.finish_reason) for c in done.choices]
    for text, finish in outputs:
        assert finish == "stop", text
        if shape == "choice":
            assert text in CHOICES
        elif shape == "regex":
            assert re.fullmatch(REGEX, text), text
        else:
            jsonschema.validate(json.loads(text), BOUNDED)


# --- strict schemas ---------------------------------------------------------------------------

# Open objects (no additionalProperties) at three depths, one of them under a property that
# happens to be called "properties", and one object that stays open because it says so.
OPEN: dict[str, Any] = {
    "type": "object", "required": ["a"],
    "properties": {
        "a": {"type": "object", "properties": {"b": {"type": "integer"}}},
        "properties": {"type": "array", "items": {"type": "object",
                                                  "properties": {"c": {"type": "boolean"}}}},
        "free": {"type": "object", "properties": {}, "additionalProperties": True},
    },
}


@pytest.mark.parametrize("strict", [True, False])
def test_a_strict_schema_closes_its_objects(tiny_model: Path, strict: bool) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    view = grammar.tokenizer_view(tokenizer)
    body = ChatCompletionRequest.model_validate({
        "model": MODEL, "messages": _msg("x"), "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "open", "schema": OPEN, "strict": strict}}})
    found = requested(body)
    assert found is not None and found[0] == "response_format"
    text = found[1]()

    def admits(doc: str) -> bool:
        matcher = llguidance.LLMatcher(view, text, log_level=0)
        return bool(matcher.consume_tokens(tokenizer.encode(doc))) and matcher.is_accepting()

    assert admits('{"a":{"b":1},"properties":[{"c":true}],"free":{"x":1}}')
    for extra in ('{"a":{"b":1},"z":0}', '{"a":{"b":1,"z":0}}',
                  '{"a":{"b":1},"properties":[{"c":true,"z":0}]}'):
        assert admits(extra) is not strict, extra


# --- no-op fields, min_tokens, special tokens -------------------------------------------------


def test_ignored_openai_fields_change_nothing(client: openai.OpenAI) -> None:
    body: dict[str, Any] = dict(model=MODEL, messages=_msg("tell me"), max_tokens=12,
                                temperature=0, seed=1)
    plain = client.chat.completions.create(**body)
    dressed = client.chat.completions.create(
        **body, metadata={"team": "search"}, store=True, service_tier="auto",
        prompt_cache_key="user-42", prompt_cache_retention="24h",
        safety_identifier="hashed-user", prediction={"type": "content", "content": "a guess"})
    assert dressed.choices[0].message.content == plain.choices[0].message.content
    assert dressed.usage.completion_tokens == plain.usage.completion_tokens
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(**body, extra_body={"storee": True})
    error: Any = refused.value.body
    assert error["param"] == "storee"


def test_min_tokens_holds_back_stop_tokens(client: openai.OpenAI, tiny_model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    body: dict[str, Any] = dict(model=MODEL, prompt=[5, 6, 7], max_tokens=12, temperature=0)
    greedy = client.completions.create(**body, logprobs=0)
    first = greedy.choices[0].logprobs.tokens[0]
    stop_ids = tokenizer.encode(first, add_special_tokens=False)
    assert len(stop_ids) == 1 and tokenizer.decode(stop_ids) == first
    extra = {"stop_token_ids": stop_ids, "ignore_eos": False}
    early = client.completions.create(**body, extra_body=extra)
    # The first greedy token is now a stop token: the choice ends at once.
    assert early.choices[0].finish_reason == "stop"
    assert early.usage.completion_tokens == 1 and early.choices[0].text == ""
    held = client.completions.create(**body, extra_body={**extra, "min_tokens": 8})
    assert held.usage.completion_tokens >= 8
    assert held.choices[0].text


def test_special_tokens_shown_when_asked(client: openai.OpenAI) -> None:
    # logit_bias makes id 1 (<|im_start|>) certain; it is a special token, skipped by default.
    body: dict[str, Any] = dict(model=MODEL, prompt=[5, 6], max_tokens=3, temperature=0,
                                logit_bias={"1": 100})
    hidden = client.completions.create(**body)
    shown = client.completions.create(**body, extra_body={"skip_special_tokens": False})
    assert hidden.choices[0].text == ""
    assert shown.choices[0].text == "<|im_start|>" * 3
    chat: dict[str, Any] = dict(model=MODEL, messages=_msg("x"), max_tokens=3, temperature=0,
                logit_bias={"1": 100}, extra_body={"skip_special_tokens": False})
    whole = client.chat.completions.create(**chat)
    streamed = "".join(c.choices[0].delta.content or ""
                       for c in client.chat.completions.create(**chat, stream=True)
                       if c.choices)
    assert whole.choices[0].message.content == streamed == "<|im_start|>" * 3
