"""The data port's server (:class:`DataPlaneServer`): accepts connections, admits those that
present a live ticket, and sends each admitted stream its chunks from L1 in the ticket's framing.

Tickets are issued here (:meth:`DataPlaneServer.issue`) by the ``FetchChunks`` servicer, only over
the authorized control plane, and retired when that gRPC stream ends. The protocol and its
security invariants are :mod:`kvgrid.agent.peers.dataplane.protocol`'s.

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
- A ticket is served only in its own mode, to its own identity: a ``tls`` ticket on a connection
  whose client certificate names that identity, a ``mac`` or ``aead`` one with a hello MACed under
  the ticket's key.
"""

from __future__ import annotations

import collections
import contextlib
import hmac
import itertools
import logging
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence

from kvgrid.agent.cache import ChunkCache
from kvgrid.agent.l1 import Chunk
from kvgrid.agent.peers.dataplane.aead import AeadSender
from kvgrid.agent.peers.dataplane.checksummed import send_checksummed
from kvgrid.agent.peers.dataplane.keys import check_security_dependencies, dependencies_present, hello_tag
from kvgrid.agent.peers.dataplane.mac import send_mac
from kvgrid.agent.peers.dataplane.protocol import (
    DEFAULT_SECURITY,
    HELLO,
    HELLO_TAG_BYTES,
    HELLO_TIMEOUT_S,
    IDLE_TIMEOUT_S,
    MAGIC,
    MAGIC_MODE,
    MAX_CONNECTIONS,
    MAX_UNAUTHENTICATED,
    SECURITY_MODES,
    TLS_HANDSHAKE,
    stream_indices,
    ticket_security,
)
from kvgrid.agent.peers.dataplane.sockets import Behind, tune
from kvgrid.agent.peers.dataplane.tickets import Ticket
from kvgrid.agent.peers.dataplane.tls_contexts import ServerContexts, peer_sans
from kvgrid.common.tls import TlsFiles

__all__ = ["DataPlaneServer"]

log = logging.getLogger(__name__)


class _Unauthenticated:
    """A connection that has not presented a live ticket yet (its socket's file descriptor stays
    open while it is registered: its thread deregisters it before closing it)."""

    __slots__ = ("fd", "peer")

    def __init__(self, fd: int, peer: object) -> None:
        self.fd, self.peer = fd, peer


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
        self._servable = {m for m in SECURITY_MODES if dependencies_present(m)}
        self.tls = tls
        self.security = security if tls is not None else "plain"
        self._contexts = ServerContexts(tls) if tls is not None else None
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
        admitted: tuple[Ticket, int] | None = None
        try:
            tune(conn)
            tls = False
            # With TLS configured a connection may start a TLS handshake (tls tickets) or send a
            # plaintext hello (mac and aead tickets, whose hello is MACed): its first byte tells.
            if self._contexts is not None and _peek_until(conn, deadline) == TLS_HANDSHAKE:
                conn = self._contexts.get().wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
                _handshake_until(conn, deadline)
                tls = True
            admitted = self._admit(conn, peer, deadline, tls)
            if admitted is None:
                return
            ticket, stream = admitted
            self._authenticated(key)
            self.admitted += 1
            self.admitted_modes[ticket.security] += 1
            # From here a piece the reader does not take within the idle timeout ends it.
            conn.settimeout(self.idle_timeout_s)
            self._send(conn, ticket, stream)
        except TimeoutError as e:
            if admitted is None:
                self.refused += 1
            log.info("data plane: connection from %s timed out: %s", peer, e)
        except (OSError, ssl.SSLError, ConnectionError) as e:
            log.info("data plane: connection from %s ended: %s", peer, e)
        finally:
            # Only a connection that claimed a stream ends one: the ticket's secret crosses the
            # network in mac and aead hellos, so naming it (without the key's MAC) must not be
            # enough to close the ticket on its fetcher.
            if admitted is not None:
                admitted[0].stream_ended()
            self._authenticated(key)  # before the close: the descriptor must not be shut once reused
            conn.close()
            with self._lock:
                self._connections -= 1

    def _admit(
        self, conn: socket.socket, peer: object, deadline: float, tls: bool
    ) -> tuple[Ticket, int] | None:
        """Read the hello and check it names a live ticket this connection may use: the ticket and
        the stream index it claimed, or None when refused (counted and logged)."""
        hello = bytearray(HELLO.size)
        _recv_until(conn, memoryview(hello), deadline)
        magic, secret, stream = HELLO.unpack(hello)
        mode = ("tls" if tls else "plain") if magic == MAGIC else MAGIC_MODE.get(magic, "")
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
            return None
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
                return None
        elif ticket is not None and ticket.identity and ticket.identity not in peer_sans(conn):
            self.refused += 1
            log.warning(
                "data plane: %s refused: its ticket was issued to %r, the connection's certificate names %s",
                peer,
                ticket.identity,
                peer_sans(conn) or "nothing",
            )
            return None
        if ticket is None or not ticket.claim(stream):
            self.refused += 1
            log.warning("data plane: %s refused: no live ticket for stream %d", peer, stream)
            return None
        return ticket, stream

    def _send(self, conn: socket.socket, ticket: Ticket, stream: int) -> None:
        behind = Behind() if ticket.security in ("mac", "aead") else None
        aead = AeadSender(ticket, behind) if behind is not None and ticket.security == "aead" else None
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
                        send_mac(conn, data, ticket, index, behind)
                    else:
                        send_checksummed(conn, data, chunk)
                finally:
                    if behind is not None:
                        behind.close_step()  # its helper reads the chunk: done before it is released
                    ticket.sent(index)
                if self.on_sent is not None:
                    self.on_sent(chunk.nbytes)
        finally:
            if behind is not None:
                behind.close()


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
