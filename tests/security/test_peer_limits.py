"""The agent's TCP side under a starving peer, against real servers serving with mTLS.

The attacks these tests replay:

- 24 FetchChunks streams from one agent identity that never read held every TCP thread (16), so the
  controller's Snapshot pull and other peers' fetches timed out, and still did 10 s later (no
  serving deadline). Now one caller has at most ``peer_streams_per_identity`` (8) streams open
  (RESOURCE_EXHAUSTED naming the limit past it) and every stream ends by ``peer_stream_timeout_ms``.
- 300 idle sockets on the data port (no certificate, no hello) made the agent refuse a real peer's
  data connections; that peer then used gRPC for this agent for good. Now connections without a
  ticket are bounded (the oldest closed to make room) and timed out, and a peer whose data port
  failed goes back to it after a backoff.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry import metrics, trace

from kvgrid.agent.cache import ChunkCache
from kvgrid.agent.config import AgentConfig
from kvgrid.agent.l1 import L1Pool
from kvgrid.agent.peers.dataplane.protocol import HELLO, MAGIC
from kvgrid.agent.peers.dataplane.server import DataPlaneServer
from kvgrid.agent.peers.dataplane.tls_contexts import client_context
from kvgrid.agent.peers.directory import PeerCandidate
from kvgrid.agent.peers.fetcher import PeerFetcher
from kvgrid.agent.peers.metrics import PeerMetrics
from kvgrid.agent.service import AgentServer
from kvgrid.api.v1 import agent_pb2, agent_pb2_grpc
from kvgrid.common.identity import PodIdentity
from kvgrid.common.tls import AGENT_SERVER_NAME, ClientTls, TlsFiles
from kvgrid.engine.client import AgentClient
from tests.agent.helpers import keys_for, wait_for
from tests.agent.test_peers import NS_ID, _put
from tests.security.conftest import Pki, read, tls_flags
from tests.security.pki import spiffe

NBYTES = 256 * 1024


def _holder(tmp_path: Path, pki: Pki, **flags: Any) -> AgentServer:
    cfg = AgentConfig(
        uds_path=str(tmp_path / "agent.sock"), tcp_host="127.0.0.1", tcp_port=0,
        l1_page_size=4096, **tls_flags(pki.agent("pod-srv")), **{"l1_size": 8 << 20, **flags},
    )  # fmt: skip
    return AgentServer(cfg, pod=PodIdentity(pod_uid="pod-srv", epoch=1)).start()


def _channel(server: AgentServer, who: Path) -> grpc.Channel:
    """A channel of its own (no shared subchannel, no BDP probing: HTTP/2 keeps its 64 KiB window,
    so a stream this test does not read stalls its sender)."""
    cert, key, ca = read(who)
    return grpc.secure_channel(
        f"127.0.0.1:{server.tcp_port}",
        grpc.ssl_channel_credentials(ca, key, cert),
        options=[
            ("grpc.ssl_target_name_override", AGENT_SERVER_NAME),
            ("grpc.http2.bdp_probe", 0),
            ("grpc.use_local_subchannel_pool", 1),
        ],
    )


def _request(keys: list[bytes], part: int = 0) -> agent_pb2.FetchChunksRequest:
    return agent_pb2.FetchChunksRequest(
        chunk_keys=keys, layout_id="L", namespace_id=NS_ID, max_part_bytes=part
    )


def _read_all(server: AgentServer, who: Path, keys: list[bytes]) -> list[bytes]:
    with _channel(server, who) as ch:
        parts = list(agent_pb2_grpc.AgentServiceStub(ch).FetchChunks(_request(keys), timeout=10))
    out: dict[int, bytearray] = {}
    for p in parts:
        out.setdefault(p.chunk_index, bytearray()).extend(p.data)
    return [bytes(out[i]) for i in sorted(out)]


def _files(who: Path) -> TlsFiles:
    return TlsFiles(str(who / "tls.crt"), str(who / "tls.key"), str(who / "ca.crt"))


def _fetcher(cache: ChunkCache, who: Path, **overrides: Any) -> PeerFetcher:
    cfg = AgentConfig(uds_path="", **{"peer_fetch_mode": "sync", **tls_flags(who), **overrides})
    return PeerFetcher(cache, cfg, "pod-peer", PeerMetrics(metrics.get_meter("t")), trace.get_tracer("t"))


def _cache() -> ChunkCache:
    return ChunkCache(L1Pool(8 << 20, page_bytes=4096, pin=False))


def _candidate(server: AgentServer, n: int) -> PeerCandidate:
    return PeerCandidate(
        pod_uid="pod-srv", address=f"127.0.0.1:{server.tcp_port}", l1_chunks=n, total_chunks=n
    )


def _held(cache: ChunkCache, keys: list[bytes]) -> list[bytes]:
    """The bytes of the leading ready chunks of ``keys`` (waits for chunks still landing)."""
    chunks, _ = cache.acquire_ready_prefix(keys, "L", namespace_id=NS_ID)
    try:
        return [c.buffer.numpy()[:NBYTES].tobytes() for c in chunks]
    finally:
        cache.release(chunks)


# ---- gRPC streams ------------------------------------------------------------------------------


def test_unread_streams_of_one_identity_neither_starve_other_peers_nor_outlive_the_deadline(
    tmp_path: Path, pki: Pki
) -> None:
    server = _holder(tmp_path, pki, peer_stream_timeout_ms=4000)  # 16 TCP threads, 8 streams per caller
    channels: list[grpc.Channel] = []
    try:
        keys = keys_for(901, 16)
        contents = _put(server, keys, NBYTES)
        assert server.tcp_guard is not None and server.core is not None
        hog, hog_uri = pki.agent("pod-hog"), spiffe("agent", "pod-hog")
        t0 = time.monotonic()
        calls = []
        for _ in range(24):  # the attack: never read past the first message, a 60 s client deadline
            ch = _channel(server, hog)
            channels.append(ch)
            calls.append(agent_pb2_grpc.AgentServiceStub(ch).FetchChunks(_request(keys, part=1), timeout=60))
        time.sleep(1.0)  # let the agent take them up

        # Another peer's whole fetch and the controller's Snapshot pull go through meanwhile.
        t1 = time.monotonic()
        assert _read_all(server, pki.agent("pod-ok"), keys) == contents
        files = _files(pki.controller())
        with AgentClient(f"127.0.0.1:{server.tcp_port}", timeout_s=5, tls=ClientTls(files)) as client:
            assert len(client.snapshot().chunk_keys) == 16
        assert time.monotonic() - t1 < 2.0, "another peer's fetch and the snapshot waited for the hog"

        # The hog holds 8 streams (one message each read here); the other 16 were refused, naming the limit.
        held, refused = [], []
        for call in calls:
            try:
                next(call)
                held.append(call)
            except grpc.RpcError as e:
                refused.append(e)
        assert len(held) == 8, f"{len(held)} streams held, {len(refused)} refused"
        for e in refused:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.details()
            assert f"the caller '{hog_uri}@ipv4:127.0.0.1' already has 8 streams open" in (e.details() or "")
            assert "the limit is 8 per caller (peer_streams_per_identity)" in (e.details() or "")
        assert server.tcp_guard.slots.open_streams(f"{hog_uri}@ipv4:127.0.0.1") == 8
        assert time.monotonic() - t0 < 4.0, "the checks above ran after the hog's streams ended"

        # The serving deadline ends the unread streams (their client deadline is 60 s): the slots,
        # threads and chunk references come back, and the same identity may fetch again.
        wait_for("the hog's streams ended", lambda: server.tcp_guard is not None
                 and server.tcp_guard.slots.open_streams(f"{hog_uri}@ipv4:127.0.0.1") == 0, 10)  # fmt: skip
        assert time.monotonic() - t0 < 8.0
        for call in held:
            with pytest.raises(grpc.RpcError) as err:
                for _ in call:
                    pass
            assert err.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)
        assert _read_all(server, hog, keys[:2]) == contents[:2]
        assert server.core.cache.clear() == 16  # nothing is still referenced
    finally:
        for ch in channels:
            ch.close()
        server.stop(0)


def test_a_stream_still_sending_at_the_deadline_is_told_so(tmp_path: Path, pki: Pki) -> None:
    server = _holder(tmp_path, pki, peer_stream_timeout_ms=1000)
    try:
        keys = keys_for(902, 4)
        _put(server, keys, NBYTES)
        with _channel(server, pki.agent("pod-slow")) as ch:
            call = agent_pb2_grpc.AgentServiceStub(ch).FetchChunks(_request(keys, part=1), timeout=30)
            with pytest.raises(grpc.RpcError) as err:
                for _ in call:  # a slow reader: a part every 0.1 s, past the 1 s serving deadline
                    time.sleep(0.1)
        assert err.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
        if err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            assert "serving deadline (peer_stream_timeout_ms)" in (err.value.details() or "")
        assert server.core is not None
        wait_for("references dropped", lambda: server.core is not None and server.core.cache.clear() == 4, 5)
    finally:
        server.stop(0)


# ---- the data port -------------------------------------------------------------------------------


def test_idle_connections_on_the_data_port_do_not_break_a_peer_fetch(tmp_path: Path, pki: Pki) -> None:
    server = _holder(tmp_path, pki, peer_data_handshake_timeout_ms=2000)
    idle: list[socket.socket] = []
    try:
        plane = server.data_plane
        assert plane is not None
        keys = keys_for(903, 8)
        contents = _put(server, keys, NBYTES)
        for _ in range(300):  # the attack: connect, never handshake
            idle.append(socket.create_connection(("127.0.0.1", plane.port), timeout=10))
        wait_for(
            "the agent took them up", lambda: plane.evicted + plane.unauthenticated + plane.refused >= 300, 10
        )

        cache = _cache()
        fetcher = _fetcher(cache, pki.agent("pod-peer"), peer_data_streams=4)
        try:
            res = fetcher.fetch_from(_candidate(server, 8), keys, NS_ID, "L", NBYTES, time.monotonic() + 10)
        finally:
            fetcher.close()
        assert (res.chunks, res.error) == (8, ""), res
        assert _held(cache, keys) == contents  # bit for bit
        assert plane.admitted == 4 and fetcher.metrics.stats.fetch_failures == 0  # on the data plane
        assert plane.unauthenticated <= 64 and plane.evicted >= 300 - 64

        # The idle ones are closed by the handshake timeout, without a byte sent.
        wait_for("idle connections closed", lambda: plane.unauthenticated == 0, 10)
        for sock in idle[-8:]:
            sock.settimeout(5)
            with contextlib.suppress(ConnectionResetError):
                assert sock.recv(1) == b""
    finally:
        for sock in idle:
            sock.close()
        server.stop(0)


def test_after_a_data_plane_outage_the_peer_goes_back_to_the_data_plane(
    tmp_path: Path, pki: Pki, free_port: Callable[[], int]
) -> None:
    port = free_port()
    server = _holder(tmp_path, pki, peer_data_port=port)
    cache = _cache()
    fetcher = _fetcher(
        cache, pki.agent("pod-peer"), peer_fetch_mode="async", peer_data_streams=2,
        peer_data_retry_initial_ms=500, peer_data_retry_max_ms=1000,
    )  # fmt: skip
    try:
        assert server.data_plane is not None and server.tcp_servicer is not None
        address = f"127.0.0.1:{server.tcp_port}"
        k1, k2, k3 = keys_for(904, 3), keys_for(905, 3), keys_for(906, 3)
        _put(server, k1, NBYTES)
        c2 = _put(server, k2, NBYTES)
        c3 = _put(server, k3, NBYTES)

        server.data_plane.stop()  # the outage: tickets name a port nothing listens on
        fetcher.fetch_from(_candidate(server, 3), k1, NS_ID, "L", NBYTES, time.monotonic() + 10)
        wait_for("the failure was seen", lambda: fetcher.metrics.stats.fetch_failures == 1, 10)
        assert not fetcher.data_plane_backoff.usable(address)

        # Within the backoff: over gRPC, without trying the data port.
        fetcher.fetch_from(_candidate(server, 3), k2, NS_ID, "L", NBYTES, time.monotonic() + 10)
        assert _held(cache, k2) == c2
        assert fetcher.metrics.stats.fetch_failures == 1

        # The data port is back (the same port); once the backoff passed the peer uses it again.
        plane = DataPlaneServer("127.0.0.1", port, tls=server.config.tls).start()
        server.data_plane = server.tcp_servicer.data_plane = plane
        wait_for("the backoff passed", lambda: fetcher.data_plane_backoff.usable(address), 5)
        fetcher.fetch_from(_candidate(server, 3), k3, NS_ID, "L", NBYTES, time.monotonic() + 10)
        assert _held(cache, k3) == c3
        assert plane.admitted == 2, "the fetch after the backoff did not use the data plane"
        assert fetcher.data_plane_backoff.usable(address)
    finally:
        fetcher.close()
        server.stop(0)


def test_an_admitted_data_connection_that_stops_reading_is_closed(tmp_path: Path, pki: Pki) -> None:
    """A fetcher with a live ticket that stops reading: after ``peer_data_idle_timeout_ms`` the data
    connection is closed and the chunk references come back, long before the ticket's 30 s TTL."""
    server = _holder(
        tmp_path, pki, l1_size=64 << 20, peer_data_idle_timeout_ms=1000,
        peer_fetch_timeout_ms=30_000, pin_ttl_ms=31_000, pin_ttl_max_ms=31_000, peer_stream_timeout_ms=30_000,
    )  # fmt: skip
    try:
        plane = server.data_plane
        assert plane is not None and server.core is not None
        keys = keys_for(907, 12)
        _put(server, keys, 4 << 20)  # 48 MiB: far more than the sockets' buffers hold
        who = pki.agent("pod-stall")
        req = agent_pb2.FetchChunksRequest(chunk_keys=keys, layout_id="L", namespace_id=NS_ID, data_streams=1)
        with _channel(server, who) as ch:
            call = agent_pb2_grpc.AgentServiceStub(ch).FetchChunks(req, timeout=60)
            first = next(call)
            raw = socket.create_connection(("127.0.0.1", first.data_port), timeout=10)
            with client_context(_files(who)).wrap_socket(raw, server_hostname=AGENT_SERVER_NAME) as sock:
                sock.sendall(HELLO.pack(MAGIC, first.data_ticket, 0))
                sock.recv(1)  # admitted and sending; then never read again
                t0 = time.monotonic()

                def referenced() -> int:
                    """Chunks still held (the unreferenced ones are dropped first)."""
                    assert server.core is not None
                    server.core.cache.clear()
                    return server.core.cache.stats().num_chunks

                assert referenced() >= 8  # the ticket holds the chunks not sent yet
                wait_for("the stalled connection closed", lambda: referenced() == 0, 10)
                assert time.monotonic() - t0 < 8.0
            assert plane.admitted == 1
    finally:
        server.stop(0)


def test_a_hello_trickled_byte_by_byte_is_cut_at_the_handshake_deadline(tmp_path: Path, pki: Pki) -> None:
    """One deadline for the whole handshake: a client sending its hello a byte every 0.25 s (each read
    well within any per-read timeout) is closed once ``peer_data_handshake_timeout_ms`` passed."""
    server = _holder(tmp_path, pki, peer_data_handshake_timeout_ms=1500)
    try:
        plane = server.data_plane
        assert plane is not None
        raw = socket.create_connection(("127.0.0.1", plane.port), timeout=10)
        who = _files(pki.agent("pod-slowloris"))
        with client_context(who).wrap_socket(raw, server_hostname=AGENT_SERVER_NAME) as sock:
            t0 = time.monotonic()
            closed_at = None
            for byte in HELLO.pack(MAGIC, bytes(32), 0):
                try:
                    sock.sendall(bytes([byte]))
                except OSError:
                    closed_at = time.monotonic()
                    break
                time.sleep(0.25)
                if plane.unauthenticated == 0:
                    closed_at = time.monotonic()
                    break
        assert closed_at is not None, "the agent waited for the whole trickled hello"
        assert closed_at - t0 < 3.0
        assert plane.admitted == 0
    finally:
        server.stop(0)
