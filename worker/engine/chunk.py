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
    # ... and, when sampling, for the `logits` last tokens: a speculating request's chunk is
    # its last sampled token and its draft tokens, each of whose predictions is checked
    # (worker/engine/speculation/).
    logits: int = 1
    lora: str = ""  # the adapter its request names (worker/engine/lora/); "" for the base

    @property
    def rows(self) -> int:
        """Rows of logits the forward pass returns for this chunk."""
        return self.logits if self.sample else 0
