"""Prometheus metrics of one worker, served on `--metrics-port`: the same leak audit as the
API's from outside — running and waiting return to zero and every KV token to the pool."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from worker.engine import Engine


class WorkerMetrics:
    def __init__(self, engine: Engine) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        Gauge("redserve_worker_running_requests", "Requests in the running batch",
              registry=r).set_function(lambda: len(engine.running))
        Gauge("redserve_worker_waiting_requests", "Requests taken but not yet admitted",
              registry=r).set_function(lambda: len(engine.waiting))
        Gauge("redserve_worker_kv_tokens_used", "KV cache tokens held by requests",
              registry=r).set_function(lambda: engine.kv.used_tokens)
        Gauge("redserve_worker_kv_tokens_total", "KV cache capacity in tokens",
              registry=r).set_function(lambda: engine.kv.total_tokens)
        self.steps = Counter("redserve_worker_steps_total", "Forward steps run", registry=r)
        self.step_failures = Counter("redserve_worker_step_failures_total",
                                     "Steps that raised; their requests ended with an error",
                                     registry=r)
        self.finished = Counter("redserve_worker_requests_finished_total",
                                "Requests ended by this worker, by how", ["outcome"], registry=r)
        self.handed_back = Counter("redserve_worker_requests_handed_back_total",
                                   "Requests returned to the queue on shutdown", registry=r)

    def serve(self, port: int) -> None:
        start_http_server(port, registry=self.registry)
