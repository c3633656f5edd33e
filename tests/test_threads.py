"""The thread chooser: each step size runs the count that measured fastest, keeps trying the
others now and then (so a change of load is followed), and respects a pinned count."""

from __future__ import annotations

import torch

from worker.engine.threads import (
    EXPLORE_EVERY,
    LARGE_STEP_TOKENS,
    WARMUP_SAMPLES,
    ThreadChooser,
    ThreadPolicy,
)


def _drive(chooser: ThreadChooser, tokens: int, steps: int,
           per_token_s: dict[int, float]) -> list[int]:
    """`steps` steps of `tokens` tokens whose cost per token on each count is given."""
    chosen = []
    for _ in range(steps):
        threads = chooser.choose(tokens)
        chooser.record(tokens, threads, per_token_s[threads] * tokens)
        chosen.append(threads)
    return chosen


def test_each_step_size_runs_the_count_that_measured_fastest() -> None:
    chooser = ThreadChooser(ThreadPolicy(2))
    assert chooser.policy.candidates == (1, 2)
    warm = WARMUP_SAMPLES + 1
    # Batch-1 decodes are faster on one thread here (the other core is busy), 32-row ones on two.
    small = _drive(chooser, 1, warm + 4 * EXPLORE_EVERY, {1: 0.03, 2: 0.05})
    large = _drive(chooser, 32, warm + 4 * EXPLORE_EVERY, {1: 0.0024, 2: 0.0015})
    # A new step size starts on all the cores and tries the other count once.
    assert small[:warm] == large[:warm] == [2] * WARMUP_SAMPLES + [1]
    assert small[warm:].count(2) == 4 and large[warm:].count(1) == 4  # one try in EXPLORE_EVERY
    assert chooser.preferred() == {1: 1, 32: 2}


def test_a_change_of_load_is_followed() -> None:
    chooser = ThreadChooser(ThreadPolicy(2))
    _drive(chooser, 16, 3 * EXPLORE_EVERY, {1: 0.004, 2: 0.002})
    assert chooser.preferred() == {16: 2}
    # The other core gets busy: two threads become slower than one.
    _drive(chooser, 16, 12 * EXPLORE_EVERY, {1: 0.004, 2: 0.009})
    assert chooser.preferred() == {16: 1}


def test_a_pinned_decode_count_and_a_pinned_policy_are_kept() -> None:
    decode = ThreadChooser(ThreadPolicy(4, decode=1))
    assert decode.choose(32) == 1 and decode.choose(LARGE_STEP_TOKENS) == 4
    pinned = ThreadChooser(ThreadPolicy(4, pinned=True))
    assert {pinned.choose(n) for n in (1, 32, 512)} == {4}
    assert ThreadPolicy(4).candidates == (2, 3, 4)


def test_apply_sets_torchs_thread_count() -> None:
    before = torch.get_num_threads()
    try:
        chooser = ThreadChooser(ThreadPolicy(1, pinned=True))
        assert chooser.apply(8) == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_one_usable_core_runs_one_thread_every_step() -> None:
    chooser = ThreadChooser(ThreadPolicy(1))
    assert chooser.policy.candidates == (1,)
    assert set(_drive(chooser, 32, 4 * EXPLORE_EVERY, {1: 0.002})) == {1}
