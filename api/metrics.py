"""Prometheus counters of one API replica (`GET /metrics`): enough to audit from outside that
nothing is left behind — in-flight requests and result queues return to zero when idle."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge


class APIMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.inflight = Gauge("redserve_api_inflight_requests",
                              "Requests this replica is serving now", registry=r)
        self.result_queues = Gauge("redserve_api_result_queues",
                                   "Per-request result queues held by the reader", registry=r)
        self.buffered = Gauge("redserve_api_buffered_results",
                              "Result entries waiting in per-request queues", registry=r)
        self.finished = Counter("redserve_api_requests_finished_total",
                                "Requests ended, by how", ["outcome"], registry=r)
        self.rejected = Counter("redserve_api_requests_rejected_total",
                                "Requests refused before enqueueing, by reason", ["reason"],
                                registry=r)
        self.disconnects = Counter("redserve_api_client_disconnects_total",
                                   "Clients that left before their request ended", registry=r)
        self.aborts = Counter("redserve_api_aborts_total",
                              "Abort keys set by this replica", registry=r)
        self.slow_clients = Counter("redserve_api_slow_client_cancels_total",
                                    "Streams cancelled because the client fell behind",
                                    registry=r)

    def watch(self, inflight: Callable[[], int], queues: Callable[[], int],
              buffered: Callable[[], int]) -> None:
        self.inflight.set_function(inflight)
        self.result_queues.set_function(queues)
        self.buffered.set_function(buffered)
