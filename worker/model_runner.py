"""One forward pass over a packed batch of prefill chunks and decode tokens, over paged KV.

transformers supplies config and weights; the forward pass is written here because serving
wants a different shape of computation than `model.forward`: every request's new tokens packed
into one sequence with no padding, q/k/v and gate/up each fused into one matmul, weights laid
out once for the kernel that runs them (`worker/linear.py`), rotary tables computed once, and
attention reading each request's KV from its pages in the shared pool. Every op rounds as the
checkpoint's own modules round in the compute dtype (RMSNorm in fp32, then cast, then scaled),
so a request alone reproduces transformers' tokens at bf16 too, not only at fp32.

Attention, per layer:
- a prefill chunk from position 0 attends over its own fresh K/V (causal SDPA, nothing read
  from the pool);
- a chunk after a cached prefix or an earlier chunk gathers its pages and uses a causal mask
  offset by its start;
- decode tokens run in a few SDPA calls, one per group of requests of similar length (sorted,
  up to DECODE_GROUP and DECODE_GROUP_KV_BYTES at a time, so padding to the group's longest
  wastes little and the gathered K/V stays in cache): their pages are
  gathered into a [group, pages x page_size] view with a mask; the query heads that share a KV
  head are laid out as that head's query rows, so grouped-query attention needs no K/V repeat.
  A request decoding alone takes its exact keys, unmasked, a row per query head:
  transformers' layout, whose rounding in bf16 the grouped layout does not reproduce bit for
  bit.
On CUDA the same calls reach torch's fused SDPA kernels.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from worker.checkpoint import check_config
from worker.kv_cache import KVPool, KVShape
from worker.linear import Linear, Quantization

# Decode requests per attention call, at most. Sorting by length and splitting the batch into
# groups cut the padded work by about a third on a batch of 64 mixed-length requests.
DECODE_GROUP = 16
# ... and at most this much gathered K and V per call (one layer): a group that stays in cache
# runs SDPA faster. Batch 32, bf16, one thread: groups of 4 at 512 tokens of context took half
# the time of groups of 16; at 96 tokens, 16 stayed best.
DECODE_GROUP_KV_BYTES = 3 * 1024**2 // 2


@dataclass(frozen=True)
class Chunk:
    """`tokens` of one request at positions `start`..., whose KV goes to `pages`."""

    tokens: Sequence[int]
    start: int
    pages: Sequence[int]  # the request's page table, covering start + len(tokens)
    sample: bool  # return logits for the last token


@dataclass(frozen=True)
class _Layer:
    input_norm: torch.Tensor
    qkv: Linear
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear


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


class ModelRunner:
    def __init__(self, model: PreTrainedModel, *, release_modules: bool = False,
                 quantization: Quantization = "none") -> None:
        """With `release_modules`, the model's decoder layers are dropped as they are fused
        (the model is unusable afterwards)."""
        config = model.config
        check_config(config)
        inner = model.model
        attn = inner.layers[0].self_attn
        self.head_dim: int = attn.head_dim
        self.num_heads: int = config.num_attention_heads
        self.num_kv_heads: int = config.num_key_value_heads
        self.scaling: float = attn.scaling
        self.eps: float = config.rms_norm_eps
        param = next(model.parameters())
        self.kv_shape = KVShape(
            num_layers=len(inner.layers),
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=param.dtype,
            device=param.device,
        )
        with torch.no_grad():
            self.final_norm = _own(inner.norm.weight)
            self.lm_head = Linear(model.lm_head.weight)
            self.embed = _own(inner.embed_tokens.weight)  # its own copy even when tied
            self.layers = []
            for i, layer in enumerate(inner.layers):
                self.layers.append(_fuse(layer, quantization))
                if release_modules:  # free the unfused weights now: a lower peak at start
                    inner.layers[i] = torch.nn.Identity()
            self.cos, self.sin = _rotary_tables(inner.rotary_emb, config.max_position_embeddings,
                                                param.device, param.dtype)
        self.pool: KVPool | None = None
        empty = torch.empty(0, dtype=param.dtype, device=param.device)
        self._scratch = [empty, empty]  # K and V gather buffers, grown to the largest step

    @property
    def device(self) -> torch.device:
        return self.kv_shape.device

    def linears(self) -> list[Linear]:
        """Every linear layer, in the order a forward pass runs them."""
        per_layer = [lin for layer in self.layers
                     for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        return [*per_layer, self.lm_head]

    def weight_bytes(self) -> int:
        tensors = [self.embed, self.final_norm, self.cos, self.sin]
        for layer in self.layers:
            tensors += [t for t in (layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm)
                        if t is not None]
        tensors += [t for lin in self.linears() for t in lin.tensors()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def attach(self, pool: KVPool) -> None:
        self.pool = pool

    @torch.inference_mode()
    def forward(self, chunks: Sequence[Chunk]) -> torch.Tensor:
        """Logits, [number of sampling chunks, vocab] in fp32, in chunk order. Prefill chunks
        (more than one token) come first, then decode chunks (one token each)."""
        assert self.pool is not None, "attach a KV pool first"
        page_size = self.pool.page_size
        device = self.device
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        prefills: list[_Prefill] = []
        decode_rows: list[Chunk] = []
        logit_rows: list[int] = []
        for chunk in chunks:
            lo = len(ids)
            n = len(chunk.tokens)
            ids.extend(chunk.tokens)
            for pos in range(chunk.start, chunk.start + n):
                positions.append(pos)
                slots.append(chunk.pages[pos // page_size] * page_size + pos % page_size)
            if chunk.sample:
                logit_rows.append(lo + n - 1)
            if n > 1 or chunk.start == 0:
                assert not decode_rows, "prefill chunks must come before decode chunks"
                prefills.append(self._prefill(chunk, lo, device))
            else:
                decode_rows.append(chunk)
        decode = self._decode(decode_rows, len(ids) - len(decode_rows))

        ids_t = torch.tensor(ids, dtype=torch.long, device=device)
        pos_t = torch.tensor(positions, dtype=torch.long, device=device)
        slots_t = torch.tensor(slots, dtype=torch.long, device=device)
        cos, sin = self.cos[pos_t], self.sin[pos_t]
        hidden = F.embedding(ids_t, self.embed)
        for i, layer in enumerate(self.layers):
            x = _rms_norm(hidden, layer.input_norm, self.eps)
            hidden = hidden + self._attention(i, layer, x, cos, sin, slots_t, prefills, decode)
            x = _rms_norm(hidden, layer.post_norm, self.eps)
            gate, up = layer.gate_up(x).chunk(2, dim=-1)
            hidden = hidden + layer.down(F.silu(gate) * up)
        last = hidden[torch.tensor(logit_rows, dtype=torch.long, device=device)]
        last = _rms_norm(last, self.final_norm, self.eps)
        return self.lm_head(last).float()

    def _prefill(self, chunk: Chunk, lo: int, device: torch.device) -> _Prefill:
        n = len(chunk.tokens)
        if chunk.start == 0:
            return _Prefill(lo, lo + n, 0, None, None)
        assert self.pool is not None
        end = chunk.start + n
        pages = torch.tensor(chunk.pages[: -(-end // self.pool.page_size)], device=device)
        mask = torch.ones(n, end, dtype=torch.bool, device=device).tril(diagonal=chunk.start)
        return _Prefill(lo, lo + n, chunk.start, pages, mask)

    def _decode(self, rows: list[Chunk], lo: int) -> list[_Decode]:
        assert self.pool is not None
        page_size = self.pool.page_size
        device = self.device
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
        token_bytes = self.kv_shape.bytes_per_token() // self.kv_shape.num_layers
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

    def _attention(
        self,
        i: int,
        layer: _Layer,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        prefills: list[_Prefill],
        decode: list[_Decode],
    ) -> torch.Tensor:
        assert self.pool is not None
        t = x.shape[0]
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = layer.qkv(x)
        q, k, v = qkv.split((nh * hd, nkv * hd, nkv * hd), dim=-1)
        q, k, v = q.view(t, nh, hd), k.view(t, nkv, hd), v.view(t, nkv, hd)
        if layer.q_norm is not None and layer.k_norm is not None:  # Qwen3
            q = _rms_norm(q, layer.q_norm, self.eps)
            k = _rms_norm(k, layer.k_norm, self.eps)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        else:  # q and k heads side by side in the fused output: one rotation for both
            qk = _rotate(qkv[:, : (nh + nkv) * hd].view(t, nh + nkv, hd), cos, sin)
            q, k = qk[:, :nh], qk[:, nh:]

        k_pool, v_pool = self.pool.k[i], self.pool.v[i]  # [pages, page_size, kv heads, dim]
        k_pool.view(-1, nkv, hd).index_copy_(0, slots, k)
        v_pool.view(-1, nkv, hd).index_copy_(0, slots, v)

        out = torch.empty((t, nh, hd), dtype=q.dtype, device=q.device)
        for p in prefills:
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
        for d in decode:
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
        return layer.o(out.view(t, nh * hd))

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


def _fuse(layer: Any, quantization: Quantization) -> _Layer:  # layer: typed loosely by HF
    attn, mlp = layer.self_attn, layer.mlp
    biases = [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]
    q_norm = getattr(attn, "q_norm", None)
    k_norm = getattr(attn, "k_norm", None)
    return _Layer(
        input_norm=_own(layer.input_layernorm.weight),
        qkv=Linear(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
                   torch.cat(biases) if biases[0] is not None else None,
                   quantization=quantization),
        q_norm=_own(q_norm.weight) if q_norm is not None else None,
        k_norm=_own(k_norm.weight) if k_norm is not None else None,
        o=Linear(attn.o_proj.weight, attn.o_proj.bias, quantization=quantization),
        post_norm=_own(layer.post_attention_layernorm.weight),
        gate_up=Linear(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                       quantization=quantization),
        down=Linear(mlp.down_proj.weight, quantization=quantization),
    )


def _own(tensor: torch.Tensor) -> torch.Tensor:
    """A private copy: checkpoint tensors may be views of the memory-mapped weight file,
    which stays resident while any of them lives."""
    return tensor.detach().clone()


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm rounded as the checkpoints' own modules round it: normalised in fp32, cast
    back, then scaled by the weight in the compute dtype. A single fused op rounds once instead,
    and in bf16 that difference alone flipped greedy tokens against transformers."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype) * weight


def _rotary_tables(rotary: torch.nn.Module, max_len: int, device: torch.device,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for every position, [max_len, head_dim], from the checkpoint's own rotary
    module (so rope scaling variants come with it); sin's first half negated (see `_rotate`)."""
    positions = torch.arange(max_len, device=device)[None]
    probe = torch.zeros(1, device=device, dtype=dtype)
    cos, sin = rotary(probe, positions)
    half = sin.shape[-1] // 2
    sign = torch.cat([-torch.ones(half, device=device), torch.ones(half, device=device)])
    return cos[0].to(dtype), (sin[0] * sign.to(sin.dtype)).to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, half-split layout; x is [tokens, heads, dim], cos and signed sin are
    [tokens, dim]. (x2, x1) by a roll times (-sin, sin) is transformers' rotate_half(x) * sin
    with the same roundings, in one op fewer."""
    return x * cos[:, None] + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin[:, None]
