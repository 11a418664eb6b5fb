"""The gRPC server toolkit both services use: start-up, error -> status mapping, per-call metrics.

- :class:`RpcServer` builds a ``grpc.Server`` with the shared options (message size limits, no
  ``SO_REUSEPORT``, its own pool of ``workers`` threads: a service that must keep one listener's
  callers from starving another's runs one ``RpcServer`` per listener, sharing one
  :class:`RpcMetrics`), binds addresses (:meth:`RpcServer.bind` is the one place a port is added:
  with server credentials (:mod:`kvgrid.common.tls`) it is mTLS, without them a TCP address is
  plaintext and says so loudly in the log, louder still on a non-loopback host), and on
  :meth:`RpcServer.start` adds the standard health service (SERVING for ``""`` and every added
  service) and reflection.
- Authorization (:mod:`kvgrid.common.authz`): a server made with an ``authorizer`` checks every
  call of an added service before the method runs (the caller's certificate identity against the
  method's roles; PERMISSION_DENIED naming both) and exposes the identity to the method through
  :func:`kvgrid.common.authz.caller` for the call's duration. ``add_service(served=...)`` serves only
  the named methods on this server; the others answer UNIMPLEMENTED with the reason given.
- :meth:`RpcServer.add_service` serves an implementation object by the service *descriptor*: one
  method per RPC, named like it, taking the parsed request (and for client-streaming RPCs an
  iterator of them) and returning the response (or an iterable of them). Requests are parsed here,
  so a malformed message is INVALID_ARGUMENT naming its type (grpcio's deserializer says INTERNAL).
- Plaintext stays on this machine unless asked otherwise (docs/security.md): a service config calls
  :func:`check_plaintext_listen` for each TCP listen host, which refuses a non-loopback host when
  TLS is off unless ``insecure_plaintext_on_network`` is set (:data:`INSECURE_PLAINTEXT_FIELD`).
- :func:`status_of` is the one mapping from exceptions to status codes: a
  :class:`~kvgrid.common.errors.KvgridError` becomes its ``status`` with its text; anything else is
  INTERNAL with a one-line ``method failed: Type: text`` (the traceback goes to the log).
- :class:`RpcMetrics` records every call, failed or not, under the same names in every service:
  ``kvgrid_rpc_server_calls`` (counter) and ``kvgrid_rpc_server_duration`` (histogram, seconds),
  both with attributes ``method`` (the RPC name) and ``code`` (the status code name). A streaming
  call is one call, timed until its last message; a stream the peer abandons counts as CANCELLED.
- A streaming method's generator is closed exactly once when its call ends however it ends (its
  ``finally`` blocks release what it holds), never while it runs: by the worker when a step is
  under way, else by grpcio's event thread (``_Responses``).
- Bookkeeping after the reply: :func:`after_reply` runs its function at once, unless the transport
  serving the call collects it (:func:`deferring`; the agent's hot path does) and runs it once the
  reply is sent, so the caller does not wait for metric updates (~6 us each with a Prometheus
  reader). Work is per thread: a call's deferred work runs on the thread that served it, in order.
- Traces: every call runs inside a SERVER span ``{service}/{method}`` that continues the caller's
  W3C trace context (:func:`kvgrid.common.tracing.server_span`), ending with the call's status
  (``rpc.grpc.status_code``; ERROR for any code but OK). A no-op tracer when none is given.
"""

from __future__ import annotations

import inspect
import ipaddress
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import grpc
import msgspec
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry import metrics, trace
from opentelemetry.trace import Span, Status, StatusCode

from kvgrid.common.authz import Authorizer, set_caller
from kvgrid.common.errors import InvalidArgument, KvgridError, Unimplemented
from kvgrid.common.tracing import server_span

__all__ = [
    "INSECURE_PLAINTEXT_FIELD",
    "RPC_CALLS",
    "RPC_DURATION",
    "RpcMetrics",
    "RpcServer",
    "ServerOptions",
    "after_reply",
    "check_plaintext_listen",
    "deferring",
    "is_loopback_host",
    "run_deferred",
    "status_of",
]

