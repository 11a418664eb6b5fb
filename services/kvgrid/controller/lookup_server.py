"""A lean lookup listener: MatchPrefix / BatchMatchPrefix as length-prefixed frames over TCP.

Why it exists: on this project's 2-core box a Python gRPC round trip costs ~0.8-0.9 ms at one
call in flight even for a bare echo (sync or asyncio server, sync or asyncio client:
docs/controller.md "Single queries over the network"), several times the lookup itself, so a
router asking once per request could not beat a native HTTP indexer through gRPC. This listener
carries the *same protobuf messages* as the gRPC methods over a plain asyncio TCP stream and
answers from the same :class:`~kvgrid.controller.core.Controller`, so answers are byte-identical
to gRPC's (tested).

Frames (little-endian)::

    request:  u32 length | u8 method | body      (length = 1 + len(body))
    response: u32 length | u8 status | body      (status: the gRPC status code number)

Methods: 1 = MatchPrefix (body ``MatchPrefixRequest``, answer ``MatchPrefixResponse``), 2 =
BatchMatchPrefix (``BatchMatchPrefixRequest`` -> ``BatchMatchPrefixResponse``). On an error the
body is the UTF-8 text gRPC would send (INVALID_ARGUMENT naming the bad value, UNIMPLEMENTED for
an unknown method byte); the connection keeps serving. A frame longer than ``max_frame_bytes`` is
answered RESOURCE_EXHAUSTED and the connection is closed (its body is not read). Requests of one
connection are answered in order; connections are served concurrently by one event loop thread.

Invariants: only lookups (no writes, no agent methods), so it needs no per-method authorization
beyond who may connect. It binds loopback only unless given an ``ssl.SSLContext`` (the caller's
mTLS context); ``kvgrid controller`` does not start it yet (see docs/controller.md).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import ssl
import struct
import threading
from collections.abc import Callable
from typing import TypeVar

from google.protobuf.message import DecodeError

from kvgrid.api.v1 import controller_pb2
from kvgrid.common.errors import InvalidArgument, KvgridError, Unavailable, within
from kvgrid.common.rpc import status_of
from kvgrid.controller import wire
from kvgrid.controller.core import Controller

__all__ = ["METHOD_BATCH_MATCH", "METHOD_MATCH", "LookupClient", "LookupFailed", "LookupServer"]

METHOD_MATCH = 1
METHOD_BATCH_MATCH = 2
_HEAD = struct.Struct("<IB")
_OK, _UNIMPLEMENTED, _RESOURCE_EXHAUSTED = 0, 12, 8


def _match(ctl: Controller, body: bytes) -> bytes:
    req = _parse(controller_pb2.MatchPrefixRequest, body)
    return wire.match_to_proto(ctl.match(wire.prefix_query_from_proto(req))).SerializeToString()


def _batch_match(ctl: Controller, body: bytes) -> bytes:
    req = _parse(controller_pb2.BatchMatchPrefixRequest, body)
    if wire.is_packed(req):
        r = ctl.match_packed(wire.packed_from_proto(req))
    else:
        ctl.check_batch(len(req.requests))
        qs = []
        for i, q in enumerate(req.requests):
            with within(f"requests[{i}]"):
                qs.append(wire.prefix_query_from_proto(q))
        r = ctl.match_batch(qs)
    return wire.batch_match_to_proto(r, req.compact).SerializeToString()


_M = TypeVar("_M", controller_pb2.MatchPrefixRequest, controller_pb2.BatchMatchPrefixRequest)


def _parse(cls: type[_M], body: bytes) -> _M:
    try:
        return cls.FromString(body)
    except DecodeError as e:
        raise InvalidArgument(f"malformed {cls.__name__} message: {e}") from e


_METHODS: dict[int, tuple[str, Callable[[Controller, bytes], bytes]]] = {
    METHOD_MATCH: ("MatchPrefix", _match),
    METHOD_BATCH_MATCH: ("BatchMatchPrefix", _batch_match),
}


def _frame(status: int, body: bytes) -> bytes:
    return _HEAD.pack(1 + len(body), status) + body


class LookupServer:
    """Serves ``ctl``'s lookups on ``listen`` (host:port, port 0 = any) from its own thread."""

    def __init__(
        self,
        ctl: Controller,
        listen: str,
        *,
        ssl_context: ssl.SSLContext | None = None,
        max_frame_bytes: int = 16 * 2**20,
    ) -> None:
        host, _, port = listen.rpartition(":")
        host = host.strip("[]")
        if ssl_context is None and not _is_loopback(host):
            raise ValueError(
                f"listen={listen!r}: the lookup listener binds a loopback address unless given an "
                "mTLS ssl_context (it would otherwise serve anyone on the network)"
            )
        self.ctl = ctl
        self.max_frame_bytes = max_frame_bytes
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        started = threading.Event()
        failure: list[BaseException] = []

        async def start() -> None:
            self._server = await self._loop.create_server(
                lambda: _Connection(self), host, int(port), ssl=ssl_context
            )

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            try:
                self._loop.run_until_complete(start())
            except BaseException as e:  # reported to the constructor's caller
                failure.append(e)
                started.set()
                return
            started.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="kvgrid-lookup-listener", daemon=True)
        self._thread.start()
        started.wait()
        if failure:
            self._loop.close()
            raise ValueError(f"listen={listen!r}: could not bind ({failure[0]})") from failure[0]
        assert self._server is not None
        bound = self._server.sockets[0].getsockname()
        self.address: str = f"{host}:{bound[1]}"

    def _answer(self, method: int, body: bytes) -> bytes:
        entry = _METHODS.get(method)
        if entry is None:
            known = ", ".join(f"{k} ({n})" for k, (n, _) in _METHODS.items())
            return _frame(_UNIMPLEMENTED, f"method={method}: expected one of {known}".encode())
        name, fn = entry
        try:
            return _frame(_OK, fn(self.ctl, body))
        except Exception as e:  # mapped like the gRPC toolkit does; the connection keeps serving
            code, detail = status_of(name, e)
            if isinstance(e, KvgridError) and not isinstance(e, Unavailable):
                self.ctl.rejected += 1  # as the gRPC servicer counts refused calls
            return _frame(code.value[0], detail.encode())

    def stop(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()
                await self._server.wait_closed()

        if self._loop.is_running():
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


class _Connection(asyncio.Protocol):
    """One client connection: frames are parsed from the byte stream as they arrive and answered
    in order, on the loop's thread (a protocol, not streams: no task or future per request)."""

    def __init__(self, server: LookupServer) -> None:
        self.server = server
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        buf = self.buf
        buf += data
        out = []
        pos = 0
        while len(buf) - pos >= _HEAD.size:
            length, method = _HEAD.unpack_from(buf, pos)
            if length < 1 or length > self.server.max_frame_bytes:
                limit = self.server.max_frame_bytes
                msg = f"frame of {length} bytes: expected 1..max_frame_bytes={limit}"
                out.append(_frame(_RESOURCE_EXHAUSTED, msg.encode()))
                self.transport.write(b"".join(out))
                self.transport.close()  # the body is not read: the stream cannot be resynchronized
                buf.clear()
                return
            end = pos + 4 + length
            if len(buf) < end:
                break
            out.append(self.server._answer(method, bytes(buf[pos + _HEAD.size : end])))
            pos = end
        del buf[:pos]
        if out:
            self.transport.write(out[0] if len(out) == 1 else b"".join(out))


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class LookupFailed(Exception):
    """A non-OK answer: ``status`` (gRPC status code number) and the server's text."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"status {status}: {detail}")
        self.status = status
        self.detail = detail


class LookupClient:
    """Blocking client of :class:`LookupServer` (one connection; one call at a time)."""

    def __init__(self, address: str, timeout_s: float = 5.0) -> None:
        host, _, port = address.rpartition(":")
        self._sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def call_raw(self, method: int, body: bytes) -> bytes:
        """Send one request frame; the answer body (raises :class:`LookupFailed` when not OK)."""
        self._sock.sendall(_HEAD.pack(1 + len(body), method) + body)
        length, status = _HEAD.unpack(self._recv(_HEAD.size))
        out = self._recv(length - 1)
        if status != _OK:
            raise LookupFailed(status, out.decode(errors="replace"))
        return out

    def _recv(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self._sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("lookup listener closed the connection")
            buf += chunk
        return bytes(buf)

    def match(self, req: controller_pb2.MatchPrefixRequest) -> controller_pb2.MatchPrefixResponse:
        return controller_pb2.MatchPrefixResponse.FromString(
            self.call_raw(METHOD_MATCH, req.SerializeToString())
        )

    def batch_match(
        self, req: controller_pb2.BatchMatchPrefixRequest
    ) -> controller_pb2.BatchMatchPrefixResponse:
        return controller_pb2.BatchMatchPrefixResponse.FromString(
            self.call_raw(METHOD_BATCH_MATCH, req.SerializeToString())
        )

    def close(self) -> None:
        self._sock.close()
