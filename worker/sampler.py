"""Next-token choice for each request of a batch, each with its own parameters and generator.

Order, as in vLLM and transformers: logit_bias, repetition penalty (prompt and output),
presence/frequency penalties (output), then log-probabilities are taken from these logits
(before temperature), then temperature, top-k, top-p, min-p and the draw.

Numerically safe whatever a client sends: a temperature below `GREEDY_BELOW` is greedy (as in
vLLM: dividing by 1e-40 would overflow every logit to inf), logits pushed past the float range
by a penalty are clamped back into it and NaN ones are excluded, and log-probabilities are
clamped at `MIN_LOGPROB` (OpenAI's floor), so JSON never meets inf or NaN. A row whose
parameters leave no token with a finite probability fails alone, as a `SamplingError` in its
place of the result: the rest of the batch is sampled as usual.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shared.messages import SamplingParams, TokenLogprob

log = logging.getLogger("redserve.worker")

GREEDY_BELOW = 1e-5
MIN_LOGPROB = -9999.0


class SamplingError(ValueError):
    """This row cannot be sampled: its request ends with an error, the batch goes on."""


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


Sampled = tuple[int, TokenLogprob | None] | SamplingError


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < GREEDY_BELOW


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if is_greedy(params):
        return None
    gen = torch.Generator(device=device)
    if params.seed is None:
        gen.seed()
    return gen  # a seeded one is re-seeded for each token (see `_sample_row`)


def token_seed(seed: int, position: int) -> int:
    """The seed of output token `position`: a pure function of the two, so a request resumed on
    another worker from its published tokens draws exactly what it would have drawn."""
    return (seed * 0x9E3779B97F4A7C15 + position) % (1 << 63)


def sample(logits: torch.Tensor, rows: Sequence[Row]) -> list[Sampled]:
    """`logits` is [batch, vocab] in fp32; returns each row's token and, if asked, logprobs,
    or the `SamplingError` that ended that row.

    Plain greedy rows (the common case in a large batch) take one batched argmax; the others
    go row by row, each with its own generator, so a seeded request draws the same numbers
    whatever else shares its batch.
    """
    out: list[Sampled | None] = [None] * len(rows)
    plain = [i for i, row in enumerate(rows) if _plain_greedy(row.params)]
    if plain:
        # Over every row (cheaper than selecting the plain ones first); `max` finds the same
        # first maximum as `argmax`, about twice as fast on CPU.
        best = logits.max(dim=-1).indices.tolist()
        for i in plain:
            out[i] = (best[i], None)
    for i, (scores, row) in enumerate(zip(logits, rows, strict=True)):
        if out[i] is None:
            try:
                out[i] = _sample_row(scores, row)
            except SamplingError as e:
                out[i] = e
            except Exception:  # a bug or a bad logit must not end the batch
                log.exception("sampling failed for one row of the batch")
                out[i] = SamplingError("the sampler could not draw a token under this "
                                       "request's parameters")
    return [o for o in out if o is not None]  # every row is filled by now


def _plain_greedy(p: SamplingParams) -> bool:
    return (is_greedy(p) and p.logprobs is None and not p.logit_bias
            and p.repetition_penalty == 1.0 and not p.presence_penalty
            and not p.frequency_penalty)


def _sample_row(scores: torch.Tensor, row: Row) -> tuple[int, TokenLogprob | None]:
    p = row.params
    scores = _finite(_adjust(scores, row))
    if p.seed is not None and row.generator is not None:
        row.generator.manual_seed(token_seed(p.seed, len(row.tokens) - row.num_prompt))
    token = _draw(scores, p, row.generator)
    logprob: TokenLogprob | None = None
    if p.logprobs is not None:
        logprobs = torch.log_softmax(scores, dim=-1).clamp_(min=MIN_LOGPROB)
        top = torch.topk(logprobs, p.logprobs) if p.logprobs else None
        alternatives = (tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True))
                        if top is not None else ())
        logprob = (float(logprobs[token]), alternatives)
    return token, logprob


def _finite(scores: torch.Tensor) -> torch.Tensor:
    """Overflowed logits back into range (+inf: the largest float, so such tokens tie), NaN
    ones out of the running; at least one token must stay possible."""
    if bool(torch.isfinite(scores).all()):
        return scores
    big = torch.finfo(scores.dtype).max
    scores = torch.nan_to_num(scores, nan=float("-inf"), posinf=big, neginf=float("-inf"))
    if not bool(torch.isfinite(scores).any()):
        raise SamplingError("no token has a finite score under this request's sampling "
                            "parameters")
    return scores


def _adjust(scores: torch.Tensor, row: Row) -> torch.Tensor:
    p = row.params
    if not (p.logit_bias or p.repetition_penalty != 1.0 or p.presence_penalty
            or p.frequency_penalty):
        return scores
    scores = scores.clone()
    if p.logit_bias:
        ids = torch.tensor([t for t, _ in p.logit_bias], device=scores.device)
        scores.index_add_(0, ids, torch.tensor([b for _, b in p.logit_bias],
                                               device=scores.device, dtype=scores.dtype))
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
    if is_greedy(p) or gen is None:
        return int(torch.argmax(scores))
    # Dividing can overflow again (a clamped logit over a small temperature).
    scores = _finite(scores / p.temperature)
    if 0 < p.top_k < scores.shape[-1]:
        kth = torch.topk(scores, p.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        drop = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= p.top_p
        drop[0] = False  # even when top_p underflows to 0 in float32
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs.masked_fill(drop, 0.0))
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return int(torch.multinomial(probs, 1, generator=gen))
