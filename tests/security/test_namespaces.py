"""Kubernetes namespaces are a boundary: identities of another namespace, signed by the same CA (a
shared issuer, a corporate CA), are refused by real servers serving with mTLS.

The attack these tests replay: an identity of namespace B registered as an agent at namespace A's
controller, fetched chunks from A's agents, and as a controller of B pulled A's agent Snapshot --
only the trust domain was compared. Now every authorized RPC also checks the caller's namespace
against ``tls_allowed_namespaces`` (empty: the namespace of the server's own certificate identity),
with a PERMISSION_DENIED naming the caller's namespace and the accepted ones.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvgrid.agent.config import AgentConfig
from kvgrid.agent.service import AgentServer
from kvgrid.api.v1 import agent_pb2, agent_pb2_grpc, common_pb2, controller_pb2, controller_pb2_grpc
from kvgrid.common.config import load_config
from kvgrid.common.identity import PodIdentity
from kvgrid.common.tls import AGENT_SERVER_NAME, CONTROLLER_SERVER_NAME, ClientTls, TlsFiles, certificate_sans
from kvgrid.controller.config import ControllerConfig
from kvgrid.controller.service import Server, serve
from kvgrid.engine.client import AgentClient
from tests.security.conftest import NS_ID, Pki, channel_as, publish_admit, put_chunks, tls_flags
from tests.security.pki import NAMESPACE, TestCA, spiffe

Stub = controller_pb2_grpc.ControllerServiceStub
OURS = NAMESPACE  # namespace A: every server below runs with a certificate of it
THEIRS = "team-b"  # namespace B: the same CA, the same trust domain


def _code(fn: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        fn()
    return err.value.code(), err.value.details() or ""


def _refused_for_namespace(fn: Callable[[], object], method: str, ns: str = THEIRS) -> None:
    code, text = _code(fn)
    assert code == grpc.StatusCode.PERMISSION_DENIED, text
    assert text.startswith(f"{method}: the caller "), text
    assert f"is of namespace {ns!r}" in text and f"accepts callers of namespace {OURS!r} only" in text, text


# --- the controller ----------------------------------------------------------------------------


def _controller(pki: Pki, who: Path | None = None, **flags: Any) -> Server:
    return serve(
        ControllerConfig(
            listen="127.0.0.1:0", lease_ttl_ms=60_000, **tls_flags(who or pki.controller()), **flags
        )
    )


@pytest.fixture
def stub_to(pki: Pki) -> Iterator[Callable[[Server, Path], Stub]]:
    channels: list[grpc.Channel] = []

    def make(server: Server, who: Path) -> Stub:
        ch = channel_as(server.address, who, CONTROLLER_SERVER_NAME, ca=pki.ca.pem)
        channels.append(ch)
        return Stub(ch)

    yield make
    for ch in channels:
        ch.close()


def _register(stub: Stub, pod_uid: str) -> controller_pb2.RegisterAgentResponse:
    pod = common_pb2.PodIdentity(pod_uid=pod_uid, epoch=1)
    return stub.RegisterAgent(controller_pb2.RegisterAgentRequest(pod=pod, namespaces=[NS_ID]), timeout=5)


def _match(stub: Stub, keys: list[bytes]) -> controller_pb2.MatchPrefixResponse:
    req = controller_pb2.MatchPrefixRequest(chunk_keys=common_pb2.ChunkKeys(keys=keys), namespace_id=NS_ID)
    return stub.MatchPrefix(req, timeout=5)


@pytest.mark.parametrize("dns_form", [False, True], ids=["uri", "dns"])
def test_an_agent_of_another_namespace_cannot_write_the_controller(
    pki: Pki, stub_to: Callable[[Server, Path], Stub], dns_form: bool
) -> None:
    keys = [bytes([9]) * 16]
    server = _controller(pki)
    try:
        for who in (
            pki.in_namespace(THEIRS, "agent", dns_form=dns_form),
            *(() if dns_form else (pki.in_namespace(THEIRS, "agent", "pod-b"),)),  # per-pod form
        ):
            theirs = stub_to(server, who)
            _refused_for_namespace(lambda: _register(theirs, "pod-b"), "RegisterAgent")  # noqa: B023
            _refused_for_namespace(lambda: publish_admit(theirs, "pod-b", keys), "PublishEvents")  # noqa: B023
            _refused_for_namespace(
                lambda: theirs.Heartbeat(  # noqa: B023
                    controller_pb2.HeartbeatRequest(pod_uid="pod-b", epoch=1), timeout=5
                ),
                "Heartbeat",
            )
            # Reads too: the whole service is closed to namespace B, not only its write RPCs.
            _refused_for_namespace(lambda: _match(theirs, keys), "MatchPrefix")  # noqa: B023
        assert server.controller.registry.get("pod-b") is None
        router_b = stub_to(server, pki.in_namespace(THEIRS, "router", dns_form=dns_form))
        _refused_for_namespace(
            lambda: router_b.GetStats(controller_pb2.GetStatsRequest(), timeout=5), "GetStats"
        )

        # The same identities of our namespace still work.
        ours = stub_to(server, pki.in_namespace(OURS, "agent", dns_form=dns_form))
        assert _register(ours, "pod-a").lease_ttl_ms > 0
        publish_admit(ours, "pod-a", keys)
        assert server.controller.registry.get("pod-a") is not None
        router_a = stub_to(server, pki.in_namespace(OURS, "router", dns_form=dns_form))
        assert router_a.GetStats(controller_pb2.GetStatsRequest(), timeout=5).num_agents == 1
    finally:
        server.stop()


def test_the_controller_learns_its_namespace_from_a_dns_identity(
    pki: Pki, stub_to: Callable[[Server, Path], Stub]
) -> None:
    """A certificate of the chart's own CA (tls.provider=helm) has only DNS SANs; its namespace counts."""
    server = _controller(pki, pki.in_namespace(OURS, "controller", dns_form=True))
    try:
        theirs = stub_to(server, pki.in_namespace(THEIRS, "agent"))
        _refused_for_namespace(lambda: _register(theirs, "pod-b2"), "RegisterAgent")
        assert _register(stub_to(server, pki.agent()), "pod-a2").lease_ttl_ms > 0
    finally:
        server.stop()


