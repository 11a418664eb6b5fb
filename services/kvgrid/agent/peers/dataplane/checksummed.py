"""The ``plain`` and ``tls`` tickets' framing: each chunk is its bytes followed by their 16-byte
XXH3-128 checksum (``chunk_checksum``'s digest).

Both ends hash each piece of :data:`~kvgrid.agent.peers.dataplane.protocol.PIECE_BYTES` while it
is still in the CPU cache, which is why the checksum trails the bytes; the sender computes a
chunk's checksum this way only the first time it is needed (as on the gRPC path), then reuses it.
Invariant: a chunk whose bytes do not match the checksum after them is refused
(:class:`~kvgrid.agent.peers.dataplane.protocol.StreamFailure` ``"checksum"``), never committed.
This proves the bytes are the ones the holder stored, not that the holder is honest (docs/agent.md,
"Chunk integrity").
"""

from __future__ import annotations

import socket

import xxhash

from kvgrid.agent.l1 import Chunk
from kvgrid.agent.peers.dataplane.protocol import PIECE_BYTES, StreamFailure
from kvgrid.agent.peers.dataplane.sockets import recv_exact_into
from kvgrid.common.checksum import CHECKSUM_BYTES, CHECKSUM_NAME

__all__ = ["ChecksummedReceiver", "send_checksummed"]


def send_checksummed(conn: socket.socket, data: memoryview, chunk: Chunk) -> None:
    """plain, tls: the bytes in pieces (the idle timeout bounds each piece, not the whole chunk),
    then the XXH3-128 checksum, computed when first needed (as on the gRPC path) piece by piece as
    sent."""
    hasher = None if chunk.checksum else xxhash.xxh3_128()
    for off in range(0, len(data), PIECE_BYTES):
        piece = data[off : off + PIECE_BYTES]
        if hasher is not None:
            hasher.update(piece)
        conn.sendall(piece)
    if hasher is not None:
        chunk.checksum = hasher.digest()
    conn.sendall(chunk.checksum)


class ChecksummedReceiver:
    """plain, tls: receives a chunk into its view while hashing it, then the checksum after it;
    returns that checksum, or raises :class:`StreamFailure` ("checksum") when they differ."""

    def __init__(self) -> None:
        self._trailer = bytearray(CHECKSUM_BYTES)

    def close(self) -> None:
        """Nothing to release (no helper thread)."""

    def receive(self, sock: socket.socket, view: memoryview, index: int) -> bytes:
        hasher = xxhash.xxh3_128()
        recv_exact_into(sock, view, hasher)
        checksum = self._trailer
        recv_exact_into(sock, memoryview(checksum))
        if hasher.digest() != checksum:
            raise StreamFailure(
                "checksum",
                f"chunk {index} discarded: {CHECKSUM_NAME} {hasher.hexdigest()} of the bytes != "
                f"{checksum.hex()} sent with them",
            )
        return bytes(checksum)
