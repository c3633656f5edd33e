"""The real default model through the whole stack: what users see is what `generate` says."""

from __future__ import annotations

import httpx
import openai
import pytest
import redis
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from shared.models import ModelInfo
from tests.stack import Stack

pytestmark = pytest.mark.smollm2
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def client(smol_client: openai.OpenAI) -> openai.OpenAI:
    return smol_client  # this module's tests talk to the real model


def test_reply_is_what_generate_says_streamed_or_not(
    client: openai.OpenAI, smollm2: ModelInfo, sync_redis: redis.Redis, smol_stack: Stack
) -> None:
    [worker] = httpx.get(f"{smol_stack.base_url}/health").json()["workers"].values()
    assert worker["dtype"] == "float32"  # as asked with --dtype (REDSERVE_DTYPE)
    messages = [{"role": "user", "content": "What is KV Cache?"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                           max_tokens=48, temperature=0)
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                                max_tokens=48, temperature=0, stream=True)
    )
    text = whole.choices[0].message.content
    assert streamed == text
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 48

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2.path))
    model = AutoModelForCausalLM.from_pretrained(str(smollm2.path), dtype=torch.float32)
    prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                return_dict=False))
    assert whole.usage.prompt_tokens == len(prompt)
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=48,
                         do_sample=False)
    assert text == tokenizer.decode(out[0, len(prompt):], skip_special_tokens=True)


def test_eos_ends_with_stop_and_is_not_in_the_text(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}],  # type: ignore[list-item]
        max_tokens=200, temperature=0,
    )
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage is not None and reply.usage.completion_tokens < 200
    content = reply.choices[0].message.content or ""
    assert content.strip() and "<|im_end|>" not in content
