"""Compact BatchMatchPrefix answers, the cached per-slot table, and the controller's metrics (real gRPC)."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from kvgrid.api.v1 import common_pb2, controller_pb2, controller_pb2_grpc
from kvgrid.common.telemetry import setup_telemetry
from kvgrid.controller.compact import _built, compact_response, pod_ref_bytes, read_compact
from kvgrid.controller.config import ControllerConfig
from kvgrid.controller.index import IndexTier, MemoryIndex
from kvgrid.controller.matching import match_batch
from kvgrid.controller.service import Server, serve
from tests.controller.support import NS_ID, rand_keys, register_pod

L1, GPU, L2 = IndexTier.L1, IndexTier.GPU, IndexTier.L2
OTHER_NS = "f" * 32


def _req(keys: list[bytes], ns: str = NS_ID, **kw: object) -> controller_pb2.MatchPrefixRequest:
    return controller_pb2.MatchPrefixRequest(
        chunk_keys=common_pb2.ChunkKeys(keys=keys), namespace_id=ns, **kw
    )


@pytest.fixture
def controller_config() -> ControllerConfig:
    return ControllerConfig(listen="127.0.0.1:0", max_batch=64)


def test_compact_equals_readable(server: Server, stub: controller_pb2_grpc.ControllerServiceStub) -> None:
    k = rand_keys(8)
    idx = server.controller.index
    a, b, c, d = (register_pod(stub, u, [NS_ID]) for u in ("pod-a", "pod-b", "pod-c", "pod-d"))
    other = register_pod(stub, "pod-x", [OTHER_NS])
    idx.add(a, GPU, k[:4])
    idx.add(b, L1, k[:6])
    idx.add(c, GPU, k[:1])
    idx.add(d, L2, k[:7])  # its own lower tiers: one chunk past what peers can fetch
    idx.add(other, GPU, k)  # another namespace: never listed for NS_ID
    reqs = [
        _req(k),
        _req(k[:2], max_pods=1),
        _req(k, candidate_pod_uids=["pod-c", "pod-x", "pod-none"]),
        _req(rand_keys(3)),  # nobody
        _req([]),
        _req(k, ns=OTHER_NS),
    ]
    readable = stub.BatchMatchPrefix(controller_pb2.BatchMatchPrefixRequest(requests=reqs))
    compact = stub.BatchMatchPrefix(controller_pb2.BatchMatchPrefixRequest(requests=reqs, compact=True))
    assert not compact.responses and not readable.compact and not readable.pods
    assert read_compact(compact) == list(readable.responses)
    first = readable.responses[0]
    assert [(m.pod_uid, m.gpu_chunks, m.l1_chunks, m.l2_chunks, m.peer_chunks) for m in first.matches] == [
        ("pod-d", 0, 0, 7, 0),
        ("pod-a", 4, 0, 0, 2),  # all match 6 (pod-b's L1 serves peers): more GPU first
        ("pod-c", 1, 0, 0, 5),
        ("pod-b", 0, 6, 0, 0),
    ]
    assert first.peer_fetchable_chunks == 6 and first.matches[1].pod_name == "name-pod-a"
    assert [m.pod_uid for m in readable.responses[1].matches] == ["pod-a"]  # max_pods=1 (d: 2 in L2)
    assert not compact.compact[1].l2_chunks  # no listed pod has L2 chunks: the field stays empty
    assert list(compact.compact[0].l2_chunks) == [7, 0, 0, 0]
    assert [m.pod_uid for m in readable.responses[2].matches] == ["pod-c"]
    assert list(readable.responses[3].matches) == [] and readable.responses[4].num_query_chunks == 0
    assert [m.pod_uid for m in readable.responses[5].matches] == ["pod-x"]
    # the pod table holds each listed pod once
    assert sorted(p.pod_uid for p in compact.pods) == ["pod-a", "pod-b", "pod-c", "pod-d", "pod-x"]
    # unary MatchPrefix says the same as the batch
    assert stub.MatchPrefix(reqs[0]) == first
    # bad input still fails the whole batch with the index of the bad request
    bad = controller_pb2.BatchMatchPrefixRequest(requests=[reqs[0], _req([b"short"])], compact=True)
    with pytest.raises(grpc.RpcError) as e:
        stub.BatchMatchPrefix(bad)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "requests[1]: chunk_keys[0]: got 5 bytes, expected a 16-byte chunk key" in e.value.details()


def test_compact_wire_bytes_equal_field_by_field_build() -> None:
    index = MemoryIndex()
    short, long = rand_keys(5), rand_keys(200)  # 200 chunks: counts >= 128 need multi-byte varints
    for h in range(3):
        index.add(f"p{h}/1", GPU, short[: h + 2])
    index.add("p0/1", L1, long)
    index.add("p3/1", L2, short[:3])
    refs = [pod_ref_bytes(f"p{s}", f"name{s}") for s in range(64)]
    for queries in ([short, short[:1], []], [long, short]):
        view = index.lookup_batch(queries)
        m = match_batch(view.words, np.ones((len(queries), 64), dtype=bool))
        chunks = [len(q) for q in queries]
        fast, slow = compact_response(m, chunks, refs), _built(m, chunks, refs)
        assert fast.SerializeToString() == slow.SerializeToString()
        assert [c.num_query_chunks for c in fast.compact] == chunks
        assert read_compact(fast) == read_compact(slow)
    assert max(fast.compact[0].l1_chunks) == 200
    assert list(fast.compact[1].l2_chunks) == [0, 0, 3, 0]  # p2 (4), p1 (3 GPU), p3 (3 L2), p0 (2)


def test_slot_table_follows_registry_and_slots(
    server: Server, stub: controller_pb2_grpc.ControllerServiceStub
) -> None:
    k = rand_keys(3)
    ctl, idx = server.controller, server.controller.index
    a = register_pod(stub, "pod-a", [OTHER_NS])
    b = register_pod(stub, "pod-b", [NS_ID])  # no entries (no slot) yet
    idx.add(a, GPU, k)
    batch = controller_pb2.BatchMatchPrefixRequest(requests=[_req(k)], compact=True)

    def listed() -> list[str]:
        return [r.matches[0].pod_uid for r in read_compact(stub.BatchMatchPrefix(batch)) if r.matches]

    assert listed() == []  # pod-a serves another namespace
    rec = ctl.registry.get("pod-a")
    assert rec is not None
    ctl._learn_namespaces(rec, [NS_ID])  # a snapshot told us it serves NS_ID too
    assert listed() == ["pod-a"]
    slot_a = idx.lookup(k).slots
    idx.drop_holder(a)
    idx.add(b, GPU, k)  # takes pod-a's slot; the registry did not change: the cached table must follow
    assert idx.lookup(k).slots.keys() == slot_a.keys()
    assert listed() == ["pod-b"]
    stub.RegisterAgent(
        controller_pb2.RegisterAgentRequest(
            pod=common_pb2.PodIdentity(pod_uid="pod-b", pod_name="name-pod-b", epoch=2), namespaces=[NS_ID]
        )
    )  # newer epoch: the old incarnation's entries are dropped
    assert listed() == []


def test_metrics_are_recorded() -> None:
    reader = InMemoryMetricReader()
    telemetry = setup_telemetry("kvgrid-controller-test", metric_readers=[reader])
    srv = serve(ControllerConfig(listen="127.0.0.1:0"), index=MemoryIndex(), telemetry=telemetry)
    ch = grpc.insecure_channel(srv.address)
    try:
        stub = controller_pb2_grpc.ControllerServiceStub(ch)
        k = rand_keys(4)
        srv.controller.index.add(register_pod(stub, "pod-a", [NS_ID]), L1, k)
        stub.BatchMatchPrefix(controller_pb2.BatchMatchPrefixRequest(requests=[_req(k)] * 3, compact=True))
        stub.MatchPrefix(_req(k))
        with pytest.raises(grpc.RpcError):
            stub.MatchPrefix(controller_pb2.MatchPrefixRequest())  # no query: INVALID_ARGUMENT
        data = reader.get_metrics_data()
        assert data is not None
        points: dict[str, list] = {}
        for rm in data.resource_metrics:
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    points[metric.name] = list(metric.data.data_points)
        queries = {p.attributes["rpc"]: p.value for p in points["kvgrid_controller_match_requests"]}
        assert queries == {"BatchMatchPrefix": 3, "MatchPrefix": 1}
        # Per-call metrics come from the server toolkit: one point per (method, status code).
        calls = {
            (p.attributes["method"], p.attributes["code"]): p.value for p in points["kvgrid_rpc_server_calls"]
        }
        assert calls == {
            ("RegisterAgent", "OK"): 1,
            ("BatchMatchPrefix", "OK"): 1,
            ("MatchPrefix", "OK"): 1,
            ("MatchPrefix", "INVALID_ARGUMENT"): 1,
        }
        duration = {
            (p.attributes["method"], p.attributes["code"]): p for p in points["kvgrid_rpc_server_duration"]
        }
        assert duration.keys() == calls.keys()
        assert all(0 < p.sum < 5 for p in duration.values())  # seconds, not milliseconds
        lookups = {p.attributes["op"]: p.count for p in points["kvgrid_controller_index_lookup_duration"]}
        assert lookups == {"lookup_batch": 1, "lookup_one": 1}  # a single query takes the one-query path
        assert [p.value for p in points["kvgrid_controller_chunks"]] == [4]
        assert [p.value for p in points["kvgrid_controller_entries"]] == [4]
        assert [p.value for p in points["kvgrid_controller_agents"]] == [1]
        assert [p.value for p in points["kvgrid_controller_events_ingested"]] == [0]
        assert [p.value for p in points["kvgrid_controller_resyncs"]] == [0]
    finally:
        ch.close()
        srv.stop()
        telemetry.shutdown()
