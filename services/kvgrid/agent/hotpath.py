"""The engine's hot path to its agent: Lookup, Retrieve, Store and Release over a plain Unix socket.

Why: a unary gRPC call over the agent's Unix socket costs 0.6-0.8 ms of host time (grpcio's
completion queues and thread handoffs), and a request makes three or four of them (lookup, load,
store, release), while a round trip over a plain Unix socket costs ~20 us (``kvgrid bench agent
--hot-path`` measures both and the bare socket in one run). So the agent serves the engine's
per-request calls a second time on ``{uds_path}.hot``; registration, management and peers stay on
gRPC.

The same protobuf messages and the same servicer methods serve both transports, so validation,
errors and results are identical by construction; only the framing differs::

    request = u32 length | u8 method (index in HOT_METHODS; + 0x80: one-way) | u16 n | n bytes of
              W3C trace headers ("traceparent=...\\ntracestate=...") | the request message
    reply   = u32 length | u8 status (grpc.StatusCode value, 0 = OK) | the response message, or the
              error's text (UTF-8)

One-way frames (only Release, :meth:`HotPathClient.send`): the agent runs the call and sends
nothing back, so ending a lease costs the engine one ``send`` instead of a round trip. Its errors
(an unknown instance, a one-way frame of a method that must answer) are counted
(``kvgrid_rpc_server_calls`` with their code; logged at debug level only, since an engine may send
many) but never reach the engine.

Invariants and bounds:

- ``spin_us`` (config ``hot_path_spin_us``): after a call, its connection's thread polls for the
  next frame up to that long before it blocks in ``recv``, so an engine's next call finds it awake
  (a sleeping thread's wakeup costs tens of microseconds and its caches, measured:
  ``kvgrid bench hotpath``'s spaced flow). At most one thread polls at a time (the others sleep at
  once): a busy core, and the GIL taken only between polls.
- One thread per connection, frames run one at a time in the order sent: a call sent after a
  one-way Release on the same connection sees the release done. A client sends its next request
  only after the reply -- or at once after a one-way frame. A frame longer than
  ``max_message_bytes``, or a frame sent before the reply to the one before it, gets an
  INVALID_ARGUMENT reply (even if it was meant one-way) and the connection is closed (its stream
  position is lost); an unknown method or an undecodable message gets INVALID_ARGUMENT (one-way:
  counted) and the connection goes on. At most ``max_connections`` connections are served; more
  are closed at once.
- The socket is created with mode 0600 beside the gRPC socket: the same trust as the engine API.
- The client keeps one connection per thread, and makes no check per call: a connection the agent
  closed since the thread's last call (it stopped or restarted) fails the send at once, before that
  agent had the whole frame, which then goes once more on a new connection (to the new agent; no
  socket file: :class:`HotPathAbsent`, the caller goes over gRPC). A call that fails between sending
  and a whole reply (timeout, the agent gone) closes its connection, since a late reply would pair
  with the next request, and raises :class:`HotPathError` -- a ``grpc.RpcError`` and ``grpc.Call``
  with the code a gRPC call would have had (UNAVAILABLE, DEADLINE_EXCEEDED), so callers handle both
  alike. A one-way send fails only when the bytes cannot be sent (UNAVAILABLE); a Release the agent
  never ran (it went away) ended its leases anyway.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from kvgrid.api.v1 import agent_pb2
from kvgrid.common.errors import InvalidArgument
from kvgrid.common.rpc import RpcMetrics, deferring, run_deferred, status_of
from kvgrid.common.tracing import context_from_headers, exports_nothing, inject_headers, span_under

__all__ = [
    "HOT_METHODS",
    "ONE_WAY_METHODS",
    "HotPathAbsent",
    "HotPathClient",
    "HotPathError",
    "HotPathServer",
    "hot_path_of",
]

log = logging.getLogger(__name__)

HOT_METHODS = ("Lookup", "Retrieve", "Store", "Release")
_SERVICE = "kvgrid.v1.AgentService"
_REQUEST = {m: getattr(agent_pb2, f"{m}Request") for m in HOT_METHODS}
_RESPONSE = {m: getattr(agent_pb2, f"{m}Response") for m in HOT_METHODS}
_LEN = struct.Struct(">I")
_HEAD = struct.Struct(">BH")
_CODES = {c.value[0]: c for c in grpc.StatusCode}
_INDEX = {m: i for i, m in enumerate(HOT_METHODS)}
_ONE_WAY = 0x80  # added to the method byte: the caller reads no reply
ONE_WAY_METHODS = frozenset({"Release"})
_OK = grpc.StatusCode.OK
_INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]


def hot_path_of(uds_path: str) -> str:
    """Where an agent serving gRPC on ``uds_path`` serves the hot path."""
    return f"{uds_path}.hot"


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


def _recv_frame(sock: socket.socket, limit: int) -> bytes:
    """One frame's body (the client's reply reader). The first read asks for up to 64 KiB, so a
    small frame costs one system call, length included. ValueError for a length over ``limit``."""
    reader = _FrameReader(sock, limit)
    body = reader.next()
    if reader.rest:
        raise ValueError(
            f"hot path frame of {len(body)} bytes followed by {len(reader.rest)} more: expected one at a time"
        )
    return body


class _FrameReader:
    """The frames of one connection, in order. The first read asks for up to 64 KiB, so a small
    frame (every lookup, release, most retrieves and stores) costs one system call, length
    included; bytes read past a frame are kept in ``rest`` (the next frame's start: the client sent
    it without waiting, which only a one-way frame allows -- the caller checks)."""

    def __init__(
        self, sock: socket.socket, limit: int, spin_s: float = 0.0, spinning: threading.Lock | None = None
    ) -> None:
        self.sock, self.limit, self.rest = sock, limit, b""
        self.spin_s, self.spinning = spin_s, spinning
        self._poll: select.poll | None = None

    def _spin(self) -> None:
        """Poll the socket up to ``spin_s`` for the next frame, unless another thread polls."""
        if self.spinning is None or not self.spinning.acquire(blocking=False):
            return
        try:
            if self._poll is None:
                self._poll = select.poll()
                self._poll.register(self.sock, select.POLLIN)
            poll, end = self._poll.poll, time.perf_counter() + self.spin_s
            while not poll(0) and time.perf_counter() < end:
                pass
        finally:
            self.spinning.release()

    def next(self) -> bytes:
        """The next frame's body; EOFError when the peer closed between frames, ConnectionError
        inside one, ValueError for a length over ``limit`` (the rest of the frame is not read)."""
        buf, self.rest = self.rest, b""
        if not buf:
            if self.spin_s:
                self._spin()
            buf = self.sock.recv(65536)
            if not buf:
                raise EOFError
        while len(buf) < _LEN.size:
            more = self.sock.recv(65536)
            if not more:
                raise ConnectionError("connection closed inside a frame's length")
            buf += more
        (n,) = _LEN.unpack_from(buf)
        if n > self.limit:
            raise ValueError(f"hot path frame of {n} bytes: expected at most {self.limit}")
        end = _LEN.size + n
        if len(buf) >= end:
            self.rest = buf[end:]
            return buf[_LEN.size : end]
        return buf[_LEN.size :] + _recv_exact(self.sock, end - len(buf))


def _parent_of(head: bytes) -> Any:
    """The caller's trace context from a frame's header lines, None without a valid one."""
    return context_from_headers(
        dict(line.split("=", 1) for line in head.decode("utf-8", "replace").split("\n") if "=" in line)
    )


def _frame(kind: int, payload: bytes, head: bytes | None = None) -> bytes:
    if head is None:
        return _LEN.pack(1 + len(payload)) + bytes((kind,)) + payload
    return _LEN.pack(_HEAD.size + len(head) + len(payload)) + _HEAD.pack(kind, len(head)) + head + payload


class HotPathServer:
    """Serves :data:`HOT_METHODS` of ``servicer`` (the gRPC servicer object) on a Unix socket."""

    def __init__(
        self,
        path: str,
        servicer: Any,
        *,
        max_message_bytes: int,
        metrics: RpcMetrics,
        tracer: trace.Tracer | None = None,
        max_connections: int = 256,
        spin_us: int = 0,
    ) -> None:
        if spin_us < 0:
            raise ValueError(f"spin_us={spin_us}: expected >= 0 (0 = no polling)")
        self.path = path
        self.spin_s = spin_us / 1e6
        self._spinning = threading.Lock()  # held by the one thread polling, if any
        self.max_message_bytes = max_message_bytes
        self.max_connections = max_connections
        self._methods: dict[str, Callable[[Message], Message]] = {
            m: getattr(servicer, m) for m in HOT_METHODS
        }
        self._metrics = metrics
        self._tracer = tracer or trace.get_tracer("kvgrid.agent")
        self._sock: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stopping = False

    def start(self) -> HotPathServer:
        p = Path(self.path)
        if p.is_socket():
            p.unlink()  # a previous run's
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # created 0600: no window in which others may connect
        try:
            sock.bind(self.path)
        finally:
            os.umask(old)
        sock.listen(64)
        self._sock = sock
        threading.Thread(target=self._accept_loop, name="kvgrid-hot-accept", daemon=True).start()
        return self

    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self._stopping:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed by stop()
            with self._lock:
                full = len(self._conns) >= self.max_connections
                if not full:
                    self._conns.add(conn)
            if full:
                log.warning("hot path: %d connections already; refused one", self.max_connections)
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="kvgrid-hot", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        frames = _FrameReader(conn, self.max_message_bytes, self.spin_s, self._spinning)
        try:
            while True:
                try:
                    body = frames.next()
                except EOFError:
                    return  # the engine closed the connection between calls
                except ValueError as e:  # too long: the stream position is lost
                    conn.sendall(_frame(_INVALID, str(e).encode()))
                    return
                if len(body) < _HEAD.size:
                    text = f"hot path frame of {len(body)} bytes: expected at least {_HEAD.size}"
                    conn.sendall(_frame(_INVALID, text.encode()))
                    return
                if frames.rest and not body[0] & _ONE_WAY:  # sent before this frame's reply
                    text = (
                        f"hot path frame of {len(body)} bytes followed by {len(frames.rest)} more: "
                        "expected one at a time (only a one-way frame may be followed at once)"
                    )
                    conn.sendall(_frame(_INVALID, text.encode()))
                    return
                with deferring() as work:  # the core's metric updates (common/rpc.after_reply)
                    reply, method, code, seconds = self._call(body)
                try:
                    if reply is not None:
                        conn.sendall(reply)
                finally:
                    # After the reply, sent or not (the work was done): the engine does not wait for
                    # the bookkeeping (~6 us a metric update with a Prometheus reader, a handful a call).
                    self._metrics.record(method, code, seconds)
                    run_deferred(work)
        except OSError:
            return  # the peer went away mid-frame
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _call(self, body: bytes) -> tuple[bytes | None, str, grpc.StatusCode, float]:
        """The reply frame to one request frame (None for a one-way frame: its errors are counted),
        and what the metrics record of the call: method, status code, seconds."""
        kind, head_len = _HEAD.unpack_from(body)
        one_way = kind >= _ONE_WAY
        kind &= ~_ONE_WAY
        method = HOT_METHODS[kind] if kind < len(HOT_METHODS) else f"#{kind}"
        t0 = time.perf_counter()
        parent = _parent_of(body[_HEAD.size : _HEAD.size + head_len]) if head_len else None
        if parent is None and exports_nothing(self._tracer):
            # Nothing to trace and no caller context to carry on: no span (~2 us a call).
            code, reply = self._run(kind, method, body, _HEAD.size + head_len, one_way)
        else:
            with span_under(self._tracer, _SERVICE, method, parent) as span:
                code, reply = self._run(kind, method, body, _HEAD.size + head_len, one_way)
                if span.is_recording():  # the same attributes a gRPC server span carries (common/rpc.py)
                    span.set_attribute("rpc.grpc.status_code", code.value[0])
                    span.set_attribute("kvgrid.transport", "hotpath")
                    if one_way:
                        span.set_attribute("kvgrid.one_way", True)
                    if code is not _OK:
                        span.set_status(Status(StatusCode.ERROR, code.name))
        return None if one_way else reply, method, code, time.perf_counter() - t0

    def _run(
        self, kind: int, method: str, body: bytes, offset: int, one_way: bool
    ) -> tuple[grpc.StatusCode, bytes]:
        """(status, reply frame) of the call; a one-way call's errors are logged (debug) here instead."""
        try:
            if kind >= len(HOT_METHODS):
                raise InvalidArgument(
                    f"hot path method {kind}: expected 0..{len(HOT_METHODS) - 1} {HOT_METHODS}"
                )
            if one_way and method not in ONE_WAY_METHODS:
                raise InvalidArgument(
                    f"one-way {method}: expected a two-way frame "
                    f"(only {sorted(ONE_WAY_METHODS)} may be one-way)"
                )
            try:
                req = _REQUEST[method].FromString(body[offset:])
            except DecodeError as e:
                raise InvalidArgument(f"malformed {method}Request message: {e}") from None
            return _OK, _frame(0, self._methods[method](req).SerializeToString())
        except Exception as exc:
            code, detail = status_of(method, exc)
            if code is grpc.StatusCode.INTERNAL:
                log.error("hot path %s failed", method, exc_info=exc)
            elif one_way:  # counted in the RPC metrics; not a warning each: an engine can send many
                log.debug("hot path one-way %s failed: %s: %s", method, code.name, detail)
            return code, _frame(code.value[0], detail.encode())

    def stop(self) -> None:
        self._stopping = True
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        Path(self.path).unlink(missing_ok=True)


