"""Peer data plane: chunk bytes on TCP sockets of their own, with gRPC ``FetchChunks`` as the
control plane.

Chosen by measurement against Mooncake Transfer Engine, NIXL (UCX) and UCXX, whose TCP transports
moved the same bytes between two processes here at 0.1-0.3x a raw socket copy and serve registered
memory to any connection without authentication (docs/agent.md, "Peer data plane").

Protocol (one peer fetch):

1. The fetcher calls ``FetchChunks`` with ``data_streams = S`` (and, with TLS, ``data_security``:
   its ``peer_data_security``) on the mTLS gRPC channel; the server authorizes it as before (agent
   identity, namespace, layout), references the leading held chunks, and registers a
   :class:`Ticket`: 32 random bytes, admitting S connections, alive while that gRPC stream is open
   (it ends when every chunk went out, every stream hung up, or the serving deadline passed), served
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
3. The fetcher verifies each chunk (checksum, MAC, or every record's tag) before the chunk may be
   committed; it commits the leading chunks that arrived complete and intact.

Security invariants (an attacker on the pod network): the data port serves nothing without a live
ticket, and tickets are only issued over the authorized control plane (which checks the caller's
tenant first); a ticket is 256 random bits, single use per stream index, bound to the chunks it was
issued for and to the certificate identity it was issued to, and dies with its gRPC stream. The
binding to the identity: with ``tls`` another identity presenting the ticket gets nothing (the
connection's client certificate must name it); with ``mac`` and ``aead`` the hello must carry a MAC
under the ticket's key, which only that identity received (over mTLS) and which never crosses the
data port, so the ticket alone (seen on the wire) opens nothing. What each mode protects:

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

Bounded resources (a flood of idle or slow connections must not lock real peers out):

- A connection must finish its TLS handshake (when it starts one) and present a live ticket within
  ``handshake_timeout_s`` of being accepted (one deadline for the whole handshake, not per read),
  else it is closed without a byte sent.
- At most ``max_unauthenticated`` connections may be in that state; the next one accepted closes
  the oldest of them (a real peer's connection authenticates within milliseconds, so the ones
  evicted are the idle ones), and at most :data:`MAX_CONNECTIONS` are open in all (one over it is
  closed at once).
- An admitted connection sends in pieces of :data:`PIECE_BYTES`; a piece its reader does not take
  within ``idle_timeout_s`` ends the connection (its chunk references are dropped).
"""

from __future__ import annotations

import collections
import contextlib
import hmac
import itertools
import logging
import os
import secrets
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from kvgrid.agent.cache import ChunkCache
from kvgrid.agent.l1 import Chunk
from kvgrid.common.checksum import CHECKSUM_BYTES, CHECKSUM_NAME
from kvgrid.common.tls import AGENT_SERVER_NAME, TlsFiles

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

__all__ = [
    "DEFAULT_SECURITY",
    "HELLO",
    "HELLO_TAG_BYTES",
    "HELLO_TIMEOUT_S",
    "IDLE_TIMEOUT_S",
    "KEY_BYTES",
    "MAC_BYTES",
    "MAGIC_AEAD",
    "MAGIC_MAC",
    "MAX_CONNECTIONS",
    "MAX_STREAMS",
    "MAX_UNAUTHENTICATED",
    "SECURITY_MODES",
    "TAG_BYTES",
    "TICKET_BYTES",
    "DataPlaneServer",
    "Received",
    "StreamFailure",
    "Ticket",
    "TicketKeys",
    "accepted_security",
    "aead_aad",
    "aead_nonce",
    "check_security_dependencies",
    "chunk_mac",
    "client_context",
    "connect",
    "fetch_streams",
    "hello_tag",
    "recv_exact_into",
    "server_context",
    "stream_indices",
    "ticket_security",
    "ticket_streams",
]

