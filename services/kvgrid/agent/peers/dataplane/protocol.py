"""Peer data plane: chunk bytes on TCP sockets of their own, with gRPC ``FetchChunks`` as the
control plane.

Chosen by measurement against Mooncake Transfer Engine, NIXL (UCX) and UCXX, whose TCP transports
moved the same bytes between two processes here at 0.1-0.3x a raw socket copy and serve registered
memory to any connection without authentication (docs/agent.md, "Peer data plane").

Protocol (one peer fetch):

1. The fetcher calls ``FetchChunks`` with ``data_streams = S`` (and, with TLS, ``data_security``:
   its ``peer_data_security``) on the mTLS gRPC channel; the server authorizes it as before (agent
   identity, namespace, layout), references the leading held chunks, and registers a ticket
   (:class:`~kvgrid.agent.peers.dataplane.tickets.Ticket`): 32 random bytes, admitting S
   connections, alive while that gRPC stream is open (it ends when every chunk went out, every
   stream hung up, or the serving deadline passed), served
   in one security mode (:func:`ticket_security`) and, for ``mac`` and ``aead``, with a fresh random
   32-byte key of its own. The stream's one message carries the ticket, the data port, the chunk
   count and size, the mode and the key, and no data.
2. The fetcher opens S connections to the peer's data port and sends ``HELLO`` (magic, ticket,
   stream index; ``mac`` and ``aead`` add the hello's MAC under the ticket's key). Stream ``k``
   carries chunks ``k, k+S, k+2S, ...``, sent from the server's L1 buffer in pieces of
   :data:`PIECE_BYTES` and received straight into the fetcher's reserved L1 chunk (``recv_into``):

   - ``plain`` (no TLS configured) and ``tls`` (mutual TLS connections): the chunk's bytes, then
     their 16-byte XXH3-128 checksum (``chunk_checksum``'s digest). Both ends hash each piece while
     it is still in the CPU cache (the sender only when the chunk has no checksum yet).
   - ``mac`` (plaintext TCP): the chunk's bytes, then a 32-byte keyed BLAKE3 of (chunk index, chunk
     size, bytes) under the ticket's MAC subkey. Each piece is hashed on a helper thread while the
     connection moves the next one (BLAKE3 releases the GIL): hashing overlaps the copy.
   - ``aead`` (plaintext TCP, encrypted): one AES-256-GCM record per piece (ciphertext, 16-byte tag)
     under the ticket's AEAD subkey; nonce (chunk index, record index), associated data (chunk
     index, chunk size, record index, last flag); decrypted straight into the chunk.

   Each framing is a module of its own, both ends in one place: ``checksummed`` (plain, tls),
   ``mac``, ``aead``.
3. The fetcher verifies each chunk (checksum, MAC, or every record's tag) before the chunk may be
   committed; it commits the leading chunks that arrived complete and intact.

Security invariants (an attacker on the pod network): the data port serves nothing without a live
ticket, and tickets are only issued over the authorized control plane (which checks the caller's
tenant first); a ticket is 256 random bits, single use per stream index, bound to the chunks it was
issued for and to the certificate identity it was issued to, and dies with its gRPC stream. The
binding to the identity: with ``tls`` another identity presenting the ticket gets nothing (the
connection's client certificate must name it); with ``mac`` and ``aead`` the hello must carry a MAC
under the ticket's key, which only that identity received (over mTLS) and which never crosses the
data port, so the ticket alone (seen on the wire) opens nothing and closes nothing (only a connection
that claimed a stream ends one). What each mode protects:

- ``tls``: confidentiality, integrity, authenticity (both ends' certificates). Python's TLS
  returns one 16 KiB record per call: the slowest (docs/benchmarks.md, "Peer fetch").
- ``aead``: confidentiality and integrity of every record under a key only the two agents hold
  (a byte changed, a record reordered, truncated or replayed from another chunk or ticket fails
  its tag); the server is authenticated by the mTLS control call that gave the key.
- ``mac``: integrity and authenticity as ``aead`` (a chunk changed in flight, swapped within a
  ticket or replayed from another ticket fails its MAC, so it is never committed), but the bytes
  cross the network readable.

Subkeys (hello, MAC, AES-256-GCM) are derived from the ticket's key with BLAKE3's key derivation
(one context string each), so no key serves two algorithms; a key is never reused: each chunk is
sent once per ticket, so an AES-GCM nonce never repeats under its key.

Bounded resources (a flood of idle or slow connections must not lock real peers out): the
server's handshake deadline, cap on connections without a ticket, cap in all and idle timeout,
whose defaults are here (:data:`HELLO_TIMEOUT_S`, :data:`MAX_UNAUTHENTICATED`,
:data:`MAX_CONNECTIONS`, :data:`IDLE_TIMEOUT_S`), are described with
:class:`~kvgrid.agent.peers.dataplane.server.DataPlaneServer`.
"""

from __future__ import annotations

import struct

