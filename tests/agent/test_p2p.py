"""Peer data plane (``kvgrid.agent.peers.dataplane``): tickets over FetchChunks, bytes over the data port.

Real agents throughout: ``kvgrid agent`` processes for the end-to-end Lookup (bit-exact into the
fetching engine's KV cache, and the fallbacks when either side has the data plane off), and
in-process ``AgentServer`` (real gRPC, real sockets, real TLS) where a test needs to reach into the
serving agent (its L1 bytes, its data-plane counters). The attacker tests speak the wire protocol
by hand on the real data port.
"""

from __future__ import annotations

import secrets
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry import metrics, trace

from kvgrid.agent.cache import ChunkCache
from kvgrid.agent.config import AgentConfig
from kvgrid.agent.l1 import L1Pool
from kvgrid.agent.peers.dataplane.protocol import HELLO, MAGIC
from kvgrid.agent.peers.dataplane.sockets import recv_exact_into
from kvgrid.agent.peers.dataplane.tls_contexts import client_context
from kvgrid.agent.peers.fetcher import PeerFetcher
from kvgrid.agent.peers.metrics import PeerMetrics
from kvgrid.agent.service import AgentServer
from kvgrid.api.v1 import agent_pb2, agent_pb2_grpc
from kvgrid.common.checksum import chunk_checksum
from kvgrid.common.identity import PodIdentity
from kvgrid.common.tls import AGENT_SERVER_NAME, TlsFiles
from tests.agent.helpers import AgentProc, fetch_once, keys_for, start_agent, wait_for
from tests.agent.test_peers import (
    NS_ID,
    Engine,
    _put,
    chunk_bytes,
    chunk_ids,
    register,
    request_ids,
    same,
)
from tests.security.pki import TestCA, spiffe

NBYTES = 256 * 1024


def _server(**overrides: Any) -> AgentServer:
    cfg = AgentConfig(
        uds_path="", tcp_host="127.0.0.1", tcp_port=0, l1_size=8 << 20, l1_page_size=4096, **overrides
    )
    return AgentServer(cfg, pod=PodIdentity(pod_uid="uid-holder", epoch=1)).start()


def _fetcher(cache: ChunkCache, **overrides: Any) -> PeerFetcher:
    cfg = AgentConfig(uds_path="", **{"peer_fetch_mode": "sync", **overrides})
    return PeerFetcher(cache, cfg, "uid-fetcher", PeerMetrics(metrics.get_meter("t")), trace.get_tracer("t"))


def _ticket(port: int, keys: list[bytes], streams: int) -> tuple[grpc.Channel, agent_pb2.FetchChunksResponse]:
    """Ask for a ticket over the (plaintext here) control plane; the channel keeps it alive."""
    ch = grpc.insecure_channel(f"127.0.0.1:{port}")
    req = agent_pb2.FetchChunksRequest(
        chunk_keys=keys, layout_id="L", namespace_id=NS_ID, data_streams=streams
    )
    call = agent_pb2_grpc.AgentServiceStub(ch).FetchChunks(req, timeout=10)
    first = next(call)
    ch.call = call  # type: ignore[attr-defined]  # a collected call is cancelled, retiring the ticket
    return ch, first


def _hello(port: int, secret: bytes, stream: int, magic: bytes = MAGIC) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(HELLO.pack(magic, secret, stream))
    return sock


def _refused(sock: socket.socket) -> bool:
    """The data port hung up without sending a byte (a reset: it closed with our bytes unread)."""
    with sock:
        try:
            return sock.recv(1) == b""
        except ConnectionResetError:
            return True


@pytest.fixture
def holder() -> Iterator[AgentServer]:
    server = _server()
    yield server
    server.stop(0)


# ---- the protocol on the real data port ---------------------------------------------------------


def test_ticket_admits_its_streams_and_they_carry_the_chunks_bit_exact(holder: AgentServer) -> None:
    keys = keys_for(701, 5)
    contents = _put(holder, keys, NBYTES)
    ch, first = _ticket(holder.tcp_port or 0, keys, streams=2)
    with ch:
        assert holder.data_plane is not None
        assert (first.num_chunks, first.chunk_bytes, first.data, first.data_port) == (
            5,
            NBYTES,
            b"",
            holder.data_plane.port,
        )
        assert len(first.data_ticket) == 32
        got: dict[int, bytes] = {}
        for stream in (0, 1):
            with _hello(first.data_port, first.data_ticket, stream) as sock:
                for index in range(stream, 5, 2):  # round-robin over the two streams
                    data, checksum = bytearray(NBYTES), bytearray(16)
                    recv_exact_into(sock, memoryview(data))
                    recv_exact_into(sock, memoryview(checksum))
                    assert bytes(checksum) == chunk_checksum(data)
                    got[index] = bytes(data)
                assert sock.recv(1) == b""  # nothing after its share
    assert [got[i] for i in range(5)] == contents
    assert holder.data_plane.admitted == 2
    assert holder.core is not None
    wait_for("every reference dropped", lambda: holder.core is not None and holder.core.cache.clear() == 5)


