"""Next-token choice for each request of a batch, each with its own parameters and generator.

Order, as in vLLM and transformers: logit_bias, repetition penalty (prompt and output),
presence/frequency penalties (output), then log-probabilities are taken from these logits
(before temperature), then temperature, top-k, top-p, min-p and the draw.

Batched: a step samples every row with a handful of tensor operations over the whole batch,
whatever mix of greedy and temperature rows it holds; only the penalties (which read each
request's own tokens) and the random number of a seeded request are made row by row. The draw
inverts each row's CDF at one uniform number: unseeded rows take theirs from one generator of
the batch, a seeded row from its own generator re-seeded for each token (`token_seed`), so it
draws the same tokens whatever shares its batch. A row with top-p, min-p or top-k is cut and
drawn among its likeliest tokens only (`nucleus.py`), to the same token as over the whole row.

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
from worker.engine import nucleus

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
    """A request's own generator, for seeded sampling only; the others share the batch's."""
    if is_greedy(params) or params.seed is None:
        return None
    return torch.Generator(device=device)  # re-seeded for each token (see `token_seed`)


def token_seed(seed: int, position: int) -> int:
    """The seed of output token `position`: a pure function of the two, so a request resumed on
    another worker from its published tokens draws exactly what it would have drawn."""
    return (seed * 0x9E3779B97F4A7C15 + position) % (1 << 63)


def sample(logits: torch.Tensor, rows: Sequence[Row],
           generator: torch.Generator | None = None) -> list[Sampled]:
    """`logits` is [batch, vocab] in fp32; returns each row's token and, if asked, logprobs,
    or the `SamplingError` that ended that row. `generator` draws for unseeded rows (torch's
    default one when None)."""
    errors: dict[int, SamplingError] = {}
    scores = _penalised(logits, rows, errors)
    # `max` finds argmax's first maximum, twice as fast, for the greedy rows; its values tell
    # which rows hold a NaN or an overflow (max propagates NaN, and +inf is the max), without a
    # pass of its own. Without a greedy row, `amax` tells it alone, 7x faster.
    greedy = any(is_greedy(row.params) for row in rows)
    if greedy:
        best, tokens = scores.max(dim=-1)
    else:
        best = scores.amax(dim=-1)
        tokens = torch.zeros(len(rows), dtype=torch.long, device=scores.device)
    if not bool(torch.isfinite(best).all()):
        scores = _finite(scores, errors)
        if greedy:
            best, tokens = scores.max(dim=-1)
        else:
            best = scores.amax(dim=-1)
    draw = [i for i, row in enumerate(rows) if not is_greedy(row.params) and i not in errors]
    if draw:
        try:
            some = scores if len(draw) == len(rows) else scores[draw]
            tokens[draw] = _draw_rows(some, best[draw], [rows[i] for i in draw], generator)
        except Exception:  # a bug or a bad parameter: find the row, spare the others
            log.exception("sampling failed for the batch; drawing row by row")
            for i in draw:
                try:
                    tokens[i] = _draw_rows(scores[i : i + 1], best[i : i + 1], [rows[i]],
                                           generator)[0]
                except Exception:
                    errors[i] = SamplingError("the sampler could not draw a token under this "
                                              "request's parameters")
    chosen = tokens.tolist()
    logprobs = _logprobs(scores, rows, tokens, errors)
    return [errors[i] if i in errors else (chosen[i], logprobs.get(i))
            for i in range(len(rows))]


def _penalised(logits: torch.Tensor, rows: Sequence[Row],
               errors: dict[int, SamplingError]) -> torch.Tensor:
    """Logit bias and the penalties, row by row for the rows that ask for them."""
    adjusted = [i for i, row in enumerate(rows) if _needs_adjust(row.params)]
    if not adjusted:
        return logits
    scores = logits.clone()
    for i in adjusted:
        try:
            scores[i] = _adjust(logits[i], rows[i])
        except Exception:  # a bug or a bad parameter must not end the batch
            log.exception("penalties failed for one row of the batch")
            errors[i] = SamplingError("the sampler could not apply this request's penalties")
    return scores


def _finite(scores: torch.Tensor, errors: dict[int, SamplingError]) -> torch.Tensor:
    """Overflowed logits back into range (+inf: the largest float, so such tokens tie), NaN
    ones out of the running; a row left with no possible token fails."""
    big = torch.finfo(scores.dtype).max
    scores = torch.nan_to_num(scores, nan=float("-inf"), posinf=big, neginf=float("-inf"))
    for i in (~torch.isfinite(scores).any(dim=-1)).nonzero().flatten().tolist():
        errors.setdefault(i, SamplingError("no token has a finite score under this request's "
                                           "sampling parameters"))
    return scores


def _draw_rows(scores: torch.Tensor, best: torch.Tensor, rows: list[Row],
               generator: torch.Generator | None) -> torch.Tensor:
    """One token per row, each under its own temperature, top-k, top-p and min-p; `best` is
    each row's largest score."""
    p = [row.params for row in rows]
    device = scores.device
    temperature = torch.tensor([x.temperature for x in p], dtype=scores.dtype,
                               device=device)[:, None]
    # Dividing can overflow again (a clamped logit over a small temperature): the rows' largest
    # scores tell, without a pass of their own. A score that overflows to -inf alone changes
    # nothing: below a finite maximum not near the float's least value, its exp is 0 either way.
    scores = scores / temperature
    top = best / temperature[:, 0]
    if not bool(((top < float("inf")) & (top > torch.finfo(scores.dtype).min / 2)).all()):
        scores = scores.nan_to_num_(posinf=torch.finfo(scores.dtype).max)
    vocab = scores.shape[-1]
    top_k = [x.top_k if 0 < x.top_k < vocab else 0 for x in p]
    if any(top_k):
        kth = torch.topk(scores, max(top_k)).values
        kth = kth.gather(1, torch.tensor([max(k, 1) - 1 for k in top_k], device=device)[:, None])
        kth[torch.tensor([k == 0 for k in top_k], device=device)] = float("-inf")
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # Inverse CDF: one uniform number a row (a draw over the whole vocabulary per row, as
    # multinomial or an exponential race make, cost 38 ms for 32 rows of 49k tokens).
    uniform = torch.rand(len(rows), 1, generator=generator, device=device, dtype=probs.dtype)
    for j, row in enumerate(rows):
        if row.generator is not None and row.params.seed is not None:
            row.generator.manual_seed(token_seed(row.params.seed,
                                                 len(row.tokens) - row.num_prompt))
            uniform[j] = torch.rand(1, generator=row.generator, device=device,
                                    dtype=probs.dtype)
    return nucleus.draw(probs, [x.top_p for x in p], [x.min_p for x in p],
                        [k > 0 for k in top_k], uniform)


