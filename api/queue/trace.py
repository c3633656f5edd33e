"""A traced reply's spans on the replica, made only when tracing is on (shared/tracing.py).

The HTTP request's span, made by OpenTelemetry's ASGI middleware (api/app.py) from the
client's `traceparent` if it sent one, covers the whole request, a stream to its last event.
`ReplyTrace` gives it the GenAI semantic conventions' attributes (`gen_ai.*`) and redserve's
(`redserve.request_id`, `redserve.tenant`), and the children a reply's path has on a replica:
`redserve.tokenize` (api/endpoints/chat.py, completions.py), `redserve.placement`, and per choice
`redserve.admit` (its hash and the admission script) and `redserve.queue_wait` (admitted until its
worker's first entry). The HTTP span's `traceparent` goes into each choice's stream entry, so the
worker's spans (worker/broker/spans.py) are its children in the same trace; it is also kept in
the request's hash, so a resume on any replica links to it (api/endpoints/requests.py).

A request that is not sampled gets no `ReplyTrace` (None), and so nothing in Redis.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.protocol.bodies import ChatCompletionRequest, CompletionRequest
from api.protocol.reply_spec import ReplySpec
from shared import tracing

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

# Outcomes that are a finish reason; and those that are not an error (a client that went away,
# choices that ended differently).
_FINISHED = {"stop", "length", "abort"}
_FINE = {*_FINISHED, "disconnect", "mixed"}


class ReplyTrace:
    def __init__(self, tracer: Tracer, server: Span, traceparent: str) -> None:
        self.tracer = tracer
        self.server = server
        self.traceparent = traceparent  # the server span's: what goes into Redis

    @classmethod
    def start(cls, body: ChatCompletionRequest | CompletionRequest, spec: ReplySpec,
              reply_id: str, tenant: str) -> ReplyTrace | None:
        """The current request's trace, its attributes set (`reply_id`: the `id` its reply's
        objects carry); None when off or not sampled."""
        tracer, server = tracing.tracer("redserve.api"), tracing.current()
        if tracer is None or server is None:
            return None
        traceparent = tracing.traceparent(server)
        if traceparent is None:
            return None
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "chat" if spec.kind == "chat" else "text_completion",
            "gen_ai.request.model": body.model,
            "gen_ai.request.temperature": body.temperature,
            "gen_ai.request.top_p": body.top_p,
            "gen_ai.response.id": reply_id,
            "gen_ai.response.model": spec.model,
            "redserve.request_id": spec.base_id,
            "redserve.tenant": tenant,
            "redserve.stream": body.stream,
        }
        most = body.requested_max_tokens()
        if most is not None:
            attributes["gen_ai.request.max_tokens"] = most
        if body.n > 1:
            attributes["gen_ai.request.choice.count"] = body.n
        server.set_attributes(attributes)
        return cls(tracer, server, traceparent)

    def placement(self) -> AbstractContextManager[Span]:
        return self.tracer.start_as_current_span("redserve.placement")

    def admit(self, request_id: str) -> AbstractContextManager[Span]:
        return self.tracer.start_as_current_span(
            "redserve.admit", attributes={"redserve.request_id": request_id})

    def queue_wait(self, request_id: str, start_s: float, end_s: float) -> None:
        """A choice waited from its admission (`start_s`) to its worker's first entry."""
        from opentelemetry import trace

        span = self.tracer.start_span(
            "redserve.queue_wait", context=trace.set_span_in_context(self.server),
            start_time=tracing.ns(start_s), attributes={"redserve.request_id": request_id})
        span.end(end_time=tracing.ns(end_s))

    def ended(self, *, prompt_tokens: int, completion_tokens: int, outcome: str,
              queue_s: float | None, ttft_s: float | None, e2e_s: float) -> None:
        """The reply is over (its last choice closed): usage and latencies on the HTTP span."""
        attributes: dict[str, Any] = {
            "gen_ai.usage.input_tokens": prompt_tokens,
            "gen_ai.usage.output_tokens": completion_tokens,
            "gen_ai.latency.e2e": e2e_s,
            "redserve.outcome": outcome,
        }
        if outcome in _FINISHED:
            attributes["gen_ai.response.finish_reasons"] = [outcome]
        if queue_s is not None:
            attributes["gen_ai.latency.time_in_queue"] = queue_s
        if ttft_s is not None:
            attributes["gen_ai.latency.time_to_first_token"] = ttft_s
        self.server.set_attributes(attributes)
        if outcome not in _FINE:
            from opentelemetry.trace import Status, StatusCode

            self.server.set_status(Status(StatusCode.ERROR, outcome))


def resumed(original: str | None, request_id: str, after: int) -> None:
    """A stream is resumed here (api/endpoints/requests.py): this HTTP request's span links to the
    original request's (`original`, from its hash), and a `redserve.resume` span in the
    original's trace links back, so each trace shows the other."""
    tracer, server = tracing.tracer("redserve.api"), tracing.current()
    if original is None or tracer is None or server is None:
        return
    to_original = tracing.link(original, "resumed")
    if to_original is None:
        return
    server.add_link(to_original.context, to_original.attributes)
    server.set_attribute("redserve.request_id", request_id)
    here = tracing.traceparent(server)
    back = None if here is None else tracing.link(here, "resume")
    tracer.start_span("redserve.resume", context=tracing.parent(original),
                      links=[] if back is None else [back],
                      attributes={"redserve.request_id": request_id,
                                  "redserve.resume.after": after}).end()


class RouteNamedSpans:
    """Pure ASGI middleware, just inside the tracing one (api/app.py): the HTTP span is named
    after the route that answered (`GET /v1/requests/{request_id}/stream`, `http.route`),
    known only once the router has run, so one name per route whatever the ids in the path;
    a request no route answered keeps its method alone."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        span = tracing.current()
        if scope["type"] != "http" or span is None:
            await self.app(scope, receive, send)
            return

        async def named(message: Message) -> None:
            if message["type"] == "http.response.start":
                path = getattr(scope.get("route"), "path", None)
                if path:
                    span.update_name(f"{scope['method']} {path}")
                    span.set_attribute("http.route", path)
            await send(message)

        await self.app(scope, receive, named)
