"""Tenants: an identity reads only the chunks (and chunk keys) of the tenants it is entitled to,
against real servers serving with mTLS.

The attack these tests replay: an agent identity of tenant B (another Kubernetes namespace, accepted
on the wire because the operator let both namespaces in) read tenant A's KV bit for bit through
FetchChunks -- over gRPC and over the data plane -- knowing only A's namespace id, and listed A's
chunk keys with the controller's SnapshotIndex, which every role could call. Now:

- the agent's FetchChunks and Snapshot check the caller's tenant (its namespace) against the
  agent's own tenant (the namespace of its certificate) and ``chunk_readers``: PERMISSION_DENIED
  naming the caller and the tenant, before any chunk is referenced or ticket issued, the agent
  keeps serving and nothing cached is lost;
- a data-plane ticket serves only the certificate identity it was issued to;
- SnapshotIndex answers only the identity that registered the pod and the controller's own
  namespace's controller identity; routers, other agents and other namespaces' controllers are
  PERMISSION_DENIED.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvgrid.agent.config import AgentConfig
from kvgrid.agent.peers.dataplane.protocol import HELLO, MAGIC
from kvgrid.agent.peers.dataplane.sockets import recv_exact_into
from kvgrid.agent.peers.dataplane.tls_contexts import client_context
from kvgrid.agent.service import AgentServer
from kvgrid.api.v1 import agent_pb2, agent_pb2_grpc, controller_pb2, controller_pb2_grpc
from kvgrid.common.authz import parse_chunk_readers
from kvgrid.common.identity import PodIdentity
from kvgrid.common.tls import AGENT_SERVER_NAME, CONTROLLER_SERVER_NAME, ClientTls, TlsFiles
from kvgrid.controller.config import ControllerConfig
from kvgrid.controller.service import Server, serve
from kvgrid.engine.client import AgentClient
from tests.agent.helpers import wait_for
from tests.security.conftest import NS_ID, Pki, SnapshotAgent, channel_as, put_chunks, tls_flags
from tests.security.pki import NAMESPACE

OURS = NAMESPACE  # tenant A: the serving agent's namespace
THEIRS = "team-b"  # tenant B: the same CA, accepted on the wire
OTHER_NS_ID = "fedcba9876543210fedcba9876543210"
"""A second namespace id (another model or salt) of tenant A."""
NBYTES = 4096
EXPECTED = bytes(range(256)) * (NBYTES // 256)
"""What :func:`put_chunks` stores in every chunk."""


def _code(fn: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        fn()
    return err.value.code(), err.value.details() or ""


def _agent(tmp_path: Path, pki: Pki, **flags: Any) -> AgentServer:
    cfg = AgentConfig(
        uds_path=str(tmp_path / "agent.sock"), tcp_host="127.0.0.1", tcp_port=0,
        l1_size=4 << 20, l1_page_size=4096, **tls_flags(pki.agent("pod-srv")),
        **{"tls_allowed_namespaces": [OURS, THEIRS], **flags},
    )  # fmt: skip
    return AgentServer(cfg, pod=PodIdentity(pod_uid="pod-srv", epoch=1)).start()


def _put(server: AgentServer, keys: list[bytes], namespace_id: str = NS_ID) -> None:
    if namespace_id == NS_ID:
        put_chunks(server, keys, NBYTES)
        return
    import torch

    assert server.core is not None
    res = server.core.cache.reserve_store(keys, namespace_id=namespace_id, layout_id="L", nbytes=NBYTES)
    for _, chunk in res.new_chunks:
        chunk.buffer.copy_(torch.arange(NBYTES, dtype=torch.int32).to(torch.uint8))
    server.core.cache.commit(res)


def _fetch(
    server: AgentServer, who: Path, keys: list[bytes], namespace_id: str = NS_ID, streams: int = 0
) -> list[agent_pb2.FetchChunksResponse]:
    req = agent_pb2.FetchChunksRequest(
        chunk_keys=keys, layout_id="L", namespace_id=namespace_id, data_streams=streams
    )
    with channel_as(f"127.0.0.1:{server.tcp_port}", who, AGENT_SERVER_NAME) as ch:
        return list(agent_pb2_grpc.AgentServiceStub(ch).FetchChunks(req, timeout=10))


def _grpc_bytes(parts: list[agent_pb2.FetchChunksResponse]) -> list[bytes]:
    out: dict[int, bytearray] = {}
    for p in parts:
        out.setdefault(p.chunk_index, bytearray()).extend(p.data)
    return [bytes(out[i]) for i in sorted(out)]


def _files(who: Path) -> TlsFiles:
    return TlsFiles(str(who / "tls.crt"), str(who / "tls.key"), str(who / "ca.crt"))


def _data_plane_read(
    server: AgentServer, who: Path, keys: list[bytes], presenter: Path | None = None
) -> bytes:
    """Ask for a one-stream ticket as ``who`` over the control plane and read the first chunk with it
    on the data port, over TLS as ``presenter`` (default ``who``); b"" when the port sent nothing."""
    req = agent_pb2.FetchChunksRequest(chunk_keys=keys, layout_id="L", namespace_id=NS_ID, data_streams=1)
    with channel_as(f"127.0.0.1:{server.tcp_port}", who, AGENT_SERVER_NAME) as ch:
        call = agent_pb2_grpc.AgentServiceStub(ch).FetchChunks(req, timeout=10)
        first = next(call)
        assert first.data_ticket and first.num_chunks == len(keys)
        raw = socket.create_connection(("127.0.0.1", first.data_port), timeout=10)
        with client_context(_files(presenter or who)).wrap_socket(
            raw, server_hostname=AGENT_SERVER_NAME
        ) as s:
            s.sendall(HELLO.pack(MAGIC, first.data_ticket, 0))
            data = bytearray(NBYTES + 16)
            try:
                recv_exact_into(s, memoryview(data))
            except (ConnectionError, OSError):
                return b""
            call.cancel()
            return bytes(data[:NBYTES])


def _snapshot(server: AgentServer, who: Path) -> agent_pb2.SnapshotResponse:
    with AgentClient(f"127.0.0.1:{server.tcp_port}", timeout_s=5, tls=ClientTls(_files(who))) as client:
        return client.snapshot()


def _refused_for_tenant(fn: Callable[[], object], method: str, who: str, what: str) -> None:
    code, text = _code(fn)
    assert code == grpc.StatusCode.PERMISSION_DENIED, text
    assert text.startswith(f"{method}: the caller '{who}' of namespace {THEIRS!r} may not read {what}"), text
    assert f"belong to tenant {OURS!r}" in text and "chunk_readers" in text, text


@pytest.fixture
def agent_a(tmp_path: Path, pki: Pki) -> Iterator[AgentServer]:
    server = _agent(tmp_path, pki)
    yield server
    server.stop(0)


# --- the agent: FetchChunks (gRPC and data plane) and Snapshot ------------------------------------


def test_another_tenant_cannot_read_chunks_over_grpc_or_the_data_plane(
    agent_a: AgentServer, pki: Pki
) -> None:
    keys = [bytes([31]) * 16, bytes([32]) * 16]
    _put(agent_a, keys)
    assert agent_a.core is not None and agent_a.data_plane is not None
    for who, uri in (
        (pki.in_namespace(THEIRS, "agent"), f"spiffe://cluster.local/ns/{THEIRS}/role/agent"),
        (
            pki.in_namespace(THEIRS, "agent", "pod-b"),
            f"spiffe://cluster.local/ns/{THEIRS}/role/agent/pod/pod-b",
        ),
        (pki.in_namespace(THEIRS, "agent", dns_form=True), f"agent.{THEIRS}.kvgrid-id.cluster.local"),
    ):
        for streams in (0, 2):  # the chunks inside the stream, and a data-plane ticket
            _refused_for_tenant(
                lambda: _fetch(agent_a, who, keys, streams=streams),  # noqa: B023
                "FetchChunks",
                uri,
                f"namespace_id={NS_ID!r}",
            )
    # No ticket was issued, no data connection admitted, nothing referenced or lost.
    assert agent_a.data_plane.live_tickets == 0 and agent_a.data_plane.admitted == 0
    assert agent_a.core.cache.stats().num_chunks == 2
    # Nor may their controller list our keys.
    _refused_for_tenant(
        lambda: _snapshot(agent_a, pki.in_namespace(THEIRS, "controller")),
        "Snapshot",
        f"spiffe://cluster.local/ns/{THEIRS}/role/controller",
        "any of this agent's chunks",
    )

    # The agent keeps serving its own tenant, bit for bit, on both planes.
    assert _grpc_bytes(_fetch(agent_a, pki.agent("pod-peer"), keys)) == [EXPECTED, EXPECTED]
    assert _data_plane_read(agent_a, pki.agent("pod-peer"), keys) == EXPECTED
    snap = _snapshot(agent_a, pki.controller())
    assert set(snap.chunk_keys) == set(keys) and list(snap.namespaces) == [NS_ID]


def test_chunk_readers_grant_another_namespace_exactly_what_they_list(tmp_path: Path, pki: Pki) -> None:
    server = _agent(tmp_path, pki, chunk_readers=[f"{THEIRS}/{NS_ID}"], tls_allowed_namespaces=["*"])
    try:
        ours, other = [bytes([33]) * 16], [bytes([34]) * 16]
        _put(server, ours)
        _put(server, other, OTHER_NS_ID)
        theirs = pki.in_namespace(THEIRS, "agent")
        assert _grpc_bytes(_fetch(server, theirs, ours)) == [EXPECTED]
        _refused_for_tenant(
            lambda: _fetch(server, theirs, other, OTHER_NS_ID),
            "FetchChunks",
            f"spiffe://cluster.local/ns/{THEIRS}/role/agent",
            f"namespace_id={OTHER_NS_ID!r}",
        )
        # Their controller sees only the granted namespace id; ours sees both.
        snap = _snapshot(server, pki.in_namespace(THEIRS, "controller"))
        assert list(snap.chunk_keys) == ours and list(snap.namespaces) == [NS_ID]
        assert [g.namespace for g in snap.by_namespace] == [NS_ID]
        assert set(_snapshot(server, pki.controller()).chunk_keys) == {*ours, *other}
        # A third namespace, accepted on the wire ("*") but granted nothing, reads nothing.
        code, text = _code(lambda: _fetch(server, pki.in_namespace("team-c", "agent"), ours))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "namespace 'team-c'" in text, text
        assert "grants namespace 'team-c' no namespace id" in text, text
    finally:
        server.stop(0)


def test_a_data_plane_ticket_serves_only_the_identity_it_was_issued_to(
    agent_a: AgentServer, pki: Pki
) -> None:
    keys = [bytes([35]) * 16]
    _put(agent_a, keys)
    assert agent_a.data_plane is not None
    # pod-y (an agent of our own tenant) presents pod-x's ticket: nothing is sent.
    assert _data_plane_read(agent_a, pki.agent("pod-x"), keys, presenter=pki.agent("pod-y")) == b""
    assert agent_a.data_plane.admitted == 0 and agent_a.data_plane.refused == 1
    # pod-x itself gets the bytes with a ticket of its own.
    assert _data_plane_read(agent_a, pki.agent("pod-x"), keys) == EXPECTED
    assert agent_a.data_plane.admitted == 1


def test_a_single_namespace_install_reads_as_before(tmp_path: Path, pki: Pki) -> None:
    """The default (no chunk_readers, tls_allowed_namespaces empty): every identity of the agent's own
    namespace -- the shared certificate, per-pod ones, the DNS form -- reads every namespace id."""
    cfg = AgentConfig(
        uds_path=str(tmp_path / "agent.sock"), tcp_host="127.0.0.1", tcp_port=0,
        l1_size=4 << 20, l1_page_size=4096, **tls_flags(pki.agent()),
    )  # fmt: skip
    server = AgentServer(cfg, pod=PodIdentity(pod_uid="pod-one", epoch=1)).start()
    try:
        a, b = [bytes([36]) * 16], [bytes([37]) * 16]
        _put(server, a)
        _put(server, b, OTHER_NS_ID)
        for who in (pki.agent(), pki.agent("pod-q"), pki.in_namespace(OURS, "agent", dns_form=True)):
            assert _grpc_bytes(_fetch(server, who, a)) == [EXPECTED]
            assert _grpc_bytes(_fetch(server, who, b, OTHER_NS_ID)) == [EXPECTED]
        assert set(_snapshot(server, pki.controller()).chunk_keys) == {*a, *b}
    finally:
        server.stop(0)


def test_chunk_readers_setting() -> None:
    assert AgentConfig().chunk_readers == []
    assert parse_chunk_readers([THEIRS, f"team-c/{NS_ID}", f"team-c/{OTHER_NS_ID}", f"*/{NS_ID}"]) == {
        THEIRS: None,
        "team-c": frozenset({NS_ID, OTHER_NS_ID}),
        "*": frozenset({NS_ID}),
    }
    assert parse_chunk_readers([f"team-c/{NS_ID}", "team-c"]) == {"team-c": None}
    for bad, why in (
        ("Team-B", "does not start with a Kubernetes namespace name"),
        ("team-b/xyz", "names namespace id 'xyz'; expected the 32-char"),
        ("", "does not start with a Kubernetes namespace name"),
    ):
        with pytest.raises(ValueError, match=rf"chunk_readers=.*{why}"):
            AgentConfig(chunk_readers=[bad])


def test_an_agent_certificate_without_a_tenant_needs_chunk_readers(tmp_path: Path, pki: Pki) -> None:
    """Fail closed at start: an agent whose certificate names no namespace has no tenant to serve."""
    anonymous = pki.ca.write(tmp_path / "anon-agent", dns=(AGENT_SERVER_NAME,))
    cfg = AgentConfig(
        uds_path="", tcp_host="127.0.0.1", tcp_port=0, l1_size=1 << 20, l1_page_size=4096,
        tls_allowed_namespaces=[OURS], **tls_flags(anonymous),
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"tenant is unknown: set chunk_readers"):
        AgentServer(cfg, pod=PodIdentity(pod_uid="pod-anon", epoch=1)).start()


# --- the controller: SnapshotIndex ----------------------------------------------------------------


@pytest.fixture
def shared_controller(pki: Pki) -> Iterator[Server]:
    """A controller both tenants' identities may call (their agents share it)."""
    server = serve(
        ControllerConfig(
            listen="127.0.0.1:0", lease_ttl_ms=60_000, tls_allowed_namespaces=[OURS, THEIRS],
            **tls_flags(pki.controller()),
        )
    )  # fmt: skip
    yield server
    server.stop()


