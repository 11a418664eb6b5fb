"""Peer fetch: a Lookup on one agent pulls the chunks another agent holds in L1 (through the
controller's MatchPrefix/ListAgents and the holder's FetchChunks stream).

The end-to-end tests run a real ``kvgrid controller`` and real ``kvgrid agent`` processes on
loopback; the engines are this test process, owning hybrid-layout KV tensors in shared memory and
talking to their agents over Unix sockets like the connector does. The stream and fetch edge cases
(refs held while sending, a peer that dies mid-chunk, a peer that breaks the protocol) use an
in-process agent and a deliberately faulty gRPC peer on loopback.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from opentelemetry import metrics, trace

from kvgrid.agent.cache import ChunkCache
from kvgrid.agent.config import AgentConfig
from kvgrid.agent.l1 import L1Pool
from kvgrid.agent.peers.directory import PeerCandidate, choose_peers
from kvgrid.agent.peers.fetcher import PeerFetcher
from kvgrid.agent.peers.metrics import PeerMetrics
from kvgrid.agent.service import AgentServer
from kvgrid.api.v1 import agent_pb2, agent_pb2_grpc, common_pb2, controller_pb2, controller_pb2_grpc
from kvgrid.common.checksum import chunk_checksum
from kvgrid.common.identity import PodIdentity
from kvgrid.engine.client import AgentClient
from kvgrid.engine.tensors import allocate_shared_tensor
from tests.agent.helpers import (
    BPC,
    GROUPS,
    HINTS,
    NAMESPACE,
    AgentProc,
    FakePeer,
    controller_with_pods,
    fetch_once,
    keys_for,
    layer_shape,
    register_kv,
    start_pod_agent,
    wait_for,
)

NS_ID = NAMESPACE.namespace_id()


@dataclass
class Cluster:
    root: Path
    controller: controller_pb2_grpc.ControllerServiceStub
    controller_address: str
    a: AgentProc
    b: AgentProc

    def l1_chunks(self, uid: str, keys: list[bytes]) -> int:
        resp = self.controller.MatchPrefix(
            controller_pb2.MatchPrefixRequest(
                chunk_keys=common_pb2.ChunkKeys(keys=keys), namespace_id=NS_ID, candidate_pod_uids=[uid]
            ),
            timeout=5,
        )
        return sum(m.l1_chunks for m in resp.matches if m.pod_uid == uid)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, free_port: Callable[[], int]) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("peers")
    address = f"127.0.0.1:{free_port()}"
    # A serves chunks in small parts (several messages per chunk); B fetches at most 3 per Lookup.
    pods = [("pod-a", ["--peer-fetch-part-size", "1KiB"]), ("pod-b", ["--peer-fetch-max-chunks", "3"])]
    with controller_with_pods(root, address, pods) as (stub, (a, b)):
        yield Cluster(root, stub, address, a, b)


@dataclass
class Engine:
    client: AgentClient
    instance_id: str
    tensors: list[torch.Tensor]
    layout_id: str
    bytes_per_chunk: int


def register(agent: AgentProc, root: Path, instance_id: str, seed: int) -> Engine:
    d = root / instance_id
    d.mkdir()
    client = agent.client()
    tensors, reg = register_kv(client, instance_id, d, seed)
    return Engine(client, instance_id, tensors, reg.layout_id, reg.bytes_per_chunk)


def chunk_ids(first_block: int, chunk: int) -> list[list[int]]:
    """Block ids of one chunk per engine group when the request's blocks start at ``first_block``."""
    return [list(range(first_block + chunk * bpc, first_block + (chunk + 1) * bpc)) for bpc in BPC]


def request_ids(first_block: int, num_chunks: int) -> list[list[int]]:
    return [list(range(first_block, first_block + num_chunks * bpc)) for bpc in BPC]


def chunk_bytes(tensors: list[torch.Tensor], ids: list[list[int]]) -> list[torch.Tensor]:
    return [t[ids[1 if layer in (1, 3) else 0]].view(torch.int16).clone() for layer, t in enumerate(tensors)]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def engines(cluster: Cluster) -> tuple[Engine, Engine]:
    return register(cluster.a, cluster.root, "e1", seed=1), register(cluster.b, cluster.root, "e2", seed=2)


