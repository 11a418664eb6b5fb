"""Trace context through the server toolkit and the traced channel, with real gRPC servers on loopback.

``front`` serves AgentService/Health by calling ``back``'s Health through :func:`traced_channel`.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvgrid.api.v1 import agent_pb2, agent_pb2_grpc
from kvgrid.common.rpc import RpcServer, ServerOptions
from kvgrid.common.tracing import traced_channel

SERVICE = agent_pb2.DESCRIPTOR.services_by_name["AgentService"]
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CALLER = "b7ad6b7169203331"


class Forward:
    def __init__(self, target: str) -> None:
        self.stub = agent_pb2_grpc.AgentServiceStub(traced_channel(grpc.insecure_channel(target)))

    def Health(self, req: agent_pb2.HealthRequest) -> agent_pb2.HealthResponse:
        return self.stub.Health(req, timeout=5)


class Answer:
    def Health(self, req: agent_pb2.HealthRequest) -> agent_pb2.HealthResponse:
        return agent_pb2.HealthResponse()


def _server(impl: object, tracer: trace.Tracer) -> tuple[RpcServer, str]:
    srv = RpcServer(ServerOptions(max_message_bytes=1 << 20, workers=2), tracer=tracer)
    srv.add_service(SERVICE, impl, served={"Health"}, not_served="test")
    port = srv.bind("127.0.0.1:0")
    srv.start()
    return srv, f"127.0.0.1:{port}"


@pytest.fixture
def spans() -> Iterator[tuple[InMemorySpanExporter, trace.Tracer]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield exporter, provider.get_tracer("test")
    provider.shutdown()


@pytest.mark.parametrize("front_traces", [True, False])
def test_context_passes_through_a_server_with_or_without_its_own_span(
    spans: tuple[InMemorySpanExporter, trace.Tracer], front_traces: bool
) -> None:
    exporter, tracer = spans
    back, back_addr = _server(Answer(), tracer)
    # Without an exporter a service's tracer is a no-op: it must still pass the caller's context on.
    front, front_addr = _server(Forward(back_addr), tracer if front_traces else trace.NoOpTracer())
    try:
        with grpc.insecure_channel(front_addr) as ch:
            agent_pb2_grpc.AgentServiceStub(ch).Health(
                agent_pb2.HealthRequest(), metadata=[("traceparent", f"00-{TRACE_ID}-{CALLER}-01")], timeout=5
            )
    finally:
        front.stop(None)
        back.stop(None)
    finished = {s.context.span_id: s for s in exporter.get_finished_spans()}
    assert all(f"{s.context.trace_id:032x}" == TRACE_ID for s in finished.values())
    caller = int(CALLER, 16)
    if front_traces:
        [front_span] = [s for s in finished.values() if s.parent is not None and s.parent.span_id == caller]
        [back_span] = [s for s in finished.values() if s is not front_span]
        assert front_span.name == back_span.name == "kvgrid.v1.AgentService/Health"
        assert back_span.parent is not None and back_span.parent.span_id == front_span.context.span_id
    else:
        [only] = finished.values()
        assert only.parent is not None and only.parent.span_id == caller  # straight to the caller
        assert only.attributes is not None and only.attributes["rpc.grpc.status_code"] == 0


def test_a_call_without_traceparent_starts_a_new_trace(
    spans: tuple[InMemorySpanExporter, trace.Tracer],
) -> None:
    exporter, tracer = spans
    srv, addr = _server(Answer(), tracer)
    try:
        with grpc.insecure_channel(addr) as ch:
            stub = agent_pb2_grpc.AgentServiceStub(ch)
            stub.Health(agent_pb2.HealthRequest(), timeout=5)
            stub.Health(agent_pb2.HealthRequest(), metadata=[("traceparent", "not-a-traceparent")], timeout=5)
    finally:
        srv.stop(None)
    finished = exporter.get_finished_spans()
    assert len(finished) == 2 and all(s.parent is None for s in finished)
    assert finished[0].context.trace_id != finished[1].context.trace_id
