"""Real OTLP receivers for tests: the collector side of OTLP/gRPC and OTLP/HTTP (protobuf), in process.

Both keep every span and metric they are sent, with the sender's resource attributes, so tests can
assert on what a service really exported over the wire.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

__all__ = ["GrpcReceiver", "HttpReceiver", "Store", "attrs"]


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    return None if kind is None else getattr(v, kind)


def attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


class Store:
    """Spans and metrics received, each with its resource's attributes."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spans: list[tuple[dict[str, Any], Any]] = []
        self.metrics: list[tuple[dict[str, Any], Any]] = []

    def add_traces(self, req: trace_service_pb2.ExportTraceServiceRequest) -> None:
        with self.lock:
            for rs in req.resource_spans:
                for ss in rs.scope_spans:
                    self.spans += [(attrs(rs.resource.attributes), s) for s in ss.spans]

    def add_metrics(self, req: metrics_service_pb2.ExportMetricsServiceRequest) -> None:
        with self.lock:
            for rm in req.resource_metrics:
                for sm in rm.scope_metrics:
                    self.metrics += [(attrs(rm.resource.attributes), m) for m in sm.metrics]

    def wait_for(self, check: Callable[[], bool], timeout_s: float = 20.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                if check():
                    return True
            time.sleep(0.1)
        return False


class GrpcReceiver(
    Store, trace_service_pb2_grpc.TraceServiceServicer, metrics_service_pb2_grpc.MetricsServiceServicer
):
    """OTLP/gRPC on 127.0.0.1:``port``."""

    def __init__(self) -> None:
        super().__init__()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def Export(self, request: Any, context: grpc.ServicerContext) -> Any:
        if isinstance(request, trace_service_pb2.ExportTraceServiceRequest):
            self.add_traces(request)
            return trace_service_pb2.ExportTraceServiceResponse()
        self.add_metrics(request)
        return metrics_service_pb2.ExportMetricsServiceResponse()

    def close(self) -> None:
        self.server.stop(grace=None)


class HttpReceiver(Store):
    """OTLP/HTTP (protobuf bodies) on http://127.0.0.1:``port``: POST /v1/traces and /v1/metrics."""

    def __init__(self) -> None:
        super().__init__()
        store = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.headers.get("Content-Type") != "application/x-protobuf":
                    self.send_error(415, "expected application/x-protobuf")
                    return
                if self.path == "/v1/traces":
                    store.add_traces(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
                    out = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                elif self.path == "/v1/metrics":
                    store.add_metrics(metrics_service_pb2.ExportMetricsServiceRequest.FromString(body))
                    out = metrics_service_pb2.ExportMetricsServiceResponse().SerializeToString()
                else:
                    self.send_error(404, f"no OTLP signal at {self.path}")
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
