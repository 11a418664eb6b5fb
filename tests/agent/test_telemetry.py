"""The agent's metrics and spans, read back from in-memory OpenTelemetry readers."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvgrid.agent.config import AgentConfig
from kvgrid.agent.core import AgentCore
from kvgrid.agent.service import AgentServer
from kvgrid.api.v1 import agent_pb2, agent_pb2_grpc
from kvgrid.common.identity import PodIdentity
from kvgrid.common.rpc import RPC_CALLS, RPC_DURATION
from tests.agent.helpers import GROUPS, HINTS, NAMESPACE, block_ids, keys_for, make_kv


def points(reader: InMemoryMetricReader) -> dict[str, list[tuple[dict, float]]]:
    out: dict[str, list[tuple[dict, float]]] = {}
    data = reader.get_metrics_data()
    assert data is not None
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                for p in m.data.data_points:
                    value = getattr(p, "value", None)
                    if value is None:
                        value = p.sum  # histogram
                    out.setdefault(m.name, []).append((dict(p.attributes or {}), value))
    return out


def test_store_retrieve_lookup_are_measured_and_traced(tmp_path: Path) -> None:
    reader = InMemoryMetricReader()
    spans = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(spans))
    cfg = AgentConfig(l1_size=1 << 20, l1_page_size=4096, uds_path="", tcp_port=0)
    core = AgentCore(
        cfg,
        PodIdentity(pod_uid="u"),
        meter=MeterProvider(metric_readers=[reader]).get_meter("t"),
        tracer=tp.get_tracer("t"),
    )
    tensors, _ = make_kv(tmp_path)
    inst = core.register("e", engine_groups=GROUPS, tensors=tensors, namespace=NAMESPACE, layout_hints=HINTS)
    keys = keys_for(1, 3)
    core.store("e", keys[:2], block_ids(0, 2))
    assert core.lookup("e", "r", keys).num_hit_chunks == 2
    core.retrieve("e", "r", keys, block_ids(8, 3))

    p = points(reader)
    moved = {a["direction"]: v for a, v in p["kvgrid_agent_transfer"]}
    assert moved == {"store": 2 * inst.bytes_per_chunk, "retrieve": 2 * inst.bytes_per_chunk}
    lookups = {a["result"]: v for a, v in p["kvgrid_agent_lookup_chunks"]}
    assert lookups == {"hit": 2, "miss_not_found": 1}
    assert dict((a["result"], v) for a, v in p["kvgrid_agent_store_chunks"]) == {"stored": 2}
    assert p["kvgrid_agent_l1_chunks"] == [({}, 2)]
    assert p["kvgrid_agent_l1_capacity"] == [({}, 1 << 20)]
    assert p["kvgrid_agent_l1_used"][0][1] == 2 * 5 * 4096  # 19456 bytes -> 5 pages each
    assert {a["direction"] for a, _ in p["kvgrid_agent_transfer_duration"]} == {"store", "retrieve"}
    names = [s.name for s in spans.get_finished_spans()]
    assert names == ["agent.register", "agent.store", "agent.lookup", "agent.retrieve"]
    retrieve = spans.get_finished_spans()[-1]
    assert retrieve.attributes is not None and retrieve.attributes["hit_chunks"] == 2


def test_rpc_calls_are_counted_by_the_server_toolkit_under_the_shared_names(tmp_path: Path) -> None:
    """Every AgentService call, failed or not, is one ``kvgrid_rpc_server_calls`` point per (method,
    code) and a ``kvgrid_rpc_server_duration`` in seconds: the same instruments as the controller's."""
    reader = InMemoryMetricReader()
    cfg = AgentConfig(l1_size=1 << 20, l1_page_size=4096, uds_path=str(tmp_path / "a.sock"), tcp_port=-1)
    server = AgentServer(
        cfg, pod=PodIdentity(pod_uid="u"), meter=MeterProvider(metric_readers=[reader]).get_meter("t")
    ).start()
    try:
        with grpc.insecure_channel(f"unix:{cfg.uds_path}") as ch:
            stub = agent_pb2_grpc.AgentServiceStub(ch)
            stub.Health(agent_pb2.HealthRequest(), timeout=5)
            with pytest.raises(grpc.RpcError) as err:
                stub.Lookup(agent_pb2.LookupRequest(instance_id="nobody"), timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            call = ch.unary_unary("/kvgrid.v1.AgentService/Health")
            with pytest.raises(grpc.RpcError) as err:
                call(b"\xff\xff", timeout=5)  # not a HealthRequest
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "malformed HealthRequest" in (err.value.details() or "")
    finally:
        server.stop(0)
    p = points(reader)
    calls = {(a["method"], a["code"]): v for a, v in p[RPC_CALLS]}
    assert calls == {
        ("Health", "OK"): 1,
        ("Lookup", "INVALID_ARGUMENT"): 1,
        ("Health", "INVALID_ARGUMENT"): 1,
    }
    seconds = {(a["method"], a["code"]): v for a, v in p[RPC_DURATION]}
    assert seconds.keys() == calls.keys() and all(0 < s < 5 for s in seconds.values())
