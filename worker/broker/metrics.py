"""Prometheus metrics of one worker, served on `--metrics-port`, and its per-request log events.

Two jobs, as on the API. The leak audit from outside: running and waiting return to zero and
every KV page to the pool (or to the prefix cache, which holds no request). And what an
operator watches: queue time, time to first token, the gap between a request's tokens and
end-to-end latency as histograms; the batch, the KV pool and the prefix cache's hit rate as
gauges; tokens generated, preemptions, finish reasons and aborts by cause as counters; and
speculative decoding's draft tokens, accepted drafts and tokens per request-step.

Every request timing starts at the request's `created` (unix time, set by the API replica that
accepted it): queue time ends when the engine schedules its first step, TTFT and the token
gaps are taken when the pipeline carrying its tokens has been written, end-to-end when its
terminal entry has. Across machines that assumes synchronised clocks (a negative figure from
skew counts as 0). What the engine counts anyway (the batch, the KV pool, preemptions, tokens)
is read at scrape time, from one `SchedulerStats` snapshot per scrape, so the step loop pays
nothing for it and a scrape's gauges agree with each other; per request, the cost is a histogram
observation per published token and one dictionary entry, dropped when the request ends or is
handed back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from shared.latency import LATENCY_BUCKETS, TOKEN_GAP_BUCKETS, round_s
from shared.logs import log_event
from worker.broker.clock import Clock
from worker.engine.engine import Engine
from worker.engine.lora.resident import Residency
from worker.engine.scheduler import Admitted, SchedulerStats
from worker.engine.speculation.speculator import SpeculationStats

if TYPE_CHECKING:
    from worker.broker.spans import RequestSpans

log = logging.getLogger("redserve.worker.requests")


# Outcomes (finish reason or error code) that mean the request was cut short, by cause.
ABORT_CAUSES = {
    "abort": "client",  # its abort key: a client gone, the cancel route, a stop string
    "request_timeout": "deadline",
    "queue_timeout": "queue_timeout",
    "worker_failed": "max_deliveries",
    "redis_unavailable": "redis_lost",
    "internal_error": "step_failed",
}


# The scheduler's snapshot as gauges: (name, documentation, figure).
_GAUGES: tuple[tuple[str, str, Callable[[SchedulerStats], float]], ...] = (
    ("running_requests", "Requests in the running batch", lambda s: s.running),
    ("waiting_requests", "Requests taken but not yet admitted", lambda s: s.waiting),
    ("kv_pages_used", "KV pages referenced by requests", lambda s: s.pages_used),
    ("kv_pages_cached", "KV pages held only by the prefix cache", lambda s: s.pages_cached),
    # As in the heartbeat: what a new request can take, cached pages included.
    ("kv_pages_free", "KV pages no request references (empty, or held only by the prefix "
     "cache and evictable)", lambda s: s.pages_free),
    ("kv_pages_total", "KV pages in the pool", lambda s: s.pages_total),
    ("kv_usage_ratio", "Fraction of the KV pool referenced by requests",
     lambda s: s.pages_used / max(s.pages_total, 1)),
)


class _EngineState(Collector):
    """What the engine keeps anyway, read at scrape time from one snapshot: the batch and the
    KV pool as gauges, its running totals as counters."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.scheduler.stats()
        for name, documentation, figure in _GAUGES:
            yield GaugeMetricFamily(f"redserve_worker_{name}", documentation,
                                    value=figure(stats))
        yield CounterMetricFamily("redserve_worker_preemptions_total",
                                  "Requests preempted (pages ran out; recomputed later)",
                                  value=stats.preempted)
        yield CounterMetricFamily("redserve_worker_generated_tokens_total",
                                  "Tokens sampled (rate: output tokens/s)",
                                  value=self.engine.num_generated)
        yield from _speculation(self.engine.speculator.stats())
        if self.engine.config.loras is not None:
            yield from _loras(self.engine.config.loras)


