"""A lean lookup listener: the router's controller calls as length-prefixed frames over TCP (or mTLS).

Why it exists: on this project's 2-core box a Python gRPC round trip costs ~0.8-0.9 ms at one
call in flight even for a bare echo (sync or asyncio server, sync or asyncio client:
docs/controller.md "Single queries over the network"), several times the lookup itself, so a
router asking once per request could not beat a native HTTP indexer through gRPC. This listener
carries the *same protobuf messages* as the gRPC methods over a plain asyncio TCP stream and
answers from the same :class:`~kvgrid.controller.core.Controller`, so answers are byte-identical
to gRPC's (tested). ``kvgrid controller`` starts it on ``lookup_port`` (docs/controller.md).

Frames (little-endian)::

    request:  u32 length | u8 method | body      (length = 1 + len(body))
    response: u32 length | u8 status | body      (status: the gRPC status code number)

Methods: 1 = MatchPrefix (body ``MatchPrefixRequest``, answer ``MatchPrefixResponse``), 2 =
BatchMatchPrefix (``BatchMatchPrefixRequest`` -> ``BatchMatchPrefixResponse``), 3 = Score
(``ScoreRequest`` -> ``ScoreResponse``), 4 = ListAgents (``ListAgentsRequest`` ->
``ListAgentsResponse``). On an error the body is the UTF-8 text gRPC would send (INVALID_ARGUMENT
naming the bad value, PERMISSION_DENIED naming the method and the caller, UNIMPLEMENTED for an
unknown method byte); the connection keeps serving. A frame longer than ``max_frame_bytes`` is
answered RESOURCE_EXHAUSTED and the connection is closed (its body is not read). Requests of one
connection are answered in order; connections are served concurrently by one event loop thread.

Invariants:

- Only what a router asks: lookups, ``Score`` (whose ``reserve`` records a speculative entry: the
  routing decision the gRPC ``POLICY`` also lets every read role make) and ``ListAgents``; never an
  agent's write (RegisterAgent, Heartbeat, PublishEvents).
- With TLS (``ssl_context``, built by :func:`server_ssl_context` from the controller's ``tls_*``
  files) a client must present a certificate the CA signed (else the TLS handshake fails: no frame
  is ever read), and every request is authorized by the ``authorizer`` the gRPC server uses, with
  the identity read from the connection's verified peer certificate (URI and DNS SANs, as gRPC's
  auth context gives them): a caller outside the trust domain or the accepted namespaces, or whose
  role the method's policy entry does not list, is answered PERMISSION_DENIED with the authorizer's
  text. An ``ssl_context`` without an ``authorizer``, or one that does not require a client
  certificate, is refused at construction. The files are re-read when they change (checked at each
  handshake), as the gRPC server does.
- Without TLS it binds loopback only, unless ``insecure_plaintext_on_network`` (the controller's
  flag of the same name, which also lets its gRPC port be plaintext on the network).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import ssl
import struct
import threading
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

import grpc
from google.protobuf.message import DecodeError

from kvgrid.api.v1 import controller_pb2
from kvgrid.common.authz import Authorizer
from kvgrid.common.errors import InvalidArgument, KvgridError, PermissionDenied, Unavailable, within
from kvgrid.common.rpc import status_of
from kvgrid.common.tls import CONTROLLER_SERVER_NAME, TlsFiles, _Watched
from kvgrid.controller import wire
from kvgrid.controller.core import Controller

__all__ = [
    "METHOD_BATCH_MATCH",
    "METHOD_LIST_AGENTS",
    "METHOD_MATCH",
    "METHOD_SCORE",
    "ClientSsl",
    "LookupClient",
    "LookupFailed",
    "LookupPool",
    "LookupServer",
    "LookupUnavailable",
    "server_ssl_context",
]

log = logging.getLogger(__name__)

METHOD_MATCH = 1
METHOD_BATCH_MATCH = 2
METHOD_SCORE = 3
METHOD_LIST_AGENTS = 4
_HEAD = struct.Struct("<IB")
_OK, _DEADLINE_EXCEEDED, _PERMISSION_DENIED, _RESOURCE_EXHAUSTED = 0, 4, 7, 8
_UNIMPLEMENTED, _UNAVAILABLE = 12, 14


def _answered(ctl: Controller, rpc: str, queries: int) -> None:
    if ctl.metrics is not None:
        ctl.metrics.answered(rpc, queries)


def _match(ctl: Controller, body: bytes) -> bytes:
    req = _parse(controller_pb2.MatchPrefixRequest, body)
    out = wire.match_to_proto(ctl.match(wire.prefix_query_from_proto(req))).SerializeToString()
    _answered(ctl, "MatchPrefix", 1)
    return out


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
    out = wire.batch_match_to_proto(r, req.compact).SerializeToString()
    _answered(ctl, "BatchMatchPrefix", len(r.num_chunks))
    return out


def _score(ctl: Controller, body: bytes) -> bytes:
    req = _parse(controller_pb2.ScoreRequest, body)
    out = wire.score_to_proto(ctl.score(wire.score_query_from_proto(req))).SerializeToString()
    _answered(ctl, "Score", 1)
    return out


def _list_agents(ctl: Controller, body: bytes) -> bytes:
    _parse(controller_pb2.ListAgentsRequest, body)
    return wire.agents_to_proto(ctl.list_agents()).SerializeToString()


_M = TypeVar(
    "_M",
    controller_pb2.MatchPrefixRequest,
    controller_pb2.BatchMatchPrefixRequest,
    controller_pb2.ScoreRequest,
    controller_pb2.ListAgentsRequest,
)


def _parse(cls: type[_M], body: bytes) -> _M:
    try:
        return cls.FromString(body)
    except DecodeError as e:
        raise InvalidArgument(f"malformed {cls.__name__} message: {e}") from e


_METHODS: dict[int, tuple[str, Callable[[Controller, bytes], bytes]]] = {
    METHOD_MATCH: ("MatchPrefix", _match),
    METHOD_BATCH_MATCH: ("BatchMatchPrefix", _batch_match),
    METHOD_SCORE: ("Score", _score),
    METHOD_LIST_AGENTS: ("ListAgents", _list_agents),
}


def _frame(status: int, body: bytes) -> bytes:
    return _HEAD.pack(1 + len(body), status) + body


def _split(address: str, what: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{what}={address!r}: expected host:port, e.g. 127.0.0.1:50062")
    return host.strip("[]"), int(port)


# ---- TLS ------------------------------------------------------------------------------------------


def _server_context(files: TlsFiles) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_cert_chain(files.cert_file, files.key_file)
    ctx.load_verify_locations(cafile=files.ca_file)
    return ctx


def server_ssl_context(files: TlsFiles) -> ssl.SSLContext:
    """The listener's mTLS context from the service's ``tls_*`` files: its certificate, a client
    certificate signed by the CA required. The files are checked at every handshake and a changed
    set serves new connections (open ones keep theirs); files that cannot be loaded keep the previous
    ones (logged). ValueError naming the file when one cannot be read at start."""
    watched = _Watched(files)  # a missing or non-PEM file: ValueError naming the setting
    try:
        first = _server_context(files)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(
            f"tls_cert_file={files.cert_file!r}, tls_key_file={files.key_file!r}, "
            f"tls_ca_file={files.ca_file!r}: cannot load them for the lookup listener ({e})"
        ) from None
    current = [first]

    def on_hello(sslobj: ssl.SSLObject, _name: str | None, _ctx: ssl.SSLContext) -> None:
        # Called for every ClientHello, with or without SNI: swap in the reloaded files if changed.
        if watched.changed():
            try:
                current[0] = _server_context(files)
            except (OSError, ssl.SSLError) as e:
                log.warning("lookup listener: TLS files changed but cannot be loaded (keeping the "
                            "previous ones): %s", e)  # fmt: skip
        if current[0] is not first:
            sslobj.context = current[0]

    first.sni_callback = on_hello
    return first


class ClientSsl:
    """A client's mTLS context for the lookup listener from its ``tls_*`` files, rebuilt when they
    change (checked on each :meth:`context`; :attr:`generation` tells connections made before)."""

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        self._watched = _Watched(files)
        self._lock = threading.Lock()
        self._ctx: ssl.SSLContext | None = None
        self._ctx_generation = -1

    @property
    def generation(self) -> int:
        self._watched.changed()
        return self._watched.generation

    def context(self) -> ssl.SSLContext:
        gen = self.generation
        with self._lock:
            if self._ctx is None or self._ctx_generation != gen:
                f = self.files
                ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the chain and the name
                ctx.minimum_version = ssl.TLSVersion.TLSv1_2
                try:
                    ctx.load_cert_chain(f.cert_file, f.key_file)
                    ctx.load_verify_locations(cafile=f.ca_file)
                except (OSError, ssl.SSLError) as e:
                    raise ValueError(
                        f"tls_cert_file={f.cert_file!r}, tls_key_file={f.key_file!r}, "
                        f"tls_ca_file={f.ca_file!r}: cannot load them ({e})"
                    ) from None
                self._ctx, self._ctx_generation = ctx, gen
            return self._ctx


# ---- server ---------------------------------------------------------------------------------------


class _PeerCertificate:
    """What :class:`~kvgrid.common.authz.Authorizer` reads of a gRPC call (its auth context's
    ``peer_uri`` and ``peer_dns``), taken from a TLS connection's verified peer certificate."""

    def __init__(self, cert: Mapping[str, Any] | None) -> None:
        sans = (cert or {}).get("subjectAltName", ())
        self._auth = {
            "peer_uri": [str(v).encode() for k, v in sans if k == "URI"],
            "peer_dns": [str(v).encode() for k, v in sans if k == "DNS"],
        }

    def auth_context(self) -> dict[str, list[bytes]]:
        return self._auth