log = logging.getLogger(__name__)

INSECURE_PLAINTEXT_FIELD = "insecure_plaintext_on_network"
"""The config field (flag ``--insecure-plaintext-on-network``, env
``KVGRID_INSECURE_PLAINTEXT_ON_NETWORK``) that lets a service without TLS listen on a network address."""


def is_loopback_host(host: str) -> bool:
    """True for a listen host only this machine reaches: ``localhost``, 127.0.0.0/8, ``::1``
    (brackets allowed). Any other name counts as a network address: it may resolve to one."""
    h = host.strip().strip("[]")
    if h.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def check_plaintext_listen(field: str, value: str, host: str, *, tls: bool, insecure: bool) -> None:
    """ValueError naming ``field=value`` and the two ways out when a listener without TLS would take
    connections from the network (``host`` not loopback) and ``insecure`` was not set explicitly."""
    if tls or insecure or is_loopback_host(host):
        return
    raise ValueError(
        f"{field}={value!r} is not a loopback address and TLS is off: a plaintext listener there lets "
        "anyone on the network call it unauthenticated (see which chunks are cached where; on an "
        "agent, list every chunk key and read the KV). "
        "Either turn on mTLS (tls_cert_file, tls_key_file and tls_ca_file: --tls-cert-file, "
        "--tls-key-file, --tls-ca-file or KVGRID_TLS_*; docs/security.md), or listen on 127.0.0.1, "
        f"or accept plaintext on the network explicitly with {INSECURE_PLAINTEXT_FIELD}=true "
        "(--insecure-plaintext-on-network, env KVGRID_INSECURE_PLAINTEXT_ON_NETWORK=true)"
    )


RPC_CALLS = "kvgrid_rpc_server_calls"
RPC_DURATION = "kvgrid_rpc_server_duration"
# From a cached lookup (~50 µs) to a large transfer or a long event stream.
_DURATION_BUCKETS_S = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0,
)  # fmt: skip


class _Deferred(threading.local):
    work: list[tuple[Callable[..., object], tuple[object, ...]]] | None = None


_DEFERRED = _Deferred()


def after_reply(fn: Callable[..., object], *args: object) -> None:
    """``fn(*args)`` once the current call's reply is sent when its transport defers bookkeeping
    (:func:`deferring`), else now. For work whose result the caller never sees (metrics)."""
    work = _DEFERRED.work
    if work is None:
        fn(*args)
    else:
        work.append((fn, args))


@contextmanager
def deferring() -> Iterator[list[tuple[Callable[..., object], tuple[object, ...]]]]:
    """Collect this thread's :func:`after_reply` work while the block runs; the caller runs it
    (:func:`run_deferred`) after sending the reply."""
    work: list[tuple[Callable[..., object], tuple[object, ...]]] = []
    _DEFERRED.work = work
    try:
        yield work
    finally:
        _DEFERRED.work = None


def run_deferred(work: list[tuple[Callable[..., object], tuple[object, ...]]]) -> None:
    """Run collected work in order; a failure is logged and the rest still runs."""
    for fn, args in work:
        try:
            fn(*args)
        except Exception:
            log.exception("deferred %s failed", getattr(fn, "__qualname__", fn))


