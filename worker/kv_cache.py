"""Per-request KV storage: one contiguous K and V buffer per request, sized at admission.

A request's whole length (prompt + max_tokens) is known when it is admitted, so its buffer is
allocated once and written in place; the engine admits requests only while the sum of those
sizes stays under the configured byte budget, so memory stays bounded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    def bytes_per_token(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


class RequestKV:
    def __init__(self, shape: KVShape, capacity: int) -> None:
        size = (shape.num_layers, shape.num_kv_heads, capacity, shape.head_dim)
        self.k = torch.empty(size, dtype=shape.dtype, device=shape.device)
        self.v = torch.empty(size, dtype=shape.dtype, device=shape.device)
        self.capacity = capacity


class KVBudget:
    """Counts the tokens of KV held by admitted requests against a fixed budget."""

    def __init__(self, shape: KVShape, budget_bytes: int) -> None:
        self.shape = shape
        self.total_tokens = budget_bytes // shape.bytes_per_token()
        self.used_tokens = 0

    def try_allocate(self, capacity: int) -> RequestKV | None:
        if self.used_tokens + capacity > self.total_tokens:
            return None
        self.used_tokens += capacity
        return RequestKV(self.shape, capacity)

    def release(self, kv: RequestKV) -> None:
        self.used_tokens -= kv.capacity
