"""A traced request's spans on the worker, made only when tracing is on (shared/tracing.py)
and the request came with its replica span's `traceparent` (`GenerateRequest.traceparent`).

Why here and not in the engine: the engine's step must not get slower and knows nothing of
Redis or of tracing. Everything a span needs is already known on the broker's side, by the
times `WorkerMetrics` keeps (`Clock`): so the worker makes one span per request when it takes
it (`redserve.worker.request`, a child of the replica's span: the same trace), and its
children once it ends, with the times they began and ended:
- `redserve.queued`: from the request's creation until this worker took it (time in queue);
- `redserve.prefill`: from its admission into the engine to its first token written to Redis
  (its prompt's chunks, and the step that sampled the token);
- `redserve.decode`: from its first token to its last written;
- `redserve.publish`: its terminal entry, from staged to written.
Per request that is a fixed handful of spans, whatever its length: none per step or token.
A request taken over from a dead worker (`deliveries` > 1) links to the span of the worker
before (its `traceparent` is in the request's hash, read by worker/broker/recovery.py); this
worker's span context goes into the hash too (`stage_running`), for a later takeover.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from shared import tracing
from worker.broker.clock import Clock
from worker.broker.recovery import Claimed

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

# Outcomes (finish reasons) that are not errors.
_FINE = {"stop", "length", "abort"}


class RequestSpans:
    def __init__(self, tracer: Tracer, worker: str) -> None:
        self.tracer = tracer
        self.worker = worker
        self._open: dict[str, Span] = {}  # request id -> its span, until it ends here

    @classmethod
    def of(cls, worker: str) -> RequestSpans | None:
        """None when tracing is off."""
        tracer = tracing.tracer("redserve.worker")
        return None if tracer is None else cls(tracer, worker)

    def taken(self, claimed: Claimed) -> str | None:
        """This worker took the request: its span starts (if the request is traced). Returns
        the span's `traceparent`, for the request's hash."""
        request = claimed.request
        if request.traceparent is None:
            return None
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind

        now = time.time()
        parent = tracing.parent(request.traceparent)
        previous = (tracing.link(claimed.previous_trace, "takeover")
                    if claimed.previous_trace else None)
        span = self.tracer.start_span(
            "redserve.worker.request", context=parent, kind=SpanKind.CONSUMER,
            start_time=tracing.ns(now), links=[] if previous is None else [previous],
            attributes={"redserve.request_id": request.id, "redserve.tenant": request.tenant,
                        "redserve.worker": self.worker, "redserve.deliveries": claimed.deliveries,
                        "gen_ai.request.model": request.model,
                        "gen_ai.request.max_tokens": request.params.max_tokens,
                        "gen_ai.usage.input_tokens": len(request.prompt_ids)})
        self._open[request.id] = span
        if claimed.deliveries == 1:
            context = trace.set_span_in_context(span)
            queued = self.tracer.start_span("redserve.queued", context=context,
                                            start_time=tracing.ns(request.created))
            queued.end(end_time=tracing.ns(now))
        return tracing.traceparent(span)

    def ended(self, request_id: str, clock: Clock | None, outcome: str, tokens: int | None,
              now: float) -> None:
        """Its terminal entry is written: its phases become spans, and its span ends."""
        span = self._open.pop(request_id, None)
        if span is None:
            return
        from opentelemetry import trace
        from opentelemetry.trace import Status, StatusCode

        attributes: dict[str, Any] = {"redserve.outcome": outcome}
        if clock is not None:
            self._phases(trace.set_span_in_context(span), clock, now)
            attributes["gen_ai.usage.output_tokens"] = clock.tokens if tokens is None else tokens
            attributes["gen_ai.usage.cache_read.input_tokens"] = clock.cached
            if clock.queue_s is not None:
                attributes["gen_ai.latency.time_in_queue"] = clock.queue_s
            if clock.ttft_s is not None:
                attributes["gen_ai.latency.time_to_first_token"] = clock.ttft_s
        if outcome in _FINE:
            attributes["gen_ai.response.finish_reasons"] = [outcome]
        else:
            span.set_status(Status(StatusCode.ERROR, outcome))
        span.set_attributes(attributes)
        span.end(end_time=tracing.ns(now))

    def _phases(self, context: Any, clock: Clock, now: float) -> None:
        phases = [("redserve.prefill", clock.admitted or None, clock.first),
                  ("redserve.decode", clock.first, clock.last),
                  ("redserve.publish", clock.ending, now)]
        for name, start, end in phases:
            if start is not None and end is not None and end >= start:
                self.tracer.start_span(name, context=context,
                                       start_time=tracing.ns(start)).end(tracing.ns(end))

    def left(self, request_id: str, why: str) -> None:
        """It leaves this worker unfinished (handed back, claimed by another, or its ending
        given up after its keys expired)."""
        span = self._open.pop(request_id, None)
        if span is not None:
            span.set_attribute("redserve.outcome", why)
            span.end()
