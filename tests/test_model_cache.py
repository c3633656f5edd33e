"""Processes sharing one cache directory convert the default model once: a compose stack's two
API replicas and its worker start together on one fresh volume, and only the first to take the
lock converts; the others wait and load what it wrote. Here the test holds the lock (as a
converting process would), a real second process resolves the default model meanwhile, and it
must wait, then take the checkpoint that appeared rather than convert again."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tqdm.auto import tqdm

from shared.models import conversion_lock, progress_bars_for_terminals_only
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


def test_a_conversion_draws_its_progress_bar_on_a_terminal_only(
        capsys: pytest.CaptureFixture[str]) -> None:
    """In a container the conversion's output is a log, not a terminal: the GGUF reader's tqdm
    bar (drawn on whatever `sys.stderr` is when it starts) goes nowhere, so the log holds the
    `converting` and `converted` lines alone. Checked here with a real tqdm bar, the way
    transformers draws it, under pytest's capture (no terminal); a whole conversion takes 25
    CPU-s, so it is not repeated here."""
    with progress_bars_for_terminals_only():
        for _ in tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."):
            pass
    assert capsys.readouterr().err == ""
    for _ in tqdm(range(3), desc="outside"):  # the same bar elsewhere is drawn
        pass
    assert "\r" in capsys.readouterr().err


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