log = logging.getLogger(__name__)

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
_MAGIC_MODE = {MAGIC_MAC: "mac", MAGIC_AEAD: "aead"}
KEY_BYTES = 32
"""A ``mac`` or ``aead`` ticket's key (FetchChunksResponse.data_key)."""
HELLO_TAG_BYTES = 32
MAC_BYTES = 32
"""The keyed BLAKE3 that trails each chunk of a ``mac`` ticket."""
TAG_BYTES = 16
"""The AES-GCM tag that trails each record of an ``aead`` ticket."""
_TLS_HANDSHAKE = 0x16  # the first byte of a TLS ClientHello record; never the first of a magic
_MAC_HEADER = struct.Struct("<QQ")  # chunk index, chunk bytes: MACed before the bytes
_NONCE = struct.Struct("<QI")  # chunk index, record index: 12 bytes, once per ticket key
_AAD = struct.Struct("<QQIB")  # chunk index, chunk bytes, record index, last record
HELLO_TIMEOUT_S = 5.0
"""Default of ``handshake_timeout_s`` (the agent's ``peer_data_handshake_timeout_ms``)."""
IDLE_TIMEOUT_S = 10.0
"""Default of ``idle_timeout_s`` (the agent's ``peer_data_idle_timeout_ms``)."""
MAX_UNAUTHENTICATED = 64
"""Default of ``max_unauthenticated`` (the agent's ``peer_data_max_unauthenticated``)."""
CONNECT_TIMEOUT_S = 1.0
PIECE_BYTES = 1 << 20
"""Hashed per piece while in cache: XXH3 runs 2-4x faster on 1 MiB than on 32 MiB (docs/benchmarks.md)."""
MAX_CONNECTIONS = 256
_SOCKET_BUFFER = 4 << 20  # larger kernel buffers: fewer wake-ups per 32 MiB chunk


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


def _blake3() -> Any:
    try:
        import blake3
    except ImportError as e:  # pragma: no cover - a dependency of the agent extra
        raise RuntimeError(
            "the peer data plane's mac and aead modes need the blake3 package (pip install 'kvgrid[agent]'), "
            "or peer_data_security=tls"
        ) from e
    return blake3.blake3


def _aesgcm(key: bytes) -> AESGCM:
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
        _blake3()
    if security == "aead":
        _aesgcm(bytes(KEY_BYTES))


def _dependencies_present(security: str) -> bool:
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
        b3 = _blake3()
        self.hello: bytes = b3(key, derive_key_context="kvgrid 2026 peer data plane hello").digest()
        self.mac: bytes = b3(key, derive_key_context="kvgrid 2026 peer data plane chunk mac").digest()
        self.aead: bytes = b3(key, derive_key_context="kvgrid 2026 peer data plane aes-256-gcm").digest()


def hello_tag(keys: TicketKeys, magic: bytes, secret: bytes, stream: int) -> bytes:
    """What follows a ``mac`` or ``aead`` hello: keyed BLAKE3 of the hello under the hello subkey
    (proves the connection holds the ticket's key, not only the ticket)."""
    return bytes(_blake3()(HELLO.pack(magic, secret, stream), key=keys.hello).digest())


def chunk_mac(keys: TicketKeys, index: int, nbytes: int) -> Any:
    """A keyed BLAKE3 hasher for chunk ``index`` of a ``mac`` ticket, its index and size already in:
    feed it the chunk's bytes; its 32-byte digest trails them. The index binds the chunk to its place
    in the ticket (chunks swapped between streams or positions fail), the per-ticket key to the ticket
    (a chunk and MAC replayed from another ticket fail)."""
    h = _blake3()(key=keys.mac)
    h.update(_MAC_HEADER.pack(index, nbytes))
    return h


def aead_nonce(index: int, record: int) -> bytes:
    return _NONCE.pack(index, record)


def aead_aad(index: int, nbytes: int, record: int, last: bool) -> bytes:
    return _AAD.pack(index, nbytes, record, last)


class _Behind:
    """Runs one step of a connection's work on a helper thread while the caller does the next: a
    piece's hash (mac: the piece just moved is hashed while the connection moves the next) or a
    record's socket copy (aead: one record is sent or received while the caller seals or opens
    another). Both sides release the GIL (BLAKE3, sockets), so they run on two cores. A step starts
    only after the previous one finished, so their order holds; its error surfaces at the next
    :meth:`feed` or :meth:`wait`."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvgrid-dataplane-helper")
        self._last: Future[object] | None = None

    def feed(self, step: Callable[..., object], *args: object) -> None:
        self.wait()
        self._last = self._pool.submit(step, *args)

    def wait(self) -> None:
        last, self._last = self._last, None
        if last is not None:
            last.result()

    def close_step(self) -> None:
        """Wait for the step in flight, whether it failed or not (an error was already raised or
        is moot: the connection is ending)."""
        with contextlib.suppress(Exception):
            self.wait()

    def close(self) -> None:
        self.close_step()
        self._pool.shutdown(wait=True)


def server_context(files: TlsFiles) -> ssl.SSLContext:
    """Mutual TLS for the data port: this agent's certificate, a client certificate from the CA
    required. Rebuilt when the files change (``_ServerContexts``), so rotated files apply to new
    connections."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(files.cert_file, files.key_file)
    ctx.load_verify_locations(files.ca_file)
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