class LookupServer:
    """Serves ``ctl``'s lookups on ``listen`` (host:port, port 0 = any) from its own thread."""

    def __init__(
        self,
        ctl: Controller,
        listen: str,
        *,
        ssl_context: ssl.SSLContext | None = None,
        authorizer: Authorizer | None = None,
        insecure_plaintext_on_network: bool = False,
        max_frame_bytes: int = 16 * 2**20,
    ) -> None:
        host, port = _split(listen, "listen")
        if ssl_context is None and not insecure_plaintext_on_network and not _is_loopback(host):
            raise ValueError(
                f"listen={listen!r}: the lookup listener binds a loopback address unless given an mTLS "
                "ssl_context, or insecure_plaintext_on_network=true (it would otherwise serve anyone on "
                "the network)"
            )
        if ssl_context is not None:
            if authorizer is None:
                raise ValueError(
                    "ssl_context given without authorizer: expected the Authorizer of the gRPC lookup "
                    "methods (every mTLS request is authorized by the caller's certificate identity)"
                )
            if ssl_context.verify_mode != ssl.CERT_REQUIRED:
                raise ValueError(
                    f"ssl_context.verify_mode={ssl_context.verify_mode!r}: expected CERT_REQUIRED (a "
                    "client certificate signed by the CA; see server_ssl_context)"
                )
        self.ctl = ctl
        self.authorizer = authorizer if ssl_context is not None else None
        self.tls = ssl_context is not None
        self.max_frame_bytes = max_frame_bytes
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        started = threading.Event()
        failure: list[BaseException] = []

        async def start() -> None:
            self._server = await self._loop.create_server(
                lambda: _Connection(self), host, port, ssl=ssl_context
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
            self._thread.join(10)
            self._loop.close()
            raise ValueError(f"listen={listen!r}: could not bind ({failure[0]})") from failure[0]
        assert self._server is not None
        bound = self._server.sockets[0].getsockname()
        self.address: str = f"{host}:{bound[1]}"

    def _denied(self, cert: Mapping[str, Any] | None) -> dict[int, str]:
        """Method -> PERMISSION_DENIED text for a connection's peer certificate (empty: all allowed)."""
        assert self.authorizer is not None
        peer = cast(grpc.ServicerContext, _PeerCertificate(cert))  # only auth_context() is read
        out: dict[int, str] = {}
        for method, (name, _) in _METHODS.items():
            try:
                self.authorizer.check(name, peer)
            except PermissionDenied as e:
                out[method] = str(e)
        return out

    def _answer(self, method: int, body: bytes, denied: Mapping[int, str]) -> bytes:
        entry = _METHODS.get(method)
        if entry is None:
            known = ", ".join(f"{k} ({n})" for k, (n, _) in _METHODS.items())
            return _frame(_UNIMPLEMENTED, f"method={method}: expected one of {known}".encode())
        refusal = denied.get(method)
        if refusal is not None:
            self.ctl.rejected += 1  # as the gRPC toolkit counts a refused call
            return _frame(_PERMISSION_DENIED, refusal.encode())
        name, fn = entry
        try:
            return _frame(_OK, fn(self.ctl, body))
        except Exception as e:  # mapped like the gRPC toolkit does; the connection keeps serving
            code, detail = status_of(name, e)
            if code is grpc.StatusCode.INTERNAL:
                log.error("lookup listener: %s failed", name, exc_info=e)
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


_NONE_DENIED: Mapping[int, str] = {}


class _Connection(asyncio.Protocol):
    """One client connection: frames are parsed from the byte stream as they arrive and answered
    in order, on the loop's thread (a protocol, not streams: no task or future per request). With
    TLS, ``connection_made`` runs after the handshake, so the peer certificate is known."""

    def __init__(self, server: LookupServer) -> None:
        self.server = server
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.denied = _NONE_DENIED

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.server.authorizer is not None:
            self.denied = self.server._denied(transport.get_extra_info("peercert"))
            if self.denied:
                log.warning(
                    "lookup listener: caller %s refused %s: %s",
                    transport.get_extra_info("peername"),
                    ", ".join(_METHODS[m][0] for m in sorted(self.denied)),
                    next(iter(self.denied.values())),
                )

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
            out.append(self.server._answer(method, bytes(buf[pos + _HEAD.size : end]), self.denied))
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


# ---- client ---------------------------------------------------------------------------------------


def _code_name(status: int) -> str:
    for code in grpc.StatusCode:
        if code.value[0] == status:
            return str(code.name)
    return f"status {status}"


class LookupFailed(Exception):
    """A non-OK answer: ``status`` (gRPC status code number) and the server's text."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"{_code_name(status)}: {detail}")
        self.status = status
        self.detail = detail

    @property
    def code_name(self) -> str:
        """The gRPC status code's name (``PERMISSION_DENIED``, ...)."""
        return _code_name(self.status)


class LookupUnavailable(LookupFailed):
    """No answer came: the connection could not be made, the TLS handshake was refused, the listener
    closed the connection (UNAVAILABLE) or the deadline passed (DEADLINE_EXCEEDED). The connection is
    unusable afterwards."""


class LookupClient:
    """Blocking client of :class:`LookupServer` (one connection; one call at a time).

    ``ssl_context`` (from :class:`ClientSsl`): mTLS, verifying that the listener's certificate
    carries ``server_name``. Every transport failure raises :class:`LookupUnavailable` naming the
    address; a non-OK answer raises :class:`LookupFailed`."""

    def __init__(
        self,
        address: str,
        timeout_s: float = 5.0,
        *,
        ssl_context: ssl.SSLContext | None = None,
        server_name: str = CONTROLLER_SERVER_NAME,
    ) -> None:
        host, port = _split(address, "lookup address")
        self.address = address
        try:
            sock = socket.create_connection((host, port), timeout=timeout_s)
        except TimeoutError:
            raise LookupUnavailable(
                _DEADLINE_EXCEEDED, f"lookup listener {address}: no connection within {timeout_s:g} s"
            ) from None
        except OSError as e:
            raise LookupUnavailable(
                _UNAVAILABLE, f"lookup listener {address}: cannot connect: {e.strerror or e}"
            ) from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if ssl_context is not None:
            try:
                sock = ssl_context.wrap_socket(sock, server_hostname=server_name)
            except (OSError, ssl.SSLError) as e:
                sock.close()
                raise self._transport_error(e) from None
        self._sock = sock
        self._tls = ssl_context is not None
        self._answered = False

    def _transport_error(self, e: BaseException) -> LookupUnavailable:
        if isinstance(e, ssl.SSLCertVerificationError):
            return LookupUnavailable(
                _UNAVAILABLE,
                f"lookup listener {self.address}: its certificate was not accepted "
                f"({e.verify_message}): expected one signed by tls_ca_file and naming the server name",
            )
        if isinstance(e, ssl.SSLError):
            return LookupUnavailable(
                _UNAVAILABLE,
                f"lookup listener {self.address}: TLS refused ({e.reason or e}): it requires mTLS with a "
                "client certificate its CA signed (tls_cert_file, tls_key_file, tls_ca_file)",
            )
        if isinstance(e, TimeoutError):
            return LookupUnavailable(_DEADLINE_EXCEEDED, f"lookup listener {self.address}: no answer in time")
        if isinstance(e, OSError):
            return LookupUnavailable(_UNAVAILABLE, f"lookup listener {self.address}: {e.strerror or e}")
        return LookupUnavailable(_UNAVAILABLE, f"lookup listener {self.address}: {e}")

    def call_raw(self, method: int, body: bytes) -> bytes:
        """Send one request frame; the answer body (raises :class:`LookupFailed` when not OK)."""
        try:
            self._sock.sendall(_HEAD.pack(1 + len(body), method) + body)
            length, status = _HEAD.unpack(self._recv(_HEAD.size))
            out = self._recv(length - 1)
        except (OSError, ssl.SSLError) as e:
            raise self._transport_error(e) from None
        self._answered = True
        if status != _OK:
            raise LookupFailed(status, out.decode(errors="replace"))
        return out

    def _recv(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self._sock.recv(n - len(buf))
            if not chunk:
                why = ""
                if self._tls and not self._answered:
                    # TLS 1.3: the server checks the client's certificate after the client's side
                    # of the handshake is done, and asyncio closes without sending the alert.
                    why = (
                        " before its first answer: it refuses a client certificate its CA did not "
                        "sign, or none (tls_cert_file, tls_key_file, tls_ca_file)"
                    )
                raise LookupUnavailable(
                    _UNAVAILABLE, f"lookup listener {self.address}: closed the connection{why}"
                )
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

    def score(self, req: controller_pb2.ScoreRequest) -> controller_pb2.ScoreResponse:
        return controller_pb2.ScoreResponse.FromString(self.call_raw(METHOD_SCORE, req.SerializeToString()))

    def list_agents(self) -> controller_pb2.ListAgentsResponse:
        return controller_pb2.ListAgentsResponse.FromString(
            self.call_raw(METHOD_LIST_AGENTS, controller_pb2.ListAgentsRequest().SerializeToString())
        )

    def close(self) -> None:
        self._sock.close()


class LookupPool:
    """Thread-safe calls to one lookup listener: an idle connection per caller thread that needs one
    (a :class:`LookupClient` serves one call at a time). A connection that failed in transport is
    dropped; one made before the TLS files changed is not reused."""

    def __init__(
        self,
        address: str,
        *,
        tls: TlsFiles | None = None,
        server_name: str = CONTROLLER_SERVER_NAME,
        timeout_s: float = 5.0,
    ) -> None:
        _split(address, "lookup address")
        self.address = address
        self.server_name = server_name
        self.timeout_s = timeout_s
        self._ssl = ClientSsl(tls) if tls is not None else None
        self._lock = threading.Lock()
        self._idle: list[tuple[int, LookupClient]] = []

    def call_raw(self, method: int, body: bytes) -> bytes:
        gen = self._ssl.generation if self._ssl is not None else 0
        client: LookupClient | None = None
        with self._lock:
            while self._idle:
                g, c = self._idle.pop()
                if g == gen:
                    client = c
                    break
                c.close()
        if client is None:
            ctx = self._ssl.context() if self._ssl is not None else None
            client = LookupClient(self.address, self.timeout_s, ssl_context=ctx, server_name=self.server_name)
        try:
            out = client.call_raw(method, body)
        except LookupUnavailable:
            client.close()
            raise
        except LookupFailed as e:
            self._release(gen, client, keep=e.status != _RESOURCE_EXHAUSTED)  # that one closes
            raise
        self._release(gen, client, keep=True)
        return out

    def _release(self, gen: int, client: LookupClient, *, keep: bool) -> None:
        if not keep:
            client.close()
            return
        with self._lock:
            self._idle.append((gen, client))

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for _, c in idle:
            c.close()
