"""The gRPC receive path: a peer's chunks as ``FetchChunks`` parts on the control stream itself
(``peer_data_plane=grpc`` on either side, or a data port that could not be reached).

Invariants: every part is checked against the chunk index, offset and size expected next (else
``protocol``); a chunk is verified against the checksum sent with its first part once its last
byte arrived, and one that does not match (or came without one) is refused (``checksum``), never
committed; a failure after some chunks raises :class:`~kvgrid.agent.peers.errors.PartialFetch`
carrying how many leading chunks arrived intact.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

import grpc
import numpy as np

from kvgrid.agent.peers.errors import PartialFetch, PeerError, peer_error
from kvgrid.api.v1 import agent_pb2
from kvgrid.common.checksum import ChecksumMismatch, verify_checksum

__all__ = ["receive_parts"]


def receive_parts(
    first: agent_pb2.FetchChunksResponse,
    call: Iterable[agent_pb2.FetchChunksResponse],
    limit: int,
    bytes_per_chunk: int,
    targets: dict[int, np.ndarray],
    verified: Callable[[int, bytes], None],
) -> int:
    """Receive the first ``limit`` chunks of the stream (``first``, then the rest of ``call``) into
    ``targets`` (chunk index -> bytes; a chunk not in it is read past: another store holds it) and
    return how many leading chunks arrived intact, calling ``verified(index, checksum)`` for each.
    A failure after some chunks raises :class:`PartialFetch` with their count."""
    filled = 0  # leading chunks received completely
    written = 0  # bytes of chunk ``filled`` received so far
    expected = b""  # checksum of the chunk being received
    try:
        for msg in itertools.chain((first,), call):
            if msg.chunk_index != filled or msg.offset != written:
                raise PeerError(
                    "protocol",
                    f"got chunk {msg.chunk_index} offset {msg.offset}; expected chunk {filled} offset "
                    f"{written}",
                )
            if msg.chunk_bytes != bytes_per_chunk or written + len(msg.data) > bytes_per_chunk:
                raise PeerError(
                    "protocol",
                    f"chunk {filled}: {msg.chunk_bytes} bytes (part of {len(msg.data)} at {written}); "
                    f"expected {bytes_per_chunk}",
                )
            if written == 0:
                expected = msg.checksum  # sent with the chunk's first part
            dst = targets.get(filled)
            if dst is not None:  # None: another store committed the key meanwhile
                dst[written : written + len(msg.data)] = np.frombuffer(msg.data, dtype=np.uint8)
            written += len(msg.data)
            if written == bytes_per_chunk:
                if dst is not None:
                    # Integrity: bytes that do not match the checksum recorded at store (or came
                    # without one) are never committed, so never reach a lookup or the engine.
                    try:
                        verify_checksum(dst, expected)
                    except ChecksumMismatch as e:
                        raise PeerError("checksum", f"chunk {filled} discarded: {e}") from None
                    verified(filled, expected)
                filled, written = filled + 1, 0
                if filled == limit:
                    break
    except PeerError as e:
        raise PartialFetch(filled, e) from None
    except grpc.RpcError as e:
        raise PartialFetch(filled, peer_error(e)) from None
    return filled
