"""Chunk integrity: a checksum of a chunk's bytes, recorded when the bytes are final, carried with
the chunk on the wire and checked before bytes from anywhere but this agent's own committed L1 are
made visible.

The checksum is XXH3-128 (``xxhash``), chosen by measurement (``kvgrid bench checksum``,
``docs/benchmarks.md``): about as fast as copying the bytes once, 25-70x BLAKE2b. It is not
collision resistant. It proves the bytes are the ones the sender stored (corruption in its memory,
on the wire, or bytes swapped without recomputing the checksum); a peer that forges bytes *and*
their checksum passes any hash it sends itself: that is for peer authentication (mTLS). A checksum
ever taken from a channel the peer does not control needs a collision-resistant hash instead
(``docs/agent.md``, "Chunk integrity").
The digest is 16 bytes, big-endian as ``xxh3_128_digest`` writes it; an empty or wrong-sized
checksum never verifies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import xxhash

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

__all__ = ["CHECKSUM_BYTES", "CHECKSUM_NAME", "ChecksumMismatch", "chunk_checksum", "verify_checksum"]

CHECKSUM_NAME = "xxh3-128"
CHECKSUM_BYTES = 16


class ChecksumMismatch(ValueError):
    """A chunk's bytes do not match the checksum that came with them (or none came)."""


def chunk_checksum(data: ReadableBuffer | np.ndarray) -> bytes:
    """XXH3-128 of ``data`` (any contiguous buffer: bytes, a numpy array, a CPU tensor's ``numpy()``)."""
    if isinstance(data, np.ndarray):
        data = data.data  # a memoryview of the same bytes, no copy
    return xxhash.xxh3_128_digest(data)


def verify_checksum(data: ReadableBuffer | np.ndarray, expected: bytes) -> None:
    """Raise :class:`ChecksumMismatch` unless ``expected`` is the checksum of ``data``."""
    if len(expected) != CHECKSUM_BYTES:
        raise ChecksumMismatch(
            f"checksum of {len(expected)} bytes: expected a {CHECKSUM_BYTES}-byte {CHECKSUM_NAME}"
        )
    got = chunk_checksum(data)
    if got != expected:
        raise ChecksumMismatch(f"{CHECKSUM_NAME} {got.hex()} of the bytes != {expected.hex()} sent with them")