def test_forged_reused_and_malformed_hellos_are_refused_and_the_port_keeps_serving(
    holder: AgentServer,
) -> None:
    keys = keys_for(702, 2)
    contents = _put(holder, keys, NBYTES)
    assert holder.data_plane is not None
    port = holder.data_plane.port
    # Nothing without a ticket: a guessed one, garbage, an empty connection.
    assert _refused(_hello(port, secrets.token_bytes(32), 0))
    assert _refused(_hello(port, bytes(32), 0))
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(64))
    assert _refused(sock)
    ch, first = _ticket(holder.tcp_port or 0, keys, streams=1)
    with ch:
        # A real ticket with the wrong magic, or for a stream it does not admit, is refused too.
        assert _refused(_hello(port, first.data_ticket, 0, magic=b"XXXX"))
        assert _refused(_hello(port, first.data_ticket, 1))
        with _hello(port, first.data_ticket, 0) as sock:
            data = bytearray(16 + NBYTES)
            recv_exact_into(sock, memoryview(data))  # this claim was admitted first
            assert bytes(data[:NBYTES]) == contents[0]
            # A second claim of the same stream (a replayed ticket) gets nothing. Only after the
            # first one's bytes arrived: two connections' hellos may be handled in either order
            # (under load the replay once won and the test failed).
            assert _refused(_hello(port, first.data_ticket, 0))
    assert holder.data_plane.refused == 6 and holder.data_plane.admitted == 1
    # Once the control stream ended (the holder learns it asynchronously) the ticket is dead.
    wait_for(
        "the holder retired the ticket",
        lambda: holder.data_plane is not None and not holder.data_plane.live_tickets,
    )
    assert _refused(_hello(port, first.data_ticket, 0))


def test_a_fetcher_that_never_connects_does_not_pin_chunks_past_the_ttl() -> None:
    # The ticket lives 2 s, so the first clear() below comes well before it lapses on a slow machine.
    server = _server(peer_fetch_timeout_ms=2000, pin_ttl_ms=3000)
    try:
        keys = keys_for(703, 2)
        _put(server, keys, NBYTES)
        assert server.core is not None
        ch, first = _ticket(server.tcp_port or 0, keys, streams=2)
        with ch:
            assert first.data_ticket
            assert server.core.cache.clear() == 0  # referenced by the ticket
            wait_for("ticket expired", lambda: server.core is not None and server.core.cache.clear() == 2, 10)
    finally:
        server.stop(0)


def test_a_cancelled_fetch_releases_its_ticket_at_once() -> None:
    server = _server(peer_fetch_timeout_ms=60_000, pin_ttl_ms=61_000, pin_ttl_max_ms=61_000)
    try:
        keys = keys_for(711, 2)
        _put(server, keys, NBYTES)
        assert server.core is not None and server.data_plane is not None
        ch, first = _ticket(server.tcp_port or 0, keys, streams=2)
        with ch:
            assert server.core.cache.clear() == 0  # referenced by the ticket
            ch.call.cancel()  # type: ignore[attr-defined]
            # Long before the 60 s TTL: the call's end closed the ticket.
            wait_for("ticket closed", lambda: server.core is not None and server.core.cache.clear() == 2, 5)
            assert _refused(_hello(server.data_plane.port, first.data_ticket, 0))
    finally:
        server.stop(0)


# ---- the fetcher --------------------------------------------------------------------------------


def _fetch(holder: AgentServer, keys: list[bytes], **fetcher_cfg: Any) -> tuple[ChunkCache, object]:
    cache = ChunkCache(L1Pool(4 << 20, page_bytes=4096, pin=False))
    fetcher = _fetcher(cache, **fetcher_cfg)
    res = fetch_once(
        fetcher, f"127.0.0.1:{holder.tcp_port}", keys, NBYTES, peer_uid="uid-holder", timeout_s=10
    )
    return cache, res


@pytest.mark.parametrize("streams", [1, 3])
def test_fetcher_receives_over_the_data_plane_into_l1(holder: AgentServer, streams: int) -> None:
    keys = keys_for(704, 4)
    contents = _put(holder, keys, NBYTES)
    cache, res = _fetch(holder, keys, peer_data_streams=streams)
    assert (res.chunks, res.nbytes, res.error) == (4, 4 * NBYTES, ""), res  # type: ignore[attr-defined]
    held, _ = cache.acquire_prefix(keys, "L", namespace_id=NS_ID)
    assert [c.buffer.numpy().tobytes() for c in held] == contents
    assert [c.checksum for c in held] == [chunk_checksum(c) for c in contents]
    assert holder.data_plane is not None and holder.data_plane.admitted == streams