def store_on(engine: Engine, keys: list[bytes], first_block: int = 0) -> None:
    res = engine.client.store(engine.instance_id, keys, request_ids(first_block, len(keys)))
    assert res.num_stored_chunks == len(keys), res


def test_lookup_fetches_peer_chunks_and_retrieve_is_bit_exact(
    cluster: Cluster, engines: tuple[Engine, Engine]
) -> None:
    e1, e2 = engines
    assert e1.layout_id == e2.layout_id
    keys = keys_for(101, 4)
    store_on(e1, keys)  # agent A holds chunks 0-3 (engine 1's bytes)
    store_on(e2, keys[:1])  # agent B holds chunk 0 itself (engine 2's bytes)
    wait_for("A's chunks indexed", lambda: cluster.l1_chunks(cluster.a.pod_uid, keys) == 4)

    hit = e2.client.lookup(e2.instance_id, "r1", keys)
    assert (hit.num_hit_chunks, hit.num_peer_chunks, hit.miss_cause) == (4, 3, "none")
    assert e2.client.health().num_pinned_chunks == 4  # the lookup pinned local + fetched chunks

    dst = 32
    res = e2.client.retrieve(e2.instance_id, "r1", keys, request_ids(dst, 4))
    assert res.hit_mask == [True] * 4 and res.bytes_moved == 4 * e2.bytes_per_chunk
    assert same(chunk_bytes(e2.tensors, chunk_ids(dst, 0)), chunk_bytes(e2.tensors, chunk_ids(0, 0)))
    for c in (1, 2, 3):  # fetched from A: engine 1's bytes, bit for bit
        assert same(chunk_bytes(e2.tensors, chunk_ids(dst, c)), chunk_bytes(e1.tensors, chunk_ids(0, c)))
    assert not same(chunk_bytes(e2.tensors, chunk_ids(0, 1)), chunk_bytes(e1.tensors, chunk_ids(0, 1)))

    # B now holds them: its snapshot lists them and the controller knows B as an L1 holder.
    snap = e2.client.snapshot()
    assert set(keys) <= set(snap.chunk_keys)
    wait_for("B indexed as L1 holder", lambda: cluster.l1_chunks(cluster.b.pod_uid, keys) == 4)
    health_b = e2.client.health()
    assert health_b.peer_fetched_chunks >= 3 and health_b.num_pinned_chunks == 0
    # A counts a chunk as served once its stream moved past it, which can be just after B stopped
    # reading: wait for the count rather than racing it.
    wait_for("A counted the chunks it served", lambda: e1.client.health().peer_served_chunks >= 3)
    assert e1.client.health().num_pinned_chunks == 0


def test_lookup_fetches_at_most_max_chunks_per_call(cluster: Cluster, engines: tuple[Engine, Engine]) -> None:
    e1, e2 = engines
    keys = keys_for(202, 5)
    store_on(e1, keys, first_block=20)
    wait_for("A's chunks indexed", lambda: cluster.l1_chunks(cluster.a.pod_uid, keys) == 5)
    first = e2.client.lookup(e2.instance_id, "", keys)  # B: --peer-fetch-max-chunks 3
    assert (first.num_hit_chunks, first.num_peer_chunks, first.miss_cause) == (3, 3, "not_found")
    second = e2.client.lookup(e2.instance_id, "", keys)
    assert (second.num_hit_chunks, second.num_peer_chunks, second.miss_cause) == (5, 2, "none")
    assert e2.client.lookup(e2.instance_id, "", keys).num_peer_chunks == 0  # all local now


