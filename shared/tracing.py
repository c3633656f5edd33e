"""Opt-in OpenTelemetry tracing: the few helpers the replica and the worker share.

Why this module exists: one request crosses an API replica, Redis, a worker (two, after a
takeover) and maybe a second replica (a resume), and an operator wants it as one trace. The
replica's span context rides in the request's stream entry (`GenerateRequest.traceparent`, W3C
Trace Context), and the worker's spans are its children. Everything OpenTelemetry-specific
that both sides need is here, so neither imports the SDK itself.

Why so careful about being off: tracing is opt-in, and off it must cost nothing on the hot
path. It is on only when the SDK is installed (`pip install 'redserve[tracing]'`) and the
standard environment asks for it (`configure`): `OTEL_TRACES_EXPORTER` names an exporter
(`otlp`, `console`; `none` is off), or an OTLP endpoint is set (`OTEL_EXPORTER_OTLP_ENDPOINT`,
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`), and `OTEL_SDK_DISABLED` is not `true`. Off (or without
the SDK), `tracer()` is None: callers test that once and make no span object, and nothing is
added to what goes through Redis. On, the SDK reads the rest of the standard variables itself
(`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER[_ARG]`, `OTEL_BSP_*`,
`OTEL_EXPORTER_OTLP_*`). Spans are exported in batches by a background thread, over OTLP's
HTTP/protobuf (the default) or gRPC, as `OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL` says.
"""

from __future__ import annotations

import logging
import os
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Link, Span, Tracer

log = logging.getLogger("redserve.tracing")

_provider: TracerProvider | None = None
_spans: Tracer | None = None  # `span`'s
_NO_SPAN: AbstractContextManager[None] = nullcontext()


def wanted(env: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """Whether the standard OTel variables ask for traces."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporters:
        return exporters != "none"
    return bool(env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def configure(service: str, instance: str = "") -> bool:
    """Start tracing in this process if the environment asks for it and the SDK is there;
    True if it is on. `service`: the default `service.name` (OTEL_SERVICE_NAME wins)."""
    global _provider, _spans
    if _provider is not None or not wanted():
        return _provider is not None
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        log.warning("OTEL_* asks for traces but the OpenTelemetry SDK is not installed "
                    "(pip install 'redserve[tracing]'): tracing is off")
        return False
    attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": service}
    if instance:
        attributes["service.instance.id"] = instance
    provider = TracerProvider(resource=Resource.create(attributes))
    for exporter in _exporters():
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _provider, _spans = provider, provider.get_tracer("redserve")
    log.info("tracing on: %s", os.environ.get("OTEL_TRACES_EXPORTER") or "otlp")
    return True


def _exporters() -> list[Any]:
    names = [n.strip().lower() for n in
             (os.environ.get("OTEL_TRACES_EXPORTER") or "otlp").split(",") if n.strip()]
    exporters: list[Any] = []
    for name in names:
        if name == "otlp":
            exporters += _otlp()
        elif name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            exporters.append(ConsoleSpanExporter())
        else:
            log.warning("OTEL_TRACES_EXPORTER: unknown exporter %r ignored (otlp, console)", name)
    return exporters


def _otlp() -> list[Any]:
    """The OTLP exporter for the protocol the standard variables name: none (with a warning)
    for one the Python SDK has no exporter of, so a collector is never sent what it does not
    speak."""
    protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf")
    protocol = protocol.strip().lower()
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return [OTLPSpanExporter()]
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter as GrpcSpanExporter,
            )
        except ImportError:
            log.warning("OTLP over gRPC needs opentelemetry-exporter-otlp-proto-grpc (in "
                        "pip install 'redserve[tracing]'): no spans are exported")
            return []
        return [GrpcSpanExporter()]
    log.warning("OTEL_EXPORTER_OTLP_PROTOCOL %r is not served (http/protobuf, grpc): no spans "
                "are exported", protocol)
    return []


def shutdown() -> None:
    """Export what is buffered and stop (at process exit)."""
    global _provider, _spans
    if _provider is not None:
        _provider.shutdown()
        _provider = _spans = None


def enabled() -> bool:
    return _provider is not None


def tracer(name: str) -> Tracer | None:
    """This process's tracer for `name`, or None when tracing is off."""
    return None if _provider is None else _provider.get_tracer(name)


def span(name: str, **attributes: Any) -> AbstractContextManager[Any]:
    """A child of the current span around a block (a shared do-nothing context when off)."""
    if _spans is None:
        return _NO_SPAN
    return _spans.start_as_current_span(name, attributes=attributes)


def current() -> Span | None:
    """The span now current (the HTTP request's on a replica), or None when off."""
    if _provider is None:
        return None
    from opentelemetry import trace

    return trace.get_current_span()


def traceparent(of: Span) -> str | None:
    """`of`'s W3C `traceparent` (what crosses Redis), or None if it is not a sampled, valid
    span (nothing then goes into Redis)."""
    context = of.get_span_context()
    if not context.is_valid or not context.trace_flags.sampled:
        return None
    return (f"00-{context.trace_id:032x}-{context.span_id:016x}-"
            f"{int(context.trace_flags):02x}")


def parent(traceparent: str) -> Context:
    """The context whose spans are children of the span `traceparent` names."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({"traceparent": traceparent})


def link(traceparent: str, kind: str) -> Link | None:
    """A link to the span `traceparent` names (a takeover's earlier worker, a resumed
    request), tagged `redserve.link=<kind>`; None if it does not parse."""
    from opentelemetry import trace

    context = trace.get_current_span(parent(traceparent)).get_span_context()
    if not context.is_valid:
        return None
    return trace.Link(context, {"redserve.link": kind})


def ns(unix_s: float) -> int:
    """Unix seconds as the nanoseconds a span's start or end takes."""
    return int(unix_s * 1e9)

