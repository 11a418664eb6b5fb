"""Connection plumbing both ends of the data plane share: socket tuning, connecting (with TLS when
the ticket says so), bounded receives straight into a buffer, and the helper thread that overlaps a
connection's hashing or crypto with its socket copies.

Invariants: :func:`recv_exact_into` fills its whole view or raises (``ConnectionError`` on a
hang-up, ``TimeoutError`` once :func:`receive_deadline`'s time passed), so a chunk is never taken
for complete when it is not; :class:`Behind` starts a step only after the previous one finished,
so the order of a connection's bytes and hashes holds.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import struct
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import xxhash

from kvgrid.agent.peers.dataplane.protocol import PIECE_BYTES
from kvgrid.common.tls import AGENT_SERVER_NAME

__all__ = ["Behind", "connect", "receive_deadline", "recv_exact_into", "tune"]

_SOCKET_BUFFER = 4 << 20  # larger kernel buffers: fewer wake-ups per 32 MiB chunk


class Behind:
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


def tune(sock: socket.socket) -> None:
    """No Nagle delay, larger kernel buffers (both ends of a data connection)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, _SOCKET_BUFFER)


def connect(host: str, port: int, timeout_s: float, tls: ssl.SSLContext | None) -> socket.socket:
    """A tuned connection to a data port (over TLS with ``tls``, checking the agent role name)."""
    sock = socket.create_connection((host, port), timeout=timeout_s)
    try:
        tune(sock)
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
