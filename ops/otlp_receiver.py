"""An OTLP/HTTP trace receiver in this process, which keeps every span it is sent, decoded:
what tests/test_tracing.py checks its traces against, and what the tracing benchmark
(ops/benchmarks/tracing.py) counts. It answers each export at once, so an export costs what it
costs against a collector that keeps up.

It needs opentelemetry-proto (the tracing extra's OTLP exporter brings it), imported when a
request arrives, so importing this module costs nothing without it.
"""

from __future__ import annotations

import gzip
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

from ops.embedded_redis import free_port


@dataclass(frozen=True)
class Received:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent: str
    kind: int
    attributes: dict[str, Any]
    links: list[tuple[str, str, dict[str, Any]]]  # (trace id, span id, attributes)


def _value(v: Any) -> Any:
    """An OTLP `AnyValue` as Python: its one value, arrays element by element."""
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def _attributes(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


class _Handler(BaseHTTPRequestHandler):
    server: OTLPReceiver

    def do_POST(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        request = ExportTraceServiceRequest.FromString(body)
        for resource_spans in request.resource_spans:
            service = _attributes(resource_spans.resource.attributes).get("service.name", "")
            self.server.add([
                Received(service, s.name, s.trace_id.hex(), s.span_id.hex(),
                         s.parent_span_id.hex(), s.kind, _attributes(s.attributes),
                         [(link.trace_id.hex(), link.span_id.hex(),
                           _attributes(link.attributes)) for link in s.links])
                for scope in resource_spans.scope_spans for s in scope.spans])
        reply = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class OTLPReceiver(ThreadingHTTPServer):
    """Serves on a free local port from `start` to `stop`, on a thread of its own; `endpoint`
    is what OTEL_EXPORTER_OTLP_ENDPOINT names."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", free_port()), _Handler)
        self._spans: list[Received] = []
        self._lock = threading.Lock()

    def start(self) -> Self:
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def add(self, spans: list[Received]) -> None:
        with self._lock:
            self._spans += spans

    @property
    def spans(self) -> list[Received]:
        """Every span received so far, in the order they arrived."""
        with self._lock:
            return list(self._spans)

    def of(self, trace_id: str) -> list[Received]:
        return [s for s in self.spans if s.trace_id == trace_id]
