"""The sampler's logit processing, on hand-made logits where the right answer is known."""

from __future__ import annotations

import math

import pytest
import torch

from shared.messages import SamplingParams
from worker.engine import nucleus
from worker.engine.sampler import Row, SamplingError, make_generator, sample


def _one(logits: list[float], output: tuple[int, ...] = (), prompt: tuple[int, ...] = (),
         **params: object) -> tuple[int, object]:
    p = SamplingParams(max_tokens=1, **{"temperature": 0.0, **params})  # type: ignore[arg-type]
    row = Row(p, make_generator(p, torch.device("cpu")), (*prompt, *output), len(prompt))
    [(token, logprob)] = sample(torch.tensor([logits]), [row])
    return token, logprob


def test_greedy_and_logprobs() -> None:
    token, logprob = _one([1.0, 3.0, 2.0], logprobs=2)
    assert token == 1
    norm = math.log(math.exp(1) + math.exp(3) + math.exp(2))
    chosen, top = logprob  # type: ignore[misc]
    assert chosen == pytest.approx(3 - norm, abs=1e-5)
    assert [t for t, _ in top] == [1, 2]


def test_logit_bias() -> None:
    assert _one([1.0, 3.0, 2.0], logit_bias=((0, 5.0),))[0] == 0


def test_frequency_and_presence_penalties_count_output_only() -> None:
    # Token 1 leads by 1.0; seen twice in the output, a frequency penalty of 0.6 sinks it.
    assert _one([0.0, 3.0, 2.0], output=(1, 1), frequency_penalty=0.6)[0] == 2
    assert _one([0.0, 3.0, 2.0], output=(1, 1), frequency_penalty=0.4)[0] == 1
    assert _one([0.0, 3.0, 2.0], output=(1,), presence_penalty=1.5)[0] == 2
    # The prompt does not count for these two.
    assert _one([0.0, 3.0, 2.0], prompt=(1, 1, 1), presence_penalty=1.5)[0] == 1


def test_repetition_penalty_covers_prompt_and_output() -> None:
    assert _one([0.0, 3.0, 2.0], prompt=(1,), repetition_penalty=2.0)[0] == 2  # 3/2 < 2
    assert _one([-1.0, -3.0, -2.0], output=(0,), repetition_penalty=3.0)[0] == 2  # -3 < -2


def test_min_p_and_top_k_cut_the_tail() -> None:
    # One dominant token: min_p 0.5 leaves only it, whatever the seed.
    logits = [5.0, 0.0, 0.0, 0.0]
    draws = {_one(logits, temperature=1.0, seed=s, min_p=0.5)[0] for s in range(30)}
    assert draws == {0}
    draws = {_one([1.0, 1.0, 0.9, 0.0], temperature=1.0, seed=s, top_k=2)[0] for s in range(40)}
    assert draws == {0, 1}


def test_extreme_parameters_stay_finite() -> None:
    logits = [1.0, 3.0, 2.0, -1.0]
    for params in ({"temperature": 1e-40, "logprobs": 3},
                   {"repetition_penalty": 1e-300, "logprobs": 3},
                   {"repetition_penalty": 1e-300, "temperature": 1.0, "seed": 3, "logprobs": 3},
                   {"temperature": 1e-5, "seed": 1, "top_p": 1e-300, "min_p": 1.0},
                   {"logit_bias": ((0, 100.0), (1, -100.0)), "logprobs": 3}):
        token, logprob = _one(logits, prompt=(1, 2, 0), **params)
        assert 0 <= token < 4
        if logprob is not None:
            chosen, top = logprob  # type: ignore[misc]
            assert all(math.isfinite(v) and v >= -9999.0 for v in [chosen, *(lp for _, lp in top)])
    # Clamped back into range, the three penalised logits tie, and overflow again when divided
    # by the temperature: clamped again, they still tie.
    draws = {_one(logits, prompt=(1, 2, 0), repetition_penalty=1e-300, temperature=0.5,
                  top_p=0.9, seed=s)[0] for s in range(30)}
    assert draws == {0, 1, 2}
    # A temperature below 1e-5 is greedy, as in vLLM.
    assert {_one(logits, temperature=1e-9, seed=s)[0] for s in range(10)} == {1}


def test_a_row_that_cannot_be_sampled_fails_alone() -> None:
    p = SamplingParams(max_tokens=1, temperature=1.0, seed=1)
    rows = [Row(p, make_generator(p, torch.device("cpu")), (), 0) for _ in range(3)]
    logits = torch.tensor([[1.0, 2.0], [float("nan")] * 2, [3.0, 1.0]])
    good, bad, other = sample(logits, rows)
    assert isinstance(bad, SamplingError)
    assert isinstance(good, tuple) and isinstance(other, tuple)