def test_layout_mismatch_is_refused(cluster: Cluster, engines: tuple[Engine, Engine]) -> None:
    e1, _ = engines
    keys = keys_for(303, 2)
    store_on(e1, keys, first_block=40)
    with AgentClient(f"127.0.0.1:{cluster.a.tcp_port}", timeout_s=10) as peer:
        parts = list(peer.fetch_chunks(keys, e1.layout_id, namespace_id=NS_ID))
        assert [m.chunk_index for m in parts][-1] == 1 and parts[0].num_chunks == 2
        assert sum(len(m.data) for m in parts) == 2 * e1.bytes_per_chunk
        with pytest.raises(grpc.RpcError) as err:
            list(peer.fetch_chunks(keys, "0123456789abcdef", namespace_id=NS_ID))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # The error names what the caller sent, never the layout the chunk is held in.
    assert e1.layout_id not in err.value.details() and "0123456789abcdef" in err.value.details()

    # An engine on B whose KV has another dtype: same keys, other layout -> B cannot use A's chunks.
    d = cluster.root / "e3"
    d.mkdir()
    paths = [str(d / f"kv-{layer}.bin") for layer in range(5)]
    tensors = [allocate_shared_tensor(p, layer_shape(i), torch.float16) for i, p in enumerate(paths)]
    b = cluster.b.client()
    reg = b.register_kv_caches(
        "e3", tensors, namespace=NAMESPACE, engine_groups=GROUPS, shm_paths=paths, layout_hints=HINTS
    )
    assert reg.layout_id != e1.layout_id
    wait_for("A's chunks indexed", lambda: cluster.l1_chunks(cluster.a.pod_uid, keys) == 2)
    failures = b.health().peer_fetch_failures
    hit = b.lookup("e3", "r3", keys)
    assert (hit.num_hit_chunks, hit.miss_cause) == (0, "peer_failed")
    assert b.health().peer_fetch_failures == failures + 1
    assert not set(keys) & set(b.snapshot().chunk_keys)
    b.unregister_kv_caches("e3")


def test_dead_peer_leaves_only_local_hits(cluster: Cluster, engines: tuple[Engine, Engine]) -> None:
    _, e2 = engines
    c = start_pod_agent(cluster.root, "pod-c", cluster.controller_address)
    try:
        e4 = register(c, cluster.root, "e4", seed=4)
        keys = keys_for(404, 3)
        store_on(e4, keys)
        store_on(e2, keys[:1], first_block=50)
        wait_for("C's chunks indexed", lambda: cluster.l1_chunks(c.pod_uid, keys) == 3)
        e4.client.close()
        c.proc.send_signal(signal.SIGKILL)  # C's lease is still valid: the controller still names it
        c.proc.wait(10)
        failures = e2.client.health().peer_fetch_failures
        t0 = time.monotonic()
        hit = e2.client.lookup(e2.instance_id, "r4", keys)
        assert time.monotonic() - t0 < 5
        assert (hit.num_hit_chunks, hit.num_peer_chunks, hit.miss_cause) == (1, 0, "peer_failed")
        assert e2.client.health().peer_fetch_failures == failures + 1
        assert e2.client.release(e2.instance_id, "r4") == 1
    finally:
        c.stop()


# ---- in-process: the stream's references, a peer dying mid-chunk, a peer breaking the protocol ----


def _server(tmp_path: Path) -> AgentServer:
    cfg = AgentConfig(uds_path="", tcp_host="127.0.0.1", tcp_port=0, l1_size=4 << 20, l1_page_size=4096)
    return AgentServer(cfg, pod=PodIdentity(pod_uid="uid-local", epoch=1)).start()


def _put(server: AgentServer, keys: list[bytes], nbytes: int, layout_id: str = "L") -> list[bytes]:
    """Commit chunks with known bytes straight into the server's cache; returns their contents."""
    assert server.core is not None
    res = server.core.cache.reserve_store(keys, namespace_id=NS_ID, layout_id=layout_id, nbytes=nbytes)
    contents = []
    for i, (_, chunk) in enumerate(res.new_chunks):
        data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i))
        chunk.buffer.copy_(data)
        contents.append(data.numpy().tobytes())
    server.core.cache.commit(res)
    return contents


def _stream(port: int, keys: list[bytes], part: int) -> tuple[grpc.Channel, Any]:
    """FetchChunks over a channel without BDP probing, so HTTP/2 flow control keeps the 64 KiB
    default window and the server cannot run far ahead of what this test reads."""
    ch = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.http2.bdp_probe", 0)])
    req = agent_pb2.FetchChunksRequest(
        chunk_keys=keys, layout_id="L", namespace_id=NS_ID, max_part_bytes=part
    )
    return ch, agent_pb2_grpc.AgentServiceStub(ch).FetchChunks(req, timeout=10)


