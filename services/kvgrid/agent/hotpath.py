"""The engine's hot path to its agent: Lookup, Retrieve, Store and Release over a plain Unix socket.

Why: a unary gRPC call over the agent's Unix socket costs 0.6-0.8 ms of host time (grpcio's
completion queues and thread handoffs), and a request makes three or four of them (lookup, load,
store, release), while a round trip over a plain Unix socket costs ~20 us (``kvgrid bench agent
--hot-path`` measures both and the bare socket in one run). So the agent serves the engine's
per-request calls a second time on ``{uds_path}.hot``; registration, management and peers stay on
gRPC.

The same protobuf messages and the same servicer methods serve both transports, so validation,
errors and results are identical by construction; only the framing differs::

    request = u32 length | u8 method (index in HOT_METHODS) | u16 n | n bytes of W3C trace headers
              ("traceparent=...\\ntracestate=...") | the request message
    reply   = u32 length | u8 status (grpc.StatusCode value, 0 = OK) | the response message, or the
              error's text (UTF-8)

Invariants and bounds:

- One thread per connection, one call at a time on it: a client sends its next request only after
  the reply. A frame longer than ``max_message_bytes``, or a second frame sent before the reply,
  gets an INVALID_ARGUMENT reply and the connection is closed (its stream position is lost); an
  unknown method or an undecodable message gets INVALID_ARGUMENT and the connection goes on. At
  most ``max_connections`` connections are served; more are closed at once.
- The socket is created with mode 0600 beside the gRPC socket: the same trust as the engine API.
- The client keeps one connection per thread. A call that fails between sending and a whole reply
  (timeout, the agent gone) closes its connection, since a late reply would pair with the next
  request, and raises :class:`HotPathError` -- a ``grpc.RpcError`` and ``grpc.Call`` with the code a
  gRPC call would have had (UNAVAILABLE, DEADLINE_EXCEEDED), so callers handle both alike.
"""

from __future__ import annotations

import contextlib
import logging
import os
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
from kvgrid.common.rpc import RpcMetrics, status_of
from kvgrid.common.tracing import context_from_headers, inject_headers, span_under

__all__ = ["HOT_METHODS", "HotPathAbsent", "HotPathClient", "HotPathError", "HotPathServer", "hot_path_of"]

log = logging.getLogger(__name__)