def test_allowed_namespaces_admit_the_listed_ones(pki: Pki, stub_to: Callable[[Server, Path], Stub]) -> None:
    server = _controller(pki, tls_allowed_namespaces=[OURS, THEIRS])
    try:
        theirs = stub_to(server, pki.in_namespace(THEIRS, "agent"))
        assert _register(theirs, "pod-b3").lease_ttl_ms > 0
        publish_admit(theirs, "pod-b3", [bytes([5]) * 16])
        assert _register(stub_to(server, pki.agent()), "pod-a3").lease_ttl_ms > 0
        # The list is exact: a third namespace is still refused, naming both accepted ones.
        code, text = _code(lambda: _register(stub_to(server, pki.in_namespace("team-c", "agent")), "pod-c"))
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert "namespace 'team-c'" in text and f"{OURS!r}, {THEIRS!r}" in text, text
    finally:
        server.stop()
    server = _controller(pki, tls_allowed_namespaces=["*"])
    try:
        assert _register(stub_to(server, pki.in_namespace("team-c", "agent")), "pod-c").lease_ttl_ms > 0
    finally:
        server.stop()


def test_a_server_certificate_without_a_namespace_needs_an_explicit_list(tmp_path: Path, pki: Pki) -> None:
    """Fail closed at start: without a kvgrid identity of its own, the server cannot tell which
    namespace to accept -- it refuses to start instead of accepting every namespace."""
    anonymous = pki.ca.write(tmp_path / "anon", dns=(CONTROLLER_SERVER_NAME,))
    with pytest.raises(ValueError, match=r"carries no kvgrid identity of trust domain 'cluster.local'.*"
                       r"set tls_allowed_namespaces"):  # fmt: skip
        _controller(pki, anonymous)
    with pytest.raises(ValueError, match="tls_allowed_namespaces"):
        AgentServer(
            AgentConfig(
                uds_path="", tcp_host="127.0.0.1", tcp_port=0, l1_size=1 << 20, **tls_flags(anonymous)
            ),
            pod=PodIdentity(pod_uid="pod-anon", epoch=1),
        ).start()
    server = _controller(pki, anonymous, tls_allowed_namespaces=[OURS])
    try:
        with channel_as(server.address, pki.agent(), CONTROLLER_SERVER_NAME, ca=pki.ca.pem) as ch:
            assert _register(Stub(ch), "pod-a4").lease_ttl_ms > 0
        with channel_as(server.address, pki.in_namespace(THEIRS, "agent"), CONTROLLER_SERVER_NAME) as ch:
            _refused_for_namespace(lambda: _register(Stub(ch), "pod-b4"), "RegisterAgent")
    finally:
        server.stop()