class _ServerContexts:
    """The data port's server context, rebuilt only when a TLS file changed (its mtime, size or
    inode, as :mod:`kvgrid.common.tls` checks): loading the certificate and CA costs milliseconds of
    CPU, which a flood of connections must not be able to make the agent spend per connection.
    A file that cannot be read keeps the previous context (logged). Thread-safe."""

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        self._lock = threading.Lock()
        self._stamp = self._read_stamp()
        self._ctx = server_context(files)

    def _read_stamp(self) -> tuple[tuple[int, int, int], ...]:
        out = []
        for path in (self.files.cert_file, self.files.key_file, self.files.ca_file):
            st = os.stat(path)
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
        return tuple(out)

    def get(self) -> ssl.SSLContext:
        with self._lock:
            try:
                stamp = self._read_stamp()
                if stamp != self._stamp:
                    self._ctx, self._stamp = server_context(self.files), stamp
            except (OSError, ssl.SSLError) as e:
                log.warning(
                    "data plane: TLS files changed but cannot be reloaded (keeping the previous): %s", e
                )
            return self._ctx


def client_context(files: TlsFiles) -> ssl.SSLContext:
    """The fetcher's side: present this agent's certificate, verify the peer's chain and role name."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(files.cert_file, files.key_file)
    ctx.load_verify_locations(files.ca_file)
    return ctx


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, _SOCKET_BUFFER)


def connect(host: str, port: int, timeout_s: float, tls: ssl.SSLContext | None) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=timeout_s)
    try:
        _tune(sock)
        if tls is not None:
            sock = tls.wrap_socket(sock, server_hostname=AGENT_SERVER_NAME)
    except BaseException:
        sock.close()
        raise
    return sock


def receive_deadline(sock: socket.socket, seconds: float) -> None:
    """Bound every later receive on ``sock`` by ``seconds``. A plain TCP socket is made blocking
    with the kernel's receive timeout, so :func:`recv_exact_into` can wait for a whole piece in one
    ``recv_into(MSG_WAITALL)`` with the GIL released (Python's own timeouts poll before every
    ``recv``: two system calls and two GIL hand-offs per few hundred KiB); a TLS socket keeps
    Python's timeout."""
    seconds = max(0.001, seconds)
    if isinstance(sock, ssl.SSLSocket):
        sock.settimeout(seconds)
        return
    sock.settimeout(None)
    whole = int(seconds)
    sock.setsockopt(
        socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", whole, int((seconds - whole) * 1e6))
    )


def recv_exact_into(sock: socket.socket, view: memoryview, hasher: xxhash.xxh3_128 | None = None) -> None:
    """Fill ``view`` from ``sock`` (feeding ``hasher`` each piece as it lands); ``ConnectionError``
    when the peer hangs up first, ``TimeoutError`` when :func:`receive_deadline`'s time passes."""
    got, hashed, size = 0, 0, len(view)
    # A blocking plain socket waits in the kernel for a whole piece; TLS returns one 16 KiB record
    # per call and takes no flags.
    flags = socket.MSG_WAITALL if sock.gettimeout() is None and not isinstance(sock, ssl.SSLSocket) else 0
    while got < size:
        want = min(size - got, PIECE_BYTES) if flags else size - got
        try:
            n = sock.recv_into(view[got:], want, flags)
        except BlockingIOError:  # SO_RCVTIMEO passed with nothing received
            raise TimeoutError(
                f"data connection: no bytes within the deadline after {got} of {size}"
            ) from None
        if n == 0:
            raise ConnectionError(f"peer closed the data connection after {got} of {size} bytes")
        got += n
        # Hash in pieces of PIECE_BYTES (still in cache), not per call, to keep the Python work per
        # byte down.
        if hasher is not None and (got - hashed >= PIECE_BYTES or got == size):
            hasher.update(view[hashed:got])
            hashed = got


