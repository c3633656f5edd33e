"""Processes sharing one cache directory convert the default model once: a compose stack's two
API replicas and its worker start together on one fresh volume, and only the first to take the
lock converts; the others wait and load what it wrote. Here the test holds the lock (as a
converting process would), a real second process resolves the default model meanwhile, and it
must wait, then take the checkpoint that appeared rather than convert again."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from shared.models import conversion_lock
from shared.settings import DEFAULT_MODEL
from tests.stack import eventually

ROOT = Path(__file__).resolve().parents[1]
RESOLVE = ("import logging, sys; from pathlib import Path; "
           "from shared.models import resolve_model; "
           "logging.basicConfig(level=logging.INFO, stream=sys.stderr); "
           "print(resolve_model(sys.argv[1], Path(sys.argv[2])).path)")


def test_a_second_process_waits_for_the_conversion_and_converts_nothing(
    tmp_path: Path, tiny_model: Path
) -> None:
    cache = tmp_path / "cache"
    target = cache / "models" / DEFAULT_MODEL
    target.parent.mkdir(parents=True)
    log = tmp_path / "second.log"
    with conversion_lock(target.parent / f".{DEFAULT_MODEL}.lock"):
        with log.open("w") as err:
            second = subprocess.Popen([sys.executable, "-c", RESOLVE, DEFAULT_MODEL, str(cache)],
                                      cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True)
        try:
            assert eventually(lambda: "waiting for it" in log.read_text(), 60), log.read_text()
            assert second.poll() is None  # it waits while the lock is held
            # What the converting process would leave: a complete checkpoint.
            shutil.copytree(tiny_model, target)
        except BaseException:
            second.kill()
            raise
    out, _ = second.communicate(timeout=60)
    assert second.returncode == 0, log.read_text()
    assert Path(out.strip()) == target
    assert ".gguf into" not in log.read_text()  # the converting line: it never converted
    assert not list(target.parent.glob(".convert-*"))


def test_a_conversion_in_a_container_logs_lines_not_a_progress_bar(tmp_path: Path) -> None:
    """The first start in a container converts the default model with its output in a log, not
    a terminal: a few JSON lines, no progress bar redrawn with carriage returns (transformers'
    GGUF reader draws one of its own). Slow (a real conversion, about 25 CPU-s) because the
    first start of every compose stack does exactly this."""
    script = ("import sys; from pathlib import Path; "
              "from shared.logs import setup_logging; from shared.settings import Settings; "
              "from shared.models import resolve_model; "
              "setup_logging(Settings(log_format='json'), loads_models=True); "
              "print(resolve_model(sys.argv[1], Path(sys.argv[2])).path)")
    done = subprocess.run([sys.executable, "-c", script, DEFAULT_MODEL, str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "\r" not in done.stderr
    records = [json.loads(line) for line in done.stderr.splitlines()]  # JSON lines only
    said = [r["msg"] for r in records]
    assert any(m.startswith("converting ") for m in said), said
    assert any(m.startswith("converted ") for m in said), said
    assert (Path(done.stdout.strip()) / "model.safetensors").exists()


def test_a_process_without_torch_waits_for_a_worker_to_convert(tmp_path: Path,
                                                               tiny_model: Path) -> None:
    """The replicas' image holds no torch: on a fresh volume, a replica waits for the worker's
    conversion (it cannot convert), then loads what appeared."""
    cache = tmp_path / "cache"
    target = cache / "models" / DEFAULT_MODEL
    log = tmp_path / "replica.log"
    no_torch = "import sys; sys.modules['torch'] = None; " + RESOLVE
    with log.open("w") as err:
        replica = subprocess.Popen([sys.executable, "-c", no_torch, DEFAULT_MODEL, str(cache)],
                                   cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        assert eventually(lambda: "waiting for a worker" in log.read_text(), 60), log.read_text()
        assert replica.poll() is None
        shutil.copytree(tiny_model, target)  # what the worker's conversion leaves
        out, _ = replica.communicate(timeout=60)
    finally:
        if replica.poll() is None:
            replica.kill()
    assert replica.returncode == 0, log.read_text()
    assert Path(out.strip()) == target
    assert ".gguf into" not in log.read_text()
