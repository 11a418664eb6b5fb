"""The hot path's frame protocol: the engine's per-request calls to its agent on a plain Unix socket.

Why: a unary gRPC call over the agent's Unix socket costs 0.6-0.8 ms of host time (grpcio's
completion queues and thread handoffs), and a request makes three or four of them (lookup, load,
store, release), while a round trip over a plain Unix socket costs ~20 us (``kvgrid bench agent
--hot-path`` measures both and the bare socket in one run). So the agent serves the engine's
per-request calls a second time on ``{uds_path}.hot`` (:func:`hot_path_of`); registration,
management and peers stay on gRPC. Both ends use this module: the agent's server
(:mod:`kvgrid.agent.hotpath`) and the engine's client (:mod:`kvgrid.engine.hotpath`).

The same protobuf messages and the same servicer methods serve both transports, so validation,
errors and results are identical by construction; only the framing differs::

    request = u32 length | u8 method (index in HOT_METHODS; + 0x80: one-way) | u16 n | n bytes of
              W3C trace headers ("traceparent=...\\ntracestate=...") | the request message
    reply   = u32 length | u8 status (grpc.StatusCode value, 0 = OK) | the response message, or the
              error's text (UTF-8)

One-way frames (only :data:`ONE_WAY_METHODS`, i.e. Release): the agent runs the call and sends
nothing back, so ending a lease costs the engine one ``send`` instead of a round trip.

Invariants: frames on one connection run one at a time in the order sent; a client sends its next
request only after the reply -- or at once after a one-way frame (:class:`FrameReader` keeps the
bytes read past a frame in ``rest``, so the reader can tell).
"""

from __future__ import annotations

import select
import socket
import struct
import threading
import time

import grpc

from kvgrid.api.v1 import agent_pb2

__all__ = [
    "HEAD",
    "HOT_METHODS",
    "LEN",
    "METHOD_INDEX",
    "ONE_WAY",
    "ONE_WAY_METHODS",
    "REQUEST_TYPES",
    "RESPONSE_TYPES",
    "SERVICE",
    "STATUS_CODES",
    "FrameReader",
    "frame",
    "hot_path_of",
    "recv_frame",
]

HOT_METHODS = ("Lookup", "Retrieve", "Store", "Release")
SERVICE = "kvgrid.v1.AgentService"
REQUEST_TYPES = {m: getattr(agent_pb2, f"{m}Request") for m in HOT_METHODS}
RESPONSE_TYPES = {m: getattr(agent_pb2, f"{m}Response") for m in HOT_METHODS}
LEN = struct.Struct(">I")
HEAD = struct.Struct(">BH")
STATUS_CODES = {c.value[0]: c for c in grpc.StatusCode}
METHOD_INDEX = {m: i for i, m in enumerate(HOT_METHODS)}
ONE_WAY = 0x80  # added to the method byte: the caller reads no reply
ONE_WAY_METHODS = frozenset({"Release"})


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


def recv_frame(sock: socket.socket, limit: int) -> bytes:
    """One frame's body (the client's reply reader). The first read asks for up to 64 KiB, so a
    small frame costs one system call, length included. ValueError for a length over ``limit``."""
    reader = FrameReader(sock, limit)
    body = reader.next()
    if reader.rest:
        raise ValueError(
            f"hot path frame of {len(body)} bytes followed by {len(reader.rest)} more: expected one at a time"
        )
    return body


class FrameReader:
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
        while len(buf) < LEN.size:
            more = self.sock.recv(65536)
            if not more:
                raise ConnectionError("connection closed inside a frame's length")
            buf += more
        (n,) = LEN.unpack_from(buf)
        if n > self.limit:
            raise ValueError(f"hot path frame of {n} bytes: expected at most {self.limit}")
        end = LEN.size + n
        if len(buf) >= end:
            self.rest = buf[end:]
            return buf[LEN.size : end]
        return buf[LEN.size :] + _recv_exact(self.sock, end - len(buf))


def frame(kind: int, payload: bytes, head: bytes | None = None) -> bytes:
    """A whole frame: a reply (``kind`` is the status; no ``head``) or a request (``kind`` is the
    method byte, ``head`` the trace header lines, possibly empty)."""
    if head is None:
        return LEN.pack(1 + len(payload)) + bytes((kind,)) + payload
    return LEN.pack(HEAD.size + len(head) + len(payload)) + HEAD.pack(kind, len(head)) + head + payload