__all__ = [
    "DEFAULT_SECURITY",
    "HELLO",
    "HELLO_TAG_BYTES",
    "HELLO_TIMEOUT_S",
    "IDLE_TIMEOUT_S",
    "KEY_BYTES",
    "MAC_BYTES",
    "MAGIC",
    "MAGIC_AEAD",
    "MAGIC_MAC",
    "MAGIC_MODE",
    "MAX_CONNECTIONS",
    "MAX_STREAMS",
    "MAX_UNAUTHENTICATED",
    "PIECE_BYTES",
    "SECURITY_MODES",
    "TAG_BYTES",
    "TICKET_BYTES",
    "TLS_HANDSHAKE",
    "StreamFailure",
    "accepted_security",
    "stream_indices",
    "ticket_security",
    "ticket_streams",
]

TICKET_BYTES = 32
MAGIC = b"KVGD"
"""Hello of a ``plain`` or ``tls`` ticket: chunks trail their XXH3-128 checksum."""
MAGIC_MAC = b"KVGM"
"""Hello of a ``mac`` ticket (followed by its :func:`hello_tag`): chunks trail a keyed BLAKE3."""
MAGIC_AEAD = b"KVGA"
"""Hello of an ``aead`` ticket (followed by its :func:`hello_tag`): AES-256-GCM records."""
HELLO = struct.Struct(f"<4s{TICKET_BYTES}sI")
"""What a fetcher sends first on each data connection: magic, ticket, stream index."""
SECURITY_MODES = ("mac", "aead", "tls")
"""What ``peer_data_security`` may name (it applies with TLS configured; without, tickets are
``plain``)."""
DEFAULT_SECURITY = "mac"
"""The agent's default ``peer_data_security`` (docs/security.md, "Peer data plane")."""
_STRENGTH = {"plain": 0, "mac": 1, "aead": 2, "tls": 2}
"""mac < aead = tls: a server never serves a mode weaker than its own, a fetcher never takes one."""
MAGIC_MODE = {MAGIC_MAC: "mac", MAGIC_AEAD: "aead"}
KEY_BYTES = 32
"""A ``mac`` or ``aead`` ticket's key (FetchChunksResponse.data_key)."""
HELLO_TAG_BYTES = 32
MAC_BYTES = 32
"""The keyed BLAKE3 that trails each chunk of a ``mac`` ticket."""
TAG_BYTES = 16
"""The AES-GCM tag that trails each record of an ``aead`` ticket."""
TLS_HANDSHAKE = 0x16  # the first byte of a TLS ClientHello record; never the first of a magic
HELLO_TIMEOUT_S = 5.0
"""Default of ``handshake_timeout_s`` (the agent's ``peer_data_handshake_timeout_ms``)."""
IDLE_TIMEOUT_S = 10.0
"""Default of ``idle_timeout_s`` (the agent's ``peer_data_idle_timeout_ms``)."""
MAX_UNAUTHENTICATED = 64
"""Default of ``max_unauthenticated`` (the agent's ``peer_data_max_unauthenticated``)."""
PIECE_BYTES = 1 << 20
"""Hashed per piece while in cache: XXH3 runs 2-4x faster on 1 MiB than on 32 MiB (docs/benchmarks.md)."""
MAX_CONNECTIONS = 256
MAX_STREAMS = 16


def stream_indices(stream: int, streams: int, num_chunks: int) -> range:
    """Chunks stream ``stream`` of ``streams`` carries: round-robin, so the leading chunks (the
    ones a Lookup can use) arrive first on every stream."""
    return range(stream, num_chunks, streams)


def ticket_security(requested: str, own: str) -> str:
    """The mode a server with TLS whose ``peer_data_security`` is ``own`` serves a ticket in: what the
    fetcher ``requested``, unless that is weaker than ``own`` (mac < aead, tls) or unknown. An empty
    request comes from a fetcher older than the field, which takes its bytes over TLS."""
    req = requested or "tls"
    if req not in SECURITY_MODES or _STRENGTH[req] < _STRENGTH[own]:
        return own
    return req


def accepted_security(answered: str, own: str, *, tls: bool) -> str:
    """The mode a fetcher receives a ticket in, from the server's answer (``data_security``):
    ValueError, naming it, when it is unknown or weaker than the fetcher's own ``own``. Empty means
    ``tls`` with TLS (a server older than the field), ``plain`` without."""
    if not tls:
        if answered:
            raise ValueError(f"data_security={answered!r} from a server reached without TLS: expected none")
        return "plain"
    mode = answered or "tls"
    if mode not in SECURITY_MODES:
        raise ValueError(f"data_security={answered!r}: expected one of {', '.join(SECURITY_MODES)}")
    if _STRENGTH[mode] < _STRENGTH[own]:
        raise ValueError(
            f"data_security={mode!r} is weaker than this agent's peer_data_security={own!r}: refused"
        )
    return mode


def ticket_streams(requested: int, num_chunks: int) -> int:
    """Connections a ticket admits: what the fetcher asked for, at most one per chunk and
    :data:`MAX_STREAMS` (both sides compute it, so it needs no field of its own)."""
    return max(1, min(requested, num_chunks, MAX_STREAMS))


class StreamFailure(Exception):
    """A data-plane stream failed; ``reason`` is the peer-fetch failure label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