class HotPathError(grpc.RpcError, grpc.Call):
    """A failed hot-path call, shaped like a failed gRPC call (``code()``, ``details()``)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def initial_metadata(self) -> tuple[()]:
        return ()

    def trailing_metadata(self) -> tuple[()]:
        return ()

    def is_active(self) -> bool:
        return False

    def time_remaining(self) -> float:
        return 0.0

    def cancel(self) -> bool:
        return False

    def add_callback(self, callback: Callable[[], None]) -> bool:
        return False


class HotPathAbsent(HotPathError):
    """The agent serves no hot path (no socket file): the caller goes over gRPC instead."""


class HotPathClient:
    """Calls :data:`HOT_METHODS` on an agent's hot-path socket; one connection per thread."""

    def __init__(self, path: str, *, timeout_s: float = 60.0, spin_us: int = 0) -> None:
        """``spin_us``: after sending, poll the connection (without sleeping) up to this long before
        blocking for the reply. Sleeping and being woken costs ~25 us a call on a small VM, so a
        spin that outlasts the agent's answer saves that; the price is this core (and the GIL,
        released only inside each poll) for up to ``spin_us`` a call, and with no core to spare the
        spin delays the agent instead (measured: worse). 0: block at once."""
        if spin_us < 0:
            raise ValueError(f"spin_us={spin_us}: expected >= 0 (0 = no spinning)")
        self.path = path
        self.timeout_s = timeout_s
        self.spin_s = spin_us / 1e6
        self._local = threading.local()
        self._all: list[socket.socket] = []
        self._lock = threading.Lock()

    def _conn(self) -> tuple[socket.socket, bool]:
        """This thread's connection, and whether it was made just now. No socket file:
        :class:`HotPathAbsent`."""
        sock: socket.socket | None = getattr(self._local, "sock", None)
        if sock is not None:
            return sock, False
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self.path)
        except FileNotFoundError as e:
            sock.close()
            raise HotPathAbsent(grpc.StatusCode.UNAVAILABLE, f"agent hot path {self.path}: {e}") from None
        except OSError as e:
            sock.close()
            raise HotPathError(grpc.StatusCode.UNAVAILABLE, f"agent hot path {self.path}: {e}") from None
        self._local.sock, self._local.timeout = sock, None
        if self.spin_s:
            self._local.poller = select.poll()
            self._local.poller.register(sock, select.POLLIN)
        with self._lock:  # closed ones (dropped after a failure or a restart) go
            self._all = [s for s in self._all if s.fileno() != -1] + [sock]
        return sock, True

    def _drop(self) -> None:
        sock = getattr(self._local, "sock", None)
        self._local.sock = None
        if sock is not None:
            sock.close()

    def _request(self, method: str, req: Message, one_way: bool, timeout_s: float | None) -> socket.socket:
        """Send ``req`` as one frame (one system call) on this thread's connection; the connection.

        A connection the agent closed since this thread's last call (it stopped or restarted) fails
        the send at once (EPIPE: that agent never had the whole frame, so never ran it), and the
        frame goes once more on a new connection: the first call after a restart reaches the new
        agent, or learns there is none (no socket file: :class:`HotPathAbsent`), without a check on
        every call."""
        headers = inject_headers()
        head = "\n".join(f"{k}={v}" for k, v in headers.items()).encode() if headers else b""
        frame = _frame(_INDEX[method] + (_ONE_WAY if one_way else 0), req.SerializeToString(), head)
        timeout = timeout_s or self.timeout_s
        sock, fresh = self._conn()
        while True:
            if self._local.timeout != timeout:  # a system call each time otherwise
                sock.settimeout(timeout)
                self._local.timeout = timeout
            try:
                sock.sendall(frame, socket.MSG_NOSIGNAL)
                return sock
            except TimeoutError:
                self._drop()
                raise HotPathError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"agent hot path {method}: could not send in {timeout} s",
                ) from None
            except OSError as e:
                self._drop()
                if fresh:
                    raise HotPathError(
                        grpc.StatusCode.UNAVAILABLE, f"agent hot path {method}: {e!r}"
                    ) from None
            sock, fresh = self._conn()  # the agent closed the old one: once more on a new one

    def call(self, method: str, req: Message, timeout_s: float | None = None) -> Message:
        """``method``'s response, or :class:`HotPathError` with the agent's status and text."""
        sock = self._request(method, req, False, timeout_s)
        if self.spin_s:
            self._spin()
        try:
            body = _recv_frame(sock, 1 << 31)
        except TimeoutError:
            self._drop()
            raise HotPathError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"agent hot path {method}: no reply in {timeout_s or self.timeout_s} s",
            ) from None
        except (OSError, EOFError, ValueError) as e:
            self._drop()
            raise HotPathError(grpc.StatusCode.UNAVAILABLE, f"agent hot path {method}: {e!r}") from None
        status = body[0]
        if status:
            raise HotPathError(
                _CODES.get(status, grpc.StatusCode.UNKNOWN), body[1:].decode("utf-8", "replace")
            )
        try:
            return _RESPONSE[method].FromString(body[1:])
        except DecodeError as e:
            self._drop()
            raise HotPathError(grpc.StatusCode.INTERNAL, f"agent hot path {method}: bad reply: {e}") from None

    def _spin(self) -> None:
        """Return once this thread's connection has bytes to read or ``spin_s`` passed."""
        poller = self._local.poller
        end = time.perf_counter() + self.spin_s
        while not poller.poll(0) and time.perf_counter() < end:
            pass

    def send(self, method: str, req: Message, timeout_s: float | None = None) -> None:
        """Send ``method`` one-way (one of :data:`ONE_WAY_METHODS`): the agent runs it after this
        thread's earlier calls and before its later ones, and answers nothing (its errors are
        counted there). :class:`HotPathError` only when the frame cannot be sent."""
        if method not in ONE_WAY_METHODS:
            raise ValueError(f"one-way {method}: expected one of {sorted(ONE_WAY_METHODS)}")
        self._request(method, req, True, timeout_s)

    def close(self) -> None:
        with self._lock:
            socks, self._all = self._all, []
        for s in socks:
            s.close()
