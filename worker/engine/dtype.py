"""Which floating-point type the worker computes and caches KV in.

bf16 halves the bytes every matmul and attention read moves, and on hardware that computes it
natively (CUDA; CPUs with AVX512-BF16 or AMX) it is the fastest type: on an EPYC with
avx512_bf16 the default model's linear layers take about a third of their fp32 time. On a CPU
without those instructions torch emulates bf16 by converting to fp32 and back, which is slower
than fp32 itself, so `auto` reads the CPU's flags rather than assuming. fp16 is offered for
GPUs that lack bf16; on CPU it is emulated and slow, but a user may still ask for it.
"""

from __future__ import annotations

from pathlib import Path

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# CPU flags (as /proc/cpuinfo spells them) under which bf16 matmuls run natively.
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first CPU's feature flags; empty where /proc/cpuinfo is absent (not Linux)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def pick_dtype(setting: str, device: torch.device,
               flags: frozenset[str] | None = None) -> torch.dtype:
    """`setting` is auto or one of `DTYPES`; auto is bf16 on CUDA and on CPUs with native bf16
    (by `flags`, read from the machine when not given), fp32 elsewhere."""
    if setting != "auto":
        return DTYPES[setting]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "cpu":
        native = NATIVE_BF16_FLAGS & (cpu_flags() if flags is None else flags)
        return torch.bfloat16 if native else torch.float32
    return torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
