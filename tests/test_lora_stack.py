"""LoRA adapters through the real system: a replica and a worker started with the same
`REDSERVE_LORA`, the official `openai` client naming an adapter in `model`.

Each adapter's completion is the text of peft's merged model (fp32), chat and the Responses
API, streamed and not, give one text per adapter, requests for two adapters and the base sent
together each get their own text, `/v1/models` lists the adapters with their base as
`parent`, and an unknown name is still a 404 `model_not_found`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from transformers import AutoTokenizer, PreTrainedModel

from tests.lora_adapters import ALL, greedy, make_adapter, merged
from tests.stack import Stack

BASE = "tiny-llama"
PROMPT = [50, 7, 300, 9, 1000, 11, 12, 13]
NEW = 16


@pytest.fixture(scope="module")
def adapters(tiny_base_model: PreTrainedModel,
             tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("stack-loras")
    return {"alpha": make_adapter(tiny_base_model, root / "alpha", ALL, seed=1),
            "beta": make_adapter(tiny_base_model, root / "beta", ["q_proj", "v_proj", "down_proj"],
                                 seed=2)}


@pytest.fixture(scope="module")
def lora_stack(redis_url: str, tiny_model: Path, adapters: dict[str, Path]) -> Iterator[Stack]:
    lora = ",".join(f"{name}={path}" for name, path in adapters.items())
    stack = Stack(redis_url, tiny_model, served_name=BASE,
                  env={"REDSERVE_DTYPE": "float32", "REDSERVE_LORA": lora}).start()
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def client(lora_stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{lora_stack.base_url}/v1", api_key="x", max_retries=0)


def _completion(client: openai.OpenAI, model: str) -> str:
    reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=NEW,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert reply.model == model
    return reply.choices[0].text


def test_models_lists_the_adapters_with_their_base(client: openai.OpenAI,
                                                   adapters: dict[str, Path]) -> None:
    cards = {m.id: m.model_dump() for m in client.models.list().data}
    assert set(cards) == {BASE, *adapters}
    for name, path in adapters.items():
        assert (cards[name]["parent"], cards[name]["root"]) == (BASE, str(path))
    assert "parent" not in cards[BASE]


def test_an_adapter_completes_as_peft_merged_model(
        client: openai.OpenAI, tiny_model: Path, tiny_base_model: PreTrainedModel,
        adapters: dict[str, Path]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    texts = {}
    for name, path in {"": None, **adapters}.items():
        model = tiny_base_model if path is None else merged(tiny_base_model, path)
        expected = tokenizer.decode(greedy(model, PROMPT, NEW), skip_special_tokens=True)
        texts[name] = _completion(client, name or BASE)
        assert texts[name] == expected, name
    assert len(set(texts.values())) == 3  # each adapter answers otherwise than the base


def test_chat_streamed_or_not_and_mixed_with_the_base(client: openai.OpenAI,
                                                      lora_stack: Stack) -> None:
    messages = [{"role": "user", "content": "Name a colour."}]

    def chat(model: str) -> str:
        reply = client.chat.completions.create(model=model, messages=messages,  # type: ignore[arg-type]
                                               max_tokens=NEW, temperature=0)
        return reply.choices[0].message.content or ""

    alone = {m: chat(m) for m in (BASE, "alpha", "beta")}
    assert len(set(alone.values())) == 3
    stream = client.chat.completions.create(model="beta", messages=messages,  # type: ignore[arg-type]
                                            max_tokens=NEW, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == alone["beta"]
    # The Responses API, streamed and not: the same conversation, the same text.
    response = client.responses.create(model="beta", input="Name a colour.",
                                       max_output_tokens=NEW, temperature=0)
    assert (response.model, response.output_text) == ("beta", alone["beta"])
    events = client.responses.create(model="alpha", input="Name a colour.",
                                     max_output_tokens=NEW, temperature=0, stream=True)
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == \
        alone["alpha"]

    async def together() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=f"{lora_stack.base_url}/v1", api_key="x",
                                     max_retries=0)
        replies = await asyncio.gather(*(aclient.chat.completions.create(
            model=m, messages=messages, max_tokens=NEW, temperature=0)  # type: ignore[arg-type]
            for m in [*alone] * 3))
        return [r.choices[0].message.content or "" for r in replies]

    assert asyncio.run(together()) == [*alone.values()] * 3


def test_an_unknown_adapter_is_model_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        _completion(client, "gamma")
    assert missing.value.code == "model_not_found"
    assert "'gamma' does not exist" in str(missing.value)
