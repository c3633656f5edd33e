"""What a benchmark ran on, printed in its header: the CPU model and the flags that decide
which dtype is fast, so figures from different sessions are never compared blindly."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

from worker.engine.dtype import cpu_flags

FLAGS_OF_INTEREST = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def describe() -> str:
    flags = cpu_flags()
    present = [f for f in FLAGS_OF_INTEREST if f in flags]
    absent = [f for f in FLAGS_OF_INTEREST if f not in flags]
    kernels = torch.backends.cpu.get_cpu_capability()
    return (f"CPU: {cpu_model()}, {os.cpu_count()} logical CPUs, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads, kernels {kernels})"
            f"\nflags: {' '.join(present) or 'none'}; absent: {' '.join(absent) or 'none'}")


def peak_rss_mib(pids: list[int]) -> float:
    """The sum of the peak resident sets (VmHWM) of `pids`, in MiB; gone ones count 0."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024


def cpu_seconds(pid: int) -> float:
    """The user and system CPU process `pid` has used so far (OSError once it is gone)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo += children.get(p, [])
    return found
