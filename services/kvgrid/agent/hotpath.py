"""The agent's hot-path server: the engine's Lookup, Retrieve, Store and Release on ``{uds_path}.hot``.

The frames, and why there is a hot path beside gRPC: :mod:`kvgrid.common.hotpath`. The same
servicer methods serve both transports, so validation, errors and results are identical by
construction. One-way frames (only Release): the agent runs the call and sends nothing back; its
errors (an unknown instance, a one-way frame of a method that must answer) are counted
(``kvgrid_rpc_server_calls`` with their code; logged at debug level only, since an engine may send
many) but never reach the engine.

Invariants and bounds:

- ``spin_us`` (config ``hot_path_spin_us``): after a call, its connection's thread polls for the
  next frame up to that long before it blocks in ``recv``, so an engine's next call finds it awake
  (a sleeping thread's wakeup costs tens of microseconds and its caches, measured:
  ``kvgrid bench hotpath``'s spaced flow). At most one thread polls at a time (the others sleep at
  once): a busy core, and the GIL taken only between polls.
- One thread per connection, frames run one at a time in the order sent: a call sent after a
  one-way Release on the same connection sees the release done. A frame longer than
  ``max_message_bytes``, or a frame sent before the reply to the one before it, gets an
  INVALID_ARGUMENT reply (even if it was meant one-way) and the connection is closed (its stream
  position is lost); an unknown method or an undecodable message gets INVALID_ARGUMENT (one-way:
  counted) and the connection goes on. At most ``max_connections`` connections are served; more
  are closed at once.
- The socket is created with mode 0600 beside the gRPC socket: the same trust as the engine API.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from kvgrid.common.errors import InvalidArgument
from kvgrid.common.hotpath import (
    HEAD,
    HOT_METHODS,
    ONE_WAY,
    ONE_WAY_METHODS,
    REQUEST_TYPES,
    SERVICE,
    FrameReader,
    frame,
)
from kvgrid.common.rpc import RpcMetrics, deferring, run_deferred, status_of
from kvgrid.common.tracing import context_from_headers, exports_nothing, span_under

__all__ = ["HotPathServer"]

log = logging.getLogger(__name__)

_OK = grpc.StatusCode.OK
_INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]


def _parent_of(head: bytes) -> Any:
    """The caller's trace context from a frame's header lines, None without a valid one."""
    return context_from_headers(
        dict(line.split("=", 1) for line in head.decode("utf-8", "replace").split("\n") if "=" in line)
    )


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
        frames = FrameReader(conn, self.max_message_bytes, self.spin_s, self._spinning)
        try:
            while True:
                try:
                    body = frames.next()
                except EOFError:
                    return  # the engine closed the connection between calls
                except ValueError as e:  # too long: the stream position is lost
                    conn.sendall(frame(_INVALID, str(e).encode()))
                    return
                if len(body) < HEAD.size:
                    text = f"hot path frame of {len(body)} bytes: expected at least {HEAD.size}"
                    conn.sendall(frame(_INVALID, text.encode()))
                    return
                if frames.rest and not body[0] & ONE_WAY:  # sent before this frame's reply
                    text = (
                        f"hot path frame of {len(body)} bytes followed by {len(frames.rest)} more: "
                        "expected one at a time (only a one-way frame may be followed at once)"
                    )
                    conn.sendall(frame(_INVALID, text.encode()))
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
        kind, head_len = HEAD.unpack_from(body)
        one_way = kind >= ONE_WAY
        kind &= ~ONE_WAY
        method = HOT_METHODS[kind] if kind < len(HOT_METHODS) else f"#{kind}"
        t0 = time.perf_counter()
        parent = _parent_of(body[HEAD.size : HEAD.size + head_len]) if head_len else None
        if parent is None and exports_nothing(self._tracer):
            # Nothing to trace and no caller context to carry on: no span (~2 us a call).
            code, reply = self._run(kind, method, body, HEAD.size + head_len, one_way)
        else:
            with span_under(self._tracer, SERVICE, method, parent) as span:
                code, reply = self._run(kind, method, body, HEAD.size + head_len, one_way)
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
                req = REQUEST_TYPES[method].FromString(body[offset:])
            except DecodeError as e:
                raise InvalidArgument(f"malformed {method}Request message: {e}") from None
            return _OK, frame(0, self._methods[method](req).SerializeToString())
        except Exception as exc:
            code, detail = status_of(method, exc)
            if code is grpc.StatusCode.INTERNAL:
                log.error("hot path %s failed", method, exc_info=exc)
            elif one_way:  # counted in the RPC metrics; not a warning each: an engine can send many
                log.debug("hot path one-way %s failed: %s: %s", method, code.name, detail)
            return code, frame(code.value[0], detail.encode())

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
