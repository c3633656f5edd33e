"""A benchmark-only stand-in for the model: each forward pass just takes a fixed time.

`REDSERVE_SYNTHETIC_STEP_MS` makes a worker run the real engine (scheduler, pages, sampler)
and the real Redis loop around this runner, so broker benchmarks measure Redis and the API
replicas rather than a CPU-bound model. Every row of logits picks the same token (a request
drafting by prompt lookup then has every draft accepted). Never for serving.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from worker.engine.chunk import Chunk
from worker.engine.kernels import Kernels
from worker.engine.kv_cache import KVPool, KVShape

SYNTHETIC_TOKEN = 100


class SyntheticRunner:
    def __init__(self, vocab_size: int, step_s: float) -> None:
        self.vocab_size = vocab_size
        self.step_s = step_s
        self.kv_shape = KVShape(num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32,
                                device=torch.device("cpu"))
        self.kernels = Kernels("synthetic", False, "REDSERVE_SYNTHETIC_STEP_MS: no model")

    @property
    def device(self) -> torch.device:
        return self.kv_shape.device

    def attach(self, pool: KVPool) -> None:
        pass  # nothing is ever written to it

    def forward(self, chunks: Sequence[Chunk]) -> torch.Tensor:
        time.sleep(self.step_s)
        logits = torch.zeros(sum(c.rows for c in chunks), self.vocab_size)
        logits[:, SYNTHETIC_TOKEN] = 1.0
        return logits
