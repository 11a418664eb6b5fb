"""OpenTelemetry metrics and traces for one kvgrid service, set up by one call.

``setup_telemetry("kvgrid-agent", prometheus_port=9464)`` returns a :class:`Telemetry` that owns its
own MeterProvider and TracerProvider (not the process-global ones, so tests can build many); take
``.meter`` and ``.tracer`` from it and call ``.shutdown()`` to flush. Metric names start ``kvgrid_``.

Exporters:

- OTLP over gRPC when ``otlp_endpoint`` is given or ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or the per-signal
  ``OTEL_EXPORTER_OTLP_{TRACES,METRICS}_ENDPOINT``) is set. The exporters read the other standard
  variables themselves (``OTEL_EXPORTER_OTLP_HEADERS``, ``_TIMEOUT``, ``_INSECURE``, ``_CERTIFICATE``,
  ``_COMPRESSION``, ``OTEL_METRIC_EXPORT_INTERVAL``, ``OTEL_BSP_*``). ``OTEL_TRACES_EXPORTER=none`` /
  ``OTEL_METRICS_EXPORTER=none`` turn one signal off, ``OTEL_SDK_DISABLED=true`` turns everything off.
  An explicit endpoint without a scheme is plaintext (an in-cluster collector); use ``https://`` for TLS.
- Prometheus scrape endpoint (``/metrics``) on ``prometheus_port`` when given, backed by a registry of
  this Telemetry's own so two instances in a process never clash.

Without either, nothing leaves the process (spans still get ids, instruments still work).
"""

from __future__ import annotations

import atexit
import logging
import os
from collections.abc import Mapping, Sequence
from importlib import metadata
from types import TracebackType
from typing import Any
from wsgiref.simple_server import WSGIServer

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

__all__ = ["METRIC_PREFIX", "Telemetry", "setup_telemetry"]

METRIC_PREFIX = "kvgrid_"
_SCOPE = "kvgrid"
_log = logging.getLogger(__name__)
_global_installed = False


def _version() -> str:
    try:
        return metadata.version("kvgrid")
    except metadata.PackageNotFoundError:
        return "0+unknown"


