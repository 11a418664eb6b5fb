"""The ``mac`` tickets' framing (plaintext TCP): each chunk is its bytes followed by a 32-byte keyed
BLAKE3 of (chunk index, chunk size, bytes) under the ticket's MAC subkey
(:func:`~kvgrid.agent.peers.dataplane.keys.chunk_mac`).

Each piece is hashed on a helper thread while the connection moves the next one (BLAKE3 releases
the GIL), so hashing overlaps the copy. Invariants: a chunk changed in flight, swapped within a
ticket or replayed from another ticket fails its MAC and is refused
(:class:`~kvgrid.agent.peers.dataplane.protocol.StreamFailure` ``"checksum"``), never committed; the
sender's helper is done reading a chunk before the chunk's reference is dropped.
"""

from __future__ import annotations

import hmac
import socket

from kvgrid.agent.peers.dataplane.keys import TicketKeys, chunk_mac
from kvgrid.agent.peers.dataplane.protocol import MAC_BYTES, StreamFailure
from kvgrid.agent.peers.dataplane.sockets import Behind, recv_exact_into
from kvgrid.agent.peers.dataplane.tickets import Ticket

__all__ = ["HASH_PIECE_BYTES", "MacReceiver", "send_mac"]

HASH_PIECE_BYTES = 4 << 20
"""Bytes hashed per helper step, on either end (the MAC covers the whole chunk, so this is local:
no part of the wire). Each step costs two thread hand-offs under the GIL; 4 MiB pieces moved 0.72-0.78
of a raw socket copy against 0.67-0.68 with 1 MiB on the 16-core H100 host (docs/benchmarks.md)."""


def send_mac(conn: socket.socket, data: memoryview, ticket: Ticket, index: int, behind: Behind) -> None:
    """mac: the bytes in pieces, each hashed on the helper thread while it is sent, then the MAC."""
    assert ticket.keys is not None
    mac = chunk_mac(ticket.keys, index, len(data))
    for off in range(0, len(data), HASH_PIECE_BYTES):
        piece = data[off : off + HASH_PIECE_BYTES]
        behind.feed(mac.update, piece)
        conn.sendall(piece)
    behind.wait()
    conn.sendall(mac.digest())


class MacReceiver:
    """mac: receives a chunk into its view piece by piece, each hashed on the helper thread while
    the next lands, then checks the MAC after it; returns b"" (the checksum is computed when first
    needed), or raises :class:`StreamFailure` ("checksum") when the MAC does not verify."""

    def __init__(self, keys: TicketKeys) -> None:
        self.keys = keys
        self._trailer = bytearray(MAC_BYTES)
        self._behind = Behind()

    def close(self) -> None:
        self._behind.close()

    def receive(self, sock: socket.socket, view: memoryview, index: int) -> bytes:
        mac = chunk_mac(self.keys, index, len(view))
        try:
            for off in range(0, len(view), HASH_PIECE_BYTES):
                piece = view[off : off + HASH_PIECE_BYTES]
                recv_exact_into(sock, piece)
                self._behind.feed(mac.update, piece)  # hashed while the next piece lands
        finally:
            self._behind.wait()
        recv_exact_into(sock, memoryview(self._trailer))
        if not hmac.compare_digest(mac.digest(), self._trailer):
            raise StreamFailure(
                "checksum",
                f"chunk {index} discarded: its keyed BLAKE3 MAC does not verify under the ticket's key "
                "(bytes changed in flight, a chunk of another position or ticket, or another key)",
            )
        return b""
