"""The adapters' updates as a step applies them (worker/engine/lora/apply.py), at the dtype and
on the kernels a worker serves with: each row gets its own adapter's (x A^T) B^T, base rows
nothing, whichever way the step computes it (one adapter's pair on its rows, the stacked layers
of a short step naming several, a pair per adapter on a long one). The engine's tests
(tests/test_lora.py) hold the tokens to peft's at fp32; these hold the bf16 packed-GEMM path,
which is what serves, to an fp32 reference."""

from __future__ import annotations

import pytest
import torch

from tests.marks import needs_brgemm
from worker.engine.chunk import Chunk
from worker.engine.linear import Linear
from worker.engine.lora.adapter import LoraPair
from worker.engine.lora.apply import DENSE_ROWS, Loras

IN, OUT = 64, 96
RANKS = {"a": 8, "b": 16, "c": 8}  # one adapter of another rank: the stacks pad it


def _pairs(dtype: torch.dtype) -> dict[str, LoraPair]:
    torch.manual_seed(0)
    return {name: LoraPair(torch.randn(IN, r).to(dtype), torch.randn(r, OUT).to(dtype) / r)
            for name, r in RANKS.items()}


def _chunks(names: list[str], tokens: int) -> list[Chunk]:
    """A chunk of `tokens` tokens per name ("" for a base request)."""
    return [Chunk([1] * tokens, 0, [0], sample=True, lora=name) for name in names]


def _reference(x: torch.Tensor, pairs: dict[str, LoraPair], names: list[str],
               tokens: int) -> torch.Tensor:
    """Each row's own adapter's update in fp32 (zeros for base rows)."""
    out = torch.zeros(x.shape[0], OUT)
    for i, name in enumerate(names):
        if name:
            rows = slice(i * tokens, (i + 1) * tokens)
            out[rows] = (x[rows].float() @ pairs[name].a.float()) @ pairs[name].b.float()
    return out


@pytest.mark.parametrize(("names", "tokens"), [
    (["a", "", "a"], 1),  # one adapter: its pair on its rows (an index: not contiguous)
    (["a", "b", "", "c", "b"], 1),  # several, a decode step: the stacked layers
    (["a", "b", "", "c"], DENSE_ROWS // 2),  # several, past DENSE_ROWS: a pair per adapter
    (["", "c"], 3),  # one adapter's contiguous rows: a slice
], ids=["one-adapter", "stacked", "per-adapter", "slice"])
@pytest.mark.parametrize("dtype", [
    pytest.param(torch.bfloat16, marks=needs_brgemm, id="bf16-packed"),
    pytest.param(torch.float32, id="fp32")])
def test_each_row_gets_its_own_adapters_update(names: list[str], tokens: int,
                                               dtype: torch.dtype) -> None:
    pairs = _pairs(dtype)
    linear = Linear(torch.zeros(OUT, IN, dtype=dtype), native=True)
    loras = Loras({name: {linear: pair} for name, pair in pairs.items()}, native=True)
    step = loras.step(_chunks(names, tokens), torch.device("cpu"))
    assert step is not None
    x = torch.randn(len(names) * tokens, IN).to(dtype)
    y = torch.randn(x.shape[0], OUT).to(dtype)
    before = y.clone()
    with torch.inference_mode():
        step.add(linear, x, y)
    got = (y.float() - before.float())
    want = _reference(x, pairs, names, tokens)
    base_rows = [i * tokens + t for i, n in enumerate(names) if not n for t in range(tokens)]
    assert torch.equal(y[base_rows], before[base_rows])  # base rows untouched, bit for bit
    tolerance = 0.05 if dtype == torch.bfloat16 else 1e-4
    assert torch.allclose(got, want, rtol=tolerance, atol=tolerance * want.abs().max().item())


def test_a_step_without_adapters_has_no_lora_work() -> None:
    linear = Linear(torch.zeros(OUT, IN), native=True)
    loras = Loras({"a": {linear: _pairs(torch.float32)["a"]}})
    assert loras.step(_chunks(["", ""], 2), torch.device("cpu")) is None
