"""The agent's listeners: the engine API only on the Unix socket, the TCP port serving FetchChunks to
agent identities and Snapshot to the controller identity, over mTLS (a real in-process agent)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvgrid.agent.config import AgentConfig
from kvgrid.agent.service import TCP_POLICY, AgentServer
from kvgrid.api.v1 import agent_pb2, agent_pb2_grpc
from kvgrid.common.identity import PodIdentity
from kvgrid.common.tls import AGENT_SERVER_NAME, ClientTls, TlsFiles
from kvgrid.engine.client import AgentClient
from tests.security.conftest import NS_ID, Pki, channel_as, put_chunks, tls_flags
from tests.security.pki import spiffe

ENGINE_METHODS = (
    "RegisterKVCaches",
    "UnregisterKVCaches",
    "Lookup",
    "Retrieve",
    "Store",
    "Release",
    "Health",
)


def _agent(tmp_path: Path, tls: Path | None) -> AgentServer:
    cfg = AgentConfig(
        uds_path=str(tmp_path / "agent.sock"), tcp_host="127.0.0.1", tcp_port=0,
        l1_size=4 << 20, l1_page_size=4096, **(tls_flags(tls) if tls else {}),
    )  # fmt: skip
    return AgentServer(cfg, pod=PodIdentity(pod_uid="pod-srv", epoch=1)).start()


@pytest.fixture
def tls_agent(tmp_path: Path, pki: Pki) -> Iterator[AgentServer]:
    server = _agent(tmp_path, pki.agent("pod-srv"))
    yield server
    server.stop(0)


def _fetch(ch: grpc.Channel, keys: list[bytes]) -> list[agent_pb2.FetchChunksResponse]:
    req = agent_pb2.FetchChunksRequest(chunk_keys=keys, layout_id="L", namespace_id=NS_ID)
    return list(agent_pb2_grpc.AgentServiceStub(ch).FetchChunks(req, timeout=5))


def _engine_call(ch: grpc.Channel, method: str) -> grpc.RpcError:
    m = agent_pb2.DESCRIPTOR.services_by_name["AgentService"].methods_by_name[method]
    call = ch.unary_unary(
        f"/kvgrid.v1.AgentService/{method}",
        request_serializer=lambda b: b,
        response_deserializer=lambda b: b,
    )
    assert not m.server_streaming
    with pytest.raises(grpc.RpcError) as err:
        call(b"", timeout=5)
    return err.value


def test_tcp_serves_exactly_the_peer_and_controller_methods() -> None:
    assert dict(TCP_POLICY.allowed) == {"FetchChunks": {"agent"}, "Snapshot": {"controller"}}


@pytest.mark.parametrize("tls", [False, True], ids=["plaintext", "mtls"])
def test_engine_methods_are_not_served_over_tcp(tmp_path: Path, pki: Pki, tls: bool) -> None:
    server = _agent(tmp_path, pki.agent("pod-srv") if tls else None)
    try:
        address = f"127.0.0.1:{server.tcp_port}"
        ch = (
            channel_as(address, pki.agent("pod-x"), AGENT_SERVER_NAME)
            if tls
            else grpc.insecure_channel(address)
        )
        with ch:
            for method in ENGINE_METHODS:
                err = _engine_call(ch, method)
                assert err.code() == grpc.StatusCode.UNIMPLEMENTED, method
                assert f"AgentService.{method} is not served on this listener" in (err.details() or "")
                assert "Unix socket" in (err.details() or "")
        # The same methods work on the Unix socket (the engine's listener, plaintext).
        assert server.uds_path
        with AgentClient(server.uds_path, timeout_s=5) as engine:
            assert engine.health().pod.pod_uid == "pod-srv"
    finally:
        server.stop(0)


def test_plaintext_and_foreign_clients_are_refused_at_the_handshake(tls_agent: AgentServer, pki: Pki) -> None:
    address = f"127.0.0.1:{tls_agent.tcp_port}"
    for ch in (
        grpc.insecure_channel(address),
        channel_as(address, None, AGENT_SERVER_NAME, ca=pki.ca.pem),
        channel_as(address, pki.foreign_agent(), AGENT_SERVER_NAME, ca=pki.ca.pem),
    ):
        with ch, pytest.raises(grpc.RpcError) as err:
            _fetch(ch, [bytes(16)])
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_fetch_chunks_only_for_agent_identities(tls_agent: AgentServer, pki: Pki) -> None:
    keys = [bytes([3]) * 16]
    put_chunks(tls_agent, keys)
    address = f"127.0.0.1:{tls_agent.tcp_port}"
    for who, role in ((pki.router(), "router"), (pki.controller(), "controller")):
        with channel_as(address, who, AGENT_SERVER_NAME) as ch, pytest.raises(grpc.RpcError) as err:
            _fetch(ch, keys)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "FetchChunks needs a agent identity" in (err.value.details() or "")
        assert spiffe(role) in (err.value.details() or "")
    for who in (pki.agent("pod-peer"), pki.agent()):  # per-pod or shared agent certificate
        with channel_as(address, who, AGENT_SERVER_NAME) as ch:
            parts = _fetch(ch, keys)
        assert parts and parts[0].num_chunks == 1 and sum(len(p.data) for p in parts) == 4096


def test_snapshot_only_for_the_controller_identity(tls_agent: AgentServer, pki: Pki) -> None:
    put_chunks(tls_agent, [bytes([4]) * 16])
    address = f"127.0.0.1:{tls_agent.tcp_port}"
    for who in (pki.router(), pki.agent("pod-peer")):
        with channel_as(address, who, AGENT_SERVER_NAME) as ch, pytest.raises(grpc.RpcError) as err:
            agent_pb2_grpc.AgentServiceStub(ch).Snapshot(agent_pb2.SnapshotRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "Snapshot needs a controller identity" in (err.value.details() or "")
    ctl = pki.controller()
    files = TlsFiles(str(ctl / "tls.crt"), str(ctl / "tls.key"), str(ctl / "ca.crt"))
    with AgentClient(address, timeout_s=5, tls=ClientTls(files)) as client:
        snap = client.snapshot()
    assert snap.pod.pod_uid == "pod-srv" and bytes([4]) * 16 in snap.chunk_keys
