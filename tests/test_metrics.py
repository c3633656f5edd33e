"""What operators watch: the Prometheus metrics of a real replica and worker after real traffic,
the request events in their logs, and the monitoring files (Grafana's dashboard may only name
metrics the code exports; Prometheus scrapes what compose.yaml runs)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from ops.embedded_redis import free_port
from tests.stack import Stack, eventually

ROOT = Path(__file__).resolve().parents[1]
MONITORING = ROOT / "ops" / "monitoring"
MODEL = "tiny-llama"
# Over three KV pages of tokens: the second request with it takes pages from the prefix cache.
PROMPT = "The quick brown fox jumps over the lazy dog near the river bank. " * 4
MAX_TOKENS = 8


@dataclass
class Families:
    """One scrape, parsed: metric families by name (counters without `_total`)."""

    by_name: dict[str, Any]

    @classmethod
    def scrape(cls, url: str) -> Families:
        text = httpx.get(url, timeout=5).text
        return cls({f.name: f for f in text_string_to_metric_families(text)})

    def value(self, sample: str, **labels: str) -> float:
        """The sum of the samples named `sample` whose labels include `labels`."""
        return sum(s.value for f in self.by_name.values() for s in f.samples
                   if s.name == sample and labels.items() <= s.labels.items())

    def sample_names(self) -> set[str]:
        """Every sample name the families export, those without a sample yet included."""
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
        return {f.name + suffix for f in self.by_name.values()
                for suffix in suffixes.get(f.type, ("",))}


@dataclass
class Served:
    api: Families
    worker: Families
    events: list[dict[str, Any]]  # the request events of every process's JSON log
    request_ids: dict[str, str]  # what each request was -> its X-Request-Id
    log_text: str


def _completion(stack: Stack, stream: bool) -> str:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "temperature": 0, "stream": stream}
    response = httpx.post(f"{stack.base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.headers["x-request-id"]


def _disconnect_after_first_token(stack: Stack) -> str:
    body = {"model": MODEL, "prompt": "count to a thousand", "max_tokens": 400,
            "ignore_eos": True, "temperature": 0, "stream": True, "speculation": False}
    with httpx.stream("POST", f"{stack.base_url}/v1/completions", json=body,
                      timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and orjson.loads(line[6:])["choices"][0]["text"]:
                return response.headers["x-request-id"]  # leaving closes the connection
    raise AssertionError("the stream sent no token")


@pytest.fixture(scope="module")
def served(redis_url: str, tiny_model: Path) -> Iterator[Served]:
    """A replica and a worker after: one JSON reply, one stream, one stream whose client left
    after its first token, a 404 from the route and a 413 from the door."""
    port = free_port()
    stack = Stack(redis_url, tiny_model, served_name=MODEL, env={
        "REDSERVE_METRICS_PORT": str(port), "REDSERVE_MAX_BODY_BYTES": "4096",
        "REDSERVE_LOG_FORMAT": "json"}).start()
    worker_url = f"http://127.0.0.1:{port}/metrics"
    try:
        ids = {"json": _completion(stack, stream=False), "stream": _completion(stack, stream=True),
               "disconnect": _disconnect_after_first_token(stack)}
        missing = httpx.post(f"{stack.base_url}/v1/completions",
                             json={"model": "nope", "prompt": "hi"})
        assert missing.status_code == 404
        too_large = httpx.post(f"{stack.base_url}/v1/completions",
                               content=b"{" + b" " * 5000 + b"}",
                               headers={"content-type": "application/json"})
        assert too_large.status_code == 413
        # Everything has ended on both sides: the abort's terminal entry too.
        assert eventually(lambda: Families.scrape(worker_url).value(
            "redserve_worker_request_duration_seconds_count") == 3, 30), stack.output()
        assert eventually(lambda: Families.scrape(f"{stack.base_url}/metrics").value(
            "redserve_api_inflight_requests") == 0, 30)
        log_text = "\n".join(log.read_text() for log in stack.logs)
        events = [orjson.loads(line) for line in log_text.splitlines()
                  if line.startswith("{") and '"event":"request.' in line]
        yield Served(Families.scrape(f"{stack.base_url}/metrics"),
                     Families.scrape(worker_url), events, ids, log_text)
    finally:
        stack.stop()


def test_api_histograms_and_counters_count_the_requests(served: Served) -> None:
    api = served.api
    for stream, replies in (("false", 1), ("true", 2)):
        for histogram in ("time_to_first_token", "queue"):
            assert api.value(f"redserve_api_{histogram}_seconds_count", model=MODEL,
                             stream=stream) == replies, (histogram, stream)
    # One gap between each of the JSON reply's 8 tokens; the streams have those and more.
    assert api.value("redserve_api_inter_token_seconds_count", stream="false") == MAX_TOKENS - 1
    assert api.value("redserve_api_inter_token_seconds_count", stream="true") >= MAX_TOKENS - 1
    duration = "redserve_api_request_duration_seconds_count"
    assert api.value(duration, model=MODEL, stream="false", outcome="length") == 1
    assert api.value(duration, model=MODEL, stream="true", outcome="length") == 1
    assert api.value(duration, model=MODEL, stream="true", outcome="disconnect") == 1
    assert api.value("redserve_api_request_duration_seconds_bucket", le="+Inf") == 3

    accepted = "redserve_api_requests_total"  # the 404 and the 413 were never accepted
    assert api.value(accepted, model=MODEL, endpoint="completions") == 3
    assert api.value(accepted) == 3
    finished = "redserve_api_requests_finished_total"
    assert api.value(finished, model=MODEL, outcome="length") == 2
    assert api.value(finished, model=MODEL, outcome="disconnect") == 1
    assert api.value("redserve_api_client_disconnects_total") == 1
    assert api.value("redserve_api_aborts_total", cause="disconnect") == 1
    assert api.value("redserve_api_aborts_total") == 1

    responses = "redserve_api_http_responses_total"
    assert api.value(responses, **{"class": "4xx", "code": "404"}) == 1
    assert api.value(responses, **{"class": "4xx", "code": "413"}) == 1  # before any route
    assert api.value(responses, **{"class": "4xx"}) == 2
    assert api.value(responses, **{"class": "5xx"}) == 0
    assert api.value(responses, code="200") >= 3

    # Nothing left behind, and the queue read from Redis is empty.
    for gauge in ("requests_waiting", "requests_running", "queue_depth"):
        assert [s.value for s in api.by_name[f"redserve_api_{gauge}"].samples] == [0.0], gauge


def test_worker_histograms_and_counters_count_the_requests(served: Served) -> None:
    worker = served.worker
    for histogram in ("queue", "time_to_first_token", "request_duration"):
        assert worker.value(f"redserve_worker_{histogram}_seconds_count", model=MODEL) == 3
    # The two complete replies' gaps at least (the left stream may have more or fewer).
    assert worker.value("redserve_worker_inter_token_seconds_count") >= 2 * (MAX_TOKENS - 1)
    finished = "redserve_worker_requests_finished_total"
    assert worker.value(finished, model=MODEL, outcome="length") == 2
    assert worker.value(finished, model=MODEL, outcome="abort") == 1
    assert worker.value("redserve_worker_aborts_total", model=MODEL, cause="client") == 1
    assert worker.value("redserve_worker_aborts_total") == 1

    steps = worker.value("redserve_worker_steps_total")
    assert steps > 0 and worker.value("redserve_worker_step_seconds_count") == steps
    assert worker.value("redserve_worker_generated_tokens_total") >= 2 * MAX_TOKENS + 1
    assert worker.value("redserve_worker_preemptions_total") == 0
    # The second request with PROMPT took its first pages from the prefix cache.
    prompt = worker.value("redserve_worker_prompt_tokens_total")
    cached = worker.value("redserve_worker_cached_prompt_tokens_total")
    assert prompt > 0 and cached >= 32
    assert worker.value("redserve_worker_prefix_cache_hit_ratio") == pytest.approx(cached / prompt)
    assert worker.value("redserve_worker_running_requests") == 0
    assert worker.value("redserve_worker_kv_pages_used") == 0
    assert worker.value("redserve_worker_kv_usage_ratio") == 0
    total = worker.value("redserve_worker_kv_pages_total")
    # Free pages include those only the prefix cache holds (as in the heartbeat).
    assert worker.value("redserve_worker_kv_pages_free") == total > 0
    assert 0 < worker.value("redserve_worker_kv_pages_cached") <= total


def test_every_request_logs_its_story_without_its_text(served: Served) -> None:
    events: dict[tuple[str, str], dict[str, Any]] = {}  # by (event, request id)
    for event in served.events:
        side = event["logger"].split(".")[1]  # api or worker
        key = (f"{side} {event['event']}", event["request_id"])
        assert key not in events, key  # one of each per request
        events[key] = event
    for kind, request_id in served.request_ids.items():
        api = events["api request.finished", request_id]
        assert api["model"] == MODEL and api["tenant"] == "anonymous"
        assert api["stream"] is (kind != "json") and api["prompt_tokens"] > 0
        assert api["outcome"] == ("disconnect" if kind == "disconnect" else "length")
        assert 0 <= api["queue_s"] <= api["ttft_s"] <= api["e2e_s"]
        assert api["completion_tokens"] >= (1 if kind == "disconnect" else MAX_TOKENS)
        admitted = events["worker request.admitted", request_id]
        worker = events["worker request.finished", request_id]
        assert admitted["model"] == worker["model"] == MODEL and worker["worker"]
        assert worker["outcome"] == ("abort" if kind == "disconnect" else "length")
        assert 0 <= worker["queue_s"] <= worker["ttft_s"] <= worker["e2e_s"]
        assert worker["queue_s"] == admitted["queue_s"]
        # The replica's queue time is the one the worker measured (sent with the first token).
        assert api["queue_s"] == pytest.approx(worker["queue_s"], abs=0.001)
        if kind != "disconnect":
            assert worker["tokens"] == MAX_TOKENS
    assert PROMPT.split(".")[0] not in served.log_text
    assert "count to a thousand" not in served.log_text


_METRIC = re.compile(r"\bredserve_[a-z0-9_]+\b")


def _dashboard_exprs() -> list[str]:
    dashboard = orjson.loads((MONITORING / "grafana" / "dashboards" / "redserve.json")
                             .read_bytes())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert exprs and all(_METRIC.search(e) for e in exprs)
    return exprs


def test_the_dashboard_names_only_metrics_the_code_exports(served: Served) -> None:
    exported = served.api.sample_names() | served.worker.sample_names()
    named = {name for expr in _dashboard_exprs() for name in _METRIC.findall(expr)}
    assert named - exported == set()
    # histogram_quantile reads buckets, and only those of histograms.
    buckets = {n for n in exported if n.endswith("_bucket")}
    for expr in _dashboard_exprs():
        if "histogram_quantile" in expr:
            assert set(_METRIC.findall(expr)) <= buckets, expr
    # What the dashboard is for: the key figures each have a panel.
    for wanted in ("redserve_api_time_to_first_token_seconds_bucket",
                   "redserve_api_inter_token_seconds_bucket",
                   "redserve_worker_queue_seconds_bucket", "redserve_api_queue_depth",
                   "redserve_worker_kv_usage_ratio", "redserve_worker_generated_tokens_total",
                   "redserve_worker_cached_prompt_tokens_total", "redserve_api_aborts_total",
                   "redserve_api_http_responses_total"):
        assert wanted in named, wanted


def test_prometheus_scrapes_what_compose_runs() -> None:
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = compose["services"]
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    flags = {"redserve-api": "--port", "redserve-worker": "--metrics-port"}
    assert {job["job_name"] for job in config["scrape_configs"]} == set(flags)
    for job in config["scrape_configs"]:
        [sd] = job["dns_sd_configs"]
        assert sd["type"] == "A"
        for name in sd["names"]:
            command = services[name]["command"]
            flag = flags[job["job_name"]]
            assert command[command.index(flag) + 1] == str(sd["port"]), name
            assert str(sd["port"]) in services[name]["expose"], name
    # Every service that runs a worker or a replica is scraped.
    scraped = {n for job in config["scrape_configs"] for n in job["dns_sd_configs"][0]["names"]}
    assert scraped == {n for n, s in services.items() if s.get("command", [""])[0] in
                       ("api", "worker")}
    assert "prometheus.yml:/etc/prometheus/prometheus.yml" in services["prometheus"][
        "volumes"][0]


def test_grafana_is_provisioned_from_the_repository() -> None:
    grafana = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]["grafana"]
    mounts = dict(v.removeprefix("./").removesuffix(":ro").split(":") for v in
                  grafana["volumes"])
    provisioning = ROOT / next(src for src, dst in mounts.items()
                               if dst == "/etc/grafana/provisioning")
    [source] = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())[
        "datasources"]
    assert source["url"] == "http://prometheus:9090"
    [provider] = yaml.safe_load((provisioning / "dashboards" / "redserve.yml").read_text())[
        "providers"]
    dashboards = next(src for src, dst in mounts.items() if dst == provider["options"]["path"])
    dashboard = orjson.loads((ROOT / dashboards / "redserve.json").read_bytes())
    assert {p["datasource"]["uid"] for p in dashboard["panels"]} == {source["uid"]}
    assert grafana["environment"]["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
