"""Verifying draft tokens: one sampler row per prediction, then the drafts that stand.

A speculating request's chunk is its last sampled token t and drafts d1..dk; the forward pass
returns k + 1 rows of logits, row j predicting the token after t, d1..dj. Each row is sampled as
an ordinary decode of that context would be (`rows`: the row's tokens are the request's plus
the drafts before it, so penalties see them, and `min_tokens` and logprobs count them), all
rows of the step in one `worker.engine.sampler.sample` call. Walking the rows in order, the
sampled token is emitted; while it equals the next draft, that draft's KV (computed in the same
pass) stands and the next row is valid too; the first token that differs, or the row after the
last draft (the "bonus"), ends the request's step (`accepted`).

Exact, for every kind of request:
- greedy: each row's token is the argmax of the same logits plain decoding computes (at fp32
  up to the rounding of a differently shaped batch: the same tokens; with `--batch-invariant`
  the same bits), so the output is the same tokens; at bf16 without it a near-tie can flip,
  as batching alone can;
- sampled: row j's token is drawn from the target distribution p_j (after temperature, top-k,
  top-p, min-p and penalties). Drawing x ~ p_j and accepting the draft d when x = d is
  rejection sampling with a one-hot draft distribution: d is accepted with probability p_j(d),
  and on rejection x is distributed as p_j without d, renormalised. So each emitted token has
  exactly the distribution of plain decoding (tests/test_speculation.py checks it);
- seeded: the sampler re-seeds a seeded row from the request's seed and the row's output
  position (`worker.engine.sampler.token_seed`), the same position plain decoding draws it at,
  so a seeded request draws the same numbers with or without speculation, and resumed or taken
  over on another worker it stays reproducible.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from worker.engine.sampler import Row, Sampled, SamplingError
from worker.engine.sequence import Sequence


def rows(seq: Sequence, drafts: Seq[int]) -> list[Row]:
    """The sampler rows of `seq`'s step: its next token, then the one after each draft."""
    params, generator, prompt = seq.request.params, seq.generator, seq.num_prompt
    if not drafts:
        return [Row(params, generator, seq.tokens, prompt)]
    return [Row(params, generator, [*seq.tokens, *drafts[:j]], prompt)
            for j in range(len(drafts) + 1)]


def accepted(choices: Seq[Sampled], drafts: Seq[int]) -> int:
    """How many drafts stand: those each sampled in their place, up to the first that was
    not (a row whose sampling failed ends them too)."""
    n = 0
    for choice, draft in zip(choices, drafts, strict=False):
        if isinstance(choice, SamplingError) or choice[0] != draft:
            break
        n += 1
    return n
