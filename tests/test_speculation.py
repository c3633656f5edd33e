"""Speculative decoding in the engine: the same tokens as without it, token for token, at fp32
on both kernel sets and bit for bit in batch-invariant mode; every limit of a request (length,
stop tokens, min_tokens, logprobs) honoured when one step emits several of its tokens; sampled
tokens keep the model's distribution; the drafter and the draft length on their own."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from shared.messages import GenerateRequest, SamplingParams
from tests.marks import KERNELS, needs_native_bf16
from worker.engine.checkpoint import Checkpoint
from worker.engine.drafting.adaptive import PAUSE_STEPS, DraftLength
from worker.engine.drafting.drafter import NgramIndex
from worker.engine.engine import Engine, EngineConfig, StepOutput
from worker.engine.kv_cache import KVPool
from worker.engine.model_runner import ModelRunner
from worker.engine.speculation.speculator import SpeculationConfig

PAGE_SIZE = {"torch": 4, "vllm-cpu": 16}
# Prompts that repeat themselves (a random model's greedy output soon loops as well): drafts
# are proposed and many accepted.
PROMPTS = [[*range(10, 40)] * 3, [5, 6, 7, 8] * 10, [1, 2, 3], [*range(100, 117), 3, 4] * 2]


def _model(vocab: int = 1000, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                         max_position_embeddings=512)
    return LlamaForCausalLM(config).to(dtype).eval()  # type: ignore[arg-type]


def _peaky(vocab: int) -> PreTrainedModel:
    """A model whose next-token distributions are far from uniform: sampled, its output
    repeats itself enough for drafts to be proposed."""
    model = _model(vocab)
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)
    return model


def _engine(model: PreTrainedModel, speculation: str, *, kernels: str = "torch",
            batch_invariant: bool = False, eos: tuple[int, ...] = (), tokens: int = 5) -> Engine:
    page_size = PAGE_SIZE[kernels]
    runner = ModelRunner(Checkpoint.of(model), kernels=kernels, page_size=page_size,
                         batch_invariant=batch_invariant)
    config = EngineConfig(max_running=8, max_step_tokens=64, max_model_len=512,
                          page_size=page_size,
                          speculation=SpeculationConfig(speculation, tokens))  # type: ignore[arg-type]
    return Engine(runner, KVPool(runner.kv_shape, 256, page_size), config, eos_token_ids=eos)


def _request(i: int, prompt: list[int], max_tokens: int = 60, **params: object
             ) -> GenerateRequest:
    params.setdefault("temperature", 0.0)
    return GenerateRequest(id=f"r{i}", model="m", prompt_ids=tuple(prompt), created=0.0,
                           queue_deadline=0.0, deadline=0.0,
                           params=SamplingParams(max_tokens=max_tokens, **params))  # type: ignore[arg-type]


def _run(engine: Engine, requests: list[GenerateRequest]) -> dict[str, list[StepOutput]]:
    for req in requests:
        engine.add(req)
    out: dict[str, list[StepOutput]] = {}
    while engine.scheduler.has_work():
        step = engine.step()
        for o in step:
            out.setdefault(o.request_id, []).append(o)
    engine.scheduler.pages.check()
    stats = engine.scheduler.stats()
    assert (stats.running, stats.pages_used) == (0, 0)
    return out


def _tokens(outputs: dict[str, list[StepOutput]]) -> dict[str, list[int | None]]:
    return {rid: [o.token for o in outs] for rid, outs in outputs.items()}


def _both(model: PreTrainedModel, requests: list[GenerateRequest], **kw: object
          ) -> tuple[dict[str, list[StepOutput]], dict[str, list[StepOutput]], Engine]:
    off = _run(_engine(model, "off", **kw), requests)  # type: ignore[arg-type]
    engine = _engine(model, "ngram", **kw)  # type: ignore[arg-type]
    on = _run(engine, requests)
    return off, on, engine


@pytest.mark.parametrize("kernels", KERNELS)
def test_greedy_with_speculation_is_greedy_without_it(kernels: str) -> None:
    model = _model()
    requests = [_request(i, p) for i, p in enumerate(PROMPTS)]
    off, on, engine = _both(model, requests, kernels=kernels)
    assert _tokens(on) == _tokens(off)
    stats = engine.speculator.stats()
    assert stats.accepted > 20 and stats.tokens_per_step > 1.5, stats  # it did speculate
    for outs in on.values():  # indices run on without gap or repeat
        assert [o.index for o in outs] == list(range(len(outs)))
        assert outs[-1].finish == "length" and outs[-1].completion_tokens == 60


@needs_native_bf16
def test_batch_invariant_speculation_gives_the_same_bits_at_bf16() -> None:
    model = _model(dtype=torch.bfloat16)
    requests = [_request(i, p, logprobs=2) for i, p in enumerate(PROMPTS)]
    off, on, engine = _both(model, requests, kernels="vllm-cpu", batch_invariant=True)
    assert engine.speculator.stats().accepted > 20
    for rid in off:
        assert [(o.token, o.logprob) for o in on[rid]] == [(o.token, o.logprob) for o in off[rid]]


def test_limits_hold_when_a_step_emits_several_tokens() -> None:
    model = _model()
    reference = _tokens(_run(_engine(model, "off"), [_request(0, PROMPTS[1])]))["r0"]
    assert len(set(reference[10:])) < 8  # the output loops: drafts are accepted
    stop = reference[17]
    first = reference.index(stop)
    off, on, engine = _both(model, [
        _request(0, PROMPTS[1], max_tokens=13),  # ends inside an accepted run of drafts
        _request(1, PROMPTS[1], stop_token_ids=(stop,)),
        _request(2, PROMPTS[1], stop_token_ids=(stop,), min_tokens=first + 2),
        _request(3, PROMPTS[1], max_tokens=30, logprobs=3),
    ])
    assert engine.speculator.stats().accepted > 0
    assert _tokens(on) == _tokens(off)
    assert [o.token for o in on["r0"]] == reference[:13] and on["r0"][-1].finish == "length"
    assert [o.token for o in on["r1"]] == [*reference[:first], None]
    assert on["r1"][-1].finish == "stop" and on["r1"][-1].completion_tokens == first + 1
    assert stop not in [o.token for o in on["r2"]][: first + 2]  # min_tokens held it off
    for a, b in zip(on["r3"], off["r3"], strict=True):
        assert a.logprob is not None and b.logprob is not None
        assert a.logprob[0] == pytest.approx(b.logprob[0], abs=1e-4)
        assert [t for t, _ in a.logprob[1]] == [t for t, _ in b.logprob[1]]


def test_a_request_that_opts_out_never_drafts() -> None:
    model = _model()
    engine = _engine(model, "ngram")
    out = _run(engine, [_request(0, PROMPTS[1], speculate=False)])
    assert engine.speculator.stats().proposed == 0
    assert _tokens(out) == _tokens(_run(_engine(model, "off"), [_request(0, PROMPTS[1])]))


def test_seeded_requests_draw_the_same_tokens_with_speculation() -> None:
    model = _peaky(50)
    prompts = [[t % 50 for t in p] for p in PROMPTS]
    requests = [_request(i, p, temperature=0.8, seed=11 + i) for i, p in enumerate(prompts)]
    off, on, engine = _both(model, requests)
    assert engine.speculator.stats().proposed > 0
    assert _tokens(on) == _tokens(off)


def test_sampled_tokens_keep_the_model_distribution() -> None:
    """Tokens 1 and 2 of a sampled request over an 8-token vocabulary, 1,200 times with
    speculation, against their exact marginals computed from the model (chi-square, 7 degrees
    of freedom, p < 1e-4 to fail; the generator is seeded, so the outcome is fixed)."""
    model = _peaky(8)
    # The model's own greedy output (it loops): drafts follow its likeliest path, so some are
    # accepted and some rejected.
    with torch.no_grad():
        prompt = model.generate(torch.tensor([[2, 5]]), max_new_tokens=22, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0].tolist()
    temperature = 0.9

    def probs(tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0, -1].double()
        return torch.softmax(logits / temperature, dim=-1)

    p0 = probs(prompt)
    p1 = sum(p0[a] * probs([*prompt, a]) for a in range(8))
    p2 = sum(p0[a] * probs([*prompt, a])[b] * probs([*prompt, a, b])
             for a in range(8) for b in range(8))
    engine = _engine(model, "ngram")
    engine.generator.manual_seed(0)
    n = 1200
    seen: list[Counter[int]] = [Counter(), Counter()]
    for batch in range(n // 8):
        out = _tokens(_run(engine, [_request(batch * 8 + i, prompt, 3, temperature=temperature)
                                    for i in range(8)]))
        for tokens in out.values():
            seen[0][tokens[1]] += 1  # type: ignore[index]
            seen[1][tokens[2]] += 1  # type: ignore[index]
    for counts, exact in zip(seen, (p1, p2), strict=True):
        expected = [float(exact[t]) * n for t in range(8)]
        chi2 = sum((counts[t] - e) ** 2 / e for t, e in enumerate(expected) if e > 0)
        assert chi2 < 29.9, (counts, expected)
    stats = engine.speculator.stats()
    assert 0 < stats.accepted < stats.proposed, stats  # drafts both accepted and rejected


def test_ngram_index_proposes_what_followed_the_latest_occurrence() -> None:
    index = NgramIndex(min_n=2, max_n=3)
    tokens = [1, 2, 3, 4, 9, 2, 3, 5, 6, 2, 3]
    assert index.propose(tokens, 3) == (5, 6, 2)  # the latest (2, 3) was followed by 5
    tokens += [7, 8]
    assert index.propose(tokens, 2) == ()  # (7, 8) and (3, 7, 8) never occurred before
    tokens = [5, 1, 2, 1, 2]
    assert NgramIndex().propose(tokens, 5) == (1, 2, 1, 2, 1)  # a loop goes on looping


def test_incremental_index_agrees_with_a_fresh_one() -> None:
    rng = random.Random(0)
    tokens: list[int] = []
    grown = NgramIndex()
    for _ in range(400):
        tokens += [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
        assert grown.propose(tokens, 4) == NgramIndex().propose(tokens, 4)


def test_draft_length_follows_acceptance() -> None:
    length = DraftLength(most=8)
    assert length.next() == 8
    length.verified(8, 2)
    assert length.next() == 3
    length.verified(3, 3)
    assert length.next() == 6
    for _ in range(10):  # misses in a row: it pauses, then tries one token
        if length.paused:
            break
        length.verified(max(length.next(), 1), 0)
    assert [length.next() for _ in range(PAUSE_STEPS + 1)] == [0] * PAUSE_STEPS + [1]
    assert math.isclose(length.rate, 0.4)
