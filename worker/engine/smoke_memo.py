"""The smoke tests a machine has passed, remembered on disk, so that a worker restarted on the
same machine (by `redserve up`'s supervisor, a rollout, a crash loop elsewhere in the process)
does not pay the check's child process again: an interpreter importing torch and the library,
2 to 4 s of a 2-vCPU machine's CPU per start.

A pass is remembered under a digest of everything its result depends on: the library file
(path, size, modification time), torch's version, the CPU's flags, the configuration checked
(dtype, head size, page size, KV split) and the checks themselves (this package's smoke.py).
A failure is never remembered: the next start checks again. With a fault injected for the
tests (`REDSERVE_FAULT_KERNEL`) nothing is read or written. A memo that cannot be read or
written is no memo: the check runs, as it always did.
"""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path

import torch

from worker.engine.dtype import cpu_flags, dtype_name
from worker.engine.native_ops import load_native_library

_CHECKS = Path(__file__).with_name("smoke.py")


def memo_path(cache_dir: Path, dtype: torch.dtype, head_dim: int, page_size: int,
              split_kv: bool) -> Path | None:
    """Where this configuration's pass on this machine is remembered; None without a library
    (nothing to remember)."""
    native = load_native_library()
    if isinstance(native, str):
        return None
    try:
        library, checks = native.library.stat(), _CHECKS.stat()
    except OSError:
        return None
    key = "\n".join([
        str(native.library), str(library.st_size), str(library.st_mtime_ns), torch.__version__,
        " ".join(sorted(cpu_flags())), dtype_name(dtype), str(head_dim), str(page_size),
        str(split_kv), str(checks.st_size), str(checks.st_mtime_ns)])
    return cache_dir / "kernel-checks" / hashlib.sha256(key.encode()).hexdigest()


def passed_before(path: Path | None) -> bool:
    return path is not None and path.is_file()


def remember_pass(path: Path | None) -> None:
    if path is None:
        return
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("passed\n")
