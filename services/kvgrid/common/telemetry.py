"""OpenTelemetry metrics and traces for one kvgrid service, set up by one call.

``setup_telemetry("kvgrid-agent", prometheus_port=9464)`` returns a :class:`Telemetry` that owns its
own MeterProvider and TracerProvider (not the process-global ones, so tests can build many); take
``.meter`` and ``.tracer`` from it and call ``.shutdown()`` to flush. Metric names start ``kvgrid_``.

Exporters:

- OTLP when ``otlp_endpoint`` is given or ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or the per-signal
  ``OTEL_EXPORTER_OTLP_{TRACES,METRICS}_ENDPOINT``) is set, over gRPC (default) or HTTP
  (``OTEL_EXPORTER_OTLP[_{TRACES,METRICS}]_PROTOCOL=http/protobuf``; an explicit endpoint is then
  the base URL, ``/v1/traces`` and ``/v1/metrics`` are added). The exporters read the other standard
  variables themselves (``OTEL_EXPORTER_OTLP_HEADERS``, ``_TIMEOUT``, ``_INSECURE``, ``_CERTIFICATE``,
  ``_COMPRESSION``, ``OTEL_METRIC_EXPORT_INTERVAL``, ``OTEL_BSP_*``). ``OTEL_TRACES_EXPORTER=none`` /
  ``OTEL_METRICS_EXPORTER=none`` turn one signal off, ``OTEL_SDK_DISABLED=true`` turns everything off.
  An explicit endpoint without a scheme is plaintext (an in-cluster collector); use ``https://`` for TLS.
- Prometheus scrape endpoint (``/metrics``) on ``prometheus_port`` when given, backed by a registry of
  this Telemetry's own so two instances in a process never clash.

Without either, nothing leaves the process (instruments still work; without a span exporter or
processor the tracer is a no-op, so RPCs pay no span cost, and incoming trace context is still
passed on to outgoing calls).

Invariant: no telemetry setting stops a service. A bad protocol or exporter name, an exporter that
cannot be built or a Prometheus port that cannot be bound is logged (warning), recorded in
``Telemetry.problems`` and skipped; an unreachable collector only makes the background exporters
log. ``/metrics`` does not depend on OTLP and vice versa.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from importlib import metadata
from types import TracebackType
from typing import Any
from wsgiref.simple_server import WSGIServer

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricExporter, MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

__all__ = ["METRIC_PREFIX", "SHUTDOWN_TIMEOUT_S", "Telemetry", "setup_telemetry"]

METRIC_PREFIX = "kvgrid_"
SHUTDOWN_TIMEOUT_S = 3.0
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
        problems: Sequence[str] = (),
    ) -> None:
        self.service_name = service_name
        self.meter_provider = meter_provider
        self.tracer_provider = tracer_provider
        self.meter: metrics.Meter = meter_provider.get_meter(_SCOPE, _version())
        self.tracer: trace.Tracer = tracer_provider.get_tracer(_SCOPE, _version())
        # What leaves the process: subset of "otlp-traces", "otlp-metrics", "prometheus".
        self.exporters: tuple[str, ...] = tuple(exporters)
        # Settings that were logged and ignored (bad protocol, exporter name, busy port...).
        self.problems: tuple[str, ...] = tuple(problems)
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

    def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Flush and stop exporters and the Prometheus server; safe to call more than once.

        Bounded: exporters retrying an unreachable collector get ``timeout_s`` in all, then are
        left behind (daemon thread, logged) so a stopping service never waits on its telemetry."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        if self._prometheus_server is not None:
            self._prometheus_server.shutdown()
            self._prometheus_server.server_close()
        done = threading.Thread(target=self._stop_providers, name="kvgrid-telemetry-stop", daemon=True)
        done.start()
        done.join(timeout_s)
        if done.is_alive():
            _log.warning(
                "%s telemetry: exporters did not finish within %.0fs (collector unreachable?); "
                "stopping without them",
                self.service_name,
                timeout_s,
            )

    def _stop_providers(self) -> None:
        self.force_flush()
        for provider in (self.tracer_provider, self.meter_provider):
            stop = getattr(provider, "shutdown", None)
            if stop is not None:
                stop()

    def __enter__(self) -> Telemetry:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.shutdown()


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() == "true"


_PROTOCOLS = ("grpc", "http/protobuf")
_HTTP_PATHS = {"TRACES": "/v1/traces", "METRICS": "/v1/metrics"}


def _signal_wanted(signal: str, otlp_endpoint: str | None, problems: list[str]) -> bool:
    """OTLP export of TRACES or METRICS: an endpoint is known and the signal's exporter is 'otlp'.
    An exporter name other than 'otlp'/'none' is a problem (logged) and turns the signal off."""
    name = f"OTEL_{signal}_EXPORTER"
    choices = {c.strip().lower() for c in os.environ.get(name, "otlp").split(",") if c.strip()}
    if "none" in choices or not choices:
        return False
    unknown = sorted(choices - {"otlp"})
    if unknown:
        problems.append(
            f"{name}={os.environ[name]!r}: {', '.join(map(repr, unknown))} is not supported; "
            "expected 'otlp' or 'none'"
        )
        if "otlp" not in choices:
            return False
    return bool(
        otlp_endpoint
        or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or os.environ.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT")
    )


def _protocol(signal: str, problems: list[str]) -> str | None:
    """'grpc' or 'http/protobuf' for ``signal`` (per-signal variable first); None when the
    configured value is unknown (a problem: that signal is not exported)."""
    for name in (f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        value = os.environ.get(name, "").strip()
        if value:
            if value.lower() in _PROTOCOLS:
                return value.lower()
            problems.append(f"{name}={value!r} is not supported; expected one of {', '.join(_PROTOCOLS)}")
            return None
    return "grpc"


def _endpoint(otlp_endpoint: str | None) -> str | None:
    """Explicit endpoints without a scheme are plaintext unless OTEL_EXPORTER_OTLP_INSECURE says."""
    if otlp_endpoint is None or "://" in otlp_endpoint or "OTEL_EXPORTER_OTLP_INSECURE" in os.environ:
        return otlp_endpoint
    return "http://" + otlp_endpoint


def _http_endpoint(signal: str, endpoint: str | None) -> str | None:
    """An explicit base endpoint gets the signal's path (the exporter adds it only to the env one)."""
    if endpoint is None:
        return None
    if "://" not in endpoint:
        endpoint = "http://" + endpoint
    return endpoint.rstrip("/") + _HTTP_PATHS[signal]


