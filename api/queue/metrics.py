"""Prometheus metrics of one API replica (`GET /metrics`) and the per-reply timings behind them.

Two jobs. The leak audit: in-flight requests and result queues return to zero when idle, as
seen from outside. And what an operator watches: time to first token, gaps between tokens,
end-to-end latency and the wait for a worker, as histograms by model; how requests end and why
this replica cancelled them; HTTP responses by status (those refused before any route runs,
401/413/431, included); the model's queue depth; how prefix placement went.

Every timing starts at the request's `created`, the moment the replica accepted it
(validated, tokenized, about to be queued), which is also where the worker's own timings
start, so the two sides compare. The queue time (accepted -> admitted by a worker) is the one
the worker measured and sent with the request's first token (`queued_ms`): only the worker
knows when the prompt's prefill began, and a first result's arrival would add the prefill to
the wait. A request resumed from another worker's tokens has none to report. TTFT and ITL are
taken as the result entries are handed to the response, once per entry, never per Redis
command. One `request.finished` log event per reply carries the same figures; never text.

Labels stay bounded: model, stream, endpoint (the route: chat, completions or responses, which
share one generation path and so one set of timings), and outcome (finish reasons and error
codes are fixed sets in the code); never a request id. A tenant is a label only on the
rate-limit refusals: tenants are configured (API keys), so there are as many as the keys file
has owners, and an operator needs to know whose requests the limits refuse. An adapter is a
label only on the per-adapter counters (requests and output tokens by `adapter`, the base
model's requests under its own name): the adapters are the declared ones and those of the
registry (`api/queue/loras.py`, itself bounded), and an unloaded adapter's series go with it
(`forget_adapters`), so the label's values are bounded by what is loaded now.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shared.keys import QUEUE_STALE_MARGIN_S
from shared.latency import LATENCY_BUCKETS, TOKEN_GAP_BUCKETS, round_s
from shared.logs import log_event
from shared.messages import Finish, ResultEntry, Tokens

if TYPE_CHECKING:
    from api.queue.trace import ReplyTrace

log = logging.getLogger("redserve.api.requests")

# The route a reply was asked for on: the `endpoint` label of the requests accepted.
Endpoint = Literal["chat", "completions", "responses"]

# Queue depth is read from Redis at most this often, however often /metrics is scraped.
QUEUE_DEPTH_CACHE_S = 1.0

# How a request this replica ended early maps to the abort cause it counts under.
_ABORT_CAUSES = {
    None: "disconnect",
    "stop": "stop_string",
    "client_too_slow": "slow_client",
    "server_shutdown": "drain",
    "request_timeout": "timeout",
    "queue_timeout": "queue_timeout",
    "no_worker": "no_worker",
}


def abort_cause(outcome: str | None) -> str:
    """The `cause` label of an abort this replica sets, from how it ended the request (None:
    its client left)."""
    return _ABORT_CAUSES.get(outcome, "error")


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
        self.waiting = Gauge("redserve_api_requests_waiting",
                             "This replica's requests no worker has answered yet", ["model"],
                             registry=r)
        self.running = Gauge("redserve_api_requests_running",
                             "This replica's requests a worker is answering", ["model"],
                             registry=r)
        self.queue_depth = Gauge("redserve_api_queue_depth",
                                 "Requests of the model no worker has taken yet (all replicas)",
                                 ["model"], registry=r)
        self.accepted = Counter("redserve_api_requests_total",
                                "Requests (replies) accepted and queued, by model and endpoint "
                                "(chat|completions|responses)", ["model", "endpoint"],
                                registry=r)
        self.finished = Counter("redserve_api_requests_finished_total",
                                "Requests (choices) ended, by how: finish reason, error code "
                                "or disconnect", ["model", "outcome"], registry=r)
        self.rejected = Counter("redserve_api_requests_rejected_total",
                                "Requests refused before enqueueing, by reason", ["reason"],
                                registry=r)
        self.rate_limited = Counter("redserve_api_rate_limited_total",
                                    "Requests refused by their tenant's rate limit, by tenant "
                                    "and limit (requests|tokens)", ["tenant", "limit"],
                                    registry=r)
        self.disconnects = Counter("redserve_api_client_disconnects_total",
                                   "Clients that left before their request ended", registry=r)
        self.aborts = Counter("redserve_api_aborts_total",
                              "Abort keys set by this replica, by cause", ["cause"], registry=r)
        self.slow_clients = Counter("redserve_api_slow_client_cancels_total",
                                    "Streams cancelled because the client fell behind",
                                    registry=r)
        self.adapter_requests = Counter(
            "redserve_api_adapter_requests_total", "Requests (replies) accepted, by base model "
            "and the adapter named (the base model's own name for the base)",
            ["model", "adapter"], registry=r)
        self.adapter_tokens = Counter(
            "redserve_api_adapter_output_tokens_total", "Tokens generated for this replica's "
            "replies, by base model and adapter (counted as each reply ends)",
            ["model", "adapter"], registry=r)
        # The adapters whose series may exist now: the base models and the adapters served.
        self._adapters: set[tuple[str, str]] = set()
        self.placements = Counter("redserve_api_placements_total",
                                  "Requests placed on a worker by prefix (api/queue/placement.py): "
                                  "hit (its worker holds a prefix page), miss, overloaded "
                                  "(the holder had no room), or adapter (its worker holds the "
                                  "request's LoRA adapter, no prefix page)",
                                  ["model", "outcome"], registry=r)
        self.responses = Counter("redserve_api_http_responses_total",
                                 "HTTP responses by status class and code", ["class", "code"],
                                 registry=r)
        self.queue_time = Histogram(
            "redserve_api_queue_seconds", "Accepted to admitted by a worker (as the worker "
            "measured it)", ["model", "stream"],
            buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram(
            "redserve_api_time_to_first_token_seconds", "Accepted to the first token handed "
            "to the response", ["model", "stream"], buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(
            "redserve_api_inter_token_seconds", "Gap between consecutive token entries of one "
            "choice handed to the response", ["model", "stream"], buckets=TOKEN_GAP_BUCKETS,
            registry=r)
        self.e2e = Histogram(
            "redserve_api_request_duration_seconds", "Accepted to the reply's end, by outcome",
            ["model", "stream", "outcome"], buckets=LATENCY_BUCKETS, registry=r)
        self._queues: QueueDepths | None = None
        self._queues_read = 0.0

    def serve_adapters(self, served: set[tuple[str, str]]) -> None:
        """The (base model, name) pairs served now; the series of any other go (an adapter
        unloaded), and tokens for one that went are not counted (a reply still ending)."""
        for gone in self._adapters - served:
            for counter in (self.adapter_requests, self.adapter_tokens):
                try:
                    counter.remove(*gone)
                except KeyError:  # none counted yet
                    pass
        self._adapters = set(served)

    def adapter_request(self, model: str, adapter: str) -> None:
        if (model, adapter) in self._adapters:
            self.adapter_requests.labels(model, adapter).inc()

    def adapter_output(self, model: str, adapter: str, tokens: int) -> None:
        if (model, adapter) in self._adapters and tokens:
            self.adapter_tokens.labels(model, adapter).inc(tokens)

    def watch(self, inflight: Callable[[], int], queues: Callable[[], int],
              buffered: Callable[[], int]) -> None:
        self.inflight.set_function(inflight)
        self.result_queues.set_function(queues)
        self.buffered.set_function(buffered)

    def watch_queues(self, queues: QueueDepths) -> None:
        self._queues = queues

    async def render(self) -> bytes:
        """The exposition, queue depths refreshed first when older than the cache."""
        now = time.monotonic()
        if self._queues is not None and now - self._queues_read >= QUEUE_DEPTH_CACHE_S:
            self._queues_read = now
            try:
                for model, depth in (await self._queues.read()).items():
                    self.queue_depth.labels(model).set(depth)
            except aioredis.RedisError as e:
                log.warning("queue depth unavailable: %s", e)
        return generate_latest(self.registry)


@dataclass(frozen=True)
class QueueDepths:
    """Each model's queue depth from its queued set (see api/queue/admission.py): one ZCOUNT a
    model, in one pipeline, leaving out the members the admission script counts as stale."""

    redis: aioredis.Redis
    queued_keys: Mapping[str, str]  # by model
    queue_timeout_s: float

    async def read(self) -> dict[str, int]:
        fresh = time.time() - self.queue_timeout_s - QUEUE_STALE_MARGIN_S  # older: trimmed
        pipe = self.redis.pipeline(transaction=False)
        for key in self.queued_keys.values():
            pipe.zcount(key, fresh, "+inf")
        return dict(zip(self.queued_keys, await pipe.execute(), strict=True))


class ReplyTimer:
    """The timings of one reply (all its choices), from `created` (unix time), fed by each
    choice's `Generation` as its entries are handed to the response; when the last choice
    closes, the reply's duration is observed and its `request.finished` event logged."""

    def __init__(self, metrics: APIMetrics, *, request_id: str, tenant: str, model: str,
                 adapter: str, stream: bool, created: float, prompt_tokens: int, choices: int,
                 trace: ReplyTrace | None = None) -> None:
        self.metrics = metrics
        self.trace = trace
        self.request_id = request_id
        self.tenant = tenant
        self.model = model
        self.adapter = adapter  # the name the request used: the base's, or an adapter's
        self.stream = stream
        self.created = created
        self.prompt_tokens = prompt_tokens
        self.choices = choices
        labels = (model, "true" if stream else "false")
        self._labels = labels
        self._ttft = metrics.ttft.labels(*labels)
        self._itl = metrics.itl.labels(*labels)
        self._waiting = metrics.waiting.labels(model)
        self._running = metrics.running.labels(model)
        self._waiting.inc(choices)
        self.queue_s: float | None = None
        self.ttft_s: float | None = None
        self._last: dict[str, float] = {}  # choice -> when its last tokens were handed on
        self._answered: set[str] = set()  # choices a worker has answered
        self._tokens: dict[str, int] = {}
        self._outcomes: dict[str, str] = {}

    def entry(self, choice: str, entry: ResultEntry) -> None:
        """A worker's result entry for `choice` goes to the response now."""
        now = time.time()
        if choice not in self._answered:
            self._answered.add(choice)
            self._waiting.dec()
            self._running.inc()
        if isinstance(entry, Tokens) and entry.queued_ms is not None and self.queue_s is None:
            self.queue_s = entry.queued_ms / 1000
            self.metrics.queue_time.labels(*self._labels).observe(self.queue_s)
        if isinstance(entry, Tokens) and entry.ids:
            self._tokens[choice] = self._tokens.get(choice, 0) + len(entry.ids)
            last = self._last.get(choice)
            if last is not None:
                self._itl.observe(now - last)
            elif self.ttft_s is None:
                self.ttft_s = max(now - self.created, 0.0)
                self._ttft.observe(self.ttft_s)
            for _ in range(len(entry.ids) - 1):  # came with the first (a speculating step)
                self._itl.observe(0.0)
            self._last[choice] = now
        elif isinstance(entry, Finish):
            self._tokens[choice] = entry.completion_tokens

    def closed(self, choice: str, outcome: str) -> None:
        """`choice` ended (`outcome`: finish reason, error code or "disconnect"); the reply
        ends with its last choice."""
        if choice in self._outcomes:
            return
        self._outcomes[choice] = outcome
        (self._running if choice in self._answered else self._waiting).dec()
        if len(self._outcomes) < self.choices:
            return
        outcomes = set(self._outcomes.values())
        reply_outcome = outcomes.pop() if len(outcomes) == 1 else "mixed"
        e2e = max(time.time() - self.created, 0.0)
        self.metrics.e2e.labels(*self._labels, reply_outcome).observe(e2e)
        self.metrics.adapter_output(self.model, self.adapter, sum(self._tokens.values()))
        log_event(log, "request.finished", request_id=self.request_id, tenant=self.tenant,
                  model=self.model, stream=self.stream, choices=self.choices,
                  prompt_tokens=self.prompt_tokens,
                  completion_tokens=sum(self._tokens.values()),
                  outcome=reply_outcome, queue_s=round_s(self.queue_s),
                  ttft_s=round_s(self.ttft_s), e2e_s=round_s(e2e))
        if self.trace is not None:
            self.trace.ended(prompt_tokens=self.prompt_tokens,
                             completion_tokens=sum(self._tokens.values()),
                             outcome=reply_outcome, queue_s=self.queue_s, ttft_s=self.ttft_s,
                             e2e_s=e2e)



class CountResponses:
    """Pure ASGI middleware, outermost: counts every response by status, those the auth guard
    refuses before any route runs included, and 500 for an exception that escapes."""

    def __init__(self, app: ASGIApp, metrics: APIMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0

        async def counting_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                self.metrics.responses.labels(f"{status // 100}xx", str(status)).inc()
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            if not status:  # the server answers 500 for it
                self.metrics.responses.labels("5xx", "500").inc()
            raise
