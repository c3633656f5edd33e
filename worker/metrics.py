"""Prometheus metrics of one worker, served on `--metrics-port`: the same leak audit as the
API's from outside — running and waiting return to zero and every KV page to the pool (or to
the prefix cache, which holds no request)."""

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
        Gauge("redserve_worker_kv_pages_used", "KV pages referenced by requests",
              registry=r).set_function(lambda: engine.pages.in_use)
        Gauge("redserve_worker_kv_pages_cached", "KV pages held only by the prefix cache",
              registry=r).set_function(lambda: engine.pages.cached)
        Gauge("redserve_worker_kv_pages_total", "KV pages in the pool",
              registry=r).set_function(lambda: engine.pages.num_pages)
        self.steps = Counter("redserve_worker_steps_total", "Forward steps run", registry=r)
        self.step_failures = Counter("redserve_worker_step_failures_total",
                                     "Steps that raised; their requests ended with an error",
                                     registry=r)
        self.finished = Counter("redserve_worker_requests_finished_total",
                                "Requests ended by this worker, by how", ["outcome"], registry=r)
        self.preempted = Gauge("redserve_worker_preemptions", "Requests preempted so far "
                               "(pages ran out; recomputed later)", registry=r)
        self.preempted.set_function(lambda: engine.num_preempted)
        self.handed_back = Counter("redserve_worker_requests_handed_back_total",
                                   "Requests returned to the queue on shutdown", registry=r)

    def serve(self, port: int) -> None:
        start_http_server(port, registry=self.registry)
