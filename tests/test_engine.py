"""The worker's batching engine against transformers' own `generate`, token for token."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from shared.messages import GenerateRequest, SamplingParams
from shared.models import ModelInfo
from worker.engine import AdmissionError, Engine
from worker.model_runner import ModelRunner


def _request(i: int, prompt: list[int], max_tokens: int, **params: object) -> GenerateRequest:
    params.setdefault("temperature", 0.0)  # greedy unless a test samples
    return GenerateRequest(
        id=f"t-{i}", model="m", prompt_ids=tuple(prompt), created=0.0, queue_deadline=0.0,
        deadline=0.0,
        params=SamplingParams(max_tokens=max_tokens, **params),  # type: ignore[arg-type]
    )


def _engine(model: PreTrainedModel, **kw: object) -> Engine:
    args: dict[str, object] = dict(
        eos_token_ids=(), max_running=8, max_prefill_tokens=64, kv_cache_bytes=2**26,
        max_model_len=model.config.max_position_embeddings,
    )
    args.update(kw)
    return Engine(ModelRunner(model), **args)  # type: ignore[arg-type]


def _run(engine: Engine, joins: dict[int, list[GenerateRequest]]) -> dict[str, list[int | None]]:
    """Step until idle, adding `joins[step]` before that step; collect tokens per request."""
    out: dict[str, list[int | None]] = {}
    step = 0
    while engine.has_work() or any(s >= step for s in joins):
        for req in joins.get(step, []):
            engine.add(req)
        for o in engine.step():
            out.setdefault(o.request_id, []).append(o.token)
        step += 1
    return out


def _hf_greedy(model: PreTrainedModel, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                         min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return [int(t) for t in out[0, len(prompt):]]


def _tiny(kind: str) -> PreTrainedModel:
    torch.manual_seed(0)
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                  max_position_embeddings=256)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**common)).eval()  # type: ignore[arg-type]
    return Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common)).eval()  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_mixed_batch_joined_at_different_steps_matches_generate(kind: str) -> None:
    model = _tiny(kind)
    prompts = [[1, 2, 3, 4, 5], list(range(10, 70)), [7], list(range(100, 117)), [9, 9, 9]]
    joins = {
        0: [_request(0, prompts[0], 24), _request(1, prompts[1], 12)],
        3: [_request(2, prompts[2], 20)],
        5: [_request(3, prompts[3], 16), _request(4, prompts[4], 1)],
    }
    engine = _engine(model)
    got = _run(engine, joins)
    for reqs in joins.values():
        for req in reqs:
            want = _hf_greedy(model, list(req.prompt_ids), req.params.max_tokens)
            assert got[req.id] == want, req.id
    assert engine.kv.used_tokens == 0 and not engine.running and not engine.waiting


def test_eos_stops_with_stop_and_is_not_shown() -> None:
    model = _tiny("llama")
    prompt = [5, 6, 7]
    reference = _hf_greedy(model, prompt, 6)
    eos = reference[3]  # pretend the 4th greedy token is EOS
    engine = _engine(model, eos_token_ids=(eos,))
    engine.add(_request(0, prompt, 6))
    outputs = []
    while engine.has_work():
        outputs += engine.step()
    first_eos = reference.index(eos)
    assert [o.token for o in outputs] == [*reference[:first_eos], None]
    assert outputs[-1].finish == "stop"
    assert outputs[-1].completion_tokens == first_eos + 1


def test_ignore_eos_runs_to_length() -> None:
    model = _tiny("llama")
    reference = _hf_greedy(model, [5, 6, 7], 6)
    engine = _engine(model, eos_token_ids=(reference[0],))
    engine.add(_request(0, [5, 6, 7], 6, ignore_eos=True))
    outputs = []
    while engine.has_work():
        outputs += engine.step()
    assert [o.token for o in outputs] == reference
    assert outputs[-1].finish == "length"


def test_abort_frees_kv_and_budget_bounds_admission() -> None:
    model = _tiny("llama")
    per_token = ModelRunner(model).kv_shape.bytes_per_token()
    engine = _engine(model, kv_cache_bytes=per_token * 40)
    engine.add(_request(0, [1] * 10, 20))  # needs 30 tokens
    engine.add(_request(1, [2] * 10, 20))  # must wait: 60 > 40
    engine.step()
    assert list(engine.running) == ["t-0"] and len(engine.waiting) == 1
    assert engine.kv.used_tokens == 30
    assert engine.abort("t-0")
    assert engine.kv.used_tokens == 0
    engine.step()
    assert list(engine.running) == ["t-1"]
    assert engine.abort("t-1") and engine.kv.used_tokens == 0
    with pytest.raises(AdmissionError):
        engine.add(_request(2, [3] * 30, 20))  # 50 tokens can never fit in 40


def test_seeded_sampling_is_reproducible_whatever_the_batch() -> None:
    model = _tiny("llama")
    alone = _run(_engine(model), {0: [_request(0, [4, 5, 6], 12, temperature=0.9, seed=7)]})
    crowd = _run(_engine(model), {
        0: [_request(1, [8, 8], 12, temperature=1.0, seed=1)],
        1: [_request(0, [4, 5, 6], 12, temperature=0.9, seed=7)],
        2: [_request(2, [3], 12, temperature=0.5, top_p=0.8, top_k=20)],
    })
    assert alone["t-0"] == crowd["t-0"]


@pytest.mark.smollm2
def test_smollm2_greedy_matches_generate(smollm2: ModelInfo) -> None:
    model = AutoModelForCausalLM.from_pretrained(str(smollm2.path), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2.path))
    questions = ["What is KV Cache?", "Name three primary colors.", "Write a haiku about Redis."]
    prompts = [
        list(tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                           add_generation_prompt=True, return_dict=False))
        for q in questions
    ]
    joins = {0: [_request(0, prompts[0], 24)], 2: [_request(1, prompts[1], 24),
                                                   _request(2, prompts[2], 24)]}
    got = _run(_engine(model, max_prefill_tokens=512), joins)
    for reqs in joins.values():
        for req in reqs:
            assert got[req.id] == _hf_greedy(model, list(req.prompt_ids), 24), req.id
