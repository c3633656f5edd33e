"""Next-token choice for each request of a batch, each with its own parameters and generator.

Order, as in vLLM and transformers: logit_bias, repetition penalty (prompt and output),
presence/frequency penalties (output), then log-probabilities are taken from these logits
(before temperature), then temperature, top-k, top-p, min-p and the draw.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shared.messages import SamplingParams, TokenLogprob


@dataclass(frozen=True)
class Row:
    params: SamplingParams
    generator: torch.Generator | None
    tokens: Sequence[int]  # prompt, then output so far (read only when a penalty needs it)
    num_prompt: int

    @property
    def prompt_ids(self) -> Sequence[int]:
        return self.tokens[: self.num_prompt]

    @property
    def output_ids(self) -> Sequence[int]:
        return self.tokens[self.num_prompt :]


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.temperature == 0.0:
        return None
    gen = torch.Generator(device=device)
    if params.seed is None:
        gen.seed()
    return gen  # a seeded one is re-seeded for each token (see `_sample_row`)


def token_seed(seed: int, position: int) -> int:
    """The seed of output token `position`: a pure function of the two, so a request resumed on
    another worker from its published tokens draws exactly what it would have drawn."""
    return (seed * 0x9E3779B97F4A7C15 + position) % (1 << 63)


def sample(logits: torch.Tensor, rows: Sequence[Row]) -> list[tuple[int, TokenLogprob | None]]:
    """`logits` is [batch, vocab] in fp32; returns each row's token and, if asked, logprobs.

    Plain greedy rows (the common case in a large batch) take one batched argmax; the others
    go row by row, each with its own generator, so a seeded request draws the same numbers
    whatever else shares its batch.
    """
    out: list[tuple[int, TokenLogprob | None] | None] = [None] * len(rows)
    plain = [i for i, row in enumerate(rows) if _plain_greedy(row.params)]
    if plain:
        # Over every row (cheaper than selecting the plain ones first); `max` finds the same
        # first maximum as `argmax`, about twice as fast on CPU.
        best = logits.max(dim=-1).indices.tolist()
        for i in plain:
            out[i] = (best[i], None)
    for i, (scores, row) in enumerate(zip(logits, rows, strict=True)):
        if out[i] is None:
            out[i] = _sample_row(scores, row)
    return [o for o in out if o is not None]  # every row is filled by now


def _plain_greedy(p: SamplingParams) -> bool:
    return (p.temperature == 0.0 and p.logprobs is None and not p.logit_bias
            and p.repetition_penalty == 1.0 and not p.presence_penalty
            and not p.frequency_penalty)


def _sample_row(scores: torch.Tensor, row: Row) -> tuple[int, TokenLogprob | None]:
    p = row.params
    scores = _adjust(scores, row)
    if p.seed is not None and row.generator is not None:
        row.generator.manual_seed(token_seed(p.seed, len(row.tokens) - row.num_prompt))
    token = _draw(scores, p, row.generator)
    logprob: TokenLogprob | None = None
    if p.logprobs is not None:
        logprobs = torch.log_softmax(scores, dim=-1)
        top = torch.topk(logprobs, p.logprobs) if p.logprobs else None
        alternatives = (tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True))
                        if top is not None else ())
        logprob = (float(logprobs[token]), alternatives)
    return token, logprob


def _adjust(scores: torch.Tensor, row: Row) -> torch.Tensor:
    p = row.params
    if not (p.logit_bias or p.repetition_penalty != 1.0 or p.presence_penalty
            or p.frequency_penalty):
        return scores
    scores = scores.clone()
    if p.logit_bias:
        ids = torch.tensor([t for t, _ in p.logit_bias], device=scores.device)
        scores[ids] += torch.tensor([b for _, b in p.logit_bias], device=scores.device)
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.tokens)), device=scores.device)
        picked = scores[seen]
        scores[seen] = torch.where(picked > 0, picked / p.repetition_penalty,
                                   picked * p.repetition_penalty)
    output = row.output_ids if p.presence_penalty or p.frequency_penalty else ()
    if output:
        counts = torch.bincount(torch.tensor(output, device=scores.device),
                                minlength=scores.shape[-1]).to(scores.dtype)
        scores -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(scores.dtype)
    return scores


def _draw(scores: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    if p.temperature == 0.0 or gen is None:
        return int(torch.argmax(scores))
    scores = scores / p.temperature
    if 0 < p.top_k < scores.shape[-1]:
        kth = torch.topk(scores, p.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        drop = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= p.top_p
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs.masked_fill(drop, 0.0))
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return int(torch.multinomial(probs, 1, generator=gen))
