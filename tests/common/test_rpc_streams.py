"""The server toolkit's streaming calls end exactly once, however they end.

grpcio runs a call's termination callbacks on its event thread, possibly while the worker is
inside the method's generator; closing the generator from there raised ``ValueError: generator
already executing`` (logged by grpcio as "Exception calling callback!") and left it to whatever
came next. Each case below ends a stream while its generator is in one state and checks that the
method's ``finally`` ran exactly once and that grpcio logged no failed callback."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from kvgrid.api.v1 import controller_pb2, controller_pb2_grpc
from kvgrid.common.rpc import RpcServer, ServerOptions

_SERVICE = controller_pb2.DESCRIPTOR.services_by_name["ControllerService"]


class _Impl:
    """PublishEvents answers each message; ``compute`` makes an answer take that long (the
    generator runs meanwhile); ``finally`` counts how often the stream was ended."""

    def __init__(self) -> None:
        self.compute_s = 0.0
        self.ended = 0
        self.ended_on: list[str] = []
        self.started = threading.Event()
        self.computing = threading.Event()

    def PublishEvents(
        self, reqs: Iterator[controller_pb2.PublishEventsRequest]
    ) -> Iterator[controller_pb2.PublishEventsResponse]:
        try:
            for i, _ in enumerate(reqs):
                self.started.set()
                if self.compute_s:
                    self.computing.set()
                    time.sleep(self.compute_s)
                yield controller_pb2.PublishEventsResponse(acked_sequence=i + 1)
        finally:
            self.ended += 1
            self.ended_on.append(threading.current_thread().name)

    def __getattr__(self, name: str) -> object:
        return lambda req: None


class _Waiting:
    """A response object whose next answer waits until the call ends, which only its thread-safe
    ``close()`` tells it (like the agent's ChunkSender waiting for its data-plane ticket)."""

    def __init__(self) -> None:
        self.closed = threading.Event()
        self.closed_after_s: float | None = None
        self.t0 = time.monotonic()

    def __iter__(self) -> Iterator[controller_pb2.PublishEventsResponse]:
        yield controller_pb2.PublishEventsResponse(acked_sequence=1)
        self.closed.wait(10)

    def close(self) -> None:
        if self.closed_after_s is None:
            self.closed_after_s = time.monotonic() - self.t0
        self.closed.set()


@pytest.fixture
def served(
    caplog: pytest.LogCaptureFixture,
) -> Iterator[tuple[controller_pb2_grpc.ControllerServiceStub, _Impl]]:
    impl = _Impl()
    rpc = RpcServer(ServerOptions(max_message_bytes=1 << 20, workers=4, thread_name_prefix="t-worker"))
    rpc.add_service(_SERVICE, impl)
    port = rpc.bind("127.0.0.1:0")
    rpc.start()
    ch = grpc.insecure_channel(f"127.0.0.1:{port}")
    caplog.set_level(logging.ERROR, logger="grpc._server")
    try:
        yield controller_pb2_grpc.ControllerServiceStub(ch), impl
    finally:
        ch.close()
        rpc.stop(0)


def _no_failed_callback(caplog: pytest.LogCaptureFixture) -> None:
    failed = [r for r in caplog.records if r.name == "grpc._server"]
    assert not failed, [f"{r.getMessage()} {r.exc_info[1] if r.exc_info else ''}" for r in failed]


def _requests(stop: threading.Event, first: int = 1) -> Iterator[controller_pb2.PublishEventsRequest]:
    for _ in range(first):
        yield controller_pb2.PublishEventsRequest()
    stop.wait(30)


def _wait(cond: object, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_stream_cancelled_while_its_method_waits_for_the_client_ends_once(served, caplog) -> None:  # type: ignore[no-untyped-def]
    stub, impl = served
    stop = threading.Event()
    call = stub.PublishEvents(_requests(stop), timeout=30)
    assert next(call).acked_sequence == 1
    time.sleep(0.2)  # the method now waits (inside its generator) for the next request
    call.cancel()
    _wait(lambda: impl.ended == 1, "the method's finally")
    time.sleep(0.3)
    stop.set()
    assert impl.ended == 1
    _no_failed_callback(caplog)


def test_a_stream_cancelled_while_its_method_computes_ends_once_on_the_worker(served, caplog) -> None:  # type: ignore[no-untyped-def]
    stub, impl = served
    impl.compute_s = 0.5
    stop = threading.Event()
    call = stub.PublishEvents(_requests(stop), timeout=30)
    assert impl.computing.wait(5)
    call.cancel()  # the callback runs while the generator runs: it must leave it to the worker
    _wait(lambda: impl.ended == 1, "the method's finally")
    time.sleep(0.3)
    stop.set()
    assert impl.ended == 1
    _no_failed_callback(caplog)
    assert impl.ended_on[0].startswith("t-worker"), impl.ended_on


def test_a_stream_whose_client_stops_reading_ends_once_when_cancelled(served, caplog) -> None:  # type: ignore[no-untyped-def]
    stub, impl = served
    stop = threading.Event()
    # Many requests, no reads: the server's answers fill the flow-control window and its send waits.
    many = controller_pb2.PublishEventsRequest(
        events=[controller_pb2.ChunkEvent(chunk_keys=[b"k" * 16] * 64)]
    )

    def flood() -> Iterator[controller_pb2.PublishEventsRequest]:
        for _ in range(20_000):
            if stop.is_set():
                return
            yield many
        stop.wait(30)

    call = stub.PublishEvents(flood(), timeout=30)
    assert impl.started.wait(5)
    time.sleep(1.0)
    call.cancel()
    _wait(lambda: impl.ended == 1, "the method's finally")
    time.sleep(0.3)
    stop.set()
    assert impl.ended == 1
    _no_failed_callback(caplog)


def test_a_response_object_is_closed_at_once_even_while_its_step_waits(
    caplog: pytest.LogCaptureFixture,
) -> None:
    waiting = _Waiting()

    class Impl:
        def PublishEvents(self, reqs: Iterator[controller_pb2.PublishEventsRequest]) -> _Waiting:
            return waiting

        def __getattr__(self, name: str) -> object:
            return lambda req: None

    rpc = RpcServer(ServerOptions(max_message_bytes=1 << 20, workers=4))
    rpc.add_service(_SERVICE, Impl())
    port = rpc.bind("127.0.0.1:0")
    rpc.start()
    ch = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        stop = threading.Event()
        call = controller_pb2_grpc.ControllerServiceStub(ch).PublishEvents(_requests(stop), timeout=30)
        assert next(call).acked_sequence == 1
        time.sleep(0.3)  # the worker now waits inside the object's next step
        call.cancel()
        assert waiting.closed.wait(5), "close() was not called while the step waited"
        assert waiting.closed_after_s is not None and waiting.closed_after_s < 3
        stop.set()
    finally:
        ch.close()
        rpc.stop(0)
    _no_failed_callback(caplog)
