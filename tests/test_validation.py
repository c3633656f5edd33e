"""The checks a request body owns against the model that serves it (`api.protocol`), on the
real default model's tokenizer, without a stack: the errors' exact text, param and code, and
the sampling parameters a body becomes."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from api.protocol.bodies import ChatCompletionRequest, CompletionRequest
from api.protocol.errors import APIError
from api.protocol.served_model import ServedModel
from api.protocol.text import TextCodec
from shared.models import ModelInfo

CONTEXT = 32


@pytest.fixture(scope="module")
def model(smollm2: ModelInfo) -> ServedModel:
    """The default model's tokenizer, with a small context to run out of."""
    info = dataclasses.replace(smollm2, max_model_len=CONTEXT)
    return ServedModel(info, TextCodec(str(smollm2.path)))


def _completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "x", **fields})


def _chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], **fields})


def _refusal(check: Any) -> tuple[int, str, str | None, str | None]:
    with pytest.raises(APIError) as raised:
        check()
    e = raised.value
    return e.status, e.message, e.param, e.code


@pytest.mark.parametrize("param", ["logit_bias", "stop_token_ids"])
def test_token_ids_are_checked_against_the_vocabulary(model: ServedModel, param: str) -> None:
    vocab = model.vocab_size
    assert vocab == len(model.codec.tokenizer)
    last, past = ({str(vocab - 1): 1.0}, {str(vocab): 1.0}) if param == "logit_bias" else (
        [vocab - 1], [vocab])
    _chat(**{param: last}).validate_for(model)
    assert _refusal(lambda: _chat(**{param: past}).validate_for(model)) == (
        400, f"{param}: token id {vocab} is outside the vocabulary (0..{vocab - 1})", param,
        "invalid_value")


def test_prompt_token_ids_and_text_are_checked_before_tokenizing(model: ServedModel) -> None:
    vocab = model.vocab_size
    _completion(prompt=[[1, vocab - 1], [2]]).check_prompts(model)
    assert _refusal(lambda: _completion(prompt=[[1], [2, vocab]]).check_prompts(model)) == (
        400, f"prompt token id {vocab} is outside the vocabulary (0..{vocab - 1})", "prompt",
        "invalid_value")
    # Each prompt of a batch on its own: many that fit one by one pass together.
    fits = "a" * (CONTEXT * model.codec.max_token_bytes)
    _completion(prompt=[fits, fits]).check_prompts(model)
    status, message, param, code = _refusal(
        lambda: _completion(prompt=fits + "a").check_prompts(model))
    assert (status, param, code) == (400, "prompt", "context_length_exceeded")
    assert message.startswith(f"This model's maximum context length is {CONTEXT} tokens; the "
                              "prompt text (")


def test_max_tokens_fit_the_context(model: ServedModel) -> None:
    assert _completion().max_tokens_for(model, [1] * 10) == CONTEXT - 10
    assert _completion(max_tokens=22).max_tokens_for(model, [1] * 10) == 22
    # A chat's max_completion_tokens wins over its max_tokens.
    assert _chat(max_tokens=1, max_completion_tokens=5).max_tokens_for(model, [1] * 10) == 5
    assert _refusal(lambda: _completion().max_tokens_for(model, [])) == (
        400, "the prompt is empty", "prompt", "invalid_value")
    assert _refusal(lambda: _completion().max_tokens_for(model, [1] * CONTEXT)) == (
        400, f"This model's maximum context length is {CONTEXT} tokens, but the prompt has "
        f"{CONTEXT} tokens.", "messages", "context_length_exceeded")
    assert _refusal(lambda: _completion(max_tokens=23).max_tokens_for(model, [1] * 10)) == (
        400, f"This model's maximum context length is {CONTEXT} tokens. However, you requested "
        f"33 tokens (10 in the prompt, 23 for the completion).", "max_tokens",
        "context_length_exceeded")


def test_a_body_becomes_each_choices_sampling_params() -> None:
    body = _chat(seed=7, top_k=-1, min_tokens=9, logit_bias={"1": 5.0, "01": -5.0, "2": 1.0},
                 stop_token_ids=[3, 4], logprobs=True, top_logprobs=2, temperature=0.5)
    first, third = body.to_sampling_params(4, 0), body.to_sampling_params(4, 2)
    assert (first.seed, third.seed) == (7, 9)
    assert first.model_dump(exclude={"seed"}) == third.model_dump(exclude={"seed"})
    assert first.max_tokens == 4 and first.min_tokens == 4  # held within max_tokens
    assert first.top_k == 0 and first.temperature == 0.5
    assert first.logit_bias == ((1, -5.0), (2, 1.0))  # "1" and "01": the last one, once
    assert first.stop_token_ids == (3, 4) and first.logprobs == 2
    assert _completion().to_sampling_params(4, 3).seed is None
    assert _completion(logprobs=0).to_sampling_params(4, 0).logprobs == 0
    assert _chat().to_sampling_params(4, 0).logprobs is None
