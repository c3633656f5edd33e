"""The sampler's logit processing, on hand-made logits where the right answer is known."""

from __future__ import annotations

import math

import pytest
import torch

from shared.messages import SamplingParams
from worker.sampler import Row, SamplingError, make_generator, sample


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
    # A temperature below 1e-5 is greedy, as in vLLM.
    assert {_one(logits, temperature=1e-9, seed=s)[0] for s in range(10)} == {1}


def test_a_row_that_cannot_be_sampled_fails_alone() -> None:
    p = SamplingParams(max_tokens=1, temperature=1.0, seed=1)
    rows = [Row(p, make_generator(p, torch.device("cpu")), (), 0) for _ in range(3)]
    logits = torch.tensor([[1.0, 2.0], [float("nan")] * 2, [3.0, 1.0]])
    good, bad, other = sample(logits, rows)
    assert isinstance(bad, SamplingError)
    assert isinstance(good, tuple) and isinstance(other, tuple)
