"""One forward pass over a packed batch, using the checkpoint's own transformers modules.

transformers supplies config, weights, norms, projections, MLPs and rotary embeddings; this
file only re-orders them so that any mix of prefill chunks and decode tokens runs as one packed
sequence (no padding) and each request attends over its own KV buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from worker.kv_cache import KVShape, RequestKV

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class Segment:
    """`length` new tokens of one request, written to its KV buffer from position `start`."""

    kv: RequestKV
    start: int
    length: int


class ModelRunner:
    def __init__(self, model: PreTrainedModel) -> None:
        config = model.config
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model type {config.model_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
            if config.sliding_window < config.max_position_embeddings:
                raise ValueError("sliding-window attention is not supported")
        self.model = model.eval()
        self.config = config
        self.layers = model.model.layers
        attn = self.layers[0].self_attn
        self.head_dim: int = attn.head_dim
        self.num_heads: int = config.num_attention_heads
        self.num_kv_heads: int = config.num_key_value_heads
        self.scaling: float = attn.scaling
        param = next(model.parameters())
        self.kv_shape = KVShape(
            num_layers=len(self.layers),
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=param.dtype,
            device=param.device,
        )

    @property
    def device(self) -> torch.device:
        return self.kv_shape.device

    @torch.inference_mode()
    def forward(self, token_ids: Sequence[int], segments: Sequence[Segment]) -> torch.Tensor:
        """Run `token_ids` (the segments' new tokens, concatenated) and return the logits of
        each segment's last token, shape [len(segments), vocab]."""
        device = self.device
        ids = torch.tensor(token_ids, dtype=torch.long, device=device)
        positions = torch.cat(
            [torch.arange(s.start, s.start + s.length, device=device) for s in segments]
        )
        inner = self.model.model
        hidden = inner.embed_tokens(ids)[None]  # [1, T, H]
        cos, sin = inner.rotary_emb(hidden, positions[None])
        bounds = []
        offset = 0
        for s in segments:
            bounds.append((offset, offset + s.length))
            offset += s.length
        masks = [_causal_mask(s, device) for s in segments]

        for layer_idx, layer in enumerate(self.layers):
            residual = hidden
            x = layer.input_layernorm(hidden)
            attn_out = self._attention(
                layer_idx, layer.self_attn, x, cos, sin, segments, bounds, masks
            )
            hidden = residual + attn_out
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))

        hidden = inner.norm(hidden)
        last = torch.tensor([end - 1 for _, end in bounds], device=device)
        return self.model.lm_head(hidden[0, last]).float()

    def _attention(
        self,
        layer_idx: int,
        attn: Any,  # the checkpoint's attention module (q/k/v/o projections, optional norms)
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        segments: Sequence[Segment],
        bounds: list[tuple[int, int]],
        masks: list[torch.Tensor | None],
    ) -> torch.Tensor:
        t = x.shape[1]
        q = attn.q_proj(x).view(1, t, self.num_heads, self.head_dim)
        k = attn.k_proj(x).view(1, t, self.num_kv_heads, self.head_dim)
        v = attn.v_proj(x).view(1, t, self.num_kv_heads, self.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3 normalises q and k per head before rotary
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        v = v.transpose(1, 2)

        out = torch.empty_like(q)
        for seg, (lo, hi), mask in zip(segments, bounds, masks, strict=True):
            end = seg.start + seg.length
            k_cache, v_cache = seg.kv.k[layer_idx], seg.kv.v[layer_idx]
            k_cache[:, seg.start : end] = k[0, :, lo:hi]
            v_cache[:, seg.start : end] = v[0, :, lo:hi]
            out[:, :, lo:hi] = F.scaled_dot_product_attention(
                q[:, :, lo:hi],
                k_cache[None, :, :end],
                v_cache[None, :, :end],
                attn_mask=mask,
                is_causal=mask is None and seg.length > 1,
                scale=self.scaling,
                enable_gqa=True,
            )
        return attn.o_proj(out.transpose(1, 2).reshape(1, t, self.num_heads * self.head_dim))


def _causal_mask(seg: Segment, device: torch.device) -> torch.Tensor | None:
    """None where SDPA's own causal flag is right: one query token, or a prompt from position 0."""
    if seg.length == 1 or seg.start == 0:
        return None
    end = seg.start + seg.length
    return torch.ones(seg.length, end, dtype=torch.bool, device=device).tril(diagonal=seg.start)
