"""OTLP trace receivers in this process, over HTTP/protobuf (`OTLPReceiver`) and gRPC
(`OTLPGrpcReceiver`), which keep every span they are sent, decoded: what tests/test_tracing.py
checks its traces against, and what the tracing benchmark (ops/benchmarks/tracing.py) counts.
They answer each export at once, so an export costs what it costs against a collector that
keeps up.

They need opentelemetry-proto (the tracing extra's OTLP exporters bring it; gRPC also grpcio),
imported when one is used, so importing this module costs nothing without them.
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


def _decoded(request: Any) -> list[Received]:
    """The spans of an `ExportTraceServiceRequest`."""
    return [Received(_attributes(rs.resource.attributes).get("service.name", ""), s.name,
                     s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.kind,
                     _attributes(s.attributes),
                     [(link.trace_id.hex(), link.span_id.hex(), _attributes(link.attributes))
                      for link in s.links])
            for rs in request.resource_spans for scope in rs.scope_spans for s in scope.spans]


class _Spans:
    """What a receiver has been sent, kept across its threads."""

    def __init__(self) -> None:
        self._spans: list[Received] = []
        self._lock = threading.Lock()

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
        self.server.add(_decoded(ExportTraceServiceRequest.FromString(body)))
        reply = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class OTLPReceiver(_Spans, ThreadingHTTPServer):
    """OTLP/HTTP on a free local port from `start` to `stop`, on a thread of its own;
    `endpoint` is what OTEL_EXPORTER_OTLP_ENDPOINT names."""

    def __init__(self) -> None:
        _Spans.__init__(self)
        ThreadingHTTPServer.__init__(self, ("127.0.0.1", free_port()), _Handler)

    def start(self) -> Self:
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class OTLPGrpcReceiver(_Spans):
    """OTLP over gRPC on a free local port from `start` to `stop` (grpcio's own threads);
    `endpoint` is what OTEL_EXPORTER_OTLP_ENDPOINT names, with
    OTEL_EXPORTER_OTLP_PROTOCOL=grpc."""

    def __init__(self) -> None:
        super().__init__()
        self.port = free_port()
        self._server: Any = None

    def start(self) -> Self:
        from concurrent.futures import ThreadPoolExecutor

        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as service
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceResponse,
        )

        receiver = self

        class Servicer(service.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:
                receiver.add(_decoded(request))
                return ExportTraceServiceResponse()

        self._server = grpc.server(ThreadPoolExecutor(max_workers=4))
        service.add_TraceServiceServicer_to_server(Servicer(), self._server)
        self._server.add_insecure_port(f"127.0.0.1:{self.port}")
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=None)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"