def _logprobs(scores: torch.Tensor, rows: Sequence[Row], tokens: torch.Tensor,
              errors: dict[int, SamplingError]) -> dict[int, TokenLogprob]:
    want = [i for i, row in enumerate(rows) if row.params.logprobs is not None
            and i not in errors]
    if not want:
        return {}
    logprobs = torch.log_softmax(scores[want], dim=-1).clamp_(min=MIN_LOGPROB)
    chosen = logprobs.gather(1, tokens[want][:, None])[:, 0].tolist()
    k = max(rows[i].params.logprobs or 0 for i in want)
    top = torch.topk(logprobs, k) if k else None
    ids = top.indices.tolist() if top is not None else [[]] * len(want)
    values = top.values.tolist() if top is not None else [[]] * len(want)
    out: dict[int, TokenLogprob] = {}
    for j, i in enumerate(want):
        n = rows[i].params.logprobs or 0
        out[i] = (chosen[j], tuple(zip(ids[j][:n], values[j][:n], strict=True)))
    return out


def _needs_adjust(p: SamplingParams) -> bool:
    return bool(p.logit_bias or p.repetition_penalty != 1.0 or p.presence_penalty
                or p.frequency_penalty)


def _adjust(scores: torch.Tensor, row: Row) -> torch.Tensor:
    p = row.params
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