# --- the agent's TCP port ------------------------------------------------------------------------


def _agent(tmp_path: Path, who: Path, **flags: Any) -> AgentServer:
    cfg = AgentConfig(
        uds_path=str(tmp_path / "agent.sock"), tcp_host="127.0.0.1", tcp_port=0,
        l1_size=4 << 20, l1_page_size=4096, **tls_flags(who), **flags,
    )  # fmt: skip
    return AgentServer(cfg, pod=PodIdentity(pod_uid="pod-srv", epoch=1)).start()


def _fetch(address: str, who: Path, keys: list[bytes]) -> list[agent_pb2.FetchChunksResponse]:
    req = agent_pb2.FetchChunksRequest(chunk_keys=keys, layout_id="L", namespace_id=NS_ID)
    with channel_as(address, who, AGENT_SERVER_NAME) as ch:
        return list(agent_pb2_grpc.AgentServiceStub(ch).FetchChunks(req, timeout=5))


def _snapshot(address: str, who: Path) -> agent_pb2.SnapshotResponse:
    """A snapshot pull as the controller makes it: AgentClient with the controller's TLS files."""
    files = TlsFiles(str(who / "tls.crt"), str(who / "tls.key"), str(who / "ca.crt"))
    with AgentClient(address, timeout_s=5, tls=ClientTls(files)) as client:
        return client.snapshot()


@pytest.fixture
def agent_a(tmp_path: Path, pki: Pki) -> Iterator[AgentServer]:
    server = _agent(tmp_path, pki.agent("pod-srv"))  # a per-pod agent certificate of namespace A
    yield server
    server.stop(0)


def test_another_namespace_cannot_fetch_chunks_or_pull_a_snapshot(agent_a: AgentServer, pki: Pki) -> None:
    keys = [bytes([6]) * 16]
    put_chunks(agent_a, keys)
    address = f"127.0.0.1:{agent_a.tcp_port}"
    for who in (
        pki.in_namespace(THEIRS, "agent"),
        pki.in_namespace(THEIRS, "agent", "pod-b"),
        pki.in_namespace(THEIRS, "agent", dns_form=True),
    ):
        _refused_for_namespace(lambda: _fetch(address, who, keys), "FetchChunks")  # noqa: B023
        _refused_for_namespace(lambda: _snapshot(address, who), "Snapshot")  # noqa: B023
    for who in (
        pki.in_namespace(THEIRS, "controller"),
        pki.in_namespace(THEIRS, "controller", dns_form=True),
    ):
        _refused_for_namespace(lambda: _snapshot(address, who), "Snapshot")  # noqa: B023

    # Our namespace's agents fetch and our controller pulls, as before.
    for who in (pki.agent("pod-peer"), pki.agent(), pki.in_namespace(OURS, "agent", dns_form=True)):
        parts = _fetch(address, who, keys)
        assert parts and parts[0].num_chunks == 1 and sum(len(p.data) for p in parts) == 4096
    for who in (pki.controller(), pki.in_namespace(OURS, "controller", dns_form=True)):
        snap = _snapshot(address, who)
        assert snap.pod.pod_uid == "pod-srv" and keys[0] in snap.chunk_keys