class Ticket:
    """The chunks one ``FetchChunks`` call may send on the data plane, referenced until sent.

    Each stream index may be claimed once. A chunk being sent stays referenced until
    :meth:`sent` (even when the ticket is closed meanwhile), so eviction never reuses a buffer
    while a socket reads from it. :attr:`finished` is set once nothing more will be sent.
    """

    def __init__(
        self,
        cache: ChunkCache,
        chunks: Sequence[Chunk],
        streams: int,
        identity: str = "",
        security: str = "plain",
    ) -> None:
        self.secret = secrets.token_bytes(TICKET_BYTES)
        self.identity = identity
        """The certificate identity (its SAN) the ticket was issued to; "" without TLS."""
        self.security = security
        """How its bytes are protected: plain (no TLS configured), tls, mac or aead."""
        self.key = secrets.token_bytes(KEY_BYTES) if security in ("mac", "aead") else b""
        """mac, aead: this ticket's own random key (sent once, over the mTLS control call)."""
        self.keys = TicketKeys(self.key) if self.key else None
        self.cache = cache
        self.streams = streams
        self.num_chunks = len(chunks)
        self._lock = threading.Lock()
        self._held: dict[int, Chunk] = dict(enumerate(chunks))
        self._sending: set[int] = set()
        self._claimed: set[int] = set()
        self._ended = 0  # claimed streams that hung up
        self._closed = False
        self.finished = threading.Event()
        if not chunks:
            self.finished.set()

    def claim(self, stream: int) -> bool:
        with self._lock:
            if self._closed or not 0 <= stream < self.streams or stream in self._claimed:
                return False
            self._claimed.add(stream)
            return True

    def take(self, index: int) -> Chunk | None:
        """The chunk to send next on a stream, marked in flight; None once the ticket closed."""
        with self._lock:
            chunk = None if self._closed else self._held.get(index)
            if chunk is not None:
                self._sending.add(index)
            return chunk

    def sent(self, index: int) -> None:
        with self._lock:
            self._sending.discard(index)
            chunk = self._held.pop(index, None)
            self._update()
        if chunk is not None:
            self.cache.release([chunk])

    def stream_ended(self) -> None:
        with self._lock:
            self._ended += 1
            if self._ended >= self.streams:
                self._closed = True  # every stream hung up: nobody can ask for the rest
            left = self._drop_idle()
            self._update()
        self.cache.release(left)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            left = self._drop_idle()
            self._update()
        self.cache.release(left)

    def _drop_idle(self) -> list[Chunk]:
        if not self._closed:
            return []
        idle = [i for i in self._held if i not in self._sending]
        return [self._held.pop(i) for i in idle]

    def _update(self) -> None:
        if not self._held or (self._closed and not self._sending):
            self.finished.set()


class _Unauthenticated:
    """A connection that has not presented a live ticket yet (its socket's file descriptor stays
    open while it is registered: its thread deregisters it before closing it)."""

    __slots__ = ("fd", "peer")

    def __init__(self, fd: int, peer: object) -> None:
        self.fd, self.peer = fd, peer


def _peer_sans(conn: socket.socket) -> list[str]:
    """URI and DNS SANs of a TLS connection's verified client certificate."""
    if not isinstance(conn, ssl.SSLSocket):
        return []
    cert = conn.getpeercert() or {}
    sans = cert.get("subjectAltName", ())
    out: list[str] = []
    for entry in sans if isinstance(sans, tuple) else ():
        if isinstance(entry, tuple) and len(entry) == 2 and entry[0] in ("URI", "DNS"):
            out.append(str(entry[1]))
    return out


