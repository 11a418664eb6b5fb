"""The peer data plane's security modes (``peer_data_security``: mac, aead, tls) against real agent
servers serving with mTLS, a real fetcher, and an attacker on the path of the data connections.

The attacks: the data plane of ``mac`` and ``aead`` tickets is plaintext TCP, so whoever sits on the
path between two agents can change bytes in flight, replay what an earlier ticket carried, move a
chunk to another position, or replace a chunk and compute a fresh check value for it (a plain
checksum, XXH3, passes that). Each chunk (``mac``) or record (``aead``) is therefore keyed by a fresh
random key per ticket, handed out only over the mTLS ``FetchChunks`` call and bound to the chunk's
index, and the fetcher verifies it before the chunk is committed. The attacker here is
:class:`OnPath`: a relay the holder's tickets point the fetcher to (as a hijacked route would), which
forwards to the real data port and tampers with what comes back.
"""

from __future__ import annotations

import contextlib
import secrets
import socket
import sys
import threading
import time
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from opentelemetry import metrics, trace

from kvgrid.agent.cache import ChunkCache
from kvgrid.agent.config import AgentConfig
from kvgrid.agent.l1 import L1Pool
from kvgrid.agent.peers.dataplane.keys import TicketKeys, aead_aad, aead_nonce, chunk_mac, hello_tag
from kvgrid.agent.peers.dataplane.mac import HASH_PIECE_BYTES
from kvgrid.agent.peers.dataplane.protocol import (
    DEFAULT_SECURITY,
    HELLO,
    MAC_BYTES,
    MAGIC,
    MAGIC_AEAD,
    MAGIC_MAC,
    PIECE_BYTES,
    SECURITY_MODES,
    TAG_BYTES,
    accepted_security,
    ticket_security,
)
from kvgrid.agent.peers.dataplane.server import DataPlaneServer
from kvgrid.agent.peers.dataplane.sockets import recv_exact_into
from kvgrid.agent.peers.dataplane.tls_contexts import client_context
from kvgrid.agent.peers.directory import PeerCandidate
from kvgrid.agent.peers.fetcher import PeerFetcher, PeerFetchResult
from kvgrid.agent.peers.metrics import PeerMetrics
from kvgrid.agent.service import AgentServer
from kvgrid.api.v1 import agent_pb2, agent_pb2_grpc
from kvgrid.common.config import ConfigError
from kvgrid.common.identity import PodIdentity
from kvgrid.common.tls import AGENT_SERVER_NAME, TlsFiles
from tests.agent.helpers import keys_for, wait_for
from tests.agent.test_peers import NS_ID, _put
from tests.security.conftest import Pki, channel_as, tls_flags

NBYTES = 256 * 1024
"""A chunk: one piece, so one AES-GCM record per chunk (aead frames are NBYTES + 16)."""
FRAME = {"mac": NBYTES + MAC_BYTES, "aead": NBYTES + TAG_BYTES}
"""What one chunk occupies on a data connection, by mode."""


class OnPath:
    """An attacker between the fetcher and a holder's data port: each data connection is relayed
    to the real port; what the holder sends back is either changed on the fly (``mutate(connection,
    offset, bytes)``) or, with ``hold``, gathered until the holder hung up and replaced by
    ``tamper(connection, everything)``. :attr:`seen` keeps what the holder sent per connection."""

    def __init__(
        self,
        upstream: int,
        *,
        mutate: Callable[[int, int, bytes], bytes] | None = None,
        tamper: Callable[[int, bytes], bytes] | None = None,
    ) -> None:
        self.upstream = upstream
        self.mutate = mutate
        self.tamper = tamper
        self.seen: list[bytes] = []
        self._lock = threading.Lock()
        self._srv = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._srv.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._srv.shutdown(socket.SHUT_RDWR)
        self._srv.close()

    def _accept(self) -> None:
        n = 0
        while True:
            try:
                client, _ = self._srv.accept()
            except OSError:
                return
            threading.Thread(target=self._relay, args=(n, client), daemon=True).start()
            n += 1

    def _relay(self, n: int, client: socket.socket) -> None:
        with client, socket.create_connection(("127.0.0.1", self.upstream)) as up:

            def forward() -> None:  # the fetcher's hello (and TLS handshake) go through untouched
                with contextlib.suppress(OSError):
                    while data := client.recv(1 << 16):
                        up.sendall(data)

            threading.Thread(target=forward, daemon=True).start()
            seen, offset = bytearray(), 0
            with contextlib.suppress(OSError):
                while data := up.recv(1 << 16):
                    seen += data
                    if self.tamper is None:
                        client.sendall(self.mutate(n, offset, data) if self.mutate else data)
                    offset += len(data)
            with self._lock:
                self.seen.append(bytes(seen))
            if self.tamper is not None:
                with contextlib.suppress(OSError):
                    client.sendall(self.tamper(n, bytes(seen)))