def test_a_corrupted_byte_is_refused_by_checksum(holder: AgentServer) -> None:
    keys = keys_for(705, 3)
    _put(holder, keys, NBYTES)
    assert holder.core is not None
    chunks, _ = holder.core.cache.acquire_prefix(keys, "L", namespace_id=NS_ID)
    for c in chunks:
        c.checksum = chunk_checksum(c.buffer.numpy())  # recorded when the bytes were final
    chunks[1].buffer.numpy()[12345] ^= 0x40  # then one bit of chunk 1 rots in the holder's L1
    holder.core.cache.release(chunks)
    cache, res = _fetch(holder, keys, peer_data_streams=1)
    assert res.error.startswith("checksum: ") and "chunk 1 discarded" in res.error, res  # type: ignore[attr-defined]
    assert res.chunks == 1  # type: ignore[attr-defined]  # chunk 0 arrived intact and is kept
    assert cache.prefix_length(keys, "L", namespace_id=NS_ID)[0] == 1
    assert cache.stats().num_chunks == 1  # chunk 1 never became visible; chunk 2 not kept after it


def test_fetcher_with_the_data_plane_off_streams_over_grpc(holder: AgentServer) -> None:
    keys = keys_for(706, 2)
    contents = _put(holder, keys, NBYTES)
    cache, res = _fetch(holder, keys, peer_data_plane="grpc")
    assert (res.chunks, res.error) == (2, "")  # type: ignore[attr-defined]
    held, _ = cache.acquire_prefix(keys, "L", namespace_id=NS_ID)
    assert [c.buffer.numpy().tobytes() for c in held] == contents
    assert holder.data_plane is not None and holder.data_plane.admitted == 0  # no data connection


def test_holder_with_the_data_plane_off_answers_with_data() -> None:
    server = _server(peer_data_plane="grpc")
    try:
        assert server.data_plane is None
        keys = keys_for(707, 2)
        contents = _put(server, keys, NBYTES)
        cache, res = _fetch(server, keys)  # the fetcher asks for the data plane
        assert (res.chunks, res.error) == (2, "")  # type: ignore[attr-defined]
        held, _ = cache.acquire_prefix(keys, "L", namespace_id=NS_ID)
        assert [c.buffer.numpy().tobytes() for c in held] == contents
    finally:
        server.stop(0)


# ---- mutual TLS on the data port -----------------------------------------------------------------


def _agent_tls(ca: TestCA, root: Path, name: str) -> TlsFiles:
    d = ca.write(root / name, spiffe("agent"), dns=(AGENT_SERVER_NAME,))
    return TlsFiles(str(d / "tls.crt"), str(d / "tls.key"), str(d / "ca.crt"))


def test_tls_data_plane_fetches_and_refuses_plaintext_and_foreign_certificates(tmp_path: Path) -> None:
    ca, foreign = TestCA(), TestCA("another CA")
    mine = _agent_tls(ca, tmp_path, "holder")
    tls = {"tls_cert_file": mine.cert_file, "tls_key_file": mine.key_file, "tls_ca_file": mine.ca_file}
    server = _server(**tls)
    try:
        assert server.data_plane is not None
        keys = keys_for(708, 2)
        contents = _put(server, keys, NBYTES)
        fetcher_tls = _agent_tls(ca, tmp_path, "fetcher")
        cache, res = _fetch(
            server,
            keys,
            tls_cert_file=fetcher_tls.cert_file,
            tls_key_file=fetcher_tls.key_file,
            tls_ca_file=fetcher_tls.ca_file,
        )
        assert (res.chunks, res.error) == (2, ""), res  # type: ignore[attr-defined]
        held, _ = cache.acquire_prefix(keys, "L", namespace_id=NS_ID)
        assert [c.buffer.numpy().tobytes() for c in held] == contents
        port = server.data_plane.port
        # A live ticket, asked for over the mTLS control plane as an agent.
        creds = grpc.ssl_channel_credentials(
            Path(mine.ca_file).read_bytes(),
            Path(fetcher_tls.key_file).read_bytes(),
            Path(fetcher_tls.cert_file).read_bytes(),
        )
        opts = [("grpc.ssl_target_name_override", AGENT_SERVER_NAME)]
        with grpc.secure_channel(f"127.0.0.1:{server.tcp_port}", creds, opts) as ch:
            req = agent_pb2.FetchChunksRequest(
                chunk_keys=keys, layout_id="L", namespace_id=NS_ID, data_streams=1
            )
            call = agent_pb2_grpc.AgentServiceStub(ch).FetchChunks(req, timeout=10)
            ticket = next(call).data_ticket
            # Plaintext with that ticket on the TLS data port: the handshake fails, nothing is served.
            assert _refused(_hello(port, ticket, 0))
            # TLS with a client certificate from another CA: refused at the handshake.
            # It trusts the server's CA; the server does not trust its one.
            foreign_files = _agent_tls(foreign, tmp_path, "stranger")
            stranger = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            stranger.load_cert_chain(foreign_files.cert_file, foreign_files.key_file)
            stranger.load_verify_locations(mine.ca_file)
            raw = socket.create_connection(("127.0.0.1", port), timeout=10)
            with (
                pytest.raises((ssl.SSLError, ConnectionError)),
                stranger.wrap_socket(raw, server_hostname=AGENT_SERVER_NAME) as sock,
            ):
                sock.sendall(HELLO.pack(MAGIC, ticket, 0))
                recv_exact_into(sock, memoryview(bytearray(NBYTES)))
            assert server.data_plane.admitted == 2  # only the fetch above's two streams
            # Control: the same ticket from an agent of our CA is admitted and served.
            legit = client_context(fetcher_tls)
            raw = socket.create_connection(("127.0.0.1", port), timeout=10)
            with legit.wrap_socket(raw, server_hostname=AGENT_SERVER_NAME) as sock:
                sock.sendall(HELLO.pack(MAGIC, ticket, 0))
                data = bytearray(16 + NBYTES)
                recv_exact_into(sock, memoryview(data))
                assert bytes(data[:NBYTES]) == contents[0]
            assert server.data_plane.admitted == 3
    finally:
        server.stop(0)


