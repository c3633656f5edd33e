"""vLLM's /tokenize and /detokenize on a real stack: the ids are the tokenizer's and the chat
template's own, a chat count is the prompt a chat completion is billed for, text comes back
from its ids, every bad input is a 400 or 404 in OpenAI's error shape, and with API keys
configured the endpoints are behind the same door as the /v1/ routes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.stack import Stack

MODEL = "tiny-llama"
CONTEXT = 512  # the tiny model's max_position_embeddings
KEY = "sk-tokenize-test-key"
TEXTS = ["The sea is calm tonight.", "naïve café — 東京タワー 🚀", "  two\nlines  "]
CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is KV cache?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path):  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(str(tiny_model))


def _post(stack: Stack, path: str, body: dict[str, Any], **kwargs: Any) -> httpx.Response:
    return httpx.post(f"{stack.base_url}{path}", json=body, timeout=30, **kwargs)


def _refused(response: httpx.Response, status: int, param: str | None, code: str) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["param"], error["code"]) == (param, code), error
    return str(error["message"])


def test_a_prompt_is_tokenized_as_the_tokenizer_does(tiny_stack: Stack,
                                                     tokenizer) -> None:  # type: ignore[no-untyped-def]
    for text in TEXTS:
        for special in (True, False):
            reply = _post(tiny_stack, "/tokenize", {"model": MODEL, "prompt": text,
                                                    "add_special_tokens": special})
            assert reply.status_code == 200, reply.text
            ids = tokenizer.encode(text, add_special_tokens=special)
            assert reply.json() == {"count": len(ids), "max_model_len": CONTEXT, "tokens": ids,
                                    "token_strs": None}


def test_token_strs_are_the_vocabulary_pieces(tiny_stack: Stack,
                                              tokenizer) -> None:  # type: ignore[no-untyped-def]
    # `model` left out: the replica's only model, as vLLM serves its default one.
    reply = _post(tiny_stack, "/tokenize", {"prompt": TEXTS[1], "return_token_strs": True})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["tokens"] == tokenizer.encode(TEXTS[1])
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    chat = _post(tiny_stack, "/tokenize", {"messages": CHAT, "return_token_strs": True}).json()
    assert chat["token_strs"] == tokenizer.convert_ids_to_tokens(chat["tokens"])
    assert chat["token_strs"][0] == "<|im_start|>"


def test_chat_is_rendered_by_the_models_template(tiny_stack: Stack,
                                                 tokenizer) -> None:  # type: ignore[no-untyped-def]
    reply = _post(tiny_stack, "/tokenize", {"model": MODEL, "messages": CHAT})
    assert reply.status_code == 200, reply.text
    ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)["input_ids"]
    assert reply.json() == {"count": len(ids), "max_model_len": CONTEXT, "tokens": ids,
                            "token_strs": None}
    # The last message left open for the model to continue, as vLLM's flag does.
    prefill = [*CHAT, {"role": "assistant", "content": "KV cache is"}]
    reply = _post(tiny_stack, "/tokenize", {
        "model": MODEL, "messages": prefill, "add_generation_prompt": False,
        "continue_final_message": True})
    assert reply.status_code == 200, reply.text
    assert reply.json()["tokens"] == tokenizer.apply_chat_template(
        prefill, continue_final_message=True)["input_ids"]
    assert tokenizer.decode(reply.json()["tokens"]).endswith("KV cache is")


def test_a_chat_count_is_what_the_chat_completion_is_billed(tiny_stack: Stack,
                                                            client: openai.OpenAI) -> None:
    counts = []
    # Tools are taught in the system message, and counted; tool_choice "none" leaves them out.
    for extra in ({}, {"tools": [WEATHER]}, {"tools": [WEATHER], "tool_choice": "none"}):
        count = _post(tiny_stack, "/tokenize", {"model": MODEL, "messages": CHAT,
                                                **extra}).json()["count"]
        reply = client.chat.completions.create(model=MODEL, messages=CHAT,  # type: ignore[arg-type]
                                               max_tokens=1, **extra)
        assert reply.usage is not None and reply.usage.prompt_tokens == count
        counts.append(count)
    assert counts[0] == counts[2] < counts[1]


def test_detokenize_gives_the_text_back(tiny_stack: Stack,
                                        tokenizer) -> None:  # type: ignore[no-untyped-def]
    for text in TEXTS:
        ids = _post(tiny_stack, "/tokenize", {"model": MODEL, "prompt": text}).json()["tokens"]
        reply = _post(tiny_stack, "/detokenize", {"model": MODEL, "tokens": ids})
        assert reply.status_code == 200, reply.text
        assert reply.json() == {"prompt": text}
    # Special tokens are kept, as vLLM keeps them; no ids are no text.
    chat = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)["input_ids"]
    reply = _post(tiny_stack, "/detokenize", {"tokens": chat}).json()
    assert reply["prompt"] == tokenizer.decode(chat) and reply["prompt"].startswith("<|im_start|>")
    assert _post(tiny_stack, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


def test_bad_token_ids_are_refused_by_name(tiny_stack: Stack,
                                           tokenizer) -> None:  # type: ignore[no-untyped-def]
    vocab = len(tokenizer)
    message = _refused(_post(tiny_stack, "/detokenize", {"tokens": [11, vocab + 7, 12]}), 400,
                       "tokens[1]", "invalid_value")
    assert str(vocab + 7) in message
    _refused(_post(tiny_stack, "/detokenize", {"tokens": [11, -1]}), 400, "tokens[1]",
             "invalid_value")
    _refused(_post(tiny_stack, "/detokenize", {"tokens": [2**63]}), 400, "tokens[0]",
             "invalid_value")
    _refused(_post(tiny_stack, "/detokenize", {"tokens": ["11"]}), 400, "tokens[0]",
             "invalid_value")
    # More ids than the context holds.
    _refused(_post(tiny_stack, "/detokenize", {"tokens": [11] * (CONTEXT + 1)}), 400, "tokens",
             "context_length_exceeded")


def test_unknown_fields_and_bad_bodies_are_refused(tiny_stack: Stack) -> None:
    for path, body, field in (
        ("/tokenize", {"prompt": "hi", "max_tokens": 3}, "max_tokens"),
        ("/tokenize", {"messages": CHAT, "echo": True}, "echo"),
        # vLLM refuses a request's own template too, unless its server trusts them.
        ("/tokenize", {"messages": CHAT, "chat_template": "{{ 1 }}"}, "chat_template"),
        ("/tokenize", {"messages": CHAT, "prompt": "hi"}, "prompt"),
        ("/detokenize", {"tokens": [1], "skip_special_tokens": True}, "skip_special_tokens"),
    ):
        message = _refused(_post(tiny_stack, path, body), 400, field, "invalid_value")
        assert "not supported" in message
    _refused(_post(tiny_stack, "/tokenize", {"model": MODEL}), 400, "prompt", "invalid_value")
    _refused(_post(tiny_stack, "/tokenize", {"messages": []}), 400, "messages", "invalid_value")
    _refused(_post(tiny_stack, "/tokenize", {"messages": CHAT, "continue_final_message": True}),
             400, "continue_final_message", "invalid_value")
    _refused(_post(tiny_stack, "/tokenize", {"messages": CHAT,
                                             "chat_template_kwargs": {"tools": []}}),
             400, "messages", "invalid_value")
    # Text that cannot fit the context is refused before the tokenizer sees it.
    _refused(_post(tiny_stack, "/tokenize", {"prompt": "word " * 60_000}), 400, "prompt",
             "context_length_exceeded")
    _refused(_post(tiny_stack, "/tokenize", {"messages": [
        {"role": "user", "content": "word " * 60_000}]}), 400, "messages",
        "context_length_exceeded")
    # Somewhat past the context is still counted: the client learns by how much.
    long = _post(tiny_stack, "/tokenize", {"prompt": "word " * (2 * CONTEXT)}).json()
    assert long["count"] > long["max_model_len"] == CONTEXT


def test_an_unknown_model_is_a_404(tiny_stack: Stack) -> None:
    for path, body in (("/tokenize", {"model": "gpt-4o", "prompt": "hi"}),
                       ("/tokenize", {"model": "gpt-4o", "messages": CHAT}),
                       ("/detokenize", {"model": "gpt-4o", "tokens": [1]})):
        message = _refused(_post(tiny_stack, path, body), 404, "model", "model_not_found")
        assert "gpt-4o" in message and MODEL in message


@pytest.fixture(scope="module")
def keyed(redis_url: str, tiny_model: Path) -> Iterator[Stack]:
    # Tokenizing needs no worker.
    stack = Stack(redis_url, tiny_model, served_name=MODEL, workers=0,
                  env={"REDSERVE_API_KEYS": f"team:{KEY}"}).start()
    yield stack
    stack.stop()


def test_the_endpoints_need_a_key_like_the_v1_routes(keyed: Stack) -> None:
    cases = (("/tokenize", {"model": MODEL, "prompt": "hi"}),
             ("/tokenize", {"model": MODEL, "messages": CHAT}),
             ("/detokenize", {"model": MODEL, "tokens": [11, 12]}))
    for path, body in cases:
        for headers in ({}, {"Authorization": "Bearer sk-not-a-key"}, {"Authorization": KEY}):
            response = _post(keyed, path, body, headers=headers)
            _refused(response, 401, None, "invalid_api_key")
            assert response.headers["www-authenticate"].startswith("Bearer")
        assert _post(keyed, path, body,
                     headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    # Another spelling of a path is only redirected to the guarded one, never served.
    slashed = _post(keyed, "/tokenize/", cases[0][1])
    assert slashed.status_code in (307, 401, 404) and "tokens" not in slashed.text
    # The door refuses a stranger before the body is read, and bounds a caller's body.
    huge = {"prompt": "a" * (3 * 1024**2)}
    _refused(_post(keyed, "/tokenize", huge), 401, None, "invalid_api_key")
    _refused(_post(keyed, "/tokenize", huge, headers={"Authorization": f"Bearer {KEY}"}), 413,
             None, "request_too_large")
