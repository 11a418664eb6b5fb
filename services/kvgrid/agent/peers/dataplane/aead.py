"""The ``aead`` tickets' framing (plaintext TCP, encrypted): each piece of a chunk is one
AES-256-GCM record (ciphertext, 16-byte tag) under the ticket's AEAD subkey; nonce (chunk index,
record index), associated data (chunk index, chunk size, record index, last flag)
(:func:`~kvgrid.agent.peers.dataplane.keys.aead_nonce`, :func:`~kvgrid.agent.peers.dataplane.keys.aead_aad`).

Each end seals or opens one record while the helper thread moves the other through the socket
(``cryptography`` holds the GIL while it seals or opens; the socket calls do not); records are
decrypted straight into the chunk. Invariants: a byte changed, a record reordered, truncated or
replayed from another chunk or ticket fails its tag and the chunk is refused
(:class:`~kvgrid.agent.peers.dataplane.protocol.StreamFailure` ``"checksum"``), never committed; no
receive into a scratch buffer outlives its chunk, and a chunk is out before its reference is dropped.
"""

from __future__ import annotations

import socket

from kvgrid.agent.peers.dataplane.keys import TicketKeys, aead_aad, aead_nonce, aesgcm
from kvgrid.agent.peers.dataplane.protocol import PIECE_BYTES, TAG_BYTES, StreamFailure
from kvgrid.agent.peers.dataplane.sockets import Behind, recv_exact_into
from kvgrid.agent.peers.dataplane.tickets import Ticket

__all__ = ["AeadReceiver", "AeadSender"]


class AeadSender:
    """aead: one AES-256-GCM record per piece, sealed into one of this connection's two scratch
    buffers while the helper thread sends the record sealed before (``cryptography`` holds the GIL
    while it seals; ``sendall`` does not)."""

    def __init__(self, ticket: Ticket, behind: Behind) -> None:
        assert ticket.keys is not None
        self._aes = aesgcm(ticket.keys.aead)
        self._scratch = [memoryview(bytearray(PIECE_BYTES + TAG_BYTES)) for _ in range(2)]
        self._behind = behind
        self._next = 0

    def send(self, conn: socket.socket, data: memoryview, index: int) -> None:
        size = len(data)
        for record, off in enumerate(range(0, size, PIECE_BYTES)):
            piece = data[off : off + PIECE_BYTES]
            # The other buffer's record may still be going out; this one's went out before it.
            out = self._scratch[self._next][: len(piece) + TAG_BYTES]
            self._next ^= 1
            last = off + len(piece) == size
            self._aes.encrypt_into(aead_nonce(index, record), piece, aead_aad(index, size, record, last), out)
            self._behind.feed(conn.sendall, out)
        self._behind.wait()  # the chunk is out before its reference is dropped and the next is taken


class AeadReceiver:
    """aead: opens a chunk's records into its view, each received on the helper thread while the
    one before is opened; returns b"" (the checksum is computed when first needed), or raises
    :class:`StreamFailure` ("checksum") for a record whose tag does not verify."""

    def __init__(self, keys: TicketKeys) -> None:
        self._behind = Behind()
        self._aes = aesgcm(keys.aead)
        self._records = [memoryview(bytearray(PIECE_BYTES + TAG_BYTES)) for _ in range(2)]

    def close(self) -> None:
        self._behind.close()

    def receive(self, sock: socket.socket, view: memoryview, index: int) -> bytes:
        """Each record is opened into the chunk while the helper thread receives the next one into
        the other scratch buffer (``cryptography`` holds the GIL while it opens; ``recv_into`` does
        not)."""
        from cryptography.exceptions import InvalidTag

        size = len(view)
        offsets = range(0, size, PIECE_BYTES)

        def sealed(record: int) -> memoryview:
            return self._records[record % 2][: min(PIECE_BYTES, size - offsets[record]) + TAG_BYTES]

        try:
            self._behind.feed(recv_exact_into, sock, sealed(0))
            for record, off in enumerate(offsets):
                self._behind.wait()  # record ``record`` is in
                if record + 1 < len(offsets):
                    self._behind.feed(recv_exact_into, sock, sealed(record + 1))
                n = min(PIECE_BYTES, size - off)
                aad = aead_aad(index, size, record, off + n == size)
                try:
                    self._aes.decrypt_into(
                        aead_nonce(index, record), sealed(record), aad, view[off : off + n]
                    )
                except InvalidTag:
                    raise StreamFailure(
                        "checksum",
                        f"chunk {index} discarded: AES-GCM record {record} does not authenticate under the "
                        "ticket's key (bytes changed in flight, a record of another position or ticket, or "
                        "another key)",
                    ) from None
        finally:
            self._behind.close_step()  # no receive into a scratch buffer outlives this chunk
        return b""
