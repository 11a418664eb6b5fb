"""What every lower tier shares: the record format of a chunk outside L1 and the blob-store interface.

A chunk outside L1 is one **record**: a header page (``HEADER_BYTES``, so the payload starts
aligned in a file) followed by the chunk's bytes. The header names the namespace, key and layout
the bytes belong to, their size and their XXH3-128 checksum (``kvgrid.common.checksum``).

Invariants:

- A record is read back only through :func:`decode_header` and a checksum check of the payload
  (``Tier.read_into``): a torn, truncated or altered record, or one filed under another
  namespace/key (a swapped file), is refused and never reaches L1.
- Record names are ``<namespace_id>/<key hex>``: one prefix per namespace, so a tenant's reads
  can only ever name its own records; the header check makes that hold even if a file or object
  is moved by hand.
- A :class:`BlobStore` only moves bytes; capacity, eviction order and checksums are the tier's job.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from typing import Protocol

import msgspec

from kvgrid.common.checksum import CHECKSUM_BYTES

__all__ = [
    "HEADER_BYTES",
    "BlobMissing",
    "BlobStore",
    "CorruptRecord",
    "FoundBlob",
    "RecordHeader",
    "decode_header",
    "encode_header",
    "parse_record_name",
    "record_name",
]

HEADER_BYTES = 4096
"""Size of a record's header page; the payload follows at this offset (page aligned in a file)."""
_MAGIC = b"KVGRIDT1"
_PREFIX = struct.Struct("<8sI")  # magic, length of the msgpack header that follows
_NAMESPACE_RE = re.compile(r"[0-9A-Za-z_.-]{1,128}")


class BlobMissing(LookupError):
    """The store holds no blob of that name (deleted, never written, or lost)."""


class CorruptRecord(ValueError):
    """A record whose header or payload is not what was written (torn, altered or misfiled)."""


class RecordHeader(msgspec.Struct, frozen=True, kw_only=True):
    namespace_id: str
    key: bytes
    layout_id: str
    nbytes: int
    checksum: bytes


def record_name(namespace_id: str, key: bytes) -> str:
    """``<namespace_id>/<key hex>``: the path (disk) or object name suffix (S3) of a record."""
    if not _NAMESPACE_RE.fullmatch(namespace_id):
        raise ValueError(f"namespace_id={namespace_id!r}: expected 1-128 characters of [0-9A-Za-z_.-]")
    return f"{namespace_id}/{key.hex()}"


def parse_record_name(name: str) -> tuple[str, bytes]:
    """(namespace_id, key) of a name :func:`record_name` made; ValueError for any other name."""
    namespace_id, sep, key_hex = name.partition("/")
    if not sep or not _NAMESPACE_RE.fullmatch(namespace_id):
        raise ValueError(f"record name {name!r}: expected <namespace_id>/<key hex>")
    try:
        key = bytes.fromhex(key_hex)
    except ValueError:
        raise ValueError(f"record name {name!r}: the key part is not hex") from None
    if not key or key.hex() != key_hex:
        raise ValueError(f"record name {name!r}: expected a lower-case hex key")
    return namespace_id, key


@dataclass(frozen=True)
class FoundBlob:
    """A blob an earlier run left in a store (``DiskBlobStore.scan``): its name, its first
    ``HEADER_BYTES`` (fewer if the blob is shorter), its payload size and modification time."""

    name: str
    header: bytes
    payload_bytes: int
    mtime_ns: int


def encode_header(h: RecordHeader) -> bytes:
    """The header page of a record: magic, length, msgpack of ``h``, zero padding."""
    if len(h.checksum) != CHECKSUM_BYTES:
        raise ValueError(f"checksum of {len(h.checksum)} bytes: expected {CHECKSUM_BYTES}")
    body = msgspec.msgpack.encode(h)
    out = _PREFIX.pack(_MAGIC, len(body)) + body
    if len(out) > HEADER_BYTES:
        raise ValueError(f"record header of {len(out)} bytes: expected <= {HEADER_BYTES}")
    return out + bytes(HEADER_BYTES - len(out))


def decode_header(page: bytes | bytearray | memoryview, *, namespace_id: str, key: bytes) -> RecordHeader:
    """The header of a record read under (``namespace_id``, ``key``); :class:`CorruptRecord` when
    the page is not a header or belongs to another namespace or key."""
    if len(page) < HEADER_BYTES:
        raise CorruptRecord(f"header of {len(page)} bytes: expected {HEADER_BYTES} (torn record)")
    magic, n = _PREFIX.unpack_from(page)
    if magic != _MAGIC or n > HEADER_BYTES - _PREFIX.size:
        raise CorruptRecord(f"bad record header (magic {bytes(magic)!r}, length {n})")
    try:
        h = msgspec.msgpack.decode(bytes(page[_PREFIX.size : _PREFIX.size + n]), type=RecordHeader)
    except msgspec.DecodeError as e:
        raise CorruptRecord(f"bad record header: {e}") from None
    if h.namespace_id != namespace_id or h.key != key:
        raise CorruptRecord(
            f"record filed under {namespace_id}/{key.hex()} holds {h.namespace_id}/{h.key.hex()} (misfiled)"
        )
    return h


class BlobStore(Protocol):
    """Named blobs of ``header + payload``; one backend per module (``disk``, ``s3``)."""

    kind: str
    """Tier name in metrics and logs: ``disk`` or ``s3``."""

    def write(self, name: str, header: bytes, payload: memoryview) -> None:
        """Store ``header + payload`` under ``name`` (replacing any blob of that name); a reader
        never sees a partly written blob under ``name`` as complete (checksums catch the rest)."""
        ...

    def read_into(self, name: str, header: bytearray, payload: memoryview) -> int:
        """Fill ``header`` (``HEADER_BYTES``) then ``payload`` from the blob; returns the payload
        bytes read (less than ``len(payload)`` for a short blob). :class:`BlobMissing` if absent."""
        ...

    def delete(self, name: str) -> None:
        """Remove ``name``; absent is fine."""
        ...

    def list(self, namespace_id: str) -> list[str]:
        """Names of the blobs under ``namespace_id/``."""
        ...

    def close(self) -> None: ...
