"""The connector's spans: one per agent call that serves a request, in the engine's trace.

The connector runs inside vLLM, so it uses the process's tracer provider (the one vLLM installs when
its tracing is on, e.g. ``--otlp-traces-endpoint``; a no-op otherwise) instead of a provider of its
own. A lookup's span continues the request's own trace when vLLM carries one
(``Request.trace_headers``, the W3C ``traceparent`` the HTTP caller sent): with or without a
recording provider, the agent call then carries that trace id (the agent client propagates the
current context, :mod:`kvgrid.common.tracing`), so the caller's request, the connector, the agent,
a peer agent and the controller are one trace. Worker-side loads and stores batch several requests
and start a trace of their own.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind

from kvgrid.common.tracing import context_from_headers

__all__ = ["TRACER_NAME", "agent_call_span"]

TRACER_NAME = "kvgrid.connector"


def agent_call_span(
    name: str,
    request_id: str,
    *,
    trace_headers: Mapping[str, str] | None = None,
    attributes: Mapping[str, str | int] | None = None,
) -> AbstractContextManager[Span]:
    """A CLIENT span ``name`` for one request's agent call(s), current while the block runs; child of
    ``trace_headers``' trace when they carry one."""
    attrs: dict[str, str | int] = {"kvgrid.request_id": request_id}
    attrs.update(attributes or {})
    return trace.get_tracer(TRACER_NAME).start_as_current_span(
        name, context=context_from_headers(trace_headers), kind=SpanKind.CLIENT, attributes=attrs
    )
