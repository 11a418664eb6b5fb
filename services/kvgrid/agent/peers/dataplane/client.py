"""The fetch side of the data plane: :func:`fetch_streams` opens a ticket's connections to the
holder's data port and receives its chunks straight into their reserved L1 buffers.

Stream ``k`` of ``S`` sends its hello and receives chunks ``k, k+S, k+2S, ...``, each verified in
the ticket's framing (:mod:`~kvgrid.agent.peers.dataplane.checksummed`,
:mod:`~kvgrid.agent.peers.dataplane.mac`, :mod:`~kvgrid.agent.peers.dataplane.aead`). Invariants:
only a chunk that arrived complete and verified is recorded in :class:`Received`; the first failure
on any stream (a hang-up, a chunk that does not verify, the deadline) stops every stream, and is
the one reported; a data port that cannot be reached fails within :data:`CONNECT_TIMEOUT_S`, not
the whole deadline.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from kvgrid.agent.peers.dataplane.aead import AeadReceiver
from kvgrid.agent.peers.dataplane.checksummed import ChecksummedReceiver
from kvgrid.agent.peers.dataplane.keys import TicketKeys, hello_tag
from kvgrid.agent.peers.dataplane.mac import MacReceiver
from kvgrid.agent.peers.dataplane.protocol import (
    HELLO,
    MAGIC,
    MAGIC_AEAD,
    MAGIC_MAC,
    StreamFailure,
    stream_indices,
)
from kvgrid.agent.peers.dataplane.sockets import connect, receive_deadline

__all__ = ["CONNECT_TIMEOUT_S", "Received", "fetch_streams"]

CONNECT_TIMEOUT_S = 1.0


class Received:
    """What the data plane delivered: verified chunk indices with their checksums, and the first
    failure (None when every stream finished)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.checksums: dict[int, bytes] = {}
        """Verified chunk index -> its XXH3-128 checksum (plain, tls) or b"" (mac, aead: verified by
        MAC or tags; the checksum is computed when first needed)."""
        self.failure: StreamFailure | None = None

    def leading(self) -> int:
        """How many leading chunks arrived intact (the ones a Lookup may commit)."""
        n = 0
        while n in self.checksums:
            n += 1
        return n


def fetch_streams(
    host: str,
    port: int,
    ticket: bytes,
    *,
    streams: int,
    num_chunks: int,
    chunk_bytes: int,
    targets: dict[int, np.ndarray],
    deadline: float,
    tls: ssl.SSLContext | None,
    security: str = "",
    key: bytes = b"",
) -> Received:
    """Receive ``num_chunks`` chunks over ``streams`` connections, each chunk straight into
    ``targets[i]`` (a chunk without a target, already held here, is read and dropped) and verified
    as the ticket's ``security`` says (default: ``tls`` with a ``tls`` context, else ``plain``):
    its XXH3-128 taken while it lands and compared with the checksum after it (plain, tls), its
    keyed BLAKE3 under ``key`` (mac), or every record decrypted and its tag checked (aead). Stops
    every stream at the first failure or at ``deadline`` (``time.monotonic()``)."""
    security = security or ("tls" if tls is not None else "plain")
    if security == "tls" and tls is None:
        raise ValueError("a tls ticket needs a TLS client context")
    keys = TicketKeys(key) if security in ("mac", "aead") else None
    if security in ("mac", "aead"):
        tls = None  # plaintext TCP: the key protects the bytes
    conns = _Streams(
        host=host,
        port=port,
        ticket=ticket,
        streams=streams,
        num_chunks=num_chunks,
        chunk_bytes=chunk_bytes,
        targets=targets,
        deadline=deadline,
        tls=tls,
        security=security,
        keys=keys,
    )
    threads = [
        threading.Thread(target=conns.run, args=(k,), name="kvgrid-dataplane-fetch", daemon=True)
        for k in range(1, streams)
    ]
    for t in threads:
        t.start()
    conns.run(0)
    for t in threads:
        t.join()
    return conns.got