def _span_exporter(protocol: str, endpoint: str | None) -> SpanExporter:
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=endpoint)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter

    return HttpSpanExporter(endpoint=_http_endpoint("TRACES", endpoint))


def _metric_exporter(protocol: str, endpoint: str | None) -> MetricExporter:
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

        return OTLPMetricExporter(endpoint=endpoint)
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
        OTLPMetricExporter as HttpMetricExporter,
    )

    return HttpMetricExporter(endpoint=_http_endpoint("METRICS", endpoint))


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

    Never raises for a telemetry setting (environment, endpoint, port): each exporter that cannot
    be set up is logged as a warning, listed in ``Telemetry.problems`` and left out; the others
    (and every instrument) keep working. Only a programming error (empty name) raises.
    """
    if not service_name:
        raise ValueError(f"service_name must be a non-empty string, got {service_name!r}")
    if _env_true("OTEL_SDK_DISABLED"):
        return Telemetry.disabled(service_name)
    problems: list[str] = []
    exporters: list[str] = []
    readers: list[MetricReader] = list(metric_readers)
    server: WSGIServer | None = None
    endpoint = _endpoint(otlp_endpoint)
    span_exporter: SpanExporter | None = None

    def attempt(what: str, make: Callable[[], None]) -> None:
        try:
            make()
        except Exception as e:  # a telemetry setting must never stop the service
            problems.append(f"{what}: {type(e).__name__}: {e}")

    for signal in ("TRACES", "METRICS"):
        if not _signal_wanted(signal, otlp_endpoint, problems):
            continue
        protocol = _protocol(signal, problems)
        if protocol is None:
            continue
        if signal == "METRICS":

            def add_metrics(protocol: str = protocol) -> None:
                readers.append(PeriodicExportingMetricReader(_metric_exporter(protocol, endpoint)))
                exporters.append("otlp-metrics")

            attempt(f"OTLP metric exporter ({protocol})", add_metrics)
        else:

            def add_traces(protocol: str = protocol) -> None:
                nonlocal span_exporter
                span_exporter = _span_exporter(protocol, endpoint)
                exporters.append("otlp-traces")

            attempt(f"OTLP span exporter ({protocol})", add_traces)
    if prometheus_port is not None:
        if not 0 <= prometheus_port <= 65535:
            problems.append(f"prometheus_port must be in 0..65535, got {prometheus_port}")
        else:

            def add_prometheus() -> None:
                nonlocal server
                reader, server = _start_prometheus(prometheus_port, prometheus_addr)
                readers.append(reader)
                exporters.append("prometheus")

            attempt("Prometheus exporter", add_prometheus)

    resource = _resource(service_name, resource_attributes)
    meter_provider = MeterProvider(resource=resource, metric_readers=readers, shutdown_on_exit=False)
    tracer_provider: trace.TracerProvider
    if span_exporter is None and not span_processors:
        # Nobody would see the spans: a no-op tracer costs ~1/8 of a recording span per RPC, and
        # incoming trace context is still passed on (kvgrid.common.tracing.server_span).
        tracer_provider = trace.NoOpTracerProvider()
    else:
        sdk_provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        for processor in span_processors:
            sdk_provider.add_span_processor(processor)
        if span_exporter is not None:
            sdk_provider.add_span_processor(BatchSpanProcessor(span_exporter))
        tracer_provider = sdk_provider
    problems = list(dict.fromkeys(problems))  # one bad shared variable breaks both signals: say it once
    for problem in problems:
        _log.warning("%s telemetry: %s; continuing without it", service_name, problem)

    if set_global:
        _install_global(meter_provider, tracer_provider)
    return Telemetry(
        service_name,
        meter_provider,
        tracer_provider,
        exporters=exporters,
        prometheus_server=server,
        problems=problems,
    )


def _install_global(meter_provider: MeterProvider, tracer_provider: trace.TracerProvider) -> None:
    global _global_installed
    if _global_installed:
        _log.warning("global OpenTelemetry providers already installed in this process; keeping the first")
        return
    metrics.set_meter_provider(meter_provider)
    trace.set_tracer_provider(tracer_provider)
    _global_installed = True
