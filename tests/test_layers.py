"""The layering holds, and its check can fail: the import contracts in pyproject.toml (run by
`make lint`) break on a wrong import, and the engine runs in a process where redis cannot be
imported at all."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(LINT_IMPORTS)], cwd=tree, env={"PYTHONPATH": str(tree)},
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the project's packages and contracts, free to break."""
    tree = tmp_path_factory.mktemp("layers")
    for package in ("api", "worker", "shared", "ops"):
        shutil.copytree(ROOT / package, tree / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")
    return tree


def test_the_contracts_hold_on_the_code() -> None:
    done = _lint_imports(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


@pytest.mark.parametrize(("module", "wrong", "named"), [
    # The engine reaching Redis directly, or through the part of shared/ that wraps it.
    ("worker/engine/chunk.py", "import redis", "worker.engine.chunk -> redis"),
    ("worker/engine/chunk.py", "import shared.redis_conn", "shared.redis_conn -> redis"),
    ("worker/engine/sampler.py", "import worker.broker.record",
     "worker.engine.sampler -> worker.broker.record"),
    ("worker/broker/record.py", "import api.protocol.errors",
     "worker.broker.record -> api.protocol.errors"),
    ("api/protocol/text.py", "import worker.engine.chunk",
     "api.protocol.text -> worker.engine.chunk"),
    ("shared/latency.py", "import api.protocol.errors", "shared.latency -> api.protocol.errors"),
    ("api/protocol/text.py", "import ops.console", "api.protocol.text -> ops.console"),
])
def test_a_wrong_import_breaks_a_contract(tree: Path, module: str, wrong: str,
                                          named: str) -> None:
    path = tree / module
    original = path.read_text()
    try:
        path.write_text(f"{original}\n{wrong}  # noqa: E402\n")
        done = _lint_imports(tree)
    finally:
        path.write_text(original)
    assert done.returncode != 0, done.stdout
    assert "BROKEN" in done.stdout and named in done.stdout, done.stdout


def test_the_engine_runs_where_redis_cannot_be_imported(tiny_model: Path) -> None:
    """Every module of worker.engine imports, and an engine built from settings generates,
    in a process that refuses to import redis."""
    script = textwrap.dedent(f"""
        import importlib, pkgutil, sys

        class NoRedis:
            def find_spec(self, name, path=None, target=None):
                if name == "redis" or name.startswith("redis."):
                    raise ImportError("redis is not installed here")
                return None

        sys.meta_path.insert(0, NoRedis())
        import worker.engine
        for info in pkgutil.walk_packages(worker.engine.__path__, "worker.engine."):
            importlib.import_module(info.name)
        from pathlib import Path
        from shared.messages import GenerateRequest, SamplingParams
        from shared.models import ModelInfo
        from shared.settings import WorkerSettings
        from worker.engine.build import build_engine

        path = Path({str(tiny_model)!r})
        engine = build_engine(ModelInfo("tiny", path, 512, ()), WorkerSettings(kernels="torch"))
        params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        engine.add(GenerateRequest(id="r", model="tiny", prompt_ids=(1, 2, 3), created=0.0,
                                   queue_deadline=0.0, deadline=0.0, params=params))
        tokens = []
        for _ in range(20):
            tokens += [out.token for out in engine.step() if out.token is not None]
        assert "redis" not in sys.modules, "redis was imported"
        print(len(tokens))
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={"PYTHONPATH": str(ROOT),
                                                       "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "5"
