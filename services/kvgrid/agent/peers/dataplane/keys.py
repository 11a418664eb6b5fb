"""The ``mac`` and ``aead`` modes' keys and primitives (the wire format is in
:mod:`kvgrid.agent.peers.dataplane.protocol`).

A ticket's random 32-byte key is split into subkeys with BLAKE3's key derivation, one context
string per use (hello, chunk MAC, AES-256-GCM), so no key serves two algorithms. The hello tag
proves a connection holds the ticket's key, not only the ticket; a chunk's MAC covers its index and
size before its bytes; an AES-GCM nonce is (chunk index, record index), which never repeats under
one ticket's key because each chunk is sent once per ticket.

``blake3`` and ``cryptography`` are dependencies of the ``agent`` extra, imported only when a mode
needs them: a hand-made install without them fails with a message naming the package (at start,
through :func:`check_security_dependencies`).
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Any

from kvgrid.agent.peers.dataplane.protocol import HELLO, KEY_BYTES

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

__all__ = [
    "TicketKeys",
    "aead_aad",
    "aead_nonce",
    "aesgcm",
    "check_security_dependencies",
    "chunk_mac",
    "dependencies_present",
    "hello_tag",
    "load_blake3",
]

_MAC_HEADER = struct.Struct("<QQ")  # chunk index, chunk bytes: MACed before the bytes
_NONCE = struct.Struct("<QI")  # chunk index, record index: 12 bytes, once per ticket key
_AAD = struct.Struct("<QQIB")  # chunk index, chunk bytes, record index, last record


def load_blake3() -> Any:
    """The ``blake3.blake3`` hasher class; RuntimeError naming the package when it is missing."""
    try:
        import blake3
    except ImportError as e:  # pragma: no cover - a dependency of the agent extra
        raise RuntimeError(
            "the peer data plane's mac and aead modes need the blake3 package (pip install 'kvgrid[agent]'), "
            "or peer_data_security=tls"
        ) from e
    return blake3.blake3


def aesgcm(key: bytes) -> AESGCM:
    """An AES-256-GCM cipher under ``key``; RuntimeError naming the package when it is missing."""
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError as e:  # pragma: no cover - a dependency of the agent extra
        raise RuntimeError(
            "peer_data_security=aead needs the cryptography package (pip install 'kvgrid[agent]'), or "
            "peer_data_security=mac or tls"
        ) from e
    return AESGCM(key)


def check_security_dependencies(security: str) -> None:
    """RuntimeError naming the package a data-plane mode needs when it is not installed (both are
    dependencies of the ``agent`` extra; a hand-made install may lack them)."""
    if security in ("mac", "aead"):
        load_blake3()
    if security == "aead":
        aesgcm(bytes(KEY_BYTES))


def dependencies_present(security: str) -> bool:
    """Whether this install can serve ``security`` (:func:`check_security_dependencies` passes)."""
    try:
        check_security_dependencies(security)
    except RuntimeError:
        return False
    return True


class TicketKeys:
    """A ticket's subkeys, derived from its random key with BLAKE3's key derivation (one context
    string per use, so no key serves two algorithms)."""

    __slots__ = ("aead", "hello", "mac")

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"data-plane key of {len(key)} bytes: expected {KEY_BYTES}")
        b3 = load_blake3()
        self.hello: bytes = b3(key, derive_key_context="kvgrid 2026 peer data plane hello").digest()
        self.mac: bytes = b3(key, derive_key_context="kvgrid 2026 peer data plane chunk mac").digest()
        self.aead: bytes = b3(key, derive_key_context="kvgrid 2026 peer data plane aes-256-gcm").digest()


def hello_tag(keys: TicketKeys, magic: bytes, secret: bytes, stream: int) -> bytes:
    """What follows a ``mac`` or ``aead`` hello: keyed BLAKE3 of the hello under the hello subkey
    (proves the connection holds the ticket's key, not only the ticket)."""
    return bytes(load_blake3()(HELLO.pack(magic, secret, stream), key=keys.hello).digest())


def chunk_mac(keys: TicketKeys, index: int, nbytes: int) -> Any:
    """A keyed BLAKE3 hasher for chunk ``index`` of a ``mac`` ticket, its index and size already in:
    feed it the chunk's bytes; its 32-byte digest trails them. The index binds the chunk to its place
    in the ticket (chunks swapped between streams or positions fail), the per-ticket key to the ticket
    (a chunk and MAC replayed from another ticket fail)."""
    h = load_blake3()(key=keys.mac)
    h.update(_MAC_HEADER.pack(index, nbytes))
    return h


def aead_nonce(index: int, record: int) -> bytes:
    return _NONCE.pack(index, record)


def aead_aad(index: int, nbytes: int, record: int, last: bool) -> bytes:
    return _AAD.pack(index, nbytes, record, last)
