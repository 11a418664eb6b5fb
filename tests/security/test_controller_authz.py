"""Attacks on the controller over the network, against a real controller serving with mTLS.

Each test is one attack from the security issue and would pass it without the matching check:
a client without a certificate or with another CA's is refused at the handshake; a certificate
without a kvgrid identity or from another trust domain, a router calling a write RPC, an agent
acting for another pod, and a takeover of a live pod by another identity (forged epoch 2^63-1) are
PERMISSION_DENIED with a text naming what was refused.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from kvgrid.api.v1 import common_pb2, controller_pb2, controller_pb2_grpc
from kvgrid.common.identity import MAX_EPOCH
from kvgrid.controller.config import ControllerConfig
from kvgrid.controller.service import POLICY, SERVICE_NAME, Server, serve
from tests.security.conftest import NS_ID, Pki, SnapshotAgent, channel_as, publish_admit, tls_flags
from tests.security.pki import spiffe

Stub = controller_pb2_grpc.ControllerServiceStub
StubAs = Callable[[Path | None], Stub]


def _register(
    stub: Stub, pod_uid: str, epoch: int, pod: common_pb2.PodIdentity | None = None
) -> controller_pb2.RegisterAgentResponse:
    return stub.RegisterAgent(
        controller_pb2.RegisterAgentRequest(
            pod=pod or common_pb2.PodIdentity(pod_uid=pod_uid, epoch=epoch), namespaces=[NS_ID]
        ),
        timeout=5,
    )


def _match(stub: Stub, keys: list[bytes]) -> controller_pb2.MatchPrefixResponse:
    return stub.MatchPrefix(
        controller_pb2.MatchPrefixRequest(chunk_keys=common_pb2.ChunkKeys(keys=keys), namespace_id=NS_ID),
        timeout=5,
    )


def _wait(fn: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not fn():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _code(fn: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        fn()
    return err.value.code(), err.value.details() or ""


def test_the_policy_names_every_controller_method() -> None:
    """A method missing from the table would be refused to everyone; one added to the proto must be
    given its roles on purpose."""
    from kvgrid.api.v1 import controller_pb2 as pb

    methods = {m.name for m in pb.DESCRIPTOR.services_by_name["ControllerService"].methods}
    assert set(POLICY.allowed) == methods, SERVICE_NAME
    writes = {m for m, roles in POLICY.allowed.items() if roles == {"agent"}}
    assert writes == {"RegisterAgent", "Heartbeat", "PublishEvents"}


def test_plaintext_and_certificateless_clients_are_refused_at_the_handshake(
    tls_controller: Server, pki: Pki
) -> None:
    with grpc.insecure_channel(tls_controller.address) as ch:
        code, _ = _code(lambda: Stub(ch).GetStats(controller_pb2.GetStatsRequest(), timeout=3))
    assert code == grpc.StatusCode.UNAVAILABLE
    with channel_as(tls_controller.address, None, "kvgrid-controller", ca=pki.ca.pem) as ch:
        code, _ = _code(lambda: Stub(ch).GetStats(controller_pb2.GetStatsRequest(), timeout=3))
    assert code == grpc.StatusCode.UNAVAILABLE


def test_a_certificate_from_another_ca_is_refused(tls_controller: Server, pki: Pki) -> None:
    with channel_as(tls_controller.address, pki.foreign_agent(), "kvgrid-controller", ca=pki.ca.pem) as ch:
        code, _ = _code(lambda: _register(Stub(ch), "pod-foreign", 1))
    assert code == grpc.StatusCode.UNAVAILABLE  # the TLS handshake failed: no call reached the service
    assert tls_controller.controller.registry.get("pod-foreign") is None


def test_a_client_must_verify_the_controller_certificate(tls_controller: Server, pki: Pki) -> None:
    """The client side checks the server too: wrong CA or wrong role name -> no connection."""
    router = pki.router()
    with channel_as(tls_controller.address, router, "kvgrid-controller", ca=pki.foreign.pem) as ch:
        assert _code(lambda: Stub(ch).GetStats(controller_pb2.GetStatsRequest(), timeout=3))[0] == (
            grpc.StatusCode.UNAVAILABLE
        )
    with channel_as(tls_controller.address, router, "kvgrid-agent", ca=pki.ca.pem) as ch:
        assert _code(lambda: Stub(ch).GetStats(controller_pb2.GetStatsRequest(), timeout=3))[0] == (
            grpc.StatusCode.UNAVAILABLE
        )


def test_identities_outside_the_scheme_or_trust_domain_are_denied(controller_as: StubAs, pki: Pki) -> None:
    code, text = _code(
        lambda: controller_as(pki.no_identity()).GetStats(controller_pb2.GetStatsRequest(), timeout=5)
    )
    assert code == grpc.StatusCode.PERMISSION_DENIED and "no kvgrid identity" in text
    code, text = _code(
        lambda: controller_as(pki.other_domain()).GetStats(controller_pb2.GetStatsRequest(), timeout=5)
    )
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert "evil.example" in text and "cluster.local" in text


def test_a_router_reads_but_cannot_write(controller_as: StubAs, pki: Pki) -> None:
    router = controller_as(pki.router())
    keys = [bytes([7]) * 16]
    assert _match(router, keys).num_query_chunks == 1
    assert router.GetStats(controller_pb2.GetStatsRequest(), timeout=5).num_agents >= 0
    router.ListAgents(controller_pb2.ListAgentsRequest(), timeout=5)
    for attempt in (
        lambda: _register(router, "pod-router", 1),
        lambda: publish_admit(router, "pod-router", epoch=1, keys=keys),
        lambda: router.Heartbeat(controller_pb2.HeartbeatRequest(pod_uid="pod-router", epoch=1), timeout=5),
    ):
        code, text = _code(attempt)
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert "needs a agent identity" in text and spiffe("router") in text
    assert _match(router, keys).matches == []  # nothing was claimed


def test_a_per_pod_agent_certificate_acts_only_for_its_pod(controller_as: StubAs, pki: Pki) -> None:
    a = controller_as(pki.agent("pod-a1"))
    assert _register(a, "pod-a1", 1).lease_ttl_ms > 0
    code, text = _code(lambda: _register(a, "pod-b1", 1))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert "pod-b1" in text and "pod-a1" in text  # names both
    for attempt in (
        lambda: a.Heartbeat(controller_pb2.HeartbeatRequest(pod_uid="pod-b1", epoch=1), timeout=5),
        lambda: publish_admit(a, "pod-b1", epoch=1, keys=[bytes([1]) * 16]),
    ):
        code, text = _code(attempt)
        assert code == grpc.StatusCode.PERMISSION_DENIED and "pod-b1" in text


def test_a_forged_newer_epoch_from_another_identity_cannot_take_over_a_pod(
    controller_as: StubAs, pki: Pki, tls_controller: Server, request: pytest.FixtureRequest
) -> None:
    victim = controller_as(pki.agent("pod-v"))
    keys = [bytes([9]) * 16]
    # The victim's snapshot side: the controller pulls it over mTLS (controller identity -> agent).
    snap = SnapshotAgent(pki.agent("pod-v"), "pod-v", 5, keys, NS_ID)
    request.addfinalizer(snap.stop)
    _register(victim, "pod-v", 5, snap.pod)
    router = controller_as(pki.router())
    _wait(lambda: len(_match(router, keys).matches) == 1, "the victim's snapshot indexed")
    assert snap.pulls >= 1
    forger = controller_as(pki.agent())  # a real agent certificate, but the shared one: not pod-v's
    for attempt in (
        lambda: _register(forger, "pod-v", MAX_EPOCH),
        lambda: publish_admit(forger, "pod-v", epoch=MAX_EPOCH, keys=keys),
        lambda: forger.Heartbeat(controller_pb2.HeartbeatRequest(pod_uid="pod-v", epoch=5), timeout=5),
    ):
        code, text = _code(attempt)
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert "is registered by identity" in text and spiffe("agent") in text
    # The real agent keeps its registration, its entries and its lease.
    rec = tls_controller.controller.registry.get("pod-v")
    assert rec is not None and rec.pod.epoch == 5
    assert not victim.Heartbeat(
        controller_pb2.HeartbeatRequest(pod_uid="pod-v", epoch=5), timeout=5
    ).reregister
    (m,) = _match(router, keys).matches
    assert m.pod_uid == "pod-v" and m.l1_chunks == 1
    # It may still restart with a newer epoch of its own.
    _register(victim, "pod-v", 6)
    rec = tls_controller.controller.registry.get("pod-v")
    assert rec is not None and rec.pod.epoch == 6


@pytest.fixture
def lapsing_controller(pki: Pki) -> Iterator[Server]:
    server = serve(
        ControllerConfig(
            listen="127.0.0.1:0", lease_ttl_ms=200, sweep_interval_ms=20, **tls_flags(pki.controller())
        )
    )
    yield server
    server.stop()


def test_a_pod_is_free_again_once_its_lease_lapsed(lapsing_controller: Server, pki: Pki) -> None:
    def stub(who: Path) -> Stub:
        return Stub(channel_as(lapsing_controller.address, who, "kvgrid-controller", ca=pki.ca.pem))

    _register(stub(pki.agent("pod-l")), "pod-l", 1)
    shared = stub(pki.agent())
    assert _code(lambda: _register(shared, "pod-l", 2))[0] == grpc.StatusCode.PERMISSION_DENIED
    _wait(lambda: lapsing_controller.controller.registry.get("pod-l") is None, "the lease to lapse")
    assert _register(shared, "pod-l", 2).lease_ttl_ms == 200


def test_the_plaintext_health_port_serves_health_only(pki: Pki, free_port: Callable[[], int]) -> None:
    """Kubelet gRPC probes cannot present a certificate: ``health_port`` answers grpc.health.v1 in
    plaintext and nothing else."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    server = serve(
        ControllerConfig(listen="127.0.0.1:0", health_port=free_port(), **tls_flags(pki.controller()))
    )
    try:
        with grpc.insecure_channel(server.health_address) as ch:
            ok = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert ok.status == health_pb2.HealthCheckResponse.SERVING
            code, _ = _code(lambda: Stub(ch).GetStats(controller_pb2.GetStatsRequest(), timeout=5))
            assert code == grpc.StatusCode.UNIMPLEMENTED
        with grpc.insecure_channel(server.address) as ch:
            code, _ = _code(
                lambda: health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3)
            )
            assert code == grpc.StatusCode.UNAVAILABLE  # the main port stays mTLS-only
    finally:
        server.stop()


def test_a_pod_registered_by_its_event_stream_belongs_to_that_identity(
    controller_as: StubAs, pki: Pki, tls_controller: Server
) -> None:
    """PublishEvents registers an unknown pod implicitly (e.g. after a controller restart): the
    stream's identity owns it as a RegisterAgent's would."""
    publish_admit(controller_as(pki.agent("pod-w")), "pod-w", epoch=3, keys=[bytes([5]) * 16])
    assert tls_controller.controller.registry.get("pod-w") is not None
    code, text = _code(lambda: _register(controller_as(pki.agent()), "pod-w", MAX_EPOCH))
    assert code == grpc.StatusCode.PERMISSION_DENIED and spiffe("agent", "pod-w") in text