# ---- real agent processes: Lookup fetches into the engine's KV bit for bit ----------------------


@pytest.mark.parametrize(
    ("fetcher_plane", "holder_plane"), [("socket", "socket"), ("grpc", "socket"), ("socket", "grpc")]
)
def test_lookup_between_agent_processes_is_bit_exact(
    tmp_path: Path, fetcher_plane: str, holder_plane: str
) -> None:
    agents: list[AgentProc] = []
    try:
        for uid, plane in (("uid-a", holder_plane), ("uid-b", fetcher_plane)):
            (tmp_path / uid).mkdir()
            agents.append(
                start_agent(
                    tmp_path / uid,
                    "--peer-data-plane",
                    plane,
                    "--peer-data-streams",
                    "3",
                    l1_size="16MiB",
                    pod_uid=uid,
                    shm_dir=tmp_path,
                )
            )
        a, b = agents
        e1: Engine = register(a, tmp_path, "e1", seed=1)
        e2: Engine = register(b, tmp_path, "e2", seed=2)
        keys = keys_for(709, 4)
        assert e1.client.store(e1.instance_id, keys, request_ids(0, 4)).num_stored_chunks == 4
        hit = e2.client.lookup(e2.instance_id, "r1", keys, peer_address=f"127.0.0.1:{a.tcp_port}")
        assert (hit.num_hit_chunks, hit.num_peer_chunks, hit.miss_cause) == (4, 4, "none")
        dst = 32
        res = e2.client.retrieve(e2.instance_id, "r1", keys, request_ids(dst, 4))
        assert res.hit_mask == [True] * 4
        for c in range(4):
            assert same(chunk_bytes(e2.tensors, chunk_ids(dst, c)), chunk_bytes(e1.tensors, chunk_ids(0, c)))
        # The data plane counts every chunk it sent; the gRPC stream counts one once it moved past
        # it, which the last one may never do when B cancels right after it (tests/agent/test_peers.py).
        served = 4 if "grpc" not in (fetcher_plane, holder_plane) else 3
        wait_for("A counted the chunks it served", lambda: e1.client.health().peer_served_chunks >= served)
    finally:
        for agent in agents:
            agent.stop()


def test_an_unreachable_data_port_falls_back_to_grpc(holder: AgentServer) -> None:
    keys = keys_for(710, 3)
    contents = _put(holder, keys, NBYTES)
    assert holder.data_plane is not None
    holder.data_plane.stop()  # tickets still name the port; nothing listens there (a blocked port)
    cache = ChunkCache(L1Pool(4 << 20, page_bytes=4096, pin=False))
    fetcher = _fetcher(cache)
    res = fetch_once(
        fetcher, f"127.0.0.1:{holder.tcp_port}", keys, NBYTES, peer_uid="uid-holder", timeout_s=10
    )
    assert (res.chunks, res.error) == (3, ""), res
    held, _ = cache.acquire_prefix(keys, "L", namespace_id=NS_ID)
    assert [c.buffer.numpy().tobytes() for c in held] == contents
    assert fetcher.metrics.stats.fetch_failures == 1  # the unreachable data port is counted
