"""The server toolkit: one error -> status mapping, health and reflection, shared per-call metrics."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvgrid.api.v1 import controller_pb2, controller_pb2_grpc
from kvgrid.common.authz import Authorizer, Identity, Policy, caller, parse_identity
from kvgrid.common.errors import (
    FailedPrecondition,
    InvalidArgument,
    KvgridError,
    NotFound,
    check_namespace_id,
    client_input,
    is_namespace_id,
    within,
)
from kvgrid.common.rpc import RpcServer, ServerOptions, status_of
from kvgrid.common.tls import ClientTls, TlsFiles, make_channel, server_credentials

_SERVICE = controller_pb2.DESCRIPTOR.services_by_name["ControllerService"]


class _Impl:
    """A stand-in ControllerService whose calls fail in chosen ways."""

    def __init__(self) -> None:
        self.rejected: list[tuple[str, str]] = []

    def GetStats(self, req: controller_pb2.GetStatsRequest) -> controller_pb2.GetStatsResponse:
        np.zeros(3).reshape(2, 2)  # a bug: numpy's ValueError
        raise AssertionError("unreachable")

    def ListAgents(self, req: controller_pb2.ListAgentsRequest) -> controller_pb2.ListAgentsResponse:
        raise InvalidArgument("agents: no such filter")

    def SnapshotIndex(self, req: controller_pb2.SnapshotIndexRequest) -> controller_pb2.SnapshotIndexResponse:
        raise NotFound(f"pod_uid={req.pod_uid!r}: nobody")

    def Heartbeat(self, req: controller_pb2.HeartbeatRequest) -> controller_pb2.HeartbeatResponse:
        return controller_pb2.HeartbeatResponse(lease_ttl_ms=7)

    def PublishEvents(
        self, reqs: Iterator[controller_pb2.PublishEventsRequest]
    ) -> Iterator[controller_pb2.PublishEventsResponse]:
        for i, _ in enumerate(reqs):
            if i == 1:
                raise FailedPrecondition("second message: stale")
            yield controller_pb2.PublishEventsResponse(acked_sequence=i + 1)

    def __getattr__(self, name: str) -> object:  # the RPCs this test does not call
        return lambda req: None


@pytest.fixture
def served() -> Iterator[tuple[controller_pb2_grpc.ControllerServiceStub, grpc.Channel, _Impl]]:
    impl = _Impl()
    rpc = RpcServer(ServerOptions(max_message_bytes=1 << 20, workers=4))
    rpc.add_service(_SERVICE, impl, on_error=lambda method, e: impl.rejected.append((method, e.status)))
    port = rpc.bind("127.0.0.1:0")
    assert port > 0
    rpc.start()
    ch = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield controller_pb2_grpc.ControllerServiceStub(ch), ch, impl
    finally:
        ch.close()
        rpc.stop(0)


def test_errors_map_to_status_codes_in_one_place(served) -> None:  # type: ignore[no-untyped-def]
    stub, _, impl = served
    assert stub.Heartbeat(controller_pb2.HeartbeatRequest(), timeout=5).lease_ttl_ms == 7
    cases = [
        (
            stub.GetStats,
            controller_pb2.GetStatsRequest(),
            grpc.StatusCode.INTERNAL,
            "GetStats failed: ValueError",
        ),
        (
            stub.ListAgents,
            controller_pb2.ListAgentsRequest(),
            grpc.StatusCode.INVALID_ARGUMENT,
            "no such filter",
        ),
        (
            stub.SnapshotIndex,
            controller_pb2.SnapshotIndexRequest(pod_uid="x"),
            grpc.StatusCode.NOT_FOUND,
            "nobody",
        ),
    ]
    for method, req, code, text in cases:
        with pytest.raises(grpc.RpcError) as err:
            method(req, timeout=5)
        assert err.value.code() == code
        assert text in (err.value.details() or "")
    # Only client-facing errors reach the hook (the controller counts them as rejected requests).
    assert impl.rejected == [("ListAgents", "INVALID_ARGUMENT"), ("SnapshotIndex", "NOT_FOUND")]


def test_a_stream_fails_with_the_status_of_its_error_after_earlier_answers(served) -> None:  # type: ignore[no-untyped-def]
    stub, _, _ = served
    answers = stub.PublishEvents(iter([controller_pb2.PublishEventsRequest()] * 3), timeout=5)
    assert next(answers).acked_sequence == 1
    with pytest.raises(grpc.RpcError) as err:
        next(answers)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.value.details() == "second message: stale"


def test_health_and_reflection_name_the_service(served) -> None:  # type: ignore[no-untyped-def]
    _, ch, _ = served
    health = health_pb2_grpc.HealthStub(ch)
    for name in ("", _SERVICE.full_name):
        status = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(ch)
    resp = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    assert _SERVICE.full_name in {s.name for s in resp.list_services_response.service}


def test_typed_errors() -> None:
    assert status_of("M", InvalidArgument("x"))[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert status_of("M", ValueError("x")) == (grpc.StatusCode.INTERNAL, "M failed: ValueError: x")
    assert isinstance(InvalidArgument("x"), ValueError)  # callers that catch ValueError still do
    for cls in KvgridError.__subclasses__():
        assert grpc.StatusCode[cls.status] is not grpc.StatusCode.UNKNOWN
    with pytest.raises(InvalidArgument, match=r"^keys: bad length$"), client_input("keys"):
        raise ValueError("bad length")
    with pytest.raises(NotFound, match=r"^requests\[2\]: gone$"), within("requests[2]"):
        raise NotFound("gone")
    with pytest.raises(KeyError), client_input():  # only ValueError/TypeError are the client's
        raise KeyError("bug")


def test_namespace_ids_are_checked_in_one_place() -> None:
    ok = "0123456789abcdef" * 2
    assert is_namespace_id(ok) and check_namespace_id(ok, "ns") == ok
    for bad in ("", ok[:-1], ok.upper(), ok[:-1] + "g", ok + "0"):
        assert not is_namespace_id(bad)
        with pytest.raises(InvalidArgument, match=r"^ns="):
            check_namespace_id(bad, "ns")


def test_methods_not_served_answer_unimplemented_with_the_reason() -> None:
    rpc = RpcServer(ServerOptions(max_message_bytes=1 << 20, workers=2))
    rpc.add_service(_SERVICE, _Impl(), served={"Heartbeat"}, not_served="ask the other listener")
    port = rpc.bind("127.0.0.1:0")
    rpc.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = controller_pb2_grpc.ControllerServiceStub(ch)
            assert stub.Heartbeat(controller_pb2.HeartbeatRequest(), timeout=5).lease_ttl_ms == 7
            with pytest.raises(grpc.RpcError) as err:
                stub.ListAgents(controller_pb2.ListAgentsRequest(), timeout=5)
    finally:
        rpc.stop(0)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert err.value.details() == (
        "ControllerService.ListAgents is not served on this listener: ask the other listener"
    )


def test_a_plaintext_tcp_listener_warns_and_a_unix_socket_does_not(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    rpc = RpcServer(ServerOptions(max_message_bytes=1 << 20, workers=1, thread_name_prefix="t"))
    with caplog.at_level(logging.WARNING, logger="kvgrid.common.rpc"):
        rpc.bind(f"unix:{tmp_path / 's.sock'}")
        assert not caplog.records
        rpc.bind("127.0.0.1:0")
    rpc.stop(0)
    (rec,) = caplog.records
    assert "WITHOUT TLS" in rec.getMessage() and "127.0.0.1:0" in rec.getMessage()


def test_the_toolkit_authorizes_and_hands_the_identity_to_the_method(tmp_path: Path) -> None:
    """With an authorizer the method sees the caller's certificate identity; a role the policy does
    not list never reaches the method."""
    from tests.security.pki import TestCA, spiffe

    seen: list[Identity | None] = []

    class Impl(_Impl):
        def Heartbeat(self, req: controller_pb2.HeartbeatRequest) -> controller_pb2.HeartbeatResponse:
            seen.append(caller())
            return controller_pb2.HeartbeatResponse(lease_ttl_ms=7)

    ca = TestCA()
    srv = ca.write(tmp_path / "srv", spiffe("controller"), dns=("kvgrid-controller",))
    policy = Policy({"Heartbeat": frozenset({"agent"})})
    rpc = RpcServer(
        ServerOptions(max_message_bytes=1 << 20, workers=1), authorizer=Authorizer(policy, "cluster.local")
    )
    rpc.add_service(_SERVICE, Impl())
    port = rpc.bind(
        "127.0.0.1:0", server_credentials(TlsFiles(*(str(srv / n) for n in ("tls.crt", "tls.key", "ca.crt"))))
    )
    rpc.start()
    try:
        for who in (spiffe("agent", "pod-7"), spiffe("router")):
            d = ca.write(tmp_path / who.rsplit("/", 1)[-1], who)
            files = TlsFiles(*(str(d / n) for n in ("tls.crt", "tls.key", "ca.crt")))
            with make_channel(f"127.0.0.1:{port}", ClientTls(files), "kvgrid-controller") as ch:
                stub = controller_pb2_grpc.ControllerServiceStub(ch)
                try:
                    stub.Heartbeat(controller_pb2.HeartbeatRequest(), timeout=5)
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.PERMISSION_DENIED and who == spiffe("router")
                    assert e.details() == f"Heartbeat needs a agent identity; the caller {who!r} is a router"
    finally:
        rpc.stop(0)
    assert seen == [Identity(spiffe("agent", "pod-7"), "cluster.local", "kvgrid-test", "agent", "pod-7")]
    assert caller() is None  # nothing leaks into threads that did not serve the call


def test_identities_parse_only_from_the_scheme() -> None:
    assert parse_identity("spiffe://td/ns/n/role/router") == Identity(
        "spiffe://td/ns/n/role/router", "td", "n", "router"
    )
    for bad in (
        "spiffe://td/ns/n/role/admin",
        "spiffe://td/ns/n/role/router/pod/x",  # only agents have a pod
        "spiffe://td/ns//role/agent",
        "https://td/ns/n/role/agent",
        "spiffe://td/ns/n/role/agent/pod/",
    ):
        assert parse_identity(bad) is None, bad
