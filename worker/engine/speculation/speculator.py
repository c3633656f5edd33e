"""Which requests draft, how many tokens, in each step; and the worker's speculation counters.

A step's drafts are worth their compute only while the step is memory-bound: each draft token
adds a token's worth of multiply to a step that mostly waits on weight reads. A step of 32
decodes is not memory-bound on a CPU any more (its matrices are 32 rows tall), so drafting stops
once the step's tokens reach `STEP_TOKENS`, decodes, prefill chunks and drafts together: a
busy worker never speculates and loses nothing to it, a lone stream or a few get the speedup.
Within the budget, requests draft oldest first.

A request drafts unless the worker's `--speculation` is `off`, it opted out (`speculation:
false` in its body: `SamplingParams.speculate`), or it is constrained: its grammar's matcher
would have to consume each draft and roll back the rejected ones, which this engine does not
do (constrained requests decode one token a step).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Literal

from worker.engine.drafting.adaptive import Drafting, DraftLength
from worker.engine.drafting.drafter import NgramIndex
from worker.engine.sequence import Sequence

Method = Literal["ngram", "off"]
DEFAULT_TOKENS = 5
# Tokens of a step (every request's) under which drafting goes on; measured in
# ops/benchmarks/speculation.py (docs/benchmarks.md#speculative-decoding).
STEP_TOKENS = 24


@dataclass(frozen=True)
class SpeculationConfig:
    method: Method = "ngram"
    tokens: int = DEFAULT_TOKENS  # draft tokens per request per step, at most
    step_tokens: int = STEP_TOKENS  # a step's tokens up to which requests draft


NO_SPECULATION = SpeculationConfig(method="off")


@dataclass(frozen=True)
class SpeculationStats:
    """Counters since start, as the metrics and the heartbeat show them."""

    proposed: int = 0  # draft tokens verified
    accepted: int = 0  # ... of which the model agreed with (emitted as they were)
    verifications: int = 0  # request-steps that verified drafts
    steps: int = 0  # request-steps that emitted tokens (speculating or not)
    tokens: int = 0  # tokens those emitted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens a decoding request gets from one step, on average (1.0 without drafts)."""
        return self.tokens / self.steps if self.steps else 0.0


class Speculator:
    def __init__(self, config: SpeculationConfig) -> None:
        self.config = config
        self._stats = SpeculationStats()

    def stats(self) -> SpeculationStats:
        """A snapshot; safe to read while a step runs (one reference read)."""
        return self._stats

    def propose(self, seqs: Seq[Sequence], step_tokens: int) -> list[tuple[int, ...]]:
        """Draft tokens for each of `seqs` (decoding requests, oldest first) in a step that
        holds `step_tokens` tokens without them: an empty draft for those that don't."""
        budget = self.config.step_tokens - step_tokens
        drafts: list[tuple[int, ...]] = []
        for seq in seqs:
            draft: tuple[int, ...] = ()
            if budget > 0 and self._eligible(seq):
                state = seq.drafting
                if state is None:
                    state = seq.drafting = Drafting(NgramIndex(), DraftLength(self.config.tokens))
                # The last draft token's successor is the bonus token: all of them must fit
                # in the request's capacity (and so under its max_tokens).
                k = min(state.length.next(), budget, seq.capacity - len(seq.tokens) - 1)
                draft = state.index.propose(seq.tokens, k)
                budget -= len(draft)
            drafts.append(draft)
        return drafts

    def _eligible(self, seq: Sequence) -> bool:
        return (self.config.method != "off" and seq.request.params.speculate
                and seq.constraint is None)

    def verified(self, seq: Sequence, proposed: int, accepted: int, emitted: int) -> None:
        """A step's outcome for `seq`: `proposed` drafts checked (0: none), `accepted` of
        them agreed with, `emitted` tokens sent (stops and the length limit may cut them)."""
        s = self._stats
        if proposed and seq.drafting is not None:
            seq.drafting.length.verified(proposed, accepted)
        self._stats = SpeculationStats(
            s.proposed + proposed, s.accepted + accepted, s.verifications + (proposed > 0),
            s.steps + 1, s.tokens + emitted)