class DataPlaneServer:
    """The data port: accepts connections, admits those with a live ticket, sends their chunks.

    One thread accepts; each connection gets a thread (at most :data:`MAX_CONNECTIONS`, at most
    ``max_unauthenticated`` of them before their ticket is checked: see the module's invariants).
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        tls: TlsFiles | None,
        on_sent: Callable[[int], None] | None = None,
        handshake_timeout_s: float = HELLO_TIMEOUT_S,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        max_unauthenticated: int = MAX_UNAUTHENTICATED,
        security: str = DEFAULT_SECURITY,
    ) -> None:
        """``security``: the weakest mode this server serves a ticket in with TLS (the agent's
        ``peer_data_security``; :func:`ticket_security`); without TLS every ticket is plain."""
        if not 0 < max_unauthenticated < MAX_CONNECTIONS:
            raise ValueError(
                f"max_unauthenticated={max_unauthenticated}: expected 1..{MAX_CONNECTIONS - 1} "
                f"(below the {MAX_CONNECTIONS} connections in all)"
            )
        if security not in SECURITY_MODES:
            raise ValueError(f"security={security!r}: expected one of {', '.join(SECURITY_MODES)}")
        if tls is not None:
            check_security_dependencies(security)  # a missing one fails at start, not at a fetch
        self._servable = {m for m in SECURITY_MODES if _dependencies_present(m)}
        self.tls = tls
        self.security = security if tls is not None else "plain"
        self._contexts = _ServerContexts(tls) if tls is not None else None
        self.on_sent = on_sent
        self.handshake_timeout_s = handshake_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.max_unauthenticated = max_unauthenticated
        self._lock = threading.Lock()
        self._tickets: dict[bytes, Ticket] = {}
        self._connections = 0
        self._unauthenticated: dict[int, _Unauthenticated] = {}  # by accept order (oldest first)
        self._ids = itertools.count()
        self.refused = 0
        """Connections closed without data: bad HELLO, unknown ticket, stream claimed, another
        identity's ticket, over the cap, evicted or timed out before their HELLO."""
        self.admitted = 0
        """Connections that presented a live ticket."""
        self.admitted_modes: collections.Counter[str] = collections.Counter()
        """Admitted connections by their ticket's mode (plain, tls, mac, aead)."""
        self.evicted = 0
        """Unauthenticated connections closed to make room for a newer one."""
        self._sock = socket.create_server((host, port), backlog=128)
        self.port: int = self._sock.getsockname()[1]
        self._stopping = False
        self._thread = threading.Thread(target=self._accept_loop, name="kvgrid-dataplane", daemon=True)

    def start(self) -> DataPlaneServer:
        self._thread.start()
        return self

    @property
    def unauthenticated(self) -> int:
        """Connections accepted that have not presented a live ticket yet."""
        with self._lock:
            return len(self._unauthenticated)

    def issue(
        self,
        cache: ChunkCache,
        chunks: Sequence[Chunk],
        streams: int,
        identity: str = "",
        requested: str = "",
    ) -> Ticket:
        """A ticket for ``chunks``, served in the mode the fetcher ``requested`` unless that is
        weaker than this server's (:func:`ticket_security`; plain without TLS). With ``identity``
        (the caller's certificate SAN) only that identity may claim its streams: a ``tls`` ticket on
        a connection whose client certificate carries it, a ``mac`` or ``aead`` one with a hello
        MACed under the ticket's key, which only the answer to that identity's call carries."""
        security = ticket_security(requested, self.security) if self.tls is not None else "plain"
        if security != "plain" and security not in self._servable:
            security = "tls"  # asked for a mode this install cannot serve: TLS is at least as strong
        ticket = Ticket(cache, chunks, streams, identity, security)
        with self._lock:
            self._tickets[ticket.secret] = ticket
        return ticket

    @property
    def live_tickets(self) -> int:
        """Tickets issued and not retired yet (their gRPC streams are still open)."""
        with self._lock:
            return len(self._tickets)

    def retire(self, ticket: Ticket) -> None:
        """Forget ``ticket`` (its gRPC stream ended) and release what it still holds."""
        with self._lock:
            self._tickets.pop(ticket.secret, None)
        ticket.close()

    def stop(self) -> None:
        self._stopping = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        with self._lock:
            tickets, self._tickets = list(self._tickets.values()), {}
        for t in tickets:
            t.close()

    def _accept_loop(self) -> None:
        while not self._stopping:
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return  # stopped
            accepted = time.monotonic()
            evict: _Unauthenticated | None = None
            with self._lock:
                over = self._connections >= MAX_CONNECTIONS
                if not over:
                    self._connections += 1
                    if len(self._unauthenticated) >= self.max_unauthenticated:
                        evict = self._unauthenticated.pop(next(iter(self._unauthenticated)))
                        self._shut(evict.fd)  # under the lock: its thread has not closed it yet
                        self.evicted += 1
                    key = next(self._ids)
                    self._unauthenticated[key] = _Unauthenticated(conn.fileno(), peer)
            if evict is not None:
                log.info(
                    "data plane: %s closed before its hello: %d connections without a ticket (the limit, "
                    "peer_data_max_unauthenticated)",
                    evict.peer,
                    self.max_unauthenticated,
                )
            if over:
                self.refused += 1
                log.warning("data plane: %s refused: %d connections open", peer, MAX_CONNECTIONS)
                conn.close()
                continue
            threading.Thread(
                target=self._serve,
                args=(conn, peer, key, accepted + self.handshake_timeout_s),
                name="kvgrid-dataplane-conn",
                daemon=True,
            ).start()

    @staticmethod
    def _shut(fd: int) -> None:
        """Shut a connection down by its descriptor (wakes the thread blocked in its handshake)."""
        try:
            s = socket.socket(fileno=fd)
        except OSError:
            return
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            s.detach()

    def _authenticated(self, key: int) -> None:
        with self._lock:
            self._unauthenticated.pop(key, None)

    def _serve(self, conn: socket.socket, peer: object, key: int, deadline: float) -> None:
        ticket: Ticket | None = None
        try:
            _tune(conn)
            tls = False
            # With TLS configured a connection may start a TLS handshake (tls tickets) or send a
            # plaintext hello (mac and aead tickets, whose hello is MACed): its first byte tells.
            if self._contexts is not None and _peek_until(conn, deadline) == _TLS_HANDSHAKE:
                conn = self._contexts.get().wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
                _handshake_until(conn, deadline)
                tls = True
            hello = bytearray(HELLO.size)
            _recv_until(conn, memoryview(hello), deadline)
            magic, secret, stream = HELLO.unpack(hello)
            mode = ("tls" if tls else "plain") if magic == MAGIC else _MAGIC_MODE.get(magic, "")
            with self._lock:
                ticket = self._tickets.get(secret) if mode else None
            if ticket is not None and mode != ticket.security:
                self.refused += 1
                log.warning(
                    "data plane: %s refused: a %s hello for a ticket served as %s",
                    peer,
                    mode,
                    ticket.security,
                )
                ticket = None
                return
            if ticket is not None and ticket.keys is not None:
                tag = bytearray(HELLO_TAG_BYTES)
                _recv_until(conn, memoryview(tag), deadline)
                if not hmac.compare_digest(hello_tag(ticket.keys, magic, secret, stream), tag):
                    self.refused += 1
                    log.warning(
                        "data plane: %s refused: its hello's MAC is not under the key of the ticket it names "
                        "(issued to %r)",
                        peer,
                        ticket.identity,
                    )
                    ticket = None
                    return
            elif ticket is not None and ticket.identity and ticket.identity not in _peer_sans(conn):
                self.refused += 1
                log.warning(
                    "data plane: %s refused: its ticket was issued to %r, the connection's certificate "
                    "names %s",
                    peer,
                    ticket.identity,
                    _peer_sans(conn) or "nothing",
                )
                ticket = None
                return
            if ticket is None or not ticket.claim(stream):
                ticket = None
                self.refused += 1
                log.warning("data plane: %s refused: no live ticket for stream %d", peer, stream)
                return
            self._authenticated(key)
            self.admitted += 1
            self.admitted_modes[ticket.security] += 1
            # From here a piece the reader does not take within the idle timeout ends it.
            conn.settimeout(self.idle_timeout_s)
            self._send(conn, ticket, stream)
        except TimeoutError as e:
            if ticket is None:
                self.refused += 1
            log.info("data plane: connection from %s timed out: %s", peer, e)
        except (OSError, ssl.SSLError, ConnectionError) as e:
            log.info("data plane: connection from %s ended: %s", peer, e)
        finally:
            if ticket is not None:
                ticket.stream_ended()
            self._authenticated(key)  # before the close: the descriptor must not be shut once reused
            conn.close()
            with self._lock:
                self._connections -= 1

    def _send(self, conn: socket.socket, ticket: Ticket, stream: int) -> None:
        behind = _Behind() if ticket.security in ("mac", "aead") else None
        aead = _AeadSender(ticket, behind) if behind is not None and ticket.security == "aead" else None
        try:
            for index in stream_indices(stream, ticket.streams, ticket.num_chunks):
                chunk = ticket.take(index)
                if chunk is None:
                    return  # ticket closed (gRPC stream gone): the fetcher sees the hang-up
                try:
                    data = chunk.buffer.numpy()[: chunk.nbytes].data
                    if aead is not None:
                        aead.send(conn, data, index)
                    elif behind is not None:
                        _send_mac(conn, data, ticket, index, behind)
                    else:
                        _send_checksummed(conn, data, chunk)
                finally:
                    if behind is not None:
                        behind.close_step()  # its helper reads the chunk: done before it is released
                    ticket.sent(index)
                if self.on_sent is not None:
                    self.on_sent(chunk.nbytes)
        finally:
            if behind is not None:
                behind.close()


