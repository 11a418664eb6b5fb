"""Trace context across gRPC: W3C ``traceparent`` in call metadata, both directions.

- Client side: :func:`traced_channel` wraps a channel with :class:`TraceContextInterceptor`, which
  adds the *current* span's ``traceparent`` (and ``tracestate``) to every call's metadata, all four
  call shapes. Without a current span nothing is added, so an untraced caller costs one lookup.
- Server side: :func:`server_span` (used by :mod:`kvgrid.common.rpc` for every method of both
  services) reads the caller's ``traceparent`` from the call's metadata and starts a SERVER span
  named ``{service}/{method}`` as its child, with the OpenTelemetry RPC attributes
  (``rpc.system=grpc``, ``rpc.service``, ``rpc.method``; ``rpc.grpc.status_code`` at the end).
  A call without (or with a malformed) ``traceparent`` starts a new trace.

The propagator is W3C Trace Context itself, not the process-global one: engines (vLLM) may install
their own global propagators, and kvgrid's services must agree on the header whatever they chose.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, NamedTuple

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

__all__ = [
    "TraceContextInterceptor",
    "context_from_headers",
    "exports_nothing",
    "inject_headers",
    "local_span",
    "server_span",
    "span_under",
    "traced_channel",
]

_PROPAGATOR = TraceContextTextMapPropagator()


def inject_headers(ctx: otel_context.Context | None = None) -> dict[str, str]:
    """``traceparent``/``tracestate`` of ``ctx`` (default: the current context); {} without a span."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=ctx)
    return carrier


def context_from_headers(headers: Mapping[str, str] | None) -> otel_context.Context | None:
    """The remote parent carried by ``headers`` (e.g. vLLM's ``request.trace_headers``), None
    when they carry none."""
    if not headers:
        return None
    lowered = {k.lower(): v for k, v in headers.items()}
    ctx = _PROPAGATOR.extract(lowered)
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


class _Details(NamedTuple):
    method: str
    timeout: float | None
    metadata: Any  # grpc.aio and grpc type it differently
    credentials: grpc.CallCredentials | None
    wait_for_ready: bool | None
    compression: grpc.Compression | None


class _CallDetails(_Details, grpc.ClientCallDetails):
    """grpc.ClientCallDetails is an empty interface; the interceptor returns this concrete one."""


def _with_context(details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
    headers = inject_headers()
    if not headers:
        return details
    metadata = [(k, v) for k, v in (details.metadata or ()) if k not in headers]
    metadata.extend(headers.items())
    return _CallDetails(
        details.method,
        details.timeout,
        metadata,
        details.credentials,
        getattr(details, "wait_for_ready", None),
        getattr(details, "compression", None),
    )


class TraceContextInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the current span's trace context to every outgoing call's metadata."""

    def intercept_unary_unary(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return continuation(_with_context(details), request)

    def intercept_unary_stream(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return continuation(_with_context(details), request)

    def intercept_stream_unary(self, continuation: Callable[..., Any], details: Any, requests: Any) -> Any:
        return continuation(_with_context(details), requests)

    def intercept_stream_stream(self, continuation: Callable[..., Any], details: Any, requests: Any) -> Any:
        return continuation(_with_context(details), requests)


_INTERCEPTOR = TraceContextInterceptor()


def traced_channel(channel: grpc.Channel) -> grpc.Channel:
    """``channel`` propagating the caller's trace context; closing it closes ``channel``."""
    return grpc.intercept_channel(channel, _INTERCEPTOR)


def _remote_parent(context: grpc.ServicerContext) -> otel_context.Context | None:
    carrier = {}
    for key, value in context.invocation_metadata() or ():
        if key in ("traceparent", "tracestate") and isinstance(value, str):
            carrier[key] = value
    return context_from_headers(carrier)


def exports_nothing(tracer: trace.Tracer) -> bool:
    """A no-op tracer, or a proxy while no SDK provider is installed: a span would be a no-op
    object that costs ~20 us to make (the hot path skips it)."""
    if isinstance(tracer, trace.NoOpTracer):
        return True
    return isinstance(tracer, trace.ProxyTracer) and isinstance(
        trace.get_tracer_provider(), (trace.ProxyTracerProvider, trace.NoOpTracerProvider)
    )


def local_span(
    tracer: trace.Tracer, name: str, attributes: Mapping[str, Any] | None = None
) -> AbstractContextManager[Span]:
    """``tracer.start_as_current_span(name, attributes=...)``, or a context holding the invalid
    (no-op) span when nothing exports: the per-call spans of a hot path cost ~20 us each otherwise."""
    if exports_nothing(tracer):
        return nullcontext(trace.INVALID_SPAN)
    return tracer.start_as_current_span(name, attributes=attributes)


@contextmanager
def server_span(
    tracer: trace.Tracer, service: str, method: str, context: grpc.ServicerContext
) -> Iterator[Span]:
    """A SERVER span for one call of ``service``/``method``, child of the caller's trace context,
    current while the block runs (the method's own spans and outgoing calls nest under it).

    With a no-op tracer (nothing exported) no span is made: the caller's context, if any, is made
    current as it is, so outgoing calls still carry the caller's trace id."""
    with span_under(tracer, service, method, _remote_parent(context)) as span:
        yield span


@contextmanager
def span_under(
    tracer: trace.Tracer, service: str, method: str, parent: otel_context.Context | None
) -> Iterator[Span]:
    """:func:`server_span` for a call that came with ``parent`` (from :func:`context_from_headers`)
    by another transport than gRPC (the agent's hot path)."""
    if exports_nothing(tracer):
        if parent is None:
            yield trace.INVALID_SPAN
            return
        token = otel_context.attach(parent)
        try:
            yield trace.get_current_span(parent)
        finally:
            otel_context.detach(token)
        return
    with tracer.start_as_current_span(
        f"{service}/{method}",
        context=parent,
        kind=SpanKind.SERVER,
        attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": method},
        record_exception=False,  # the status code says what failed; tracebacks go to the log
        set_status_on_exception=False,
    ) as span:
        yield span