def flip_at(position: int) -> Callable[[int, int, bytes], bytes]:
    """Flip one bit of the byte at ``position`` of the first connection's stream."""

    def mutate(n: int, offset: int, data: bytes) -> bytes:
        if n != 0 or not offset <= position < offset + len(data):
            return data
        out = bytearray(data)
        out[position - offset] ^= 0x01
        return bytes(out)

    return mutate


def _holder(tmp_path: Path, pki: Pki, **flags: Any) -> AgentServer:
    cfg = AgentConfig(
        uds_path=str(tmp_path / "agent.sock"), tcp_host="127.0.0.1", tcp_port=0,
        l1_page_size=4096, **tls_flags(pki.agent("pod-srv")), **{"l1_size": 8 << 20, **flags},
    )  # fmt: skip
    return AgentServer(cfg, pod=PodIdentity(pod_uid="pod-srv", epoch=1)).start()


def _fetch(
    server: AgentServer, pki: Pki, keys: list[bytes], mode: str, streams: int = 1, nbytes: int = NBYTES
) -> tuple[ChunkCache, PeerFetchResult]:
    """One peer fetch of ``keys`` from ``server`` by an agent of our tenant asking for ``mode``, into
    a fresh L1: the cache and the result."""
    cache = ChunkCache(L1Pool(16 << 20, page_bytes=4096, pin=False))
    security: dict[str, Any] = {"peer_data_security": mode}
    cfg = AgentConfig(
        uds_path="", peer_fetch_mode="sync", peer_data_streams=streams,
        **tls_flags(pki.agent("pod-peer")), **security,
    )  # fmt: skip
    fetcher = PeerFetcher(cache, cfg, "pod-peer", PeerMetrics(metrics.get_meter("t")), trace.get_tracer("t"))
    cand = PeerCandidate(
        pod_uid="pod-srv", address=f"127.0.0.1:{server.tcp_port}", l1_chunks=len(keys), total_chunks=len(keys)
    )
    try:
        return cache, fetcher.fetch_from(cand, keys, NS_ID, "L", nbytes, time.monotonic() + 10)
    finally:
        fetcher.close()


def _held(cache: ChunkCache, keys: list[bytes], nbytes: int = NBYTES) -> list[bytes]:
    chunks, _ = cache.acquire_prefix(keys, "L", namespace_id=NS_ID)
    try:
        return [c.buffer.numpy()[:nbytes].tobytes() for c in chunks]
    finally:
        cache.release(chunks)


@contextlib.contextmanager
def on_path(server: AgentServer, **how: Any) -> Iterator[OnPath]:
    """Route the holder's data connections through an :class:`OnPath` attacker: its tickets name
    the attacker's port (as a hijacked route would send the fetcher there)."""
    plane = server.data_plane
    assert plane is not None
    attacker = OnPath(plane.port, **how)
    real, plane.port = plane.port, attacker.port
    try:
        yield attacker
    finally:
        plane.port = real
        attacker.close()


