"""kvgrid.common.telemetry against a real in-process OTLP gRPC receiver and a real Prometheus scrape."""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from kvgrid.common.telemetry import Telemetry, setup_telemetry
from tests.telemetry.receivers import HttpReceiver


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    return None if kind is None else getattr(v, kind)


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


class OtlpSink(trace_service_pb2_grpc.TraceServiceServicer, metrics_service_pb2_grpc.MetricsServiceServicer):
    """Collector side of OTLP/gRPC: keeps every span and metric point it is sent."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spans: list[tuple[dict[str, Any], Any]] = []  # (resource attributes, Span)
        self.metrics: list[tuple[dict[str, Any], Any]] = []  # (resource attributes, Metric)

    def Export(self, request: Any, context: grpc.ServicerContext) -> Any:
        with self.lock:
            if isinstance(request, trace_service_pb2.ExportTraceServiceRequest):
                for rs in request.resource_spans:
                    for ss in rs.scope_spans:
                        self.spans += [(_attrs(rs.resource.attributes), s) for s in ss.spans]
                return trace_service_pb2.ExportTraceServiceResponse()
            for rm in request.resource_metrics:
                for sm in rm.scope_metrics:
                    self.metrics += [(_attrs(rm.resource.attributes), m) for m in sm.metrics]
            return metrics_service_pb2.ExportMetricsServiceResponse()


@pytest.fixture
def otlp_sink() -> Iterator[tuple[OtlpSink, int]]:
    sink = OtlpSink()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(sink, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield sink, port
    server.stop(grace=None)


@pytest.fixture(autouse=True)
def _clean_otel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)


def _counter_sum(sink: OtlpSink, name: str) -> float:
    points = [p for _, m in sink.metrics if m.name == name for p in m.sum.data_points]
    assert points, f"metric {name} not received; got {[m.name for _, m in sink.metrics]}"
    return points[-1].as_int or points[-1].as_double  # cumulative: the last point is the total


def test_span_and_counter_reach_otlp_receiver(otlp_sink: tuple[OtlpSink, int]) -> None:
    sink, port = otlp_sink
    tel = setup_telemetry(
        "kvgrid-test", otlp_endpoint=f"127.0.0.1:{port}", resource_attributes={"k8s.pod.name": "agent-0"}
    )
    assert set(tel.exporters) == {"otlp-traces", "otlp-metrics"}
    counter = tel.meter.create_counter("kvgrid_chunks_stored", unit="{chunk}", description="chunks stored")
    counter.add(3, {"tier": "l1"})
    counter.add(4, {"tier": "l1"})
    with tel.tracer.start_as_current_span("kvgrid.store") as span:
        span.set_attribute("kvgrid.chunks", 42)
    tel.shutdown()
    tel.shutdown()  # idempotent

    assert len(sink.spans) == 1
    resource, got = sink.spans[0]
    assert got.name == "kvgrid.store"
    assert _attrs(got.attributes) == {"kvgrid.chunks": 42}
    assert resource["service.name"] == "kvgrid-test"
    assert resource["k8s.pod.name"] == "agent-0"
    assert _counter_sum(sink, "kvgrid_chunks_stored") == 7
    point = next(m for _, m in sink.metrics if m.name == "kvgrid_chunks_stored").sum.data_points[0]
    assert _attrs(point.attributes) == {"tier": "l1"}


def test_standard_env_vars_choose_endpoint_and_signals(
    otlp_sink: tuple[OtlpSink, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    sink, port = otlp_sink
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "renamed-by-operator")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=ci")
    tel = setup_telemetry("kvgrid-test")
    assert tel.exporters == ("otlp-metrics",)
    tel.meter.create_counter("kvgrid_lookups").add(5)
    with tel.tracer.start_as_current_span("not-exported"):
        pass
    tel.shutdown()
    assert sink.spans == []
    assert _counter_sum(sink, "kvgrid_lookups") == 5
    resource = sink.metrics[0][0]
    assert resource["service.name"] == "renamed-by-operator"
    assert resource["deployment.environment"] == "ci"


def test_no_endpoint_exports_nothing_but_instruments_work() -> None:
    reader = InMemoryMetricReader()
    tel = setup_telemetry("kvgrid-test", metric_readers=[reader])
    assert tel.exporters == ()
    tel.meter.create_counter("kvgrid_local").add(2)
    with tel.tracer.start_as_current_span("local") as span:
        # Nobody would see spans: the tracer is a no-op, so RPCs pay no span cost.
        assert not span.is_recording() and not span.get_span_context().is_valid
    data = reader.get_metrics_data()
    assert data is not None
    values = [
        getattr(p, "value", None)
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == "kvgrid_local"
        for p in m.data.data_points
    ]
    assert values == [2]
    tel.shutdown()


def test_disabled_is_noop(monkeypatch: pytest.MonkeyPatch) -> None:
    tel = Telemetry.disabled("kvgrid-test")
    tel.meter.create_counter("kvgrid_x").add(1)
    with tel.tracer.start_as_current_span("x") as span:
        assert not span.get_span_context().is_valid
    assert tel.exporters == ()
    tel.shutdown()
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert setup_telemetry("kvgrid-test", otlp_endpoint="127.0.0.1:1").exporters == ()


@pytest.mark.parametrize("per_signal", [False, True])
def test_otlp_over_http_exports_spans_and_metrics(monkeypatch: pytest.MonkeyPatch, per_signal: bool) -> None:
    receiver = HttpReceiver()
    try:
        if per_signal:
            for signal in ("TRACES", "METRICS"):
                monkeypatch.setenv(f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL", "http/protobuf")
        else:
            monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        tel = setup_telemetry("kvgrid-http", otlp_endpoint=f"127.0.0.1:{receiver.port}")
        assert tel.problems == () and set(tel.exporters) == {"otlp-traces", "otlp-metrics"}
        with tel.tracer.start_as_current_span("kvgrid.http-span"):
            pass
        tel.meter.create_counter("kvgrid_http_things").add(3)
        assert tel.force_flush()
        tel.shutdown()
        names = [s.name for _, s in receiver.spans]
        assert names == ["kvgrid.http-span"]
        assert receiver.spans[0][0]["service.name"] == "kvgrid-http"
        points = [m.sum.data_points[0].as_int for _, m in receiver.metrics if m.name == "kvgrid_http_things"]
        assert points and points[-1] == 3
    finally:
        receiver.close()


@pytest.mark.parametrize(
    ("env", "problem"),
    [
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "thrift"}, "OTEL_EXPORTER_OTLP_PROTOCOL='thrift' is not supported"),
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER='zipkin': 'zipkin' is not supported"),
        ({"OTEL_METRICS_EXPORTER": "jaeger"}, "OTEL_METRICS_EXPORTER='jaeger': 'jaeger' is not supported"),
    ],
)
def test_bad_setting_is_logged_and_metrics_still_scrape(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, env: dict[str, str], problem: str
) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    tel = setup_telemetry(
        "kvgrid-bad", otlp_endpoint="127.0.0.1:1", prometheus_port=0, prometheus_addr="127.0.0.1"
    )
    try:
        assert any(problem in p for p in tel.problems), tel.problems
        assert any(problem in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)
        assert "prometheus" in tel.exporters
        tel.meter.create_counter("kvgrid_still_counted").add(2)
        assert tel.prometheus_port is not None
        sample = [
            ln
            for ln in _scrape(tel.prometheus_port).splitlines()
            if ln.startswith("kvgrid_still_counted_total")
        ]
        assert len(sample) == 1 and sample[0].endswith(" 2.0")
    finally:
        tel.shutdown()


def test_bad_port_is_a_problem_not_an_exception() -> None:
    tel = setup_telemetry("kvgrid-test", prometheus_port=70000)
    assert tel.problems == ("prometheus_port must be in 0..65535, got 70000",)
    assert tel.prometheus_port is None
    tel.shutdown()
    busy = setup_telemetry("kvgrid-a", prometheus_port=0, prometheus_addr="127.0.0.1")
    try:
        assert busy.prometheus_port is not None
        again = setup_telemetry("kvgrid-b", prometheus_port=busy.prometheus_port, prometheus_addr="127.0.0.1")
        assert any(
            f"cannot serve Prometheus metrics on 127.0.0.1:{busy.prometheus_port}" in p
            for p in again.problems
        )
        again.shutdown()
    finally:
        busy.shutdown()


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        assert resp.status == 200
        return resp.read().decode()


def test_prometheus_endpoint_serves_kvgrid_metrics() -> None:
    # Two instances in one process: each has its own registry and port, neither sees the other's metrics.
    a = setup_telemetry("kvgrid-a", prometheus_port=0, prometheus_addr="127.0.0.1")
    b = setup_telemetry("kvgrid-b", prometheus_port=0, prometheus_addr="127.0.0.1")
    try:
        assert a.exporters == ("prometheus",)
        assert a.prometheus_port and b.prometheus_port and a.prometheus_port != b.prometheus_port
        a.meter.create_counter("kvgrid_requests", description="requests served").add(5, {"rpc": "Lookup"})
        b.meter.create_up_down_counter("kvgrid_pinned_chunks").add(9)
        text_a, text_b = _scrape(a.prometheus_port), _scrape(b.prometheus_port)
        sample = next(line for line in text_a.splitlines() if line.startswith("kvgrid_requests_total{"))
        assert 'rpc="Lookup"' in sample and sample.endswith(" 5.0")
        assert "# HELP kvgrid_requests_total requests served" in text_a
        assert "kvgrid_pinned_chunks" not in text_a
        assert any(
            line.startswith("kvgrid_pinned_chunks") and line.endswith(" 9.0") for line in text_b.splitlines()
        )
    finally:
        a.shutdown()
        b.shutdown()
    with pytest.raises(OSError):
        _scrape(a.prometheus_port)  # server stopped
