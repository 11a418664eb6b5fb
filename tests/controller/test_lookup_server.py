"""The lean lookup listener answers byte for byte as the gRPC methods, refuses bad input with the
same status and text, and keeps serving the connection afterwards (real TCP on loopback)."""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator

import grpc
import pytest

from kvgrid.api.v1 import common_pb2, controller_pb2, controller_pb2_grpc
from kvgrid.controller.config import ControllerConfig
from kvgrid.controller.index import IndexTier
from kvgrid.controller.lookup_server import (
    METHOD_BATCH_MATCH,
    METHOD_MATCH,
    LookupClient,
    LookupFailed,
    LookupServer,
)
from kvgrid.controller.service import Server
from tests.controller.support import NS_ID, rand_keys, register_pod

L1, GPU = IndexTier.L1, IndexTier.GPU


@pytest.fixture
def controller_config() -> ControllerConfig:
    return ControllerConfig(listen="127.0.0.1:0", max_query_chunks=16)


@pytest.fixture
def lookup(server: Server) -> Iterator[LookupClient]:
    ls = LookupServer(server.controller, "127.0.0.1:0", max_frame_bytes=4096)
    client = LookupClient(ls.address)
    yield client
    client.close()
    ls.stop()


def _req(keys: list[bytes], max_pods: int = 0) -> controller_pb2.MatchPrefixRequest:
    return controller_pb2.MatchPrefixRequest(
        chunk_keys=common_pb2.ChunkKeys(keys=keys), namespace_id=NS_ID, max_pods=max_pods
    )


def test_same_answers_as_grpc(
    server: Server, stub: controller_pb2_grpc.ControllerServiceStub, lookup: LookupClient
) -> None:
    k = rand_keys(8)
    idx = server.controller.index
    idx.add(register_pod(stub, "pod-a", [NS_ID]), GPU, k[:3])
    idx.add(register_pod(stub, "pod-b", [NS_ID]), L1, k[:6])
    idx.add(register_pod(stub, "pod-c", [NS_ID]), GPU, k[:1])
    queries = [k, k[:2], [rand_keys(1)[0], *k], [*k[:4], *rand_keys(3)]]
    for q in queries:
        want = stub.MatchPrefix(_req(q))
        got = lookup.match(_req(q))
        assert got == want
        assert bool(got.matches) == (q[0] in k)  # answers are real: a miss lists nobody
        assert lookup.match(_req(q, max_pods=1)) == stub.MatchPrefix(_req(q, max_pods=1))
    batch = controller_pb2.BatchMatchPrefixRequest(requests=[_req(q) for q in queries], compact=True)
    assert lookup.batch_match(batch) == stub.BatchMatchPrefix(batch)
    one = lookup.match(_req(k))
    assert [(m.pod_uid, m.gpu_chunks, m.l1_chunks, m.peer_chunks) for m in one.matches] == [
        ("pod-a", 3, 0, 3),  # equal totals (6): more GPU first
        ("pod-c", 1, 0, 5),
        ("pod-b", 0, 6, 0),
    ]


def test_bad_input_is_invalid_argument_and_the_connection_keeps_serving(
    server: Server, stub: controller_pb2_grpc.ControllerServiceStub, lookup: LookupClient
) -> None:
    k = rand_keys(2)
    server.controller.index.add(register_pod(stub, "pod-a", [NS_ID]), GPU, k)
    too_long = _req(rand_keys(17))
    with pytest.raises(grpc.RpcError) as grpc_err:
        stub.MatchPrefix(too_long)
    with pytest.raises(LookupFailed) as err:
        lookup.match(too_long)
    assert err.value.status == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert err.value.detail == grpc_err.value.details()  # the same text as gRPC's
    assert "17 keys, more than max_query_chunks=16" in err.value.detail
    with pytest.raises(LookupFailed) as err:
        lookup.call_raw(METHOD_MATCH, b"\xff\xff\xff")  # not a protobuf message
    assert err.value.status == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "malformed MatchPrefixRequest message" in err.value.detail
    with pytest.raises(LookupFailed) as err:
        lookup.call_raw(9, b"")
    assert err.value.status == grpc.StatusCode.UNIMPLEMENTED.value[0]
    assert "method=9: expected one of 1 (MatchPrefix), 2 (BatchMatchPrefix)" in err.value.detail
    with pytest.raises(LookupFailed) as err:
        lookup.call_raw(
            METHOD_BATCH_MATCH,
            controller_pb2.BatchMatchPrefixRequest(requests=[_req(k), _req([b"short"])]).SerializeToString(),
        )
    assert "requests[1]" in err.value.detail
    assert lookup.match(_req(k)).matches[0].gpu_chunks == 2  # still serving on the same connection


def test_oversized_frame_is_refused_and_closed(server: Server, lookup: LookupClient) -> None:
    with pytest.raises(LookupFailed) as err:
        lookup.call_raw(METHOD_MATCH, bytes(5000))
    assert err.value.status == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert "frame of 5001 bytes: expected 1..max_frame_bytes=4096" in err.value.detail


def test_binds_loopback_only_without_tls(server: Server) -> None:
    with pytest.raises(ValueError, match="binds a loopback address unless given an mTLS ssl_context"):
        LookupServer(server.controller, "0.0.0.0:0")
    with socket.socket() as s:  # a taken port: a clear error, not a hang
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ValueError, match=f"listen='127.0.0.1:{port}': could not bind"):
            LookupServer(server.controller, f"127.0.0.1:{port}")
    assert struct.calcsize("<IB") == 5
