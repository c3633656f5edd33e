"""Attention in pure torch: each request's pages gathered into a buffer, then SDPA.

- a prefill chunk from position 0 attends over its own fresh K/V (causal SDPA, nothing read
  from the pool);
- a chunk after a cached prefix or an earlier chunk gathers its pages and uses a causal mask
  offset by its start;
- decode tokens run in a few SDPA calls, one per group of requests of similar length (sorted,
  up to DECODE_GROUP and DECODE_GROUP_KV_BYTES at a time, so padding to the group's longest
  wastes little and the gathered K/V stays in cache): their pages are gathered into a
  [group, pages x page_size] view with a mask; the query heads that share a KV head are laid
  out as that head's query rows, so grouped-query attention needs no K/V repeat.
  A request decoding alone takes its exact keys, unmasked, a row per query head:
  transformers' layout, whose rounding in bf16 the grouped layout does not reproduce bit for
  bit.
On CUDA the same calls reach torch's fused SDPA kernels. The pool is token-major,
[pages, page_size, kv heads, dim] per layer, so a gathered request is a strided view SDPA reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker.engine.chunk import Chunk
from worker.engine.kv_cache import KVPool

# Decode requests per attention call, at most. Sorting by length and splitting the batch into
# groups cut the padded work by about a third on a batch of 64 mixed-length requests.
DECODE_GROUP = 16
# ... and at most this much gathered K and V per call (one layer): a group that stays in cache
# runs SDPA faster. Batch 32, bf16, one thread: groups of 4 at 512 tokens of context took half
# the time of groups of 16; at 96 tokens, 16 stayed best.
DECODE_GROUP_KV_BYTES = 3 * 1024**2 // 2


@dataclass(frozen=True)
class _Prefill:
    lo: int  # slice of the packed batch
    hi: int
    start: int  # position of its first token
    pages: torch.Tensor | None  # page ids to gather when start > 0
    mask: torch.Tensor | None


@dataclass(frozen=True)
class _Decode:
    """One group of decode tokens."""

    rows: torch.Tensor  # their rows in the packed batch
    pages: torch.Tensor  # their page tables, [group x max pages] flattened
    mask: torch.Tensor | None  # [group, 1, 1, max pages * page_size], True where attended
    length: int = 0  # a request decoding alone: its exact length, and no mask


class GatherAttention:
    def __init__(self, pool: KVPool, scaling: float) -> None:
        assert not pool.shape.head_major, "gather attention reads a token-major pool"
        self.pool = pool
        self.scaling = scaling
        empty = torch.empty(0, dtype=pool.shape.dtype, device=pool.shape.device)
        self._scratch = [empty, empty]  # K and V gather buffers, grown to the largest step
        self._prefills: list[_Prefill] = []
        self._decode: list[_Decode] = []
        self._slots = torch.empty(0, dtype=torch.long)

    def prepare(self, chunks: Sequence[Chunk], slots: torch.Tensor) -> None:
        self._slots = slots
        self._prefills = []
        decode_rows: list[Chunk] = []
        lo = 0
        for chunk in chunks:
            n = len(chunk.tokens)
            if n > 1 or chunk.start == 0:
                assert not decode_rows, "prefill chunks must come before decode chunks"
                self._prefills.append(self._prefill(chunk, lo))
            else:
                decode_rows.append(chunk)
            lo += n
        self._decode = self._plan_decode(decode_rows, lo - len(decode_rows))

    def _prefill(self, chunk: Chunk, lo: int) -> _Prefill:
        n = len(chunk.tokens)
        if chunk.start == 0:
            return _Prefill(lo, lo + n, 0, None, None)
        device = self.pool.shape.device
        end = chunk.start + n
        pages = torch.tensor(chunk.pages[: -(-end // self.pool.page_size)], device=device)
        mask = torch.ones(n, end, dtype=torch.bool, device=device).tril(diagonal=chunk.start)
        return _Prefill(lo, lo + n, chunk.start, pages, mask)

    def _plan_decode(self, rows: list[Chunk], lo: int) -> list[_Decode]:
        page_size = self.pool.page_size
        device = self.pool.shape.device
        order = sorted(range(len(rows)), key=lambda i: rows[i].start)
        groups = []
        for members in self._group(order, rows, page_size):
            width = -(-(rows[members[-1]].start + 1) // page_size)  # the longest is last
            table: list[int] = []  # page tables padded to `width` with page 0 (masked out)
            for i in members:
                pages = rows[i].pages[: -(-(rows[i].start + 1) // page_size)]
                table += [*pages, *[0] * (width - len(pages))]
            member_rows = torch.tensor([lo + i for i in members], device=device)
            if len(rows) == 1:
                groups.append(_Decode(member_rows, torch.tensor(table, device=device), None,
                                      length=rows[members[0]].start + 1))
                continue
            lengths = torch.tensor([rows[i].start + 1 for i in members])
            mask = torch.arange(width * page_size)[None, :] < lengths[:, None]
            groups.append(_Decode(member_rows, torch.tensor(table, device=device),
                                  mask[:, None, None, :].to(device)))
        return groups

    def _group(self, order: list[int], rows: list[Chunk], page_size: int) -> list[list[int]]:
        """Split `order` (decode rows, shortest first) into attention calls."""
        shape = self.pool.shape
        token_bytes = shape.bytes_per_token() // shape.num_layers
        groups: list[list[int]] = []
        members: list[int] = []
        for i in order:
            padded = -(-(rows[i].start + 1) // page_size) * page_size  # the longest so far
            if members and (len(members) == DECODE_GROUP
                            or (len(members) + 1) * padded * token_bytes > DECODE_GROUP_KV_BYTES):
                groups.append(members)
                members = []
            members.append(i)
        if members:
            groups.append(members)
        return groups

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                 ) -> torch.Tensor:
        t, nh, hd = q.shape
        nkv = k.shape[1]
        k_pool, v_pool = self.pool.k[layer], self.pool.v[layer]
        k_pool.view(-1, nkv, hd).index_copy_(0, self._slots, k)
        v_pool.view(-1, nkv, hd).index_copy_(0, self._slots, v)

        out = torch.empty((t, nh, hd), dtype=q.dtype, device=q.device)
        for p in self._prefills:
            qp = q[p.lo : p.hi].transpose(0, 1)[None]
            if p.pages is None:  # from position 0: its own K/V is all it attends to
                kp, vp = k[p.lo : p.hi], v[p.lo : p.hi]
            else:
                end = p.start + p.hi - p.lo
                kp = self._gather(0, k_pool, p.pages).flatten(0, 1)[:end]
                vp = self._gather(1, v_pool, p.pages).flatten(0, 1)[:end]
            out[p.lo : p.hi] = F.scaled_dot_product_attention(
                qp, kp.transpose(0, 1)[None], vp.transpose(0, 1)[None], attn_mask=p.mask,
                is_causal=p.mask is None, scale=self.scaling, enable_gqa=True,
            )[0].transpose(0, 1)
        for d in self._decode:
            b = d.rows.numel()
            shape = (b, -1, nkv, hd)
            kd = self._gather(0, k_pool, d.pages).view(shape)
            vd = self._gather(1, v_pool, d.pages).view(shape)
            if d.length:
                # One request: its exact keys and a row per query head, as transformers lays
                # it out, so that a request alone decodes bit for bit as `generate` does.
                qd = q.index_select(0, d.rows).view(1, nh, 1, hd)
                kd, vd = kd[:, : d.length], vd[:, : d.length]
                attended = F.scaled_dot_product_attention(
                    qd, kd.transpose(1, 2), vd.transpose(1, 2), scale=self.scaling,
                    enable_gqa=True)
            else:
                # [b, kv heads, queries per kv head, dim]: grouped heads become query rows.
                qd = q.index_select(0, d.rows).view(b, nkv, nh // nkv, hd)
                attended = F.scaled_dot_product_attention(
                    qd, kd.transpose(1, 2), vd.transpose(1, 2), attn_mask=d.mask,
                    scale=self.scaling)
            out.index_copy_(0, d.rows, attended.reshape(b, nh, hd))
        return out

    def _gather(self, which: int, pool: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
        """Copy `pages` of one layer's pool into a reused buffer. index_select copies whole
        pages (plain indexing is several times slower on CPU), and reusing the buffer spares
        the allocator a fresh, page-faulted block for every layer of every step."""
        page_numel = pool[0].numel()
        need = pages.numel() * page_numel
        if self._scratch[which].numel() < need:
            self._scratch[which] = torch.empty(need, dtype=pool.dtype, device=pool.device)
        out = self._scratch[which][:need].view(pages.numel(), *pool.shape[1:])
        return torch.index_select(pool, 0, pages, out=out)
