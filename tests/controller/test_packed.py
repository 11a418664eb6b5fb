"""Packed BatchMatchPrefix requests (one key buffer per batch) answer exactly as the per-query form
(real gRPC, both index backends), and malformed packed requests are INVALID_ARGUMENT."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from kvgrid.api.v1 import common_pb2, controller_pb2, controller_pb2_grpc
from kvgrid.controller.config import ControllerConfig
from kvgrid.controller.index import ChunkIndex, IndexTier, MemoryIndex
from kvgrid.controller.index.redis import RedisIndex
from kvgrid.controller.service import Server
from tests.controller.support import NS_ID, rand_keys, register_pod, unique_prefix

L1, GPU = IndexTier.L1, IndexTier.GPU
OTHER_NS = "f" * 32


@pytest.fixture(params=["memory", "redis"])
def controller_index(request: pytest.FixtureRequest, valkey_url: str) -> ChunkIndex:
    return MemoryIndex() if request.param == "memory" else RedisIndex(valkey_url, prefix=unique_prefix())


@pytest.fixture
def controller_config() -> ControllerConfig:
    return ControllerConfig(listen="127.0.0.1:0", max_batch=8, max_query_chunks=16)


def _unpacked(
    queries: list[list[bytes]], ns: str = NS_ID, cands: list[str] | None = None, max_pods: int = 0
) -> controller_pb2.BatchMatchPrefixRequest:
    return controller_pb2.BatchMatchPrefixRequest(
        requests=[
            controller_pb2.MatchPrefixRequest(
                chunk_keys=common_pb2.ChunkKeys(keys=q),
                namespace_id=ns,
                candidate_pod_uids=cands or [],
                max_pods=max_pods,
            )
            for q in queries
        ]
    )


def _packed(
    queries: list[list[bytes]], ns: str = NS_ID, cands: list[str] | None = None, max_pods: int = 0
) -> controller_pb2.BatchMatchPrefixRequest:
    return controller_pb2.BatchMatchPrefixRequest(
        packed_chunk_keys=b"".join(b"".join(q) for q in queries),
        packed_query_chunks=[len(q) for q in queries],
        packed_namespace_id=ns,
        packed_candidate_pod_uids=cands or [],
        packed_max_pods=max_pods,
    )


def test_packed_equals_unpacked(server: Server, stub: controller_pb2_grpc.ControllerServiceStub) -> None:
    k = rand_keys(12)
    idx = server.controller.index
    a, b, c = (register_pod(stub, u, [NS_ID]) for u in ("pod-a", "pod-b", "pod-c"))
    other = register_pod(stub, "pod-x", [OTHER_NS])
    idx.add(a, GPU, k[:4])
    idx.add(b, L1, k[:6])
    idx.add(c, GPU, k[:1] + k[8:12])
    idx.add(other, GPU, k)
    queries = [k, k[:2], rand_keys(3), [], k[8:12], k[:5], k[:1]]  # ragged, an empty and an unknown one
    cases: list[tuple[str, list[str] | None, int]] = [
        (NS_ID, None, 0),
        (NS_ID, None, 1),
        (NS_ID, ["pod-c", "pod-x", "pod-none"], 0),
        (OTHER_NS, None, 0),
    ]
    for ns, cands, max_pods in cases:
        for compact in (False, True):
            want = _unpacked(queries, ns, cands, max_pods)
            got = _packed(queries, ns, cands, max_pods)
            want.compact = got.compact = compact
            a_resp, p_resp = stub.BatchMatchPrefix(want), stub.BatchMatchPrefix(got)
            assert p_resp == a_resp, (ns, cands, max_pods, compact)
    readable = stub.BatchMatchPrefix(_packed(queries))
    assert [(m.pod_uid, m.gpu_chunks, m.l1_chunks, m.peer_chunks) for m in readable.responses[0].matches] == [
        ("pod-a", 4, 0, 2),
        ("pod-c", 1, 0, 5),
        ("pod-b", 0, 6, 0),
    ]
    assert [r.num_query_chunks for r in readable.responses] == [len(q) for q in queries]
    # equal-length queries take the unpadded path
    same = [k[:4], k[8:12], rand_keys(4)]
    assert stub.BatchMatchPrefix(_packed(same)) == stub.BatchMatchPrefix(_unpacked(same))


def test_packed_speculative_entries(server: Server, stub: controller_pb2_grpc.ControllerServiceStub) -> None:
    k = rand_keys(5)
    a = register_pod(stub, "pod-a", [NS_ID])
    server.controller.index.add_speculative(a, k[:3], ttl_ms=60_000)
    queries = [k, k[:2], rand_keys(1)]
    got = stub.BatchMatchPrefix(_packed(queries))
    assert got == stub.BatchMatchPrefix(_unpacked(queries))
    assert [m.gpu_chunks for m in got.responses[0].matches] == [3]


def _code(
    stub: controller_pb2_grpc.ControllerServiceStub, req: controller_pb2.BatchMatchPrefixRequest
) -> str:
    with pytest.raises(grpc.RpcError) as e:
        stub.BatchMatchPrefix(req)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return str(e.value.details())


def test_packed_invalid_argument(server: Server, stub: controller_pb2_grpc.ControllerServiceStub) -> None:
    k = rand_keys(20)
    both = _packed([k[:2]])
    both.requests.add(chunk_keys=common_pb2.ChunkKeys(keys=k[:1]), namespace_id=NS_ID)
    assert "requests and packed_chunk_keys, packed_query_chunks, packed_namespace_id" in _code(stub, both)
    short = _packed([k[:3]])
    short.packed_chunk_keys = short.packed_chunk_keys[:-1]
    assert "packed_chunk_keys: 47 bytes, expected 16 * sum(packed_query_chunks) = 48" in _code(stub, short)
    assert "packed_query_chunks[1]: 17 keys, more than max_query_chunks=16" in _code(
        stub, _packed([k[:1], k[:17]])
    )
    assert "packed_query_chunks: 9 in one batch, more than max_batch=8" in _code(stub, _packed([k[:1]] * 9))
    assert "packed_namespace_id=''" in _code(stub, _packed([k[:2]], ns=""))
    assert "packed_candidate_pod_uids: contains an empty UID" in _code(stub, _packed([k[:2]], cands=[""]))
    only_max = controller_pb2.BatchMatchPrefixRequest(packed_max_pods=3)  # packed, but no namespace
    assert "packed_namespace_id" in _code(stub, only_max)
    # still serving, both forms
    a = register_pod(stub, "pod-a", [NS_ID])
    server.controller.index.add(a, GPU, k[:2])
    assert stub.BatchMatchPrefix(_packed([k[:2]])) == stub.BatchMatchPrefix(_unpacked([k[:2]]))
    empty = stub.BatchMatchPrefix(
        controller_pb2.BatchMatchPrefixRequest(packed_namespace_id=NS_ID, compact=True)
    )
    assert list(empty.compact) == [] and list(empty.responses) == []


def test_memory_lookup_packed_matches_lookup_batch() -> None:
    idx = MemoryIndex()
    k = rand_keys(40)
    idx.add("p/1", GPU, k[:30])
    idx.add("q/1", L1, k[10:40:2])
    queries = [k[:7], k[5:25], [], k[30:40], k[:1]]
    flat = np.frombuffer(b"".join(b"".join(q) for q in queries), dtype="<u8").reshape(-1, 2)
    counts = np.array([len(q) for q in queries], dtype=np.int64)
    got, want = idx.lookup_packed(flat, counts), idx.lookup_batch(queries)
    assert np.array_equal(got.words, want.words) and got.holders == want.holders
    assert got.words[:, 0].any()  # something was found
