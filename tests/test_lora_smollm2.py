"""LoRA adapters over the real default model (SmolLM2-135M-Instruct), in the engine as a worker
builds it: each adapter's greedy tokens at fp32 are those of peft's merged model under
transformers' `generate`, alone and in a step mixing two adapters and the base. (The tiny
model's tests, tests/test_lora.py, cover every kind of adapter and both kernel sets; this one
holds the real shapes: 30 layers, grouped-query attention, a 49,152-token vocabulary.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from shared.messages import GenerateRequest, SamplingParams
from shared.models import ModelInfo
from shared.settings import WorkerSettings
from tests.lora_adapters import ALL, greedy, make_adapter, merged
from worker.engine.build import attach_loras
from worker.engine.checkpoint import Checkpoint
from worker.engine.engine import Engine, EngineConfig
from worker.engine.kv_cache import KVPool
from worker.engine.model_runner import ModelRunner

pytestmark = pytest.mark.smollm2
NEW = 12
PAGE = 32
TEXTS = ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def base(smollm2: ModelInfo) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(str(smollm2.path), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(smollm2: ModelInfo) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2.path))
    return [list(tokenizer(text)["input_ids"]) for text in TEXTS]


@pytest.fixture(scope="module")
def adapters(base: PreTrainedModel, tmp_path_factory: pytest.TempPathFactory
             ) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("smol-loras")
    return {"every": make_adapter(base, root / "every", ALL, rank=16, seed=1),
            "qv": make_adapter(base, root / "qv", ["q_proj", "v_proj"], rank=8, seed=2)}


def _engine(base: PreTrainedModel, info: ModelInfo, adapters: dict[str, Path]) -> Engine:
    runner = ModelRunner(Checkpoint.of(base), page_size=PAGE)  # the default kernels
    lora = ",".join(f"{name}={path}" for name, path in adapters.items())
    loras = attach_loras(runner, info, WorkerSettings(lora=lora))
    config = EngineConfig(max_running=8, max_step_tokens=256, max_model_len=info.max_model_len,
                          page_size=PAGE, loras=loras)
    return Engine(runner, KVPool(runner.kv_shape, 64, PAGE), config, eos_token_ids=())


def _request(rid: str, prompt: list[int], lora: str) -> GenerateRequest:
    return GenerateRequest(id=rid, model="m", prompt_ids=tuple(prompt), created=0.0,
                           queue_deadline=0.0, deadline=0.0, lora=lora,
                           params=SamplingParams(max_tokens=NEW, temperature=0.0))


def _run(engine: Engine, requests: list[GenerateRequest]) -> dict[str, list[int]]:
    for request in requests:
        engine.add(request)
    tokens: dict[str, list[int]] = {}
    while engine.scheduler.has_work():
        for out in engine.step():
            assert out.token is not None and out.error is None, out
            tokens.setdefault(out.request_id, []).append(out.token)
    return tokens


def test_adapters_on_smollm2_decode_as_peft_merged_model_alone_and_mixed(
        base: PreTrainedModel, smollm2: ModelInfo, prompts: list[list[int]],
        adapters: dict[str, Path]) -> None:
    models = {"": base, **{name: merged(base, path) for name, path in adapters.items()}}
    expected = {(name, i): greedy(model, prompt, NEW)
                for name, model in models.items() for i, prompt in enumerate(prompts)}
    for name in adapters:
        assert any(expected[(name, i)] != expected[("", i)] for i in range(len(prompts)))
    engine = _engine(base, smollm2, adapters)
    for name in models:
        for i, prompt in enumerate(prompts):
            alone = _run(engine, [_request(f"{name}-{i}", prompt, name)])
            assert alone[f"{name}-{i}"] == expected[(name, i)], (name, i)
    mixed = [_request(f"{name}-{i}", prompt, name)
             for i, prompt in enumerate(prompts) for name in models]
    assert _run(engine, mixed) == {
        f"{name}-{i}": expected[(name, i)] for name in models for i in range(len(prompts))}
