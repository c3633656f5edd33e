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

from collections.abc import Sequence

import numpy as np
import torch

BLOCK = 64  # tokens whose maximum is taken together when looking for candidates
# A top-p row's candidate floors, in shares of 1 - top_p, before the last, 1 / (2 x vocab): on
# 32 rows of SmolLM2's logits at temperature 0.8 and top-p 0.9 (the step benchmark's), the
# first gathers 368 candidates in the widest row and every row's hold top_p. A higher first
# floor leaves rows to a second gathering, which costs about as much as the first; a lower one
# gathers and sorts more candidates.
TOP_P_FLOORS = (1 / 512, 1 / 4096, 1 / 32768)


def draw(probs: torch.Tensor, top_p: Sequence[float], min_p: Sequence[float],
         top_k_cut: Sequence[bool], uniform: torch.Tensor) -> torch.Tensor:
    """One token for each row of `probs` [n, vocab] under its `top_p` (1 for none), `min_p` (0
    for none) and `top_k_cut` (its probabilities are zero below its k-th token); `uniform`
    [n, 1] holds the number each row's inverse CDF is read at."""
    n = probs.shape[0]
    narrow = [i for i in range(n) if top_p[i] < 1 or min_p[i] > 0 or top_k_cut[i]]
    if len(narrow) == n:  # the usual batch: nothing to pick out
        token, left = _draw_narrow(probs, None, top_p, min_p, top_k_cut, uniform)
    else:
        token = torch.empty(n, dtype=torch.long, device=probs.device)
        cut = set(narrow)
        left = [i for i in range(n) if i not in cut]
        if narrow:
            rows = torch.tensor(narrow, device=probs.device)
            token[rows], more = _draw_narrow(
                probs, rows, [top_p[i] for i in narrow], [min_p[i] for i in narrow],
                [top_k_cut[i] for i in narrow], uniform[rows])
            left += more
    if left:
        some = probs if len(left) == n else probs[left]
        token[left] = _cut_and_draw(some, None, _tensor([top_p[i] for i in left], probs),
                                    _tensor([min_p[i] for i in left], probs), uniform[left])[0]
    return token


def _draw_narrow(probs: torch.Tensor, rows: torch.Tensor | None, top_p: Sequence[float],
                 min_p: Sequence[float], top_k_cut: Sequence[bool], uniform: torch.Tensor
                 ) -> tuple[torch.Tensor, list[int]]:
    """The tokens drawn among the candidates of `rows` of `probs` (all when None), and the
    rows of `probs` that no floor fitted (their tokens here are meaningless)."""
    vocab = probs.shape[-1]
    blocks = _blocks(probs)
    peaks = blocks.amax(dim=-1)
    if rows is not None:
        peaks = peaks[rows]
    peak = peaks.amax(dim=-1)
    top_p_t, min_p_t = _tensor(top_p, probs), _tensor(min_p, probs)
    tail = _tensor([1 - p if p < 1 else 0.0 for p in top_p], probs)
    # Below `floor` a row draws nothing whatever its top-p cut: min-p's threshold, or the
    # least float above 0 where top-k zeroed the rest.
    floor = None
    if any(min_p) or any(top_k_cut):
        least = torch.finfo(probs.dtype).tiny * torch.finfo(probs.dtype).eps
        floor = (min_p_t * peak).maximum(_tensor([least if k else 0.0 for k in top_k_cut],
                                                 probs))
    token = torch.empty(len(top_p), dtype=torch.long, device=probs.device)
    todo = torch.arange(len(top_p), device=probs.device)  # by rank in `rows`
    first = True  # `todo` is every row: the per-row tensors are taken as they are
    for share in [*(f for f in TOP_P_FLOORS if f > 0.5 / vocab), 0.5 / vocab]:
        sel = None if first else todo
        tau = _take(tail, sel) * share
        if floor is not None:
            tau = tau.maximum(_take(floor, sel))
        tau = tau.minimum(_take(peak, sel))
        index = todo if rows is None else _take(rows, sel)  # of the rows in `probs`
        probs_c, tokens = _candidates(blocks, _take(peaks, sel), index, tau)
        got, fits = _cut_and_draw(probs_c, tokens, _take(top_p_t, sel), _take(min_p_t, sel),
                                  _take(uniform, sel))
        if floor is not None:
            fits |= (tau <= _take(floor, sel)) & (_take(floor, sel) > 0)
        if first and bool(fits.all()):
            return got, []
        token[todo[fits]] = got[fits]
        todo, first = todo[~fits], False
        if not len(todo):
            return token, []
    return token, (todo if rows is None else rows[todo]).tolist()


def _tensor(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device)


def _take(values: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return values if rows is None else values[rows]


def _blocks(probs: torch.Tensor) -> torch.Tensor:
    """`probs` as [n, blocks, BLOCK], the last block padded with zeros (never a candidate)."""
    n, vocab = probs.shape
    if vocab % BLOCK:
        probs = torch.nn.functional.pad(probs, (0, BLOCK - vocab % BLOCK))
    return probs.view(n, -1, BLOCK)


def _candidates(blocks: torch.Tensor, peaks: torch.Tensor, rows: torch.Tensor,
                tau: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The probabilities of `rows`' tokens that reach their `tau` (> 0), in vocabulary order and
    zero after each row's own ([len(rows), widest]), and their tokens; `peaks` are the rows'."""
    rank, block = (peaks >= tau[:, None]).nonzero(as_tuple=True)
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
    keys = np.negative(probs.numpy().view(np.int32), dtype=np.int64) << 32
    keys |= np.arange(probs.shape[-1])
    keys.sort(axis=-1)
    ranked = np.negative(keys >> 32).astype(np.int32).view(np.float32)
    return torch.from_numpy(ranked), torch.from_numpy(keys & 0xFFFFFFFF)