def status_of(method: str, exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and detail the client gets for ``exc`` raised by ``method``."""
    if isinstance(exc, KvgridError):
        return grpc.StatusCode[exc.status], str(exc)
    return grpc.StatusCode.INTERNAL, f"{method} failed: {type(exc).__name__}: {exc}"


class RpcMetrics:
    """Per-call instruments on ``meter`` (a no-op meter when None)."""

    def __init__(self, meter: metrics.Meter | None) -> None:
        meter = meter or metrics.NoOpMeter("kvgrid")
        self.calls = meter.create_counter(
            RPC_CALLS, unit="{call}", description="RPC calls served, by method and gRPC status code"
        )
        self.duration = meter.create_histogram(
            RPC_DURATION,
            unit="s",
            description="Server time of one RPC call (a whole batch or stream), by method and status code",
            explicit_bucket_boundaries_advisory=_DURATION_BUCKETS_S,
        )
        self._attrs: dict[tuple[str, grpc.StatusCode], dict[str, str]] = {}

    def record(self, method: str, code: grpc.StatusCode, seconds: float) -> None:
        attrs = self._attrs.get((method, code))
        if attrs is None:
            attrs = self._attrs.setdefault((method, code), {"method": method, "code": code.name})
        self.calls.add(1, attrs)
        self.duration.record(seconds, attrs)


class ServerOptions(msgspec.Struct, frozen=True):
    max_message_bytes: int
    workers: int
    thread_name_prefix: str = "kvgrid-grpc"


OnError = Callable[[str, KvgridError], None]
"""Called with (method, error) for every call that ends in a client-facing error."""


class _Call:
    """One RPC: maps its exception to a status, records it (metrics and its span), aborts the call."""

    def __init__(self, method: str, metrics: RpcMetrics, on_error: OnError | None, span: Span) -> None:
        self.method, self.metrics, self.on_error, self.span = method, metrics, on_error, span
        self.t0 = time.perf_counter()
        self.code = grpc.StatusCode.OK

    def fail(self, context: grpc.ServicerContext, exc: BaseException) -> None:
        """Abort ``context`` with the status of ``exc`` (raises)."""
        self.code, detail = status_of(self.method, exc)
        if self.code is grpc.StatusCode.INTERNAL:
            log.error("%s failed", self.method, exc_info=exc)
        elif self.on_error is not None and isinstance(exc, KvgridError):
            self.on_error(self.method, exc)
        context.abort(self.code, detail)

    def done(self) -> None:
        self.metrics.record(self.method, self.code, time.perf_counter() - self.t0)
        if self.span.is_recording():
            self.span.set_attribute("rpc.grpc.status_code", self.code.value[0])
            if self.code is not grpc.StatusCode.OK:
                self.span.set_status(Status(StatusCode.ERROR, self.code.name))


def _parser(cls: type[Message]) -> Callable[[bytes], Message]:
    def parse(raw: bytes) -> Message:
        try:
            return cls.FromString(raw)
        except DecodeError as e:
            raise InvalidArgument(f"malformed {cls.__name__} message: {e}") from None

    return parse


def _serialize(msg: Message) -> bytes:
    return msg.SerializeToString()


class _PeerGone(Exception):
    """The client's request stream failed (it went away): the call ends without a status."""


def _client_stream(raw: Iterator[bytes], parse: Callable[[bytes], Message]) -> Iterator[Message]:
    while True:
        try:
            r = next(raw)
        except StopIteration:
            return
        except grpc.RpcError as e:
            raise _PeerGone(str(e.code()) if hasattr(e, "code") else str(e)) from None
        yield parse(r)


class _Responses:
    """A streaming method's response iterator as grpcio's worker steps it, ended exactly once.

    grpcio runs a call's termination callbacks on its completion-queue thread, which may be while
    the worker is inside the method's generator (waiting for the client's next message, or
    computing an answer). Closing a running generator from another thread raises ("generator
    already executing") and would leave it open; :meth:`end` (the callback) therefore closes a
    generator only when no step runs, and otherwise leaves a mark that the running step acts on
    when it returns: it closes the generator on the worker's own thread and ends the call as
    CANCELLED. A worker blocked on the request stream wakes by itself (grpcio fails the read once
    the call ends). Either way the generator's ``finally`` blocks run exactly once, never
    concurrently with a step.

    A method may instead return an object with its own ``close()`` (e.g. the agent's
    ``ChunkSender``): that one is called at once, whatever the worker does, since it is what wakes
    a step waiting on something only the call's end interrupts; it must be thread-safe."""

    def __init__(self, out: Iterable[Message]) -> None:
        self._it: Iterator[Message] = iter(out)
        self._generator = inspect.isgenerator(out)
        self._close_fn: Callable[[], object] | None = getattr(out, "close", None)
        self._step = threading.Lock()
        self._once = threading.Lock()
        self._ended = False
        self._closed = False

    def __iter__(self) -> _Responses:
        return self

    def __next__(self) -> Message:
        with self._step:
            if not self._ended:
                item = next(self._it)  # StopIteration and the method's errors pass through
                if not self._ended:
                    return item
            self._close()
        raise _PeerGone("the call ended (cancelled, deadline, or the client went away)")

    def end(self) -> None:
        """The call is over: close what the method returned now (a generator: if no step runs,
        else once the running step returns). Never blocks on a step, never raises."""
        self._ended = True
        if not self._generator:
            self._close()
        elif self._step.acquire(blocking=False):
            try:
                self._close()
            finally:
                self._step.release()

    def _close(self) -> None:
        with self._once:
            if self._closed:
                return
            self._closed = True
        if self._close_fn is None:
            return
        try:
            self._close_fn()
        except Exception:
            log.exception("closing a response stream failed")


def _admit(name: str, context: grpc.ServicerContext, authorizer: Authorizer | None) -> None:
    """Authorize the call (raises PermissionDenied) and publish its identity to the method."""
    set_caller(authorizer.check(name, context) if authorizer is not None else None)


def _handler(
    m: MethodDescriptor,
    fn: Callable[..., Any],
    metrics: RpcMetrics,
    on_error: OnError | None,
    authorizer: Authorizer | None,
    tracer: trace.Tracer,
) -> grpc.RpcMethodHandler:
    name = m.name
    service = m.containing_service.full_name
    parse = _parser(GetMessageClass(m.input_type))
    if not m.client_streaming and not m.server_streaming:

        def unary_unary(raw: bytes, context: grpc.ServicerContext) -> Message:
            with server_span(tracer, service, name, context) as span:
                call = _Call(name, metrics, on_error, span)
                try:
                    _admit(name, context, authorizer)
                    return fn(parse(raw))
                except Exception as exc:
                    call.fail(context, exc)
                    raise AssertionError("unreachable") from None  # abort raises
                finally:
                    set_caller(None)  # pool threads serve other callers next
                    call.done()

        return grpc.unary_unary_rpc_method_handler(unary_unary, response_serializer=_serialize)

    def streaming(request: Any, context: grpc.ServicerContext) -> Iterator[Message]:
        # The span stays current across yields: grpcio drains a response iterator on one thread.
        with server_span(tracer, service, name, context) as span:
            yield from _stream(request, context, span)

    def _stream(request: Any, context: grpc.ServicerContext, span: Span) -> Iterator[Message]:
        call = _Call(name, metrics, on_error, span)
        finished = False
        responses: _Responses | None = None
        try:
            _admit(name, context, authorizer)
            if m.client_streaming:
                out: Iterable[Message] = fn(_client_stream(request, parse))
            else:
                out = fn(parse(request))
            responses = _Responses(out)
            if not context.add_callback(responses.end):
                responses.end()  # the RPC already ended (client gone): release what ``out`` holds
                call.code = grpc.StatusCode.CANCELLED
                finished = True
                return
            yield from responses
            finished = True
        except _PeerGone as e:
            log.info("%s: stream ended before its answer did: %s", name, e)
            call.code, finished = grpc.StatusCode.CANCELLED, True
        except Exception as exc:
            finished = True
            call.fail(context, exc)
        finally:
            if not finished:  # closed early: the client cancelled or the server is stopping
                call.code = grpc.StatusCode.CANCELLED
            if responses is not None:
                responses.end()  # closed here if grpcio dropped the stream between two answers
            set_caller(None)
            call.done()

    if m.client_streaming and m.server_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming, response_serializer=_serialize)
    if m.server_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming, response_serializer=_serialize)
    raise NotImplementedError(f"{m.full_name}: client-streaming unary-response RPCs are not served")


