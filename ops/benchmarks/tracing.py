"""What tracing costs: `redserve up` serving the same load with tracing off and on.

    python -m ops.benchmarks.tracing [--streams 32] [--max-tokens 64] [--rounds 2]
                                     [--dtype auto]

Tracing is opt-in (shared/tracing.py, docs/observability.md#traces); the target is that off it
costs nothing and on, every request sampled (`OTEL_TRACES_SAMPLER=always_on`), a load keeps
>= 0.95x of its output tokens/s. The load is serve.py's: `--streams` concurrent chat streams of
up to `--max-tokens` tokens through HTTP, greedy, the default model. The spans go over
OTLP/HTTP to a receiver in this process that counts them (so an export costs what it costs
against a collector that answers at once); the run checks that every request sent spans.
Off and on alternate, `--rounds` times each, each round on a fresh `redserve up` after a
warm-up, so a drift of the machine falls on both; each round's figure is printed, and the
ratio is of the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import statistics
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from rich.table import Table

from ops.benchmarks.machine import describe
from ops.benchmarks.peers import redserve
from ops.benchmarks.serve import Load, _load, _pct
from ops.console import make_console
from ops.embedded_redis import free_port
from shared.settings import DEFAULT_MODEL


class _Count(BaseHTTPRequestHandler):
    server: SpanSink

    def do_POST(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        request = ExportTraceServiceRequest.FromString(body)
        self.server.counted(sum(len(scope.spans) for rs in request.resource_spans
                                for scope in rs.scope_spans))
        reply = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class SpanSink(ThreadingHTTPServer):
    """An OTLP/HTTP receiver that only counts the spans it is sent."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", free_port()), _Count)
        self.spans = 0
        self._lock = threading.Lock()

    def counted(self, n: int) -> None:
        with self._lock:
            self.spans += n

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


def _round(dtype: str, env: dict[str, str], streams: int, max_tokens: int) -> Load:
    server = redserve(dtype, env)
    try:
        server.wait()
        asyncio.run(_load(server, 4, 8, None))  # warm-up
        return asyncio.run(_load(server, streams, max_tokens, None))
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="runs of each, alternating")
    ap.add_argument("--dtype", default="auto", help="redserve's --dtype (default auto)")
    args = ap.parse_args()
    console = make_console()
    console.print(describe())
    sink = SpanSink()
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    settings = {
        "off": {},
        "on": {"OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint, "OTEL_TRACES_SAMPLER": "always_on"},
    }
    loads: dict[str, list[Load]] = {"off": [], "on": []}
    spans = 0
    for i in range(args.rounds):
        for name, env in settings.items():
            with console.status(f"round {i + 1}: tracing {name}"):
                before = sink.spans
                loads[name].append(_round(args.dtype, env, args.streams, args.max_tokens))
                if name == "on":
                    spans += sink.spans - before
                elif sink.spans != before:
                    raise RuntimeError("tracing off, and yet spans were sent")
    sink.shutdown()
    table = Table(title=f"{args.streams} streams x {args.max_tokens} tokens, {DEFAULT_MODEL}, "
                        "greedy, through HTTP: tracing off and on (always_on)")
    for col in ("tracing", "round", "tokens", "tokens/s", "TTFT p50 ms", "ITL p50 ms"):
        table.add_column(col)
    for name, runs in loads.items():
        for i, load in enumerate(runs, start=1):
            table.add_row(name, str(i), str(load.tokens), f"{load.rate:.1f}",
                          f"{_pct(load.ttft, 0.5) * 1e3:.0f}",
                          f"{_pct(load.itl or [0.0], 0.5) * 1e3:.1f}")
    console.print(table)
    off = statistics.median(load.rate for load in loads["off"])
    on = statistics.median(load.rate for load in loads["on"])
    # Every request of the measured loads and warm-ups (and each start's probe) sent spans.
    requests = args.rounds * (args.streams + 4)
    verdict = "met" if on >= 0.95 * off else "MISSED"
    console.print(f"tokens/s median: off {off:.1f}, on {on:.1f}: {on / off:.3f}x "
                  f"(target >= 0.95x: {verdict}); {spans} spans received from at least "
                  f"{requests} traced requests")


if __name__ == "__main__":
    main()