def _send_checksummed(conn: socket.socket, data: memoryview, chunk: Chunk) -> None:
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


def _send_mac(conn: socket.socket, data: memoryview, ticket: Ticket, index: int, behind: _Behind) -> None:
    """mac: the bytes in pieces, each hashed on the helper thread while it is sent, then the MAC."""
    assert ticket.keys is not None
    mac = chunk_mac(ticket.keys, index, len(data))
    for off in range(0, len(data), PIECE_BYTES):
        piece = data[off : off + PIECE_BYTES]
        behind.feed(mac.update, piece)
        conn.sendall(piece)
    behind.wait()
    conn.sendall(mac.digest())


class _AeadSender:
    """aead: one AES-256-GCM record per piece, sealed into one of this connection's two scratch
    buffers while the helper thread sends the record sealed before (``cryptography`` holds the GIL
    while it seals; ``sendall`` does not)."""

    def __init__(self, ticket: Ticket, behind: _Behind) -> None:
        assert ticket.keys is not None
        self._aes = _aesgcm(ticket.keys.aead)
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


def _left(deadline: float) -> float:
    """Seconds until ``deadline``; TimeoutError once it passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("no hello within the handshake timeout")
    return left


def _peek_until(conn: socket.socket, deadline: float) -> int:
    """The first byte the client sent, left unread (waits until ``deadline``: TimeoutError after);
    ``ConnectionError`` when it hangs up first."""
    conn.settimeout(_left(deadline))
    first = conn.recv(1, socket.MSG_PEEK)
    if not first:
        raise ConnectionError("peer closed the data connection before its hello")
    return first[0]


def _handshake_until(conn: ssl.SSLSocket, deadline: float) -> None:
    """The server side of the TLS handshake, done before ``deadline`` however slowly the client's
    bytes come (each wait is for the time left, not a fresh timeout per read); TimeoutError after."""
    conn.setblocking(False)
    try:
        while True:
            try:
                conn.do_handshake()
                return
            except ssl.SSLWantReadError:
                select.select([conn], [], [], _left(deadline))
            except ssl.SSLWantWriteError:
                select.select([], [conn], [], _left(deadline))
            _left(deadline)
    finally:
        conn.setblocking(True)


def _recv_until(sock: socket.socket, view: memoryview, deadline: float) -> None:
    """Fill ``view`` before ``deadline`` (``time.monotonic()``): TimeoutError after it, however the
    bytes trickle in; ``ConnectionError`` when the peer hangs up first."""
    got = 0
    while got < len(view):
        sock.settimeout(_left(deadline))
        n = sock.recv_into(view[got:], len(view) - got)
        if n == 0:
            raise ConnectionError(f"peer closed the data connection after {got} of {len(view)} bytes")
        got += n


class StreamFailure(Exception):
    """A data-plane stream failed; ``reason`` is the peer-fetch failure label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


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
    got = Received()
    stop = threading.Event()
    socks: list[socket.socket] = []

    def fail(e: StreamFailure) -> None:
        with got.lock:
            if got.failure is None:
                got.failure = e
        stop.set()
        with got.lock:
            for s in socks:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)  # wakes streams blocked in recv

    def run(stream: int) -> None:
        try:
            left = deadline - time.monotonic()
            if left <= 0:
                raise StreamFailure("deadline", "deadline passed before the data connection")
            # A reachable port answers in milliseconds; a filtered one would eat the whole deadline.
            sock = connect(host, port, min(left, CONNECT_TIMEOUT_S), tls)
        except StreamFailure as e:
            fail(e)
            return
        except (OSError, ssl.SSLError) as e:
            fail(StreamFailure("unreachable", f"data plane {host}:{port}: {e}"))
            return
        with got.lock:
            socks.append(sock)
        scratch: bytearray | None = None
        receiver = _Receiver(security, keys)
        try:
            if keys is None:
                sock.sendall(HELLO.pack(MAGIC, ticket, stream))
            else:
                magic = MAGIC_MAC if security == "mac" else MAGIC_AEAD
                sock.sendall(HELLO.pack(magic, ticket, stream) + hello_tag(keys, magic, ticket, stream))
            for index in stream_indices(stream, streams, num_chunks):
                if stop.is_set():
                    return
                receive_deadline(sock, deadline - time.monotonic())
                dst = targets.get(index)
                if dst is None:
                    scratch = scratch if scratch is not None else bytearray(chunk_bytes)
                    view = memoryview(scratch)
                else:
                    view = dst.data.cast("B")
                checksum = receiver.receive(sock, view, index)
                with got.lock:
                    got.checksums[index] = checksum
        except StreamFailure as e:
            fail(e)
        except TimeoutError:
            fail(StreamFailure("deadline", f"data plane {host}:{port}: deadline passed mid-chunk"))
        except (OSError, ssl.SSLError, ConnectionError) as e:
            if not stop.is_set():
                fail(StreamFailure("unavailable", f"data plane {host}:{port}, stream {stream}: {e}"))
        finally:
            receiver.close()
            sock.close()

    threads = [
        threading.Thread(target=run, args=(k,), name="kvgrid-dataplane-fetch", daemon=True)
        for k in range(1, streams)
    ]
    for t in threads:
        t.start()
    run(0)
    for t in threads:
        t.join()
    return got