def _loras(residency: Residency) -> Iterator[Metric]:
    """Per adapter: its loads (a request naming it found it not resident, or a preload) and
    evictions since start; and how many are resident now."""
    loads = CounterMetricFamily("redserve_worker_lora_loads_total", "LoRA adapters loaded "
                                "(cold: a request named one not resident; or preloaded)",
                                labels=["adapter"])
    for name, n in dict(residency.loads).items():  # one C call: safe during a step
        loads.add_metric([name], n)
    yield loads
    evictions = CounterMetricFamily("redserve_worker_lora_evictions_total", "LoRA adapters "
                                    "evicted (least recently used, for another's load)",
                                    labels=["adapter"])
    for name, n in dict(residency.evictions).items():
        evictions.add_metric([name], n)
    yield evictions
    yield CounterMetricFamily("redserve_worker_lora_read_seconds", "Time reading and checking "
                              "LoRA adapters' files (off the compute thread)",
                              value=residency.read_s)
    yield CounterMetricFamily("redserve_worker_lora_lay_out_seconds", "Time laying LoRA "
                              "adapters out (on the compute thread, between steps)",
                              value=residency.lay_out_s)
    yield GaugeMetricFamily("redserve_worker_lora_resident", "LoRA adapters held now "
                            "(at most --max-loras)", value=len(residency.resident))


def _speculation(s: SpeculationStats) -> Iterator[Metric]:
    """Speculative decoding's counters, and its two ratios since start."""
    yield CounterMetricFamily("redserve_worker_draft_tokens_total", "Draft tokens verified "
                              "(speculative decoding)", value=s.proposed)
    yield CounterMetricFamily("redserve_worker_draft_tokens_accepted_total", "Draft tokens "
                              "the model agreed with, emitted as drafted", value=s.accepted)
    yield CounterMetricFamily("redserve_worker_request_steps_total", "Steps that emitted "
                              "tokens, counted per request", value=s.steps)
    yield CounterMetricFamily("redserve_worker_request_step_tokens_total", "Tokens those "
                              "request-steps emitted (over the steps: tokens per step)",
                              value=s.tokens)
    yield GaugeMetricFamily("redserve_worker_draft_acceptance_ratio", "Draft tokens accepted "
                            "over draft tokens verified, since start", value=s.acceptance_rate)
    yield GaugeMetricFamily("redserve_worker_tokens_per_request_step", "Tokens a request got "
                            "from one step, on average since start (1 without speculation)",
                            value=s.tokens_per_step)


