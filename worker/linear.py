"""Linear layers whose weights are laid out once, at start, for the kernel that runs them.

On CPU, oneDNN (torch's mkldnn backend) multiplies fastest with a weight already reordered into
its blocked layout (the VNNI pairs that AVX512-BF16 and AMX read); given a plain tensor it
reorders the weight again on every call, which at decode batch sizes costs more than the
multiply. Prepacking once, as torch.compile's freezing pass does, took the default model's
576x3072 bf16 projection from 368 to 217 us at batch 1 and from 710 to 441 us at batch 32 on an
EPYC with avx512_bf16, with bit-identical results; fp32 gained as much at batch 32. Where oneDNN
cannot run the dtype (bf16 on a CPU without AVX512, fp16 on most CPUs) or on CUDA, the layer is
what the checkpoint's own module computes, F.linear over the [out, in] weight: any other GEMM
layout rounds bf16 differently (seen on an AVX2 EPYC), and a request alone must decode exactly
what transformers does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# A batch-size hint for the reorder; measured batch 1 to 128 ran as fast with this as with
# their own hint.
PACK_FOR_BATCH = 32


def can_prepack(dtype: torch.dtype, device: torch.device) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False


class Linear:
    """y = x W^T + b for a checkpoint's [out, in] weight; x is [tokens, in]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias.detach().clone() if bias is not None else None
        self.mode = "packed" if can_prepack(weight.dtype, weight.device) else "plain"
        w = weight.detach()
        if self.mode == "packed":
            try:
                self.weight = torch.ops.mkldnn._reorder_linear_weight(w, PACK_FOR_BATCH)
                return
            except RuntimeError:  # a oneDNN build without this layout: run it plainly
                self.mode = "plain"
        self.weight = w.contiguous().clone()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "packed":
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight] if self.bias is None else [self.weight, self.bias]