def _refuse(text: str) -> Callable[..., Any]:
    def refuse(_request: object) -> Any:
        raise Unimplemented(text)

    return refuse


class RpcServer:
    """One gRPC server: ``add_service`` and ``bind`` as needed, then ``start``."""

    def __init__(
        self,
        options: ServerOptions,
        meter: metrics.Meter | None = None,
        *,
        rpc_metrics: RpcMetrics | None = None,
        authorizer: Authorizer | None = None,
        tracer: trace.Tracer | None = None,
    ) -> None:
        """``rpc_metrics``: instruments shared with another server of the same service (else new
        ones on ``meter``). ``authorizer``: check every call's certificate identity (mTLS servers);
        None serves everyone (plaintext or Unix-socket servers). ``tracer``: one SERVER span per
        call (None: no spans)."""
        self.options = options
        self.authorizer = authorizer
        self.tracer: trace.Tracer = tracer if tracer is not None else trace.NoOpTracer()
        self.metrics = rpc_metrics if rpc_metrics is not None else RpcMetrics(meter)
        self.server = grpc.server(
            ThreadPoolExecutor(options.workers, thread_name_prefix=options.thread_name_prefix),
            options=[
                ("grpc.max_receive_message_length", options.max_message_bytes),
                ("grpc.max_send_message_length", options.max_message_bytes),
                ("grpc.so_reuseport", 0),
            ],
        )
        self.service_names: list[str] = []
        self.health = health.HealthServicer()

    def add_service(
        self,
        service: ServiceDescriptor,
        impl: object,
        *,
        on_error: OnError | None = None,
        served: Collection[str] | None = None,
        not_served: str = "",
    ) -> None:
        """Serve the RPCs of ``service`` by the methods of ``impl`` with their names: all of them,
        or only those in ``served``; the others answer UNIMPLEMENTED saying ``not_served`` (why,
        and where they are served)."""
        handlers = {}
        for m in service.methods:
            if served is not None and m.name not in served:
                # No identity check first: whoever calls learns where the method lives.
                refuse = _refuse(f"{service.name}.{m.name} is not served on this listener: {not_served}")
                handlers[m.name] = _handler(m, refuse, self.metrics, on_error, None, self.tracer)
            else:
                handlers[m.name] = _handler(
                    m, getattr(impl, m.name), self.metrics, on_error, self.authorizer, self.tracer
                )
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service.full_name, handlers),)
        )
        self.service_names.append(service.full_name)

    def bind(self, address: str, credentials: grpc.ServerCredentials | None = None) -> int:
        """Listen on ``address`` (``host:port``, ``unix:path``), with TLS when ``credentials`` are
        given; the bound port, 0 when it failed."""
        try:
            if credentials is not None:
                return int(self.server.add_secure_port(address, credentials))
            if not address.startswith("unix:") and is_loopback_host(address.rpartition(":")[0]):
                log.warning(
                    "%s: serving %s WITHOUT TLS: no client is authenticated, every caller may call "
                    "every method; set tls_cert_file, tls_key_file and tls_ca_file for mTLS",
                    self.options.thread_name_prefix,
                    address,
                )
            elif not address.startswith("unix:"):
                log.warning(
                    "%s: INSECURE: serving %s WITHOUT TLS ON A NETWORK ADDRESS: anyone who can reach "
                    "this port is unauthenticated and may call every method it serves (an agent's "
                    "Snapshot lists every cached chunk key, its FetchChunks returns KV); set "
                    "tls_cert_file, tls_key_file and tls_ca_file for mTLS, or listen on 127.0.0.1",
                    self.options.thread_name_prefix,
                    address,
                )
            return int(self.server.add_insecure_port(address))
        except RuntimeError:  # newer grpcio raises instead of returning 0
            return 0

    def start(self, *, serving: bool = True) -> None:
        """Serve; health says SERVING for ``""`` and every added service, or NOT_SERVING with
        ``serving=False`` (a service that decides its readiness itself sets ``self.health``)."""
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
        reflection.enable_server_reflection(
            (*self.service_names, health_name, reflection.SERVICE_NAME), self.server
        )
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", *self.service_names):  # before start: no call sees a status it should not
            self.health.set(name, status)
        self.server.start()

    def stop(self, grace: float | None) -> None:
        """Stop serving; waits until in-flight calls ended or ``grace`` passed."""
        self.server.stop(grace).wait()