def test_fetch_stream_holds_chunks_until_sent(tmp_path: Path) -> None:
    server = _server(tmp_path)
    try:
        assert server.core is not None
        cache = server.core.cache
        keys = keys_for(505, 3)
        nbytes = 512 * 1024
        contents = _put(server, keys, nbytes)
        ch, stream = _stream(server.tcp_port or 0, keys, 64 * 1024)
        with ch:
            first = next(stream)
            assert (first.num_chunks, first.chunk_index, first.offset, len(first.data)) == (
                3,
                0,
                0,
                64 * 1024,
            )
            # Mid-stream nothing that is still to be sent can be evicted.
            assert cache.clear() == 0
            rest = list(stream)
        data: dict[int, bytes] = {}
        for m in [first, *rest]:
            assert m.offset == len(data.get(m.chunk_index, b"")) and m.chunk_bytes == nbytes
            data[m.chunk_index] = data.get(m.chunk_index, b"") + m.data
        assert [data[i] for i in range(3)] == contents
        assert cache.clear() == 3  # every reference dropped once sent

        # A client that goes away mid-stream leaves no references behind.
        _put(server, keys, nbytes)
        ch, stream = _stream(server.tcp_port or 0, keys, 64 * 1024)
        with ch:
            next(stream)
            stream.cancel()
        wait_for("references dropped", lambda: cache.clear() == 3)
    finally:
        server.stop(0)


def faulty_peer(messages: list[agent_pb2.FetchChunksResponse], abort: grpc.StatusCode | None) -> FakePeer:
    """A peer answering FetchChunks with ``messages`` and then ``abort`` (or a clean end)."""

    def answer(req: agent_pb2.FetchChunksRequest, context: grpc.ServicerContext) -> Iterator[Any]:
        yield from messages
        if abort is not None:
            context.abort(abort, "peer going away")

    return FakePeer(answer)


def _parts(index: int, payload: bytes, part: int, num_chunks: int = 0) -> list[agent_pb2.FetchChunksResponse]:
    out = [
        agent_pb2.FetchChunksResponse(
            chunk_index=index, chunk_bytes=len(payload), offset=o, data=payload[o : o + part]
        )
        for o in range(0, len(payload), part)
    ]
    out[0].num_chunks = num_chunks
    out[0].checksum = chunk_checksum(payload)  # a well-behaved peer (tests/agent/test_integrity.py: others)
    return out


@pytest.mark.parametrize("fault", ["dies_mid_chunk", "wrong_offset"])
def test_fetch_keeps_only_complete_chunks_when_the_peer_fails(fault: str) -> None:
    cache = ChunkCache(L1Pool(1 << 20, page_bytes=4096, pin=False))
    keys = keys_for(606, 3)
    nbytes = 8192
    c0, c1 = bytes(range(256)) * 32, bytes(reversed(range(256))) * 32
    msgs = _parts(0, c0, 3000, num_chunks=3) + _parts(1, c1, 3000)[:2]
    if fault == "wrong_offset":
        msgs = _parts(0, c0, 3000, num_chunks=3) + _parts(1, c1, 3000)[1:]
    peer = faulty_peer(msgs, grpc.StatusCode.UNAVAILABLE if fault == "dies_mid_chunk" else None)
    cfg = AgentConfig(controller_address="127.0.0.1:1", peer_fetch_mode="sync")
    fetcher = PeerFetcher(cache, cfg, "uid-local", PeerMetrics(metrics.get_meter("t")), trace.get_tracer("t"))
    try:
        res = fetch_once(fetcher, f"127.0.0.1:{peer.port}", keys, nbytes, peer_uid="uid-peer", timeout_s=5)
    finally:
        peer.server.stop(0)
    assert res.chunks == 1 and res.nbytes == nbytes
    assert res.error.startswith("unavailable" if fault == "dies_mid_chunk" else "protocol"), res.error
    assert cache.prefix_length(keys, "L", namespace_id=NS_ID)[0] == 1
    assert cache.acquire_prefix(keys[:1], "L", namespace_id=NS_ID)[0][0].buffer.numpy().tobytes() == c0
    # The half-received chunk's reservation is gone: only chunk 0's pages are in use.
    assert cache.stats().used_bytes == cache.pool.pages_for(nbytes) * cache.pool.page_bytes