@dataclass
class _Streams:
    """One :func:`fetch_streams` call's connections: what they received, the flag that stops them
    all, and their sockets (shut down on the first failure, which wakes streams blocked in recv)."""

    host: str
    port: int
    ticket: bytes
    streams: int
    num_chunks: int
    chunk_bytes: int
    targets: dict[int, np.ndarray]
    deadline: float
    tls: ssl.SSLContext | None
    security: str
    keys: TicketKeys | None
    got: Received = field(default_factory=Received)
    stop: threading.Event = field(default_factory=threading.Event)
    socks: list[socket.socket] = field(default_factory=list)

    def fail(self, e: StreamFailure) -> None:
        got = self.got
        with got.lock:
            if got.failure is None:
                got.failure = e
        self.stop.set()
        with got.lock:
            for s in self.socks:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)  # wakes streams blocked in recv

    def run(self, stream: int) -> None:
        host, port = self.host, self.port
        sock = self._connect()
        if sock is None:
            return
        with self.got.lock:
            self.socks.append(sock)
        receiver = _receiver(self.security, self.keys)
        try:
            self._hello(sock, stream)
            self._receive(sock, receiver, stream)
        except StreamFailure as e:
            self.fail(e)
        except TimeoutError:
            self.fail(StreamFailure("deadline", f"data plane {host}:{port}: deadline passed mid-chunk"))
        except (OSError, ssl.SSLError, ConnectionError) as e:
            if not self.stop.is_set():
                self.fail(StreamFailure("unavailable", f"data plane {host}:{port}, stream {stream}: {e}"))
        finally:
            receiver.close()
            sock.close()

    def _connect(self) -> socket.socket | None:
        """A connection to the data port, or None after recording why there is none."""
        host, port = self.host, self.port
        try:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise StreamFailure("deadline", "deadline passed before the data connection")
            # A reachable port answers in milliseconds; a filtered one would eat the whole deadline.
            return connect(host, port, min(left, CONNECT_TIMEOUT_S), self.tls)
        except StreamFailure as e:
            self.fail(e)
            return None
        except (OSError, ssl.SSLError) as e:
            self.fail(StreamFailure("unreachable", f"data plane {host}:{port}: {e}"))
            return None

    def _hello(self, sock: socket.socket, stream: int) -> None:
        keys, ticket = self.keys, self.ticket
        if keys is None:
            sock.sendall(HELLO.pack(MAGIC, ticket, stream))
        else:
            magic = MAGIC_MAC if self.security == "mac" else MAGIC_AEAD
            sock.sendall(HELLO.pack(magic, ticket, stream) + hello_tag(keys, magic, ticket, stream))

    def _receive(self, sock: socket.socket, receiver: _ChunkReceiver, stream: int) -> None:
        """This stream's chunks, each into its target (a chunk without one, already held here, into a
        scratch buffer that is dropped); stops early once another stream failed."""
        scratch: bytearray | None = None
        for index in stream_indices(stream, self.streams, self.num_chunks):
            if self.stop.is_set():
                return
            receive_deadline(sock, self.deadline - time.monotonic())
            dst = self.targets.get(index)
            if dst is None:
                scratch = scratch if scratch is not None else bytearray(self.chunk_bytes)
                view = memoryview(scratch)
            else:
                view = dst.data.cast("B")
            checksum = receiver.receive(sock, view, index)
            with self.got.lock:
                self.got.checksums[index] = checksum


class _ChunkReceiver(Protocol):
    """One data connection's chunk reader in its ticket's framing: receives a chunk into its view
    and verifies it; returns the checksum to record (b"" for mac and aead) or raises
    :class:`StreamFailure` ("checksum") for a chunk that must not be committed."""

    def receive(self, sock: socket.socket, view: memoryview, index: int) -> bytes: ...

    def close(self) -> None: ...


def _receiver(security: str, keys: TicketKeys | None) -> _ChunkReceiver:
    """The reader for a ticket served in ``security`` (``keys``: its subkeys, for mac and aead)."""
    if security == "mac":
        assert keys is not None
        return MacReceiver(keys)
    if security == "aead":
        assert keys is not None
        return AeadReceiver(keys)
    return ChecksummedReceiver()
