"""How many CPU threads each step computes with.

A big step (a prompt's prefill) is matrix work that keeps every core busy, and nothing else
runs meanwhile. A decode step is short, and while it runs the API replica and Redis on the same
machine stream the previous step's tokens: a compute thread that has to share its core with
them stalls every parallel region of the step at its barrier. Under `redserve up` on a 2-vCPU
machine, decode steps on one thread served 32 streams at 1.8x the tokens/s of two threads, while
a 2,000-token prefill ran 1.3x faster on two. So steps of at least `min_tokens` tokens take
`large` threads and the others `small`; a worker alone on its machine (a pod) uses every core
for both.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

# Below this many tokens a step is mostly decode: latency-bound, sharing the CPU with I/O.
LARGE_STEP_TOKENS = 256


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


@dataclass(frozen=True)
class ThreadPolicy:
    large: int
    small: int
    min_tokens: int = LARGE_STEP_TOKENS

    def apply(self, num_tokens: int) -> None:
        want = self.large if num_tokens >= self.min_tokens else self.small
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)
