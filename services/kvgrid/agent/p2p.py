"""Peer data plane: chunk bytes on plain TCP sockets (TLS when the agent has TLS), with gRPC
``FetchChunks`` as the control plane.

Chosen by measurement against Mooncake Transfer Engine, NIXL (UCX) and UCXX, whose TCP transports
moved the same bytes between two processes here at 0.1-0.3x a raw socket copy and serve registered
memory to any connection without authentication (docs/agent.md, "Peer data plane").

Protocol (one peer fetch):

1. The fetcher calls ``FetchChunks`` with ``data_streams = S`` on the mTLS gRPC channel; the
   server authorizes it as before (agent identity, namespace, layout), references the leading held
   chunks, and registers a :class:`Ticket`: 32 random bytes, admitting S connections, alive while
   that gRPC stream is open (it ends when every chunk went out, every stream hung up, or the
   serving deadline passed). The stream's one message carries the ticket, the data port, the chunk
   count and size, and no data.
2. The fetcher opens S connections to the peer's data port and sends ``HELLO`` (magic, ticket,
   stream index). Stream ``k`` carries chunks ``k, k+S, k+2S, ...``, each as the chunk's bytes
   followed by their 16-byte XXH3-128 checksum (``chunk_checksum``'s digest), sent from the
   server's L1 buffer (``sendall`` of views) and received straight into the fetcher's reserved L1
   chunk (``recv_into``): no copy in Python. Both ends hash each piece of at most
   :data:`PIECE_BYTES` while it is still in the CPU cache (the sender only when the chunk has no
   checksum yet), not in a second pass over memory; hence the checksum trails the bytes.
3. The fetcher compares each chunk's checksum before the chunk may be committed; it commits the
   leading chunks that arrived complete and intact.

Security invariants (an attacker on the pod network): the data port serves nothing without a live
ticket, and tickets are only issued over the authorized control plane (which checks the caller's
tenant first); a ticket is 256 random bits, single use per stream index, bound to the chunks it was
issued for and, with TLS, to the certificate identity it was issued to (another identity presenting
it gets nothing), and dies with its gRPC stream. With TLS configured the data socket is mutual TLS
with the same certificate files as gRPC (the server requires a client certificate from the CA, the
client checks the agent role name), so the bytes are as confidential as on the control plane;
without TLS both planes are plaintext.

Bounded resources (a flood of idle or slow connections must not lock real peers out):

- A connection must finish its TLS handshake and present a live ticket within ``handshake_timeout_s``
  of being accepted (one deadline for the whole handshake, not per read), else it is closed without
  a byte sent.
- At most ``max_unauthenticated`` connections may be in that state; the next one accepted closes
  the oldest of them (a real peer's connection authenticates within milliseconds, so the ones
  evicted are the idle ones), and at most :data:`MAX_CONNECTIONS` are open in all (one over it is
  closed at once).
- An admitted connection sends in pieces of :data:`PIECE_BYTES`; a piece its reader does not take
  within ``idle_timeout_s`` ends the connection (its chunk references are dropped).
"""

from __future__ import annotations

import contextlib
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

import numpy as np
import xxhash

from kvgrid.agent.cache import ChunkCache
from kvgrid.agent.l1 import Chunk
from kvgrid.common.checksum import CHECKSUM_BYTES, CHECKSUM_NAME
from kvgrid.common.tls import AGENT_SERVER_NAME, TlsFiles

__all__ = [
    "HELLO",
    "HELLO_TIMEOUT_S",
    "IDLE_TIMEOUT_S",
    "MAX_CONNECTIONS",
    "MAX_STREAMS",
    "MAX_UNAUTHENTICATED",
    "TICKET_BYTES",
    "DataPlaneServer",
    "Received",
    "StreamFailure",
    "Ticket",
    "client_context",
    "connect",
    "fetch_streams",
    "recv_exact_into",
    "server_context",
    "stream_indices",
    "ticket_streams",
]

log = logging.getLogger(__name__)

TICKET_BYTES = 32
MAGIC = b"KVGD"
HELLO = struct.Struct(f"<4s{TICKET_BYTES}sI")
"""What a fetcher sends first on each data connection: magic, ticket, stream index."""
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


def recv_exact_into(sock: socket.socket, view: memoryview, hasher: xxhash.xxh3_128 | None = None) -> None:
    """Fill ``view`` from ``sock`` (feeding ``hasher`` each piece as it lands); ``ConnectionError``
    when the peer hangs up first."""
    got, hashed, size = 0, 0, len(view)
    while got < size:
        n = sock.recv_into(view[got:], size - got)
        if n == 0:
            raise ConnectionError(f"peer closed the data connection after {got} of {size} bytes")
        got += n
        # A TLS socket returns one 16 KiB record per call: hash in pieces of PIECE_BYTES (still in
        # cache), not per call, to keep the Python work per byte down.
        if hasher is not None and (got - hashed >= PIECE_BYTES or got == size):
            hasher.update(view[hashed:got])
            hashed = got