class _Receiver:
    """One data connection's chunk reader: receives a chunk into its view and verifies it as the
    ticket's mode says; returns the checksum to record (b"" for mac and aead) or raises
    :class:`StreamFailure` ("checksum") for a chunk that must not be committed."""

    def __init__(self, security: str, keys: TicketKeys | None) -> None:
        self.security = security
        self.keys = keys
        self._trailer = bytearray(MAC_BYTES if security == "mac" else CHECKSUM_BYTES)
        self._behind = _Behind() if security in ("mac", "aead") else None
        self._aes = _aesgcm(keys.aead) if security == "aead" and keys is not None else None
        self._records = [memoryview(bytearray(PIECE_BYTES + TAG_BYTES)) for _ in range(2 if self._aes else 0)]

    def close(self) -> None:
        if self._behind is not None:
            self._behind.close()

    def receive(self, sock: socket.socket, view: memoryview, index: int) -> bytes:
        if self.security == "mac":
            return self._receive_mac(sock, view, index)
        if self.security == "aead":
            return self._receive_aead(sock, view, index)
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

    def _receive_mac(self, sock: socket.socket, view: memoryview, index: int) -> bytes:
        assert self.keys is not None and self._behind is not None
        mac = chunk_mac(self.keys, index, len(view))
        try:
            for off in range(0, len(view), PIECE_BYTES):
                piece = view[off : off + PIECE_BYTES]
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

    def _receive_aead(self, sock: socket.socket, view: memoryview, index: int) -> bytes:
        """Each record is opened into the chunk while the helper thread receives the next one into
        the other scratch buffer (``cryptography`` holds the GIL while it opens; ``recv_into`` does
        not)."""
        from cryptography.exceptions import InvalidTag

        assert self._aes is not None and self._behind is not None
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


MAX_STREAMS = 16


def ticket_streams(requested: int, num_chunks: int) -> int:
    """Connections a ticket admits: what the fetcher asked for, at most one per chunk and
    :data:`MAX_STREAMS` (both sides compute it, so it needs no field of its own)."""
    return max(1, min(requested, num_chunks, MAX_STREAMS))
