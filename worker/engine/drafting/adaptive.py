"""Each speculating request's draft length, from its recent acceptance.

Prompt lookup is right in runs: while a request copies from its prompt, drafts are accepted
whole; where it departs, the first draft token is usually wrong. So the length doubles (up to
the worker's `--speculative-tokens`) after a draft accepted whole, and drops to one more than
what was accepted after a rejection. A request whose drafts keep missing (the moving average
of its accepted fraction under `OFF_BELOW`) stops drafting for `PAUSE_STEPS` steps, then tries
one token again: a wrong draft wastes little in a memory-bound step, but not nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.engine.drafting.drafter import NgramIndex

SMOOTHING = 0.3  # weight of the latest verification in the moving average
OFF_BELOW = 0.2  # accepted fraction under which a request pauses drafting
PAUSE_STEPS = 8
RESUME_RATE = 2 * OFF_BELOW  # the average a request resumes with (one more miss: not yet off)


@dataclass
class DraftLength:
    most: int
    tokens: int = 0  # this request's current draft length (0: `most`, its start)
    rate: float = 1.0  # moving average of the fraction of its drafts accepted
    paused: int = 0  # steps left without drafting

    def next(self) -> int:
        """How many tokens to draft in this step (0: none); called once per step."""
        if self.paused:
            self.paused -= 1
            return 0
        return self.tokens or self.most

    def verified(self, proposed: int, accepted: int) -> None:
        self.rate += SMOOTHING * (accepted / proposed - self.rate)
        if accepted == proposed:
            self.tokens = min(2 * proposed, self.most)
        else:
            self.tokens = accepted + 1
        if self.rate < OFF_BELOW:
            self.paused, self.rate, self.tokens = PAUSE_STEPS, RESUME_RATE, 1


@dataclass
class Drafting:
    """A request's speculation state, kept with its `Sequence` (preemption keeps it too)."""

    index: NgramIndex
    length: DraftLength