class Ticket:
    """The chunks one ``FetchChunks`` call may send on the data plane, referenced until sent.

    Each stream index may be claimed once. A chunk being sent stays referenced until
    :meth:`sent` (even when the ticket is closed meanwhile), so eviction never reuses a buffer
    while a socket reads from it. :attr:`finished` is set once nothing more will be sent.
    """

    def __init__(self, cache: ChunkCache, chunks: Sequence[Chunk], streams: int, identity: str = "") -> None:
        self.secret = secrets.token_bytes(TICKET_BYTES)
        self.identity = identity
        """The certificate identity (its SAN) the ticket was issued to; "" without TLS."""
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
    ) -> None:
        if not 0 < max_unauthenticated < MAX_CONNECTIONS:
            raise ValueError(
                f"max_unauthenticated={max_unauthenticated}: expected 1..{MAX_CONNECTIONS - 1} "
                f"(below the {MAX_CONNECTIONS} connections in all)"
            )
        self.tls = tls
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

    def issue(self, cache: ChunkCache, chunks: Sequence[Chunk], streams: int, identity: str = "") -> Ticket:
        """A ticket for ``chunks``; with ``identity`` (the caller's certificate SAN) only a TLS
        connection whose client certificate carries it may claim its streams."""
        ticket = Ticket(cache, chunks, streams, identity)
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
            if self._contexts is not None:
                conn = self._contexts.get().wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
                _handshake_until(conn, deadline)
            hello = bytearray(HELLO.size)
            _recv_until(conn, memoryview(hello), deadline)
            magic, secret, stream = HELLO.unpack(hello)
            with self._lock:
                ticket = self._tickets.get(secret) if magic == MAGIC else None
            if ticket is not None and ticket.identity and ticket.identity not in _peer_sans(conn):
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
        for index in stream_indices(stream, ticket.streams, ticket.num_chunks):
            chunk = ticket.take(index)
            if chunk is None:
                return  # ticket closed (gRPC stream gone): the fetcher sees the hang-up
            try:
                data = chunk.buffer.numpy()[: chunk.nbytes].data
                # In pieces: the idle timeout bounds each piece, not the whole chunk. The checksum
                # is computed when first needed (as on the gRPC path), piece by piece as sent.
                hasher = None if chunk.checksum else xxhash.xxh3_128()
                for off in range(0, len(data), PIECE_BYTES):
                    piece = data[off : off + PIECE_BYTES]
                    if hasher is not None:
                        hasher.update(piece)
                    conn.sendall(piece)
                if hasher is not None:
                    chunk.checksum = hasher.digest()
                conn.sendall(chunk.checksum)
            finally:
                ticket.sent(index)
            if self.on_sent is not None:
                self.on_sent(chunk.nbytes)


def _left(deadline: float) -> float:
    """Seconds until ``deadline``; TimeoutError once it passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("no hello within the handshake timeout")
    return left


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
) -> Received:
    """Receive ``num_chunks`` chunks over ``streams`` connections, each chunk straight into
    ``targets[i]`` (a chunk without a target, already held here, is read and dropped), its
    XXH3-128 taken while it lands and compared with the checksum after it. Stops every stream at
    the first failure or at ``deadline`` (``time.monotonic()``)."""
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
        checksum = bytearray(CHECKSUM_BYTES)
        try:
            sock.sendall(HELLO.pack(MAGIC, ticket, stream))
            for index in stream_indices(stream, streams, num_chunks):
                if stop.is_set():
                    return
                sock.settimeout(max(0.001, deadline - time.monotonic()))
                dst = targets.get(index)
                if dst is None:
                    scratch = scratch if scratch is not None else bytearray(chunk_bytes)
                    view = memoryview(scratch)
                else:
                    view = dst.data.cast("B")
                hasher = xxhash.xxh3_128()
                recv_exact_into(sock, view, hasher)
                recv_exact_into(sock, memoryview(checksum))
                if hasher.digest() != checksum:
                    raise StreamFailure(
                        "checksum",
                        f"chunk {index} discarded: {CHECKSUM_NAME} {hasher.hexdigest()} of the bytes != "
                        f"{checksum.hex()} sent with them",
                    )
                with got.lock:
                    got.checksums[index] = bytes(checksum)
        except StreamFailure as e:
            fail(e)
        except TimeoutError:
            fail(StreamFailure("deadline", f"data plane {host}:{port}: deadline passed mid-chunk"))
        except (OSError, ssl.SSLError, ConnectionError) as e:
            if not stop.is_set():
                fail(StreamFailure("unavailable", f"data plane {host}:{port}, stream {stream}: {e}"))
        finally:
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


MAX_STREAMS = 16


def ticket_streams(requested: int, num_chunks: int) -> int:
    """Connections a ticket admits: what the fetcher asked for, at most one per chunk and
    :data:`MAX_STREAMS` (both sides compute it, so it needs no field of its own)."""
    return max(1, min(requested, num_chunks, MAX_STREAMS))