class Telemetry:
    """A service's meter and tracer plus the providers and servers behind them."""

    def __init__(
        self,
        service_name: str,
        meter_provider: metrics.MeterProvider,
        tracer_provider: trace.TracerProvider,
        *,
        exporters: Sequence[str] = (),
        prometheus_server: WSGIServer | None = None,
    ) -> None:
        self.service_name = service_name
        self.meter_provider = meter_provider
        self.tracer_provider = tracer_provider
        self.meter: metrics.Meter = meter_provider.get_meter(_SCOPE, _version())
        self.tracer: trace.Tracer = tracer_provider.get_tracer(_SCOPE, _version())
        # What leaves the process: subset of "otlp-traces", "otlp-metrics", "prometheus".
        self.exporters: tuple[str, ...] = tuple(exporters)
        self._prometheus_server = prometheus_server
        self.prometheus_port: int | None = prometheus_server.server_port if prometheus_server else None
        self._closed = False
        atexit.register(self.shutdown)

    @classmethod
    def disabled(cls, service_name: str = "kvgrid") -> Telemetry:
        """No-op meter and tracer: nothing is recorded or exported."""
        return cls(service_name, metrics.NoOpMeterProvider(), trace.NoOpTracerProvider())

    def force_flush(self, timeout_millis: int = 10_000) -> bool:
        """Export pending spans and metrics now; True when every provider finished in time."""
        ok = True
        for provider in (self.tracer_provider, self.meter_provider):
            flush = getattr(provider, "force_flush", None)
            if flush is not None:
                ok = bool(flush(timeout_millis)) and ok
        return ok

    def shutdown(self) -> None:
        """Flush and stop exporters and the Prometheus server; safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        self.force_flush()
        for provider in (self.tracer_provider, self.meter_provider):
            stop = getattr(provider, "shutdown", None)
            if stop is not None:
                stop()
        if self._prometheus_server is not None:
            self._prometheus_server.shutdown()
            self._prometheus_server.server_close()

    def __enter__(self) -> Telemetry:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.shutdown()


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() == "true"


def _signal_wanted(signal: str, otlp_endpoint: str | None) -> bool:
    """OTLP export of TRACES or METRICS: an endpoint is known and the signal's exporter isn't 'none'."""
    choice = os.environ.get(f"OTEL_{signal}_EXPORTER", "otlp").strip().lower()
    if choice == "none":
        return False
    if choice != "otlp":
        raise ValueError(f"OTEL_{signal}_EXPORTER={choice!r} is not supported; expected 'otlp' or 'none'")
    return bool(
        otlp_endpoint
        or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or os.environ.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT")
    )


def _check_protocol(signal: str) -> None:
    for name in (f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        value = os.environ.get(name)
        if value:
            if value.strip().lower() != "grpc":
                raise ValueError(f"{name}={value!r} is not supported; kvgrid exports OTLP over 'grpc'")
            return


def _endpoint(otlp_endpoint: str | None) -> str | None:
    """Explicit endpoints without a scheme are plaintext unless OTEL_EXPORTER_OTLP_INSECURE says."""
    if otlp_endpoint is None or "://" in otlp_endpoint or "OTEL_EXPORTER_OTLP_INSECURE" in os.environ:
        return otlp_endpoint
    return "http://" + otlp_endpoint


def _resource(service_name: str, attributes: Mapping[str, str] | None) -> Resource:
    attrs: dict[str, Any] = {
        SERVICE_NAME: service_name,
        SERVICE_VERSION: _version(),
        "service.namespace": "kvgrid",
    }
    attrs.update(attributes or {})
    # Operators may rename the service; code-given attributes beat OTEL_RESOURCE_ATTRIBUTES otherwise.
    if os.environ.get("OTEL_SERVICE_NAME"):
        attrs[SERVICE_NAME] = os.environ["OTEL_SERVICE_NAME"]
    return Resource.create(attrs)


def _start_prometheus(port: int, addr: str) -> tuple[MetricReader, WSGIServer]:
    # Imported here: prometheus_client is only needed by services that expose a scrape port.
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry(auto_describe=False)
    reader = PrometheusMetricReader(registry=registry)
    try:
        server, _thread = start_http_server(port, addr=addr, registry=registry)
    except OSError as e:
        reader.shutdown()
        raise OSError(e.errno, f"cannot serve Prometheus metrics on {addr}:{port}: {e.strerror}") from e
    return reader, server


def setup_telemetry(
    service_name: str,
    *,
    prometheus_port: int | None = None,
    otlp_endpoint: str | None = None,
    resource_attributes: Mapping[str, str] | None = None,
    prometheus_addr: str = "0.0.0.0",
    metric_readers: Sequence[MetricReader] = (),
    span_processors: Sequence[SpanProcessor] = (),
    set_global: bool = False,
) -> Telemetry:
    """Metrics and traces for ``service_name``; see the module docstring for the exporters.

    ``prometheus_port=0`` picks a free port (``Telemetry.prometheus_port`` tells which).
    ``metric_readers`` / ``span_processors`` add in-process sinks (e.g. ``InMemoryMetricReader`` in
    tests). ``set_global`` also installs the providers as the process-wide OpenTelemetry defaults
    (first call per process only; later calls log and keep the first).
    """
    if not service_name:
        raise ValueError(f"service_name must be a non-empty string, got {service_name!r}")
    if prometheus_port is not None and not 0 <= prometheus_port <= 65535:
        raise ValueError(f"prometheus_port must be in 0..65535, got {prometheus_port}")
    if _env_true("OTEL_SDK_DISABLED"):
        return Telemetry.disabled(service_name)

    endpoint = _endpoint(otlp_endpoint)
    want_traces = _signal_wanted("TRACES", otlp_endpoint)
    want_metrics = _signal_wanted("METRICS", otlp_endpoint)
    # Validate everything before starting anything that would need stopping.
    for signal, wanted in (("TRACES", want_traces), ("METRICS", want_metrics)):
        if wanted:
            _check_protocol(signal)
    exporters: list[str] = []
    readers: list[MetricReader] = list(metric_readers)
    server: WSGIServer | None = None

    if want_metrics:
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=endpoint)))
        exporters.append("otlp-metrics")
    if prometheus_port is not None:
        reader, server = _start_prometheus(prometheus_port, prometheus_addr)
        readers.append(reader)
        exporters.append("prometheus")

    resource = _resource(service_name, resource_attributes)
    meter_provider = MeterProvider(resource=resource, metric_readers=readers, shutdown_on_exit=False)
    tracer_provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    for processor in span_processors:
        tracer_provider.add_span_processor(processor)
    if want_traces:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        exporters.append("otlp-traces")

    if set_global:
        _install_global(meter_provider, tracer_provider)
    return Telemetry(
        service_name, meter_provider, tracer_provider, exporters=exporters, prometheus_server=server
    )


def _install_global(meter_provider: MeterProvider, tracer_provider: TracerProvider) -> None:
    global _global_installed
    if _global_installed:
        _log.warning("global OpenTelemetry providers already installed in this process; keeping the first")
        return
    metrics.set_meter_provider(meter_provider)
    trace.set_tracer_provider(tracer_provider)
    _global_installed = True
