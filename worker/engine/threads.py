"""How many CPU threads each step computes with, chosen by measuring the steps themselves.

A step's tensor work splits across threads in parallel regions, each ending at a barrier. On a
machine the worker has to itself, more threads are faster: on 2 vCPUs a batch-32 decode step
took 46 ms on two threads against 77 on one, a batch-1 step 16 against 30. But under
`redserve up` the API replica, Redis and the worker's own event loop run on the same cores,
and a compute thread that loses its core to them for a moment stalls every barrier of the
step: with the other core busy, two threads measured 2 to 4 times slower than one. Which
count wins depends on the load of the moment, the machine and what else runs on it, so no
fixed rule (an earlier one kept a core free in decode steps) is right everywhere: on an
idle 2-vCPU machine that rule left 40% of the decode speed unused.

So the engine measures. Steps fall into buckets by their token count (powers of two: a
batch-1 decode, a batch-32 decode and a 512-token prefill chunk each have their own), and in
each bucket `ThreadChooser` keeps a moving average of the seconds per token of every candidate
count (all the cores the worker may use, one fewer, half). It runs the best one, and every
`EXPLORE_EVERY`-th step of the bucket one of the others, so that it follows the load as it
changes; an exploring step costs at most that step's difference.

A new bucket starts on all the cores (`WARMUP_SAMPLES` steps) and tries each other count once:
buckets of large steps are rare (a long prompt's chunks), and when every count had its three
samples first, fewest threads first, the first long prompts after a start ran their chunks on
one thread: the first 2,000-token prompt took 4.9 s where two threads take 2.9 (2-vCPU EPYC).

A fixed count can be asked for (`--decode-threads` given to the worker). Exactness does not
need one: in batch-invariant mode a row's logits came out bit-identical on one thread and on
two (tests/test_kernels.py checks it), so the chooser runs in that mode too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

# At least this many tokens a step is a prefill chunk, when a decode count is pinned.
LARGE_STEP_TOKENS = 256
# In each bucket: all the cores are measured this many times first and every other count once,
# then one step in this many tries the next other count; a new measurement has this weight in
# the moving average.
WARMUP_SAMPLES = 3
EXPLORE_EVERY = 16
SMOOTHING = 0.2


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


@dataclass(frozen=True)
class ThreadPolicy:
    """`most`: the threads a step may use. `decode`: 0 to choose by measurement, else steps
    under `LARGE_STEP_TOKENS` tokens run on `decode` threads and the others on `most`.
    `pinned`: every step on `most`."""

    most: int
    decode: int = 0
    pinned: bool = False

    @property
    def candidates(self) -> tuple[int, ...]:
        if self.pinned:
            return (self.most,)
        return tuple(sorted({self.most, max(1, self.most - 1), max(1, self.most // 2)}))

    def describe(self) -> str:
        """For logs and /health: what the policy is."""
        if self.pinned:
            return f"{self.most} threads"
        if self.decode:
            return f"{self.most} threads, {self.decode} in steps under {LARGE_STEP_TOKENS} tokens"
        return f"measured per step size among {'/'.join(map(str, self.candidates))} threads"


@dataclass
class _Bucket:
    cost: dict[int, float] = field(default_factory=dict)  # threads -> seconds per token
    samples: dict[int, int] = field(default_factory=dict)
    steps: int = 0
    explored: int = 0


class ThreadChooser:
    """The thread count of each step (`choose`, then `apply`), learnt from the time each step
    took (`record`). One per engine; not thread-safe (the compute thread alone uses it)."""

    def __init__(self, policy: ThreadPolicy) -> None:
        self.policy = policy
        self.last = 0  # the count of the latest step (the heartbeat's)
        self._buckets: dict[int, _Bucket] = {}

    def choose(self, num_tokens: int) -> int:
        policy = self.policy
        if policy.pinned:
            return policy.most
        if policy.decode:
            return policy.decode if num_tokens < LARGE_STEP_TOKENS else policy.most
        bucket = self._buckets.setdefault(num_tokens.bit_length(), _Bucket())
        bucket.steps += 1
        for count in sorted(policy.candidates, reverse=True):  # all the cores first
            if bucket.samples.get(count, 0) < (WARMUP_SAMPLES if count == policy.most else 1):
                return count
        best = min(bucket.cost, key=bucket.cost.__getitem__)
        if bucket.steps % EXPLORE_EVERY:
            return best
        others = [c for c in policy.candidates if c != best]
        if not others:  # one usable core: nothing to compare
            return best
        bucket.explored += 1
        return others[bucket.explored % len(others)]

    def apply(self, num_tokens: int) -> int:
        threads = self.last = self.choose(num_tokens)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        return threads

    def record(self, num_tokens: int, threads: int, seconds: float) -> None:
        if self.policy.pinned or self.policy.decode or num_tokens <= 0:
            return
        bucket = self._buckets.setdefault(num_tokens.bit_length(), _Bucket())
        per_token = seconds / num_tokens
        before = bucket.cost.get(threads)
        bucket.cost[threads] = per_token if before is None else (
            before + SMOOTHING * (per_token - before))
        bucket.samples[threads] = bucket.samples.get(threads, 0) + 1

    def preferred(self) -> dict[int, int]:
        """The count each measured bucket runs now, by its smallest step size in tokens."""
        return {1 << (key - 1) if key else 0: min(b.cost, key=b.cost.__getitem__)
                for key, b in sorted(self._buckets.items()) if b.cost}