def test_an_async_fetch_answers_before_the_bytes_arrive_and_readers_wait_for_them() -> None:
    """``peer_fetch_mode: async`` (the default): the fetch answers once the peer said how many chunks
    it sends; they are in L1 pending, and a reader waits for them (the peer holds the bytes back
    until the test opens its gate, so nothing here depends on timing)."""
    cache = ChunkCache(L1Pool(1 << 20, page_bytes=4096, pin=False))
    keys = keys_for(707, 2)
    c0, c1 = bytes(range(256)) * 32, bytes(reversed(range(256))) * 32
    parts = _parts(0, c0, 3000, num_chunks=2) + _parts(1, c1, 3000)
    gate = threading.Event()

    def answer(req: agent_pb2.FetchChunksRequest, context: grpc.ServicerContext) -> Iterator[Any]:
        yield parts[0]
        gate.wait(30)
        yield from parts[1:]

    peer = FakePeer(answer)
    fetcher = PeerFetcher(
        cache,
        AgentConfig(controller_address="127.0.0.1:1"),
        "uid-local",
        PeerMetrics(metrics.get_meter("t")),
        trace.get_tracer("t"),
    )
    try:
        cand = PeerCandidate(
            pod_uid="uid-peer", address=f"127.0.0.1:{peer.port}", l1_chunks=2, total_chunks=2
        )
        res = fetcher.fetch_from(cand, keys, NS_ID, "L", 8192, time.monotonic() + 30)
        assert (res.chunks, res.error) == (2, "")  # the gate is still closed
        assert cache.prefix_length(keys, "L", namespace_id=NS_ID)[0] == 2  # pending, counted
        got: list[Any] = []
        reader = threading.Thread(
            target=lambda: got.append(cache.acquire_ready_prefix(keys, "L", namespace_id=NS_ID))
        )
        reader.start()
        reader.join(0.3)
        assert reader.is_alive()  # waiting for bytes the peer has not sent
        gate.set()
        reader.join(10)
        chunks, _ = got[0]
        assert [c.buffer.numpy().tobytes() for c in chunks] == [c0, c1]
        cache.release(chunks)
    finally:
        gate.set()
        fetcher.close()
        peer.server.stop(0)


def test_choose_peers_prefers_own_l1_and_skips_self_and_unknown() -> None:
    resp = controller_pb2.MatchPrefixResponse(
        num_query_chunks=4,
        peer_fetchable_chunks=4,
        matches=[
            controller_pb2.PodMatch(pod_uid="me", l1_chunks=4),
            controller_pb2.PodMatch(pod_uid="gpu-only", gpu_chunks=4),
            controller_pb2.PodMatch(pod_uid="short", l1_chunks=2, peer_chunks=2),
            controller_pb2.PodMatch(pod_uid="long", l1_chunks=3, peer_chunks=1),
            controller_pb2.PodMatch(pod_uid="no-address", l1_chunks=4),
        ],
    )
    addresses = {"me": "a:1", "gpu-only": "b:1", "short": "c:1", "long": "d:1"}
    got = choose_peers(resp, "me", addresses, limit=5)
    assert [c.pod_uid for c in got] == ["long", "short"]
    assert got[0].address == "d:1" and choose_peers(resp, "me", addresses, limit=1) == got[:1]


def test_config_peer_fetch_needs_a_controller() -> None:
    assert not AgentConfig().peer_fetch_enabled
    assert AgentConfig(controller_address="c:1").peer_fetch_enabled
    assert not AgentConfig(controller_address="c:1", peer_fetch="off").peer_fetch_enabled
    with pytest.raises(ValueError, match="peer_fetch='on' but controller_address is empty"):
        AgentConfig(peer_fetch="on")
    with pytest.raises(ValueError, match="peer_fetch='sometimes': expected auto, on or off"):
        AgentConfig(peer_fetch="sometimes")
