"""What a step asks of the model for one request: some of its tokens, and where their KV goes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Chunk:
    """`tokens` of one request at positions `start`..., whose KV goes to `pages`."""

    tokens: Sequence[int]
    start: int
    pages: Sequence[int]  # the request's page table, covering start + len(tokens)
    sample: bool  # return logits for the last token
