"""The whole path with mTLS on: a real ``kvgrid controller`` and two real ``kvgrid agent`` processes
on loopback, each with its own certificate (per-pod agent identities), the engines on the agents'
Unix sockets. Agents register, publish events and are snapshot-pulled by the controller; a router
identity matches the prefix; agent B's Lookup fetches agent A's chunks over the mTLS peer path, bit
for bit. The controller takes its TLS settings from the environment (``KVGRID_TLS_*``, the names
the chart sets), the agents from flags.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from kvgrid.api.client import controller_stub
from kvgrid.api.v1 import common_pb2, controller_pb2
from kvgrid.common.identity import MAX_EPOCH
from tests.agent.helpers import NAMESPACE, AgentProc, keys_for, start_controller, start_pod_agent, wait_for
from tests.agent.test_peers import (
    chunk_bytes,
    chunk_ids,
    register,
    request_ids,
    same,
    store_on,
)
from tests.security.conftest import Pki

NS_ID = NAMESPACE.namespace_id()


def _tls_args(d: Path) -> list[str]:
    return [
        "--tls-cert-file",
        str(d / "tls.crt"),
        "--tls-key-file",
        str(d / "tls.key"),
        "--tls-ca-file",
        str(d / "ca.crt"),
    ]


@pytest.fixture(scope="module")
def tls_cluster(
    tmp_path_factory: pytest.TempPathFactory, free_port: Callable[[], int], pki: Pki
) -> Iterator[tuple[str, Path, AgentProc, AgentProc]]:
    root = tmp_path_factory.mktemp("e2e")
    address = f"127.0.0.1:{free_port()}"
    ctl_dir = pki.controller()
    env = {
        "KVGRID_TLS_CERT_FILE": str(ctl_dir / "tls.crt"),
        "KVGRID_TLS_KEY_FILE": str(ctl_dir / "tls.key"),
        "KVGRID_TLS_CA_FILE": str(ctl_dir / "ca.crt"),
    }
    ctrl = start_controller(address, env=env)
    agents: list[AgentProc] = []
    router = pki.router()
    stub = controller_stub(
        address,
        cert_file=str(router / "tls.crt"),
        key_file=str(router / "tls.key"),
        ca_file=str(router / "ca.crt"),
    )
    try:
        wait_for("the controller serving", lambda: _up(stub), timeout_s=60)
        for uid in ("pod-a", "pod-b"):
            agents.append(start_pod_agent(root, uid, address, *_tls_args(pki.agent(uid))))
        wait_for(
            "both agents registered",
            lambda: stub.GetStats(controller_pb2.GetStatsRequest(), timeout=5).num_agents >= 2,
        )
        yield address, root, agents[0], agents[1]
    finally:
        for a in agents:
            a.stop()
        ctrl.terminate()
        ctrl.wait(10)


def _up(stub: object) -> bool:
    try:
        stub.GetStats(controller_pb2.GetStatsRequest(), timeout=2)  # type: ignore[attr-defined]
    except grpc.RpcError:
        return False
    return True


def test_register_publish_match_and_peer_fetch_with_mtls(
    tls_cluster: tuple[str, Path, AgentProc, AgentProc], pki: Pki
) -> None:
    address, root, a, b = tls_cluster
    router = pki.router()
    stub = controller_stub(
        address,
        cert_file=str(router / "tls.crt"),
        key_file=str(router / "tls.key"),
        ca_file=str(router / "ca.crt"),
    )
    agents = {x.pod.pod_uid: x for x in stub.ListAgents(controller_pb2.ListAgentsRequest(), timeout=5).agents}
    assert set(agents) == {"pod-a", "pod-b"}
    # A holder of the shared agent certificate forges pod-a's registration with the largest epoch:
    # refused, and the real agent keeps its registration (and keeps serving below).
    shared = pki.agent()
    forger = controller_stub(
        address,
        cert_file=str(shared / "tls.crt"),
        key_file=str(shared / "tls.key"),
        ca_file=str(shared / "ca.crt"),
    )
    forged = common_pb2.PodIdentity(pod_uid="pod-a", epoch=MAX_EPOCH, agent_address="127.0.0.1:1")
    with pytest.raises(grpc.RpcError) as err:
        forger.RegisterAgent(controller_pb2.RegisterAgentRequest(pod=forged), timeout=5)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    again = {x.pod.pod_uid: x for x in stub.ListAgents(controller_pb2.ListAgentsRequest(), timeout=5).agents}
    assert again["pod-a"].pod.epoch == agents["pod-a"].pod.epoch == a.epoch
    e1, e2 = register(a, root, "e1", seed=1), register(b, root, "e2", seed=2)
    keys = keys_for(77, 3)
    store_on(e1, keys)

    def l1_on_a() -> int:
        resp = stub.MatchPrefix(
            controller_pb2.MatchPrefixRequest(chunk_keys=common_pb2.ChunkKeys(keys=keys), namespace_id=NS_ID),
            timeout=5,
        )
        return sum(m.l1_chunks for m in resp.matches if m.pod_uid == "pod-a")

    wait_for("A's chunks indexed (events over mTLS)", lambda: l1_on_a() == 3)
    # Snapshot pulls (controller -> agent over mTLS) happened for both registrations.
    stats = stub.GetStats(controller_pb2.GetStatsRequest(), timeout=5)
    assert stats.resyncs >= 2

    hit = e2.client.lookup(e2.instance_id, "r1", keys)
    assert (hit.num_hit_chunks, hit.num_peer_chunks, hit.miss_cause) == (3, 3, "none")
    res = e2.client.retrieve(e2.instance_id, "r1", keys, request_ids(32, 3))
    assert res.hit_mask == [True] * 3
    for c in range(3):  # engine 1's bytes, through A's TCP port with mTLS
        assert same(chunk_bytes(e2.tensors, chunk_ids(32, c)), chunk_bytes(e1.tensors, chunk_ids(0, c)))
    assert e2.client.health().peer_fetched_chunks == 3