@contextlib.contextmanager
def _ticket(
    server: AgentServer, who: Path, keys: list[bytes], requested: str, streams: int = 1
) -> Iterator[agent_pb2.FetchChunksResponse]:
    """The first FetchChunks answer for ``keys`` asked as ``who`` over mTLS (the ticket lives while
    this is open)."""
    req = agent_pb2.FetchChunksRequest(
        chunk_keys=keys, layout_id="L", namespace_id=NS_ID, data_streams=streams, data_security=requested
    )
    with channel_as(f"127.0.0.1:{server.tcp_port}", who, AGENT_SERVER_NAME) as ch:
        call = agent_pb2_grpc.AgentServiceStub(ch).FetchChunks(req, timeout=10)
        try:
            yield next(call)
        finally:
            call.cancel()


def _refused(sock: socket.socket) -> bool:
    """The data port hung up without sending a byte."""
    with sock:
        try:
            return sock.recv(1) == b""
        except (ConnectionResetError, OSError):
            return True


def _plain(port: int, payload: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(payload)
    return sock


@pytest.fixture
def holder(tmp_path: Path, pki: Pki) -> Iterator[AgentServer]:
    server = _holder(tmp_path, pki)
    yield server
    server.stop(0)


# ---- every mode moves the bytes; the answer names the mode and a fresh key ------------------------


@pytest.mark.parametrize("mode", ["mac", "aead", "tls"])
def test_each_mode_moves_chunks_bit_exact(holder: AgentServer, pki: Pki, mode: str) -> None:
    keys = keys_for(1201, 5)
    contents = _put(holder, keys, NBYTES)
    cache, res = _fetch(holder, pki, keys, mode, streams=2)
    assert (res.chunks, res.error) == (5, ""), res
    assert _held(cache, keys) == contents
    assert holder.data_plane is not None and holder.data_plane.admitted_modes == {mode: 2}


@pytest.mark.parametrize("mode", ["mac", "aead"])
def test_chunks_of_several_pieces_arrive_and_a_flip_in_the_last_is_caught(
    tmp_path: Path, pki: Pki, mode: str
) -> None:
    """Chunks of several pieces, the last one short: 4.5 MiB with mac (a 4 MiB piece MAC'd on the
    helper thread while the next lands, then a short one), 2.5 MiB with aead (three AES-GCM records
    of 1 MiB); a bit flipped in chunk 0's last piece refuses the whole chunk."""
    piece = HASH_PIECE_BYTES if mode == "mac" else PIECE_BYTES
    nbytes = 2 * piece + piece // 2 if mode == "aead" else piece + piece // 8
    server = _holder(tmp_path, pki, l1_size=16 << 20)
    try:
        keys = keys_for(1209, 2)
        contents = _put(server, keys, nbytes)
        cache, res = _fetch(server, pki, keys, mode, streams=2, nbytes=nbytes)
        assert (res.chunks, res.error) == (2, ""), res
        assert _held(cache, keys, nbytes) == contents
        # Chunk 0 on stream 0: a byte of its last piece (after two records' tags with aead).
        last = nbytes - nbytes % piece
        where = last + (2 * TAG_BYTES if mode == "aead" else 0) + 1000
        with on_path(server, mutate=flip_at(where)):
            cache, res = _fetch(server, pki, keys, mode, nbytes=nbytes)
        assert res.error.startswith("checksum: ") and "chunk 0 discarded" in res.error, res
        assert res.chunks == 0 and cache.stats().num_chunks == 0
    finally:
        server.stop(0)


def test_the_answer_names_the_mode_and_a_fresh_key_per_ticket(tmp_path: Path, pki: Pki) -> None:
    server = _holder(tmp_path, pki)  # peer_data_security: mac, the default
    strict = _holder(tmp_path / "strict", pki, peer_data_security="aead")
    try:
        keys = keys_for(1202, 2)
        _put(server, keys, NBYTES)
        _put(strict, keys, NBYTES)
        who = pki.agent("pod-peer")
        answers: dict[str, list[tuple[str, bytes]]] = {}
        for requested in ("mac", "mac", "aead", "tls", ""):
            with _ticket(server, who, keys, requested) as first:
                answers.setdefault(requested, []).append((first.data_security, first.data_key))
        (mode1, key1), (mode2, key2) = answers["mac"]
        assert mode1 == mode2 == "mac" and len(key1) == len(key2) == 32 and key1 != key2
        assert answers["aead"][0][0] == "aead" and len(answers["aead"][0][1]) == 32
        assert answers["tls"] == [("tls", b"")]
        assert answers[""] == [("tls", b"")]  # a fetcher older than the field: TLS, as it expects
        # A server whose own mode is stronger answers with its own.
        with _ticket(strict, who, keys, "mac") as first:
            assert first.data_security == "aead" and len(first.data_key) == 32
        with _ticket(strict, who, keys, "tls") as first:
            assert first.data_security == "tls"
        # ...and the fetcher takes it: a fetch asking for mac from it is served as aead.
        _, res = _fetch(strict, pki, keys, "mac")
        assert (res.chunks, res.error) == (2, "")
        assert strict.data_plane is not None and strict.data_plane.admitted_modes == {"aead": 1}
    finally:
        server.stop(0)
        strict.stop(0)


def test_security_negotiation_rules() -> None:
    assert [ticket_security(req, "mac") for req in ("", "mac", "aead", "tls", "bogus")] == [
        "tls", "mac", "aead", "tls", "mac",
    ]  # fmt: skip
    assert [ticket_security(req, "aead") for req in ("mac", "aead", "tls")] == ["aead", "aead", "tls"]
    assert [ticket_security(req, "tls") for req in ("mac", "aead", "tls")] == ["tls", "aead", "tls"]
    assert accepted_security("", "mac", tls=True) == "tls"
    assert accepted_security("aead", "mac", tls=True) == "aead"
    assert accepted_security("", "tls", tls=False) == "plain"
    with pytest.raises(
        ValueError, match="data_security='mac' is weaker than this agent's peer_data_security='aead'"
    ):
        accepted_security("mac", "aead", tls=True)
    with pytest.raises(ValueError, match="data_security='rot13': expected one of mac, aead, tls"):
        accepted_security("rot13", "mac", tls=True)


# ---- an attacker on the path -------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["mac", "aead", "tls"])
def test_a_byte_flipped_in_flight_is_refused_and_not_committed(
    holder: AgentServer, pki: Pki, mode: str
) -> None:
    keys = keys_for(1203, 3)
    contents = _put(holder, keys, NBYTES)
    # Control: relayed untouched, everything arrives.
    with on_path(holder):
        cache, res = _fetch(holder, pki, keys, mode)
    assert (res.chunks, res.error) == (3, ""), res
    assert _held(cache, keys) == contents
    # One bit of chunk 1 flipped in flight: chunk 0 is kept, chunk 1 (and what follows) never
    # becomes visible. Under tls the position is in chunk 1's TLS records (past the handshake).
    where = FRAME.get(mode, NBYTES) + 5000
    with on_path(holder, mutate=flip_at(where)):
        cache, res = _fetch(holder, pki, keys, mode)
    reason = "unavailable" if mode == "tls" else "checksum"  # TLS: the record fails, the connection ends
    assert res.error.startswith(f"{reason}: "), res
    if mode != "tls":
        assert "chunk 1 discarded" in res.error, res
    assert res.chunks == 1, res
    assert _held(cache, keys) == contents[:1]
    assert cache.stats().num_chunks == 1  # chunk 1 was never committed, chunk 2 not kept after it


@pytest.mark.parametrize("mode", ["mac", "aead"])
def test_chunks_replayed_from_another_ticket_are_refused(holder: AgentServer, pki: Pki, mode: str) -> None:
    keys = keys_for(1204, 3)
    contents = _put(holder, keys, NBYTES)
    # The attacker records what the first ticket carried (a fetch that succeeds: the control), and
    # answers the second ticket's connection with those bytes: the same chunks, MACed or sealed
    # correctly, but under the first ticket's key.
    first_ticket: list[bytes] = []  # what the holder sent for the first ticket

    def replay(n: int, seen: bytes) -> bytes:
        if n == 0:
            first_ticket.append(seen)
            return seen
        return first_ticket[0]

    with on_path(holder, tamper=replay) as attacker:
        cache, res = _fetch(holder, pki, keys, mode)
        assert (res.chunks, res.error) == (3, ""), res
        assert _held(cache, keys) == contents
        cache, res = _fetch(holder, pki, keys, mode)
    assert len(attacker.seen) == 2 and attacker.seen[0] != attacker.seen[1]  # same bytes, new key
    assert res.error.startswith("checksum: ") and "chunk 0 discarded" in res.error, res
    assert res.chunks == 0 and cache.stats().num_chunks == 0


@pytest.mark.parametrize("mode", ["mac", "aead"])
def test_chunks_swapped_within_a_ticket_are_refused(holder: AgentServer, pki: Pki, mode: str) -> None:
    keys = keys_for(1205, 3)
    contents = _put(holder, keys, NBYTES)
    assert contents[0] != contents[1]
    frame = FRAME[mode]

    def swap(n: int, seen: bytes) -> bytes:  # chunk 1's frame first, then chunk 0's: each valid alone
        return seen[frame : 2 * frame] + seen[:frame] + seen[2 * frame :]

    with on_path(holder, tamper=swap):
        cache, res = _fetch(holder, pki, keys, mode)
    assert res.error.startswith("checksum: ") and "chunk 0 discarded" in res.error, res
    assert res.chunks == 0 and cache.stats().num_chunks == 0


@pytest.mark.parametrize("mode", ["mac", "aead"])
def test_a_chunk_forged_under_another_key_is_refused(holder: AgentServer, pki: Pki, mode: str) -> None:
    """The attack a checksum does not stop: replace a chunk's bytes and compute a fresh check value
    for them -- here a MAC (or AES-GCM seal) under a key of the attacker's, in the right format,
    bound to the right index."""
    keys = keys_for(1206, 3)
    contents = _put(holder, keys, NBYTES)
    forged = bytes(NBYTES)  # the attacker's KV for chunk 1
    theirs = TicketKeys(secrets.token_bytes(32))
    frame = FRAME[mode]

    def forge(n: int, seen: bytes) -> bytes:
        if mode == "mac":
            mac = chunk_mac(theirs, 1, NBYTES)
            mac.update(forged)
            fake = forged + mac.digest()
        else:
            fake = AESGCM(theirs.aead).encrypt(aead_nonce(1, 0), forged, aead_aad(1, NBYTES, 0, True))
        assert len(fake) == frame
        return seen[:frame] + fake + seen[2 * frame :]

    with on_path(holder, tamper=forge):
        cache, res = _fetch(holder, pki, keys, mode)
    assert res.error.startswith("checksum: ") and "chunk 1 discarded" in res.error, res
    assert res.chunks == 1 and _held(cache, keys) == contents[:1]
    assert cache.stats().num_chunks == 1


# ---- the hello: the ticket alone opens nothing ----------------------------------------------------


@pytest.mark.parametrize("mode", ["mac", "aead"])
def test_a_hello_without_the_tickets_key_gets_nothing(holder: AgentServer, pki: Pki, mode: str) -> None:
    keys = keys_for(1207, 2)
    contents = _put(holder, keys, NBYTES)
    plane = holder.data_plane
    assert plane is not None
    magic = MAGIC_MAC if mode == "mac" else MAGIC_AEAD
    with _ticket(holder, pki.agent("pod-x"), keys, mode, streams=2) as first:
        ticket, keys_x = first.data_ticket, TicketKeys(first.data_key)
        wrong = TicketKeys(secrets.token_bytes(32))
        hello = HELLO.pack(magic, ticket, 0)
        # Whoever saw the ticket (it crosses the data port in the clear) but not the key, e.g.
        # another identity: a MAC under another key, none, or the plaintext hello of tls tickets.
        assert _refused(_plain(plane.port, hello + hello_tag(wrong, magic, ticket, 0)))
        assert _refused(_plain(plane.port, hello + bytes(32)))
        assert _refused(_plain(plane.port, HELLO.pack(MAGIC, ticket, 0)))
        # The key's MAC of stream 1's hello does not open stream 0, nor does the other mode's magic.
        assert _refused(_plain(plane.port, hello + hello_tag(keys_x, magic, ticket, 1)))
        other = MAGIC_AEAD if mode == "mac" else MAGIC_MAC
        assert _refused(
            _plain(plane.port, HELLO.pack(other, ticket, 0) + hello_tag(keys_x, other, ticket, 0))
        )
        # Over TLS as pod-y (a valid agent certificate), with the tls hello: not this ticket's mode.
        raw = socket.create_connection(("127.0.0.1", plane.port), timeout=10)
        files = pki.agent("pod-y")
        tls = client_context(TlsFiles(str(files / "tls.crt"), str(files / "tls.key"), str(files / "ca.crt")))
        with tls.wrap_socket(raw, server_hostname=AGENT_SERVER_NAME) as s:
            s.sendall(HELLO.pack(MAGIC, ticket, 0))
            assert _refused(s)
        assert plane.admitted == 0 and plane.refused == 6
        # Control: the holder of the key is served, and the chunk verifies under it.
        with _plain(plane.port, hello + hello_tag(keys_x, magic, ticket, 0)) as sock:
            if mode == "mac":
                data = bytearray(NBYTES + MAC_BYTES)
                recv_exact_into(sock, memoryview(data))
                mac = chunk_mac(keys_x, 0, NBYTES)
                mac.update(bytes(data[:NBYTES]))
                assert mac.digest() == bytes(data[NBYTES:]) and bytes(data[:NBYTES]) == contents[0]
            else:
                data = bytearray(NBYTES + TAG_BYTES)
                recv_exact_into(sock, memoryview(data))
                plain = AESGCM(keys_x.aead).decrypt(
                    aead_nonce(0, 0), bytes(data), aead_aad(0, NBYTES, 0, True)
                )
                assert plain == contents[0] and bytes(data[:NBYTES]) != contents[0]  # encrypted on the wire
        assert plane.admitted == 1


@pytest.mark.parametrize("mode", ["mac", "aead"])
def test_naming_a_seen_ticket_without_its_key_closes_nothing(
    holder: AgentServer, pki: Pki, mode: str
) -> None:
    """The ticket's secret crosses the network in mac and aead hellos. Whoever saw it may open a
    connection per stream, send the hello and hang up (or stall) before the MAC: that must not end
    the ticket's streams on its real fetcher, who is then served in full."""
    keys = keys_for(1213, 2)
    contents = _put(holder, keys, NBYTES)
    plane = holder.data_plane
    assert plane is not None
    magic = MAGIC_MAC if mode == "mac" else MAGIC_AEAD
    with _ticket(holder, pki.agent("pod-x"), keys, mode, streams=2) as first:
        ticket, keys_x = first.data_ticket, TicketKeys(first.data_key)
        for stream in (0, 1, 0, 1):
            _plain(plane.port, HELLO.pack(magic, ticket, stream)).close()  # hung up before the MAC
        wait_for("the hang-ups handled", lambda: plane.unauthenticated == 0, 10)
        got = []
        for stream in (0, 1):
            with _plain(
                plane.port, HELLO.pack(magic, ticket, stream) + hello_tag(keys_x, magic, ticket, stream)
            ) as sock:
                data = bytearray(NBYTES + (MAC_BYTES if mode == "mac" else TAG_BYTES))
                recv_exact_into(sock, memoryview(data))
                got.append(bytes(data))
        assert plane.admitted == 2
        if mode == "mac":
            assert [g[:NBYTES] for g in got] == contents
        else:
            assert [
                AESGCM(keys_x.aead).decrypt(aead_nonce(i, 0), g, aead_aad(i, NBYTES, 0, True))
                for i, g in enumerate(got)
            ] == contents


# ---- the setting -------------------------------------------------------------------------------------


def test_peer_data_security_setting() -> None:
    assert AgentConfig(uds_path="x").peer_data_security == DEFAULT_SECURITY == "mac"
    assert typing.get_args(typing.get_type_hints(AgentConfig)["peer_data_security"]) == SECURITY_MODES
    with pytest.raises(ValueError, match=r"peer_data_security='none': expected mac, aead or tls"):
        AgentConfig(uds_path="x", peer_data_security="none")  # type: ignore[arg-type]
    from kvgrid.common.config import load_config

    with pytest.raises(
        ConfigError, match=r"'peer_data_security' has invalid value 'plaintext'.*'mac', 'aead', 'tls'"
    ):
        load_config(AgentConfig, env={"KVGRID_PEER_DATA_SECURITY": "plaintext"})
    with pytest.raises(ValueError, match=r"security='rot13': expected one of mac, aead, tls"):
        DataPlaneServer("127.0.0.1", 0, tls=None, security="rot13")


def test_a_grpc_ticket_message_without_a_key_is_a_protocol_error(holder: AgentServer, pki: Pki) -> None:
    """A ticket whose answer lacks the key its mode needs is refused before any connection."""
    keys = keys_for(1208, 1)
    _put(holder, keys, NBYTES)
    assert holder.data_plane is not None
    with pytest.raises(ValueError, match="key of 0 bytes: expected 32"):
        TicketKeys(b"")
    # The fetcher side of an answer naming mac without a key.
    cache = ChunkCache(L1Pool(8 << 20, page_bytes=4096, pin=False))
    cfg = AgentConfig(uds_path="", peer_fetch_mode="sync", **tls_flags(pki.agent("pod-peer")))
    fetcher = PeerFetcher(cache, cfg, "pod-peer", PeerMetrics(metrics.get_meter("t")), trace.get_tracer("t"))
    try:
        msg = agent_pb2.FetchChunksResponse(
            num_chunks=1, chunk_bytes=NBYTES, data_ticket=bytes(32), data_port=1, data_security="mac"
        )
        cand = PeerCandidate(pod_uid="pod-srv", address="127.0.0.1:1", l1_chunks=1, total_chunks=1)
        from kvgrid.agent.peers.errors import PeerError
        from kvgrid.agent.peers.socket_stream import receive_ticket

        with pytest.raises(
            PeerError, match=r"data plane ticket \(mac\) with a data_key of 0 bytes; expected 32"
        ):
            receive_ticket(
                cand.address,
                msg,
                1,
                NBYTES,
                {},
                lambda i, c: None,
                time.monotonic() + 5,
                data_streams=fetcher.data_streams,
                own_security=fetcher.data_security,
                tls_files=cfg.tls,
            )
    finally:
        fetcher.close()


def test_a_missing_package_is_named_at_start_and_never_weakens_a_ticket(
    pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    """blake3 and cryptography come with the agent extra; an install without them is told so when
    the agent starts, and a holder that cannot serve the asked-for mode serves tls, never weaker."""
    d = pki.agent("pod-srv")
    files = TlsFiles(str(d / "tls.crt"), str(d / "tls.key"), str(d / "ca.crt"))
    monkeypatch.setitem(sys.modules, "cryptography.hazmat.primitives.ciphers.aead", None)
    with pytest.raises(RuntimeError, match=r"peer_data_security=aead needs the cryptography package"):
        DataPlaneServer("127.0.0.1", 0, tls=files, security="aead")
    plane = DataPlaneServer("127.0.0.1", 0, tls=files, security="mac")
    try:
        cache = ChunkCache(L1Pool(1 << 20, page_bytes=4096, pin=False))
        assert plane.issue(cache, [], 1, "x", requested="aead").security == "tls"
        assert plane.issue(cache, [], 1, "x", requested="mac").security == "mac"
    finally:
        plane.stop()
    monkeypatch.setitem(sys.modules, "blake3", None)
    with pytest.raises(RuntimeError, match=r"mac and aead modes need the blake3 package"):
        DataPlaneServer("127.0.0.1", 0, tls=files, security="mac")
