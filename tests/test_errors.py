"""Bad input gets an OpenAI-style error at once and never reaches a worker."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import redis

from shared.keys import Keys
from tests.stack import Stack

MODEL = "tiny-llama"


@pytest.fixture
def nothing_enqueued(tiny_stack: Stack, sync_redis: redis.Redis) -> Iterator[None]:
    key = Keys(tiny_stack.prefix).requests(MODEL)
    before = sync_redis.xlen(key)
    yield
    assert sync_redis.xlen(key) == before, "a rejected request reached the request stream"


def _post(stack: Stack, path: str, body: Any) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(f"{stack.base_url}{path}", content=body,
                          headers={"content-type": "application/json"})
    return httpx.post(f"{stack.base_url}{path}", json=body)


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    return error  # type: ignore[no-any-return]


WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
CASES = [
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 10**9]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": ["a", "b", "c", "d", "e"]},
     400, "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"abc": 1}}, 400,
     "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"999999": 1}}, 400, None),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "echo": True, "logprobs": 1}, 400, "echo"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 5, "min_tokens": 6}, 400,
     "min_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": []}, 400, "prompt"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function"}]}, 400, "tools[0].function"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema"}}, 400, None),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema", "json_schema": {
                                  "name": "x", "schema": {"type": "objekt"}}}},
     400, "response_format"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 3}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
      "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "tools": [WEATHER, WEATHER]}, 400, "tools"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {
                                  "name": "f", "parameters": {"type": "string"}}}]},
     400, "tools[0].function"),
    # A bad parameter schema is refused even when no call is forced, as OpenAI refuses it.
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "tools": [WEATHER, {"type": "function", "function": {
                                  "name": "f", "parameters": {"type": "object", "properties": {
                                      "a": {"type": "objekt"}}}}}], "tool_choice": "auto"},
     400, "tools[1].function.parameters"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "tools": [WEATHER], "tool_choice": "required",
                              "response_format": {"type": "json_object"}}, 400,
     "response_format"),
    ("/v1/chat/completions", {"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]},
     404, "model"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "priority": 10**7}, 400, "priority"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "priority": "high"}, 400, "priority"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), CASES)
def test_bad_request_is_refused_before_the_queue(
    tiny_stack: Stack, nothing_enqueued: None, path: str, body: dict[str, Any], status: int,
    param: str | None,
) -> None:
    error = _error(_post(tiny_stack, path, body), status)
    if param is not None:
        assert error["param"] == param


def test_malformed_json(tiny_stack: Stack, nothing_enqueued: None) -> None:
    error = _error(_post(tiny_stack, "/v1/completions", b"{not json"), 400)
    assert error["type"] == "invalid_request_error"


def test_prompt_plus_max_tokens_over_context_names_both_counts(
    tiny_stack: Stack, nothing_enqueued: None
) -> None:
    prompt = list(range(100, 400))  # 300 tokens; the tiny model's context is 512
    error = _error(_post(tiny_stack, "/v1/completions",
                         {"model": MODEL, "prompt": prompt, "max_tokens": 300}), 400)
    assert "512" in error["message"] and "300 in the prompt" in error["message"]
    assert "300 for the completion" in error["message"]
    assert error["code"] == "context_length_exceeded"
    error = _error(_post(tiny_stack, "/v1/completions",
                         {"model": MODEL, "prompt": list(range(100, 700))}), 400)
    assert "600" in error["message"]


def test_openai_client_sees_typed_errors(tiny_stack: Stack, nothing_enqueued: None) -> None:
    client = openai.OpenAI(base_url=f"{tiny_stack.base_url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError) as not_found:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert not_found.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt=list(range(100, 400)), max_tokens=300)
    assert bad.value.code == "context_length_exceeded"
