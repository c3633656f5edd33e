"""The draw of each sampled row from its probabilities under top-p and min-p, made among the
row's likeliest tokens rather than over its whole vocabulary.

Over a whole row, the top-p cut needs the tokens ranked by probability (a partial sort, then a
full one when the likeliest 256 hold too little: 35-70 ms for 32 rows of SmolLM2's 49k tokens
where one row's nucleus is wide) and the draw needs a cumulative sum of every token; the
softmax before them takes a millisecond. So each row's candidates are gathered first: the
tokens whose probability reaches a floor `tau`, found through the maxima of blocks of `BLOCK`
tokens (one pass over the row, then a look inside the blocks whose maximum reaches `tau`). The
cut, min-p and the draw run among them in vocabulary order, and draw the token the whole row
would give for the same uniform number: the cumulative sums add the same numbers in the same
order (in double precision on CPU, so the zeros between candidates change nothing), and the cut
compares the same cumulative sums with top_p. Equal probabilities rank in vocabulary order,
whatever else shares the batch.

The candidates hold everything a row can draw when one of its rules leaves nothing below
`tau`: min-p (`tau` is then its threshold), top-k (the probabilities below the k-th are zero,
`tau` is then the least positive float), or top-p when the candidates hold at least top_p of
the mass, checked as before on their ranked cumulative sum. For top-p, `tau` is (1 - top_p)
times each of `TOP_P_FLOORS` in turn, for the rows whose candidates held too little, then
(1 - top_p) / (2 x vocab): below that the tokens left out hold at most half of 1 - top_p, so a
row fails there only by rounding, and is then cut over its whole vocabulary, as is the draw of
a row with no rule (temperature alone).
"""

from __future__ import annotations

import numpy as np
import torch

BLOCK = 64  # tokens whose maximum is taken together when looking for candidates
# A top-p row's candidate floors, in shares of 1 - top_p, before the last, 1 / (2 x vocab): on
# 32 rows of SmolLM2's logits at temperature 0.8 and top-p 0.9 (the step benchmark's), the
# first gathers 368 candidates in the widest row and every row's hold top_p. A higher first
# floor leaves rows to a second gathering, which costs about as much as the first; a lower one
# gathers and sorts more candidates.
TOP_P_FLOORS = (1 / 512, 1 / 4096, 1 / 32768)


def draw(probs: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
         top_k_cut: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token for each row of `probs` [n, vocab]: `top_p`, `min_p` [n] (1 and 0 where a row
    has none), `top_k_cut` [n] (its probabilities are zero below its k-th token), `uniform`
    [n, 1] the number its inverse CDF is read at."""
    token = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    narrow = (top_p < 1) | (min_p > 0) | top_k_cut
    todo = narrow.nonzero()[:, 0]
    if len(todo):
        blocks = _blocks(probs)
        peaks = blocks.amax(dim=-1)
        peak = peaks.amax(dim=-1)
        # Below `floor` a row draws nothing whatever its top-p cut.
        floor = (min_p * peak).maximum(top_k_cut * torch.finfo(probs.dtype).tiny
                                       * torch.finfo(probs.dtype).eps)  # the least float > 0
        tail = torch.where(top_p < 1, 1 - top_p, 0.0)
        vocab = probs.shape[-1]
        for share in [*(f for f in TOP_P_FLOORS if f > 0.5 / vocab), 0.5 / vocab]:
            tau = (tail[todo] * share).maximum(floor[todo]).minimum(peak[todo])
            probs_c, tokens = _candidates(blocks, peaks, todo, tau)
            got, whole = _cut_and_draw(probs_c, tokens, top_p[todo], min_p[todo], uniform[todo])
            fits = whole | (tau <= floor[todo]) & (floor[todo] > 0)
            token[todo[fits]] = got[fits]
            todo = todo[~fits]
            if not len(todo):
                break
    full = torch.cat([(~narrow).nonzero()[:, 0], todo])
    if len(full):
        some = probs if len(full) == len(probs) else probs[full]
        token[full] = _cut_and_draw(some, None, top_p[full], min_p[full], uniform[full])[0]
    return token


def _blocks(probs: torch.Tensor) -> torch.Tensor:
    """`probs` as [n, blocks, BLOCK], the last block padded with zeros (never a candidate)."""
    n, vocab = probs.shape
    if vocab % BLOCK:
        probs = torch.nn.functional.pad(probs, (0, BLOCK - vocab % BLOCK))
    return probs.view(n, -1, BLOCK)


def _candidates(blocks: torch.Tensor, peaks: torch.Tensor, rows: torch.Tensor,
                tau: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The probabilities of `rows`' tokens that reach their `tau` (> 0), in vocabulary order and
    zero after each row's own ([len(rows), widest]), and their tokens."""
    rank, block = (peaks[rows] >= tau[:, None]).nonzero(as_tuple=True)
    p = blocks[rows[rank], block]
    i, j = (p >= tau[rank][:, None]).nonzero(as_tuple=True)
    rank = rank[i]
    counts = torch.bincount(rank, minlength=len(rows))
    col = torch.arange(len(rank), device=rank.device) - (counts.cumsum(0) - counts)[rank]
    shape = (len(rows), max(1, int(counts.max())))
    probs = p.new_zeros(shape)
    probs[rank, col] = p[i, j]
    tokens = rank.new_zeros(shape)
    tokens[rank, col] = block[i] * BLOCK + j
    return probs, tokens


def _cut_and_draw(probs: torch.Tensor, tokens: torch.Tensor | None, top_p: torch.Tensor,
                  min_p: torch.Tensor, uniform: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The token drawn in each row of `probs` (a row's candidates in vocabulary order, `tokens`
    naming them, or its whole vocabulary when None), and whether the row is cut by top-p
    within them (they hold top_p of its mass)."""
    cut = top_p < 1
    whole = torch.zeros_like(cut)
    if bool(cut.any()):
        ranked, order = _ranked(probs)
        mass = torch.cumsum(ranked, dim=-1)
        drop = mass - ranked >= torch.where(cut, top_p, float("inf"))[:, None]
        drop[:, 0] = False  # even when top_p underflows to 0 in float32
        probs = probs.scatter(1, order, ranked.masked_fill(drop, 0.0))
        whole = cut & (mass[:, -1] >= top_p)
    if bool((min_p > 0).any()):
        floor = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
    cdf = probs.cumsum(dim=-1)
    # side="right": the first token whose CDF exceeds the draw, never one of zero probability.
    at = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True)
    past = at[:, 0] >= probs.shape[-1]  # a draw that rounded up to the total
    if bool(past.any()):
        at[past] = probs[past].argmax(dim=-1, keepdim=True)
    return (at if tokens is None else tokens.gather(1, at))[:, 0], whole


def _ranked(probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of `probs` in decreasing order, equal ones in column order, and the column each
    came from. On CPU, numpy sorts keys that pack the two: its x86-simd-sort ranks 32 rows of
    5,000 in 1.8 ms, where torch.sort takes 15."""
    if probs.device.type != "cpu" or probs.dtype != torch.float32:
        return torch.sort(probs, dim=-1, descending=True, stable=True)
    # A non-negative float's bits order as the float does; negated, the largest sorts first.
    columns = torch.arange(probs.shape[-1])
    keys = (-probs.view(torch.int32).long() << 32) | columns
    keys = torch.from_numpy(np.sort(keys.numpy(), axis=-1))
    return (-(keys >> 32)).int().view(torch.float32), keys & 0xFFFFFFFF