def test_an_agent_allowing_another_namespace_serves_it(tmp_path: Path, pki: Pki) -> None:
    """Accepting a namespace on the wire (tls_allowed_namespaces) lets its identities call; reading
    this agent's chunks also needs a grant (chunk_readers; tests/security/test_tenants.py)."""
    server = _agent(
        tmp_path, pki.agent("pod-srv"), tls_allowed_namespaces=[OURS, THEIRS], chunk_readers=[THEIRS]
    )
    try:
        keys = [bytes([8]) * 16]
        put_chunks(server, keys)
        address = f"127.0.0.1:{server.tcp_port}"
        assert _fetch(address, pki.in_namespace(THEIRS, "agent"), keys)[0].num_chunks == 1
        assert keys[0] in _snapshot(address, pki.in_namespace(THEIRS, "controller")).chunk_keys
        assert _fetch(address, pki.agent(), keys)[0].num_chunks == 1
        code, text = _code(lambda: _fetch(address, pki.in_namespace("team-c", "agent"), keys))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "namespace 'team-c'" in text
    finally:
        server.stop(0)


def test_plaintext_listeners_keep_serving_without_identities(tmp_path: Path) -> None:
    """No TLS, no identity, no namespace check: the old behaviour (the service warns at start)."""
    cfg = AgentConfig(
        uds_path=str(tmp_path / "agent.sock"), tcp_host="127.0.0.1", tcp_port=0,
        l1_size=4 << 20, l1_page_size=4096,
    )  # fmt: skip
    server = AgentServer(cfg, pod=PodIdentity(pod_uid="pod-plain", epoch=1)).start()
    try:
        keys = [bytes([2]) * 16]
        put_chunks(server, keys)
        req = agent_pb2.FetchChunksRequest(chunk_keys=keys, layout_id="L", namespace_id=NS_ID)
        with grpc.insecure_channel(f"127.0.0.1:{server.tcp_port}") as ch:
            parts = list(agent_pb2_grpc.AgentServiceStub(ch).FetchChunks(req, timeout=5))
        assert parts and parts[0].num_chunks == 1
        with AgentClient(f"127.0.0.1:{server.tcp_port}", timeout_s=5) as client:
            assert client.snapshot().pod.pod_uid == "pod-plain"
    finally:
        server.stop(0)


# --- the setting --------------------------------------------------------------------------------


def test_the_setting_is_a_list_of_namespace_names() -> None:
    for config_type in (AgentConfig, ControllerConfig):
        assert config_type().tls_allowed_namespaces == []
        cfg = load_config(config_type, env={"KVGRID_TLS_ALLOWED_NAMESPACES": f"{OURS}, {THEIRS}"})
        assert cfg.tls_allowed_namespaces == [OURS, THEIRS]
        for bad in ("Team-B", "b/c", "", "-b", "x" * 64):
            with pytest.raises(ValueError, match=r"tls_allowed_namespaces=.*not a Kubernetes namespace"):
                config_type(tls_allowed_namespaces=[bad])
        assert config_type(tls_allowed_namespaces=["*"]).tls_allowed_namespaces == ["*"]


def test_certificate_sans_reads_the_leaf_of_a_chain(tmp_path: Path) -> None:
    ca = TestCA()
    uri = spiffe("agent", "pod-1", ns=THEIRS)
    cert, _ = ca.issue(uri, "https://example.com/x", dns=("kvgrid-agent", "agent.b.kvgrid-id.cluster.local"))
    other, _ = ca.issue(spiffe("router"))
    assert certificate_sans(cert + other + ca.pem) == (
        [uri, "https://example.com/x"],
        ["kvgrid-agent", "agent.b.kvgrid-id.cluster.local"],
    )
    assert certificate_sans(ca.pem) == ([], [])  # no SAN extension
    with pytest.raises(ValueError):
        certificate_sans(b"not a certificate")