def test_top_p_keeps_the_nucleus_and_draws_follow_the_probabilities() -> None:
    # probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.75 keeps the first two (0.5 < 0.75 <= 0.8).
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(4000, 1)
    gen = torch.Generator().manual_seed(0)
    p = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.75)
    draws = [t for t, _ in sample(logits, [Row(p, None, (), 0)] * 4000, gen)]  # type: ignore[misc]
    counts = torch.bincount(torch.tensor(draws), minlength=4).tolist()
    assert counts[2] == counts[3] == 0
    assert abs(counts[0] / 4000 - 0.5 / 0.8) < 0.03  # renormalised over the nucleus
    # Without top_p every token is drawn about as often as its probability says.
    p = SamplingParams(max_tokens=1, temperature=1.0)
    draws = [t for t, _ in sample(logits, [Row(p, None, (), 0)] * 4000, gen)]  # type: ignore[misc]
    freq = torch.bincount(torch.tensor(draws), minlength=4).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.03)


def test_a_mixed_batch_samples_each_row_under_its_own_parameters() -> None:
    vocab = 5000
    logits = torch.randn(6, vocab) * 3
    logits[:, 7] = 50.0  # one token dominates every row
    params = [SamplingParams(max_tokens=1, temperature=0.0),
              SamplingParams(max_tokens=1, temperature=0.7, top_k=1),
              SamplingParams(max_tokens=1, temperature=1.0, top_p=0.5, seed=3),
              SamplingParams(max_tokens=1, temperature=1.0, min_p=0.9),
              SamplingParams(max_tokens=1, temperature=0.0, logprobs=2),
              SamplingParams(max_tokens=1, temperature=0.0, logit_bias=((9, 100.0),))]
    rows = [Row(p, make_generator(p, torch.device("cpu")), (1, 2), 1) for p in params]
    out = sample(logits, rows)
    assert [o[0] for o in out] == [7, 7, 7, 7, 7, 9]  # type: ignore[index]
    chosen, top = out[4][1]  # type: ignore[index,misc]
    assert top[0][0] == 7 and len(top) == 2 and chosen == pytest.approx(top[0][1])
    # A seeded row draws the same whatever its neighbours, batched or alone.
    flat = torch.zeros(2, vocab)
    seeded = SamplingParams(max_tokens=1, temperature=1.0, seed=11)
    alone = sample(flat[:1], [Row(seeded, make_generator(seeded, torch.device("cpu")), (1,), 1)])
    other = SamplingParams(max_tokens=1, temperature=1.0)
    batched = sample(flat, [Row(other, None, (1,), 1),
                            Row(seeded, make_generator(seeded, torch.device("cpu")), (1,), 1)])
    assert alone[0] == batched[1]


def test_the_draw_among_candidates_is_the_draw_over_the_whole_vocabulary() -> None:
    # Peaked rows (a few candidates), wide ones (the later floors), ties, a vocabulary that is
    # not a multiple of the block, top-k zeros and min-p: for the same uniform numbers, the
    # tokens drawn among the candidates are those of the whole row.
    gen = torch.Generator().manual_seed(0)
    vocab = 5003
    logits = torch.randn(8, vocab, generator=gen) * torch.tensor([[8.0], [4.0], [2.0], [1.0],
                                                                  [0.3], [0.0], [3.0], [5.0]])
    logits = logits.bfloat16().float()  # rounded as a bf16 model's are: many equal values
    probs = torch.softmax(logits, dim=-1)
    probs[6, probs[6] < probs[6].topk(40).values[-1]] = 0.0  # a row cut to its top 40
    probs[6] /= probs[6].sum()
    top_k_cut = [False] * 6 + [True, False]
    # top-p 0.9999999 leaves a row to the whole vocabulary after the last floor (by rounding).
    for top_p, min_p in ((0.9, 0.0), (0.99, 0.0), (0.9999999, 0.0), (0.3, 0.0), (1e-30, 0.0),
                         (1.0, 0.05), (0.95, 0.01), (1.0, 0.0)):
        tp = torch.full((8,), top_p)
        mp = torch.full((8,), min_p)
        for u in torch.linspace(0, 1, 41)[:-1].tolist():
            uniform = torch.full((8, 1), u)
            whole = nucleus._cut_and_draw(probs, None, tp, mp, uniform)[0]
            drawn = nucleus.draw(probs, [top_p] * 8, [min_p] * 8, top_k_cut, uniform)
            assert torch.equal(drawn, whole)


def test_equal_probabilities_rank_in_vocabulary_order() -> None:
    # Four tokens of 0.25: top-p 0.5 keeps the first two, alone or beside a wide row.
    p = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.5)
    alone = {t for t, _ in sample(torch.zeros(64, 4), [Row(p, None, (), 0)] * 64)}  # type: ignore[misc]
    assert alone == {0, 1}
    logits = torch.zeros(2, 50_000)
    logits[0, 4:] = float("-inf")
    wide = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.99)
    for _ in range(20):
        token, _ = sample(logits, [Row(p, None, (), 0), Row(wide, None, (), 0)])[0]  # type: ignore[misc]
        assert token in (0, 1)