def _index(server: Server, who: Path, pod_uid: str) -> controller_pb2.SnapshotIndexResponse:
    with channel_as(server.address, who, CONTROLLER_SERVER_NAME) as ch:
        return controller_pb2_grpc.ControllerServiceStub(ch).SnapshotIndex(
            controller_pb2.SnapshotIndexRequest(pod_uid=pod_uid), timeout=5
        )


def test_snapshot_index_lists_a_pod_only_to_its_owner(shared_controller: Server, pki: Pki) -> None:
    keys = [bytes([38]) * 16, bytes([39]) * 16]
    owner = pki.agent("pod-a")
    # pod-a's snapshot side: the controller pulls its keys over mTLS after the registration.
    snap = SnapshotAgent(owner, "pod-a", 1, keys, NS_ID)
    try:
        with channel_as(shared_controller.address, owner, CONTROLLER_SERVER_NAME) as ch:
            stub = controller_pb2_grpc.ControllerServiceStub(ch)
            req = controller_pb2.RegisterAgentRequest(pod=snap.pod, namespaces=[NS_ID])
            stub.RegisterAgent(req, timeout=5)
            wait_for(
                "pod-a's snapshot indexed",
                lambda: (
                    len(stub.SnapshotIndex(controller_pb2.SnapshotIndexRequest(pod_uid="pod-a")).chunk_keys)
                    == 2
                ),
                10,
            )
    finally:
        snap.stop()

    for who, needle in (
        (pki.in_namespace(THEIRS, "agent"), f"the caller 'spiffe://cluster.local/ns/{THEIRS}/role/agent' "
                                            f"(namespace {THEIRS!r}) may list only the pods it registered"),
        (pki.agent("pod-z"), "proves pod 'pod-z'; an agent may list only its own pod's chunk keys"),
        (pki.agent(), "may list only the pods it registered: pod 'pod-a' is registered by identity "
                      f"'spiffe://cluster.local/ns/{OURS}/role/agent/pod/pod-a'"),
        (pki.in_namespace(THEIRS, "controller"), f"is a controller of namespace {THEIRS!r}"),
    ):  # fmt: skip
        code, text = _code(lambda: _index(shared_controller, who, "pod-a"))  # noqa: B023
        assert code == grpc.StatusCode.PERMISSION_DENIED, text
        assert text.startswith("SnapshotIndex of pod_uid='pod-a': ") and needle in text, text
    for who in (pki.router(), pki.in_namespace(THEIRS, "router")):
        code, text = _code(lambda: _index(shared_controller, who, "pod-a"))  # noqa: B023
        assert code == grpc.StatusCode.PERMISSION_DENIED, text
        assert "SnapshotIndex needs a agent or controller identity" in text and "is a router" in text, text

    # The owner and our own controller identity still list it; the controller keeps serving.
    assert set(_index(shared_controller, owner, "pod-a").chunk_keys) == set(keys)
    assert set(_index(shared_controller, pki.controller(), "pod-a").chunk_keys) == set(keys)
    with channel_as(shared_controller.address, pki.router(), CONTROLLER_SERVER_NAME) as ch:
        stats = controller_pb2_grpc.ControllerServiceStub(ch).GetStats(
            controller_pb2.GetStatsRequest(), timeout=5
        )
    assert stats.num_agents == 1