HOT_METHODS = ("Lookup", "Retrieve", "Store", "Release")
_SERVICE = "kvgrid.v1.AgentService"
_REQUEST = {m: getattr(agent_pb2, f"{m}Request") for m in HOT_METHODS}
_RESPONSE = {m: getattr(agent_pb2, f"{m}Response") for m in HOT_METHODS}
_LEN = struct.Struct(">I")
_HEAD = struct.Struct(">BH")
_CODES = {c.value[0]: c for c in grpc.StatusCode}


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
    """One frame's body. The first read asks for up to 64 KiB, so a small frame (every lookup,
    release, most retrieves and stores) costs one system call, length included. ValueError for a
    length over ``limit`` (the rest of the frame is not read)."""
    first = sock.recv(65536)
    if not first:
        raise EOFError
    while len(first) < _LEN.size:
        more = sock.recv(65536)
        if not more:
            raise ConnectionError("connection closed inside a frame's length")
        first += more
    (n,) = _LEN.unpack_from(first)
    if n > limit:
        raise ValueError(f"hot path frame of {n} bytes: expected at most {limit}")
    body = first[_LEN.size :]
    if len(body) > n:
        raise ValueError(
            f"hot path frame of {n} bytes followed by {len(body) - n} more: expected one at a time"
        )
    return body if len(body) == n else body + _recv_exact(sock, n - len(body))


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
    ) -> None:
        self.path = path
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
        try:
            while True:
                try:
                    body = _recv_frame(conn, self.max_message_bytes)
                except EOFError:
                    return  # the engine closed the connection between calls
                except ValueError as e:  # too long, or pipelined: the stream position is lost
                    conn.sendall(_frame(grpc.StatusCode.INVALID_ARGUMENT.value[0], str(e).encode()))
                    return
                if len(body) < _HEAD.size:
                    text = f"hot path frame of {len(body)} bytes: expected at least {_HEAD.size}"
                    conn.sendall(_frame(grpc.StatusCode.INVALID_ARGUMENT.value[0], text.encode()))
                    return
                conn.sendall(self._call(body))
        except OSError:
            return  # the peer went away mid-frame
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _call(self, body: bytes) -> bytes:
        kind, head_len = _HEAD.unpack_from(body)
        method = HOT_METHODS[kind] if kind < len(HOT_METHODS) else f"#{kind}"
        t0 = time.perf_counter()
        headers = dict(
            line.split("=", 1)
            for line in body[_HEAD.size : _HEAD.size + head_len].decode("utf-8", "replace").split("\n")
            if "=" in line
        )
        with span_under(self._tracer, _SERVICE, method, context_from_headers(headers)) as span:
            try:
                if kind >= len(HOT_METHODS):
                    raise InvalidArgument(
                        f"hot path method {kind}: expected 0..{len(HOT_METHODS) - 1} {HOT_METHODS}"
                    )
                try:
                    req = _REQUEST[method].FromString(body[_HEAD.size + head_len :])
                except DecodeError as e:
                    raise InvalidArgument(f"malformed {method}Request message: {e}") from None
                reply = _frame(0, self._methods[method](req).SerializeToString())
                code = grpc.StatusCode.OK
            except Exception as exc:
                code, detail = status_of(method, exc)
                if code is grpc.StatusCode.INTERNAL:
                    log.error("hot path %s failed", method, exc_info=exc)
                reply = _frame(code.value[0], detail.encode())
            if span.is_recording():  # the same attributes a gRPC server span carries (common/rpc.py)
                span.set_attribute("rpc.grpc.status_code", code.value[0])
                span.set_attribute("kvgrid.transport", "hotpath")
                if code is not grpc.StatusCode.OK:
                    span.set_status(Status(StatusCode.ERROR, code.name))
        self._metrics.record(method, code, time.perf_counter() - t0)
        return reply

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

    def __init__(self, path: str, *, timeout_s: float = 60.0) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self._local = threading.local()
        self._all: list[socket.socket] = []
        self._lock = threading.Lock()

    def _conn(self) -> socket.socket:
        """This thread's connection. A restarted agent made a new socket file (another inode): a
        connection to the old one is dropped before it is used, so the first call after a restart
        reaches the new agent instead of failing on a dead peer. No socket file: :class:`HotPathAbsent`
        (the one stat per call is both the presence check and the restart check)."""
        try:
            ino = os.stat(self.path).st_ino
        except FileNotFoundError as e:
            raise HotPathAbsent(grpc.StatusCode.UNAVAILABLE, f"agent hot path {self.path}: {e}") from None
        except OSError as e:
            raise HotPathError(grpc.StatusCode.UNAVAILABLE, f"agent hot path {self.path}: {e}") from None
        sock: socket.socket | None = getattr(self._local, "sock", None)
        if sock is not None and getattr(self._local, "ino", None) != ino:
            self._drop()
            sock = None
        if sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(self.path)
            except OSError as e:
                sock.close()
                raise HotPathError(grpc.StatusCode.UNAVAILABLE, f"agent hot path {self.path}: {e}") from None
            self._local.sock, self._local.ino = sock, ino
            with self._lock:  # closed ones (dropped after a failure or a restart) go
                self._all = [s for s in self._all if s.fileno() != -1] + [sock]
        return sock

    def _drop(self) -> None:
        sock = getattr(self._local, "sock", None)
        self._local.sock = None
        if sock is not None:
            sock.close()

    def call(self, method: str, req: Message, timeout_s: float | None = None) -> Message:
        """``method``'s response, or :class:`HotPathError` with the agent's status and text."""
        sock = self._conn()
        head = "\n".join(f"{k}={v}" for k, v in inject_headers().items()).encode()
        frame = _frame(HOT_METHODS.index(method), req.SerializeToString(), head)
        sock.settimeout(timeout_s or self.timeout_s)
        try:
            sock.sendall(frame)
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

    def close(self) -> None:
        with self._lock:
            socks, self._all = self._all, []
        for s in socks:
            s.close()