class WorkerMetrics:
    def __init__(self, engine: Engine, model: str = "", worker: str = "",
                 spans: RequestSpans | None = None) -> None:
        self.model = model
        self.worker = worker
        self.spans = spans  # the requests' spans, when tracing is on (worker/broker/spans.py)
        self.registry = CollectorRegistry()
        r = self.registry
        r.register(_EngineState(engine))
        Gauge("redserve_worker_prefix_cache_hit_ratio", "Prompt tokens taken from the prefix "
              "cache over prompt tokens admitted, since start",
              registry=r).set_function(self._hit_ratio)
        self.prompt_tokens = Counter("redserve_worker_prompt_tokens_total",
                                     "Prompt tokens of requests admitted", registry=r)
        self.cached_tokens = Counter("redserve_worker_cached_prompt_tokens_total",
                                     "Prompt tokens of requests admitted that came from the "
                                     "prefix cache", registry=r)
        self._tenant_tokens = Counter(
            "redserve_worker_tenant_tokens_total", "Tokens served per tenant: prompt tokens "
            "of the requests taken from the queue, completion tokens generated",
            ["model", "tenant", "kind"], registry=r)
        self._prompt_total = 0
        self._cached_total = 0
        self.steps = Counter("redserve_worker_steps_total", "Forward steps run", registry=r)
        self.step_failures = Counter("redserve_worker_step_failures_total",
                                     "Steps that raised; their requests ended with an error",
                                     registry=r)
        self.step_time = Histogram("redserve_worker_step_seconds", "Duration of one forward "
                                   "step (a decode token of every running request)",
                                   buckets=TOKEN_GAP_BUCKETS, registry=r)
        self.finished = Counter("redserve_worker_requests_finished_total",
                                "Requests ended by this worker, by how: finish reason or error "
                                "code", ["model", "outcome"], registry=r)
        self.aborts = Counter("redserve_worker_aborts_total", "Requests this worker cut short, "
                              "by cause", ["model", "cause"], registry=r)
        self.handed_back = Counter("redserve_worker_requests_handed_back_total",
                                   "Requests returned to the queue on shutdown", registry=r)
        self._queue = Histogram(
            "redserve_worker_queue_seconds", "Created to the first step on this worker",
            ["model"], buckets=LATENCY_BUCKETS, registry=r).labels(model)
        self._ttft = Histogram(
            "redserve_worker_time_to_first_token_seconds", "Created to the first token "
            "written to Redis", ["model"], buckets=LATENCY_BUCKETS, registry=r).labels(model)
        self._itl = Histogram(
            "redserve_worker_inter_token_seconds", "Gap between one request's tokens as "
            "written to Redis", ["model"], buckets=TOKEN_GAP_BUCKETS, registry=r).labels(model)
        self._e2e = Histogram(
            "redserve_worker_request_duration_seconds", "Created to the terminal entry "
            "written to Redis", ["model"], buckets=LATENCY_BUCKETS, registry=r).labels(model)
        self._clocks: dict[str, Clock] = {}

    def served(self, tenant: str, kind: str, tokens: int) -> None:
        self._tenant_tokens.labels(self.model, tenant, kind).inc(tokens)

    def serve(self, port: int) -> None:
        start_http_server(port, registry=self.registry)

    def _hit_ratio(self) -> float:
        return self._cached_total / self._prompt_total if self._prompt_total else 0.0

    def admitted(self, admissions: Iterable[Admitted]) -> None:
        for a in admissions:
            req, prompt = a.request, len(a.request.prompt_ids)
            self._prompt_total += prompt
            self._cached_total += a.cached
            self.prompt_tokens.inc(prompt)
            self.cached_tokens.inc(a.cached)
            queue_s = None if a.resumed else max(a.at - req.created, 0.0)
            if queue_s is not None:
                self._queue.observe(queue_s)
            self._clocks[req.id] = Clock(req.created, queue_s, a.at, a.cached)
            log_event(log, "request.admitted", request_id=req.id, model=self.model,
                      worker=self.worker, queue_s=round_s(queue_s), prompt_tokens=prompt,
                      cached_tokens=a.cached, resumed_tokens=a.resumed)

    def published(self, entries: Iterable[tuple[str, int]], now: float) -> None:
        """Tokens of these requests were written at `now` (one entry each: its request, and
        how many tokens it carried)."""
        for request_id, tokens in entries:
            clock = self._clocks.get(request_id)
            if clock is not None:
                self._tick(clock, now, tokens)

    def _tick(self, clock: Clock, now: float, tokens: int = 1) -> None:
        """`tokens` arrived together (a speculating request's step): the first after the gap
        since the last, the others with none."""
        clock.tokens += tokens
        for _ in range(tokens - 1):
            self._itl.observe(0.0)
        if clock.last is not None:
            self._itl.observe(now - clock.last)
        else:
            clock.first = now
            if clock.queue_s is not None:  # its first token, unless another worker's came first
                clock.ttft_s = max(now - clock.created, 0.0)
                self._ttft.observe(clock.ttft_s)
        clock.last = now

    def ending(self, request_id: str) -> Clock | None:
        """A terminal entry is staged: its clock goes with the entry."""
        clock = self._clocks.pop(request_id, None)
        if clock is not None:
            clock.ending = time.time()
        return clock

    def ended(self, request_id: str, clock: Clock | None, outcome: str, tokens: int | None,
              carried_tokens: int, now: float) -> None:
        """Its terminal entry is written (with its step's `carried_tokens` last tokens): counted
        only now, since an ending staged before an outage may be dropped for another worker
        that claimed the request to write (it counts it then)."""
        self.finished.labels(self.model, outcome).inc()
        cause = ABORT_CAUSES.get(outcome)
        if cause is not None:
            self.aborts.labels(self.model, cause).inc()
        if self.spans is not None:
            self.spans.ended(request_id, clock, outcome, tokens, now)
        if clock is None:  # ended before it was admitted here (a queue timeout, say)
            return
        if carried_tokens:
            self._tick(clock, now, carried_tokens)
        e2e = max(now - clock.created, 0.0)
        self._e2e.observe(e2e)
        log_event(log, "request.finished", request_id=request_id, model=self.model,
                  worker=self.worker, outcome=outcome,
                  tokens=clock.tokens if tokens is None else tokens,
                  queue_s=round_s(clock.queue_s), ttft_s=round_s(clock.ttft_s),
                  e2e_s=round_s(e2e))

    def hand_back(self, request_id: str) -> None:
        self.handed_back.inc()
        self._clocks.pop(request_id, None)
        if self.spans is not None:
            self.spans.left(request_id, "handed_back")

    def gave_up(self, request_id: str) -> None:
        """Its ending outlived its keys in the outbox (a long outage): it is forgotten."""
        self._clocks.pop(request_id, None)
        if self.spans is not None:
            self.spans.left(request_id, "expired")

    def taken_by_others(self, request_ids: Iterable[str]) -> None:
        """After an outage: these requests are another worker's now, not ours to end."""
        for request_id in request_ids:
            self._clocks.pop(request_id, None)
            if self.spans is not None:
                self.spans.left(request_id, "taken_over")

