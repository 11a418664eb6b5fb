"""The engine's hot-path client: Lookup, Retrieve, Store and Release to its agent over a plain Unix socket.

The frames, and why there is a hot path beside gRPC: :mod:`kvgrid.common.hotpath`; the agent's end:
:mod:`kvgrid.agent.hotpath`. One-way frames (only Release, :meth:`HotPathClient.send`): the agent
runs the call and answers nothing, so ending a lease costs the engine one ``send`` instead of a
round trip; its errors are counted in the agent but never reach the engine.

Invariants: the client keeps one connection per thread, sends its next request only after the
reply (or at once after a one-way frame), and makes no check per call: a connection the agent
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

import select
import socket
import threading
import time
from collections.abc import Callable

import grpc
from google.protobuf.message import DecodeError, Message

from kvgrid.common.hotpath import (
    METHOD_INDEX,
    ONE_WAY,
    ONE_WAY_METHODS,
    RESPONSE_TYPES,
    STATUS_CODES,
    frame,
    recv_frame,
)
from kvgrid.common.tracing import inject_headers

__all__ = ["HotPathAbsent", "HotPathClient", "HotPathError"]


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
        data = frame(METHOD_INDEX[method] + (ONE_WAY if one_way else 0), req.SerializeToString(), head)
        timeout = timeout_s or self.timeout_s
        sock, fresh = self._conn()
        while True:
            if self._local.timeout != timeout:  # a system call each time otherwise
                sock.settimeout(timeout)
                self._local.timeout = timeout
            try:
                sock.sendall(data, socket.MSG_NOSIGNAL)
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
            body = recv_frame(sock, 1 << 31)
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
                STATUS_CODES.get(status, grpc.StatusCode.UNKNOWN), body[1:].decode("utf-8", "replace")
            )
        try:
            return RESPONSE_TYPES[method].FromString(body[1:])
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
