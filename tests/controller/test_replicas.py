"""Three controller replicas sharing one Valkey (index and agent registry) answer alike.

Before: each replica kept its own agent registry, so an agent connected to replica A was unknown
to B and C (no ListAgents row, its entries unanswerable or answered without load or namespaces),
its heartbeats through A did not keep it alive anywhere else, and B would take a forged newer
epoch from another identity because B had never seen the owner. Now leases, epochs, addresses,
loads and ownership live in Valkey. Real valkey-server, three real gRPC controllers on loopback,
agents (real AgentService for snapshot pulls) each connected to a different replica.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvgrid.api.v1 import common_pb2, controller_pb2, controller_pb2_grpc
from kvgrid.common.identity import MAX_EPOCH
from kvgrid.common.tls import CONTROLLER_SERVER_NAME
from kvgrid.controller.config import ControllerConfig
from kvgrid.controller.core import Controller
from kvgrid.controller.readiness import Readiness
from kvgrid.controller.service import Server, serve
from tests.controller.support import NS_ID, FakeAgent, rand_keys, unique_prefix, wait_until
from tests.security.conftest import Pki, channel_as, tls_flags
from tests.security.pki import spiffe

Stub = controller_pb2_grpc.ControllerServiceStub
LEASE_MS = 1_500


def _cfg(url: str, prefix: str, **kw: object) -> ControllerConfig:
    base: dict[str, object] = {
        "listen": "127.0.0.1:0",
        "index_backend": "redis",
        "redis_url": url,
        "redis_prefix": prefix,
        "lease_ttl_ms": LEASE_MS,
        "sweep_interval_ms": 100,
        "resync_retry_ms": 100,
    }
    base.update(kw)
    return ControllerConfig(**base)  # type: ignore[arg-type]


class Replicas:
    """Three controllers on one Valkey key prefix, with a plaintext stub each."""

    def __init__(self, url: str, prefix: str, **kw: object) -> None:
        self.url, self.prefix, self.kw = url, prefix, kw
        self.servers: list[Server] = [serve(_cfg(url, prefix, **kw)) for _ in range(3)]
        self.channels = [grpc.insecure_channel(s.address) for s in self.servers]
        self.stubs = [Stub(ch) for ch in self.channels]

    def one_agent_each(self) -> list[FakeAgent]:
        """pod-0 on replica 0, pod-1 on replica 1, pod-2 on replica 2 (epochs 10, 11, 12)."""
        return [FakeAgent(s.address, f"pod-{i}", epoch=10 + i) for i, s in enumerate(self.servers)]

    def close(self) -> None:
        for ch in self.channels:
            ch.close()
        for s in self.servers:
            s.stop(0)


@pytest.fixture
def replicas(valkey_url: str) -> Iterator[Replicas]:
    r = Replicas(valkey_url, unique_prefix())
    yield r
    r.close()


@pytest.fixture
def agents(replicas: Replicas) -> Iterator[list[FakeAgent]]:
    """:meth:`Replicas.one_agent_each`, closed afterwards."""
    out = replicas.one_agent_each()
    yield out
    for a in out:
        a.close()


def _agents(stub: Stub) -> list[tuple[str, int, str, str, int, int]]:
    """ListAgents rows: pod UID, epoch, name, agent address, entries, last applied sequence."""
    resp = stub.ListAgents(controller_pb2.ListAgentsRequest(), timeout=5)
    return [
        (a.pod.pod_uid, a.pod.epoch, a.pod.pod_name, a.pod.agent_address, a.num_chunks, a.last_sequence)
        for a in resp.agents
    ]


def _loads(stub: Stub) -> dict[str, tuple[int, int, float]]:
    resp = stub.ListAgents(controller_pb2.ListAgentsRequest(), timeout=5)
    return {
        a.pod.pod_uid: (a.load.running_requests, a.load.waiting_requests, round(a.load.gpu_kv_usage, 6))
        for a in resp.agents
    }


def _match(stub: Stub, keys: list[bytes]) -> list[tuple[str, int]]:
    req = controller_pb2.MatchPrefixRequest(chunk_keys=common_pb2.ChunkKeys(keys=keys), namespace_id=NS_ID)
    return sorted((m.pod_uid, m.l1_chunks) for m in stub.MatchPrefix(req, timeout=5).matches)


def _score(stub: Stub, keys: list[bytes]) -> list[tuple[str, int, float]]:
    req = controller_pb2.ScoreRequest(
        match=controller_pb2.MatchPrefixRequest(
            chunk_keys=common_pb2.ChunkKeys(keys=keys), namespace_id=NS_ID
        )
    )
    return [
        (c.match.pod_uid, c.match.l1_chunks, round(c.estimated_ttft_ms, 3))
        for c in stub.Score(req, timeout=5).scores
    ]


def _uids(stub: Stub) -> set[str]:
    return {a[0] for a in _agents(stub)}


def test_every_replica_gives_the_same_answers(replicas: Replicas, agents: list[FakeAgent]) -> None:
    shared = rand_keys(4)
    for i, a in enumerate(agents):
        a.admit(shared + rand_keys(3 + i))  # 7, 8, 9 keys: distinct L1 counts per pod
    want = {("pod-0", 10), ("pod-1", 11), ("pod-2", 12)}

    def everyone_knows_everyone() -> bool:
        return all({(a[0], a[1]) for a in _agents(s)} == want for s in replicas.stubs)

    wait_until(everyone_knows_everyone, what="every replica lists the three agents")
    wait_until(
        lambda: all(r[4] == 4 + 3 + int(r[0][-1]) for r in _agents(replicas.stubs[0])),
        what="every agent's snapshot indexed",
    )
    # The sequence each agent's own replica applied is shared too (published by its sweeps).
    wait_until(
        lambda: all([r[5] for r in _agents(s)] == [1, 1, 1] for s in replicas.stubs),
        timeout=3,
        what="every replica shows every agent's last sequence",
    )
    rows = [_agents(s) for s in replicas.stubs]
    assert rows[0] == rows[1] == rows[2]
    assert [r[3] for r in rows[0]] == [a.pod.agent_address for a in agents]  # addresses are shared
    matches = [_match(s, shared) for s in replicas.stubs]
    assert matches[0] == [("pod-0", 4), ("pod-1", 4), ("pod-2", 4)]
    assert matches[0] == matches[1] == matches[2]

    # A load reported through replica 1 reaches every replica's ListAgents and Score.
    replicas.stubs[1].Heartbeat(
        controller_pb2.HeartbeatRequest(
            pod_uid="pod-1", epoch=11, load=controller_pb2.AgentLoad(running_requests=3, waiting_requests=7)
        ),
        timeout=5,
    )
    wait_until(
        lambda: all(_loads(s)["pod-1"][:2] == (3, 7) for s in replicas.stubs),
        timeout=3,
        what="pod-1's load on every replica",
    )
    scores = [_score(s, shared) for s in replicas.stubs]
    assert scores[0] == scores[1] == scores[2]
    assert scores[0][-1][0] == "pod-1"  # the loaded pod ranks last everywhere


def test_a_heartbeat_through_one_replica_keeps_the_agent_alive_on_all(
    replicas: Replicas, agents: list[FakeAgent]
) -> None:
    wait_until(
        lambda: all(_uids(s) == {"pod-0", "pod-1", "pod-2"} for s in replicas.stubs), what="all listed"
    )
    time.sleep(3 * LEASE_MS / 1000)  # three leases: only heartbeats (each through one replica) keep them
    for s in replicas.stubs:
        assert _uids(s) == {"pod-0", "pod-1", "pod-2"}
        remaining = [a.lease_remaining_ms for a in s.ListAgents(controller_pb2.ListAgentsRequest()).agents]
        assert all(0 < r <= LEASE_MS for r in remaining), remaining


def test_a_lapsed_lease_drops_the_agent_everywhere(replicas: Replicas, agents: list[FakeAgent]) -> None:
    keys = rand_keys(5)
    agents[0].admit(keys)
    wait_until(lambda: all(_match(s, keys) == [("pod-0", 5)] for s in replicas.stubs), what="pod-0 matched")
    agents[0].heartbeating.clear()  # pod-0 (connected to replica 0) stops renewing its lease
    took = wait_until(
        lambda: all(_uids(s) == {"pod-1", "pod-2"} for s in replicas.stubs),
        timeout=5,
        what="pod-0 gone from every replica",
    )
    assert took >= LEASE_MS / 1000 - 0.5  # not before its lease could lapse
    for s in replicas.stubs:
        assert _match(s, keys) == []
    time.sleep(LEASE_MS / 1000)  # the others, heartbeating through their own replicas, stay
    assert all(_uids(s) == {"pod-1", "pod-2"} for s in replicas.stubs)


def test_a_replica_restarted_midway_is_ready_only_with_the_shared_view(
    replicas: Replicas, agents: list[FakeAgent], free_port: Callable[[], int]
) -> None:
    want = {"pod-0", "pod-1", "pod-2"}
    wait_until(lambda: all(_uids(s) == want for s in replicas.stubs), what="all listed")
    replicas.servers[1].stop(0)
    # The rule, checked without threads: a fresh replica's view is not loaded until its first
    # sweep's sync, and it is not ready before; after it, it is ready and lists every agent.
    ctl = Controller(_cfg(replicas.url, replicas.prefix))
    try:
        ready = Readiness(ctl, settle_s=0, max_wait_s=30)
        ok, why = ready.check()
        assert not ok and "shared agent registry is not loaded" in why
        assert ctl.list_agents() == []
        ctl.sweep()
        assert ready.check() == (True, "")
        assert {a.pod.pod_uid for a in ctl.list_agents()} == want
    finally:
        ctl.stop()
    # End to end: a new server for replica 1; whenever its health says SERVING it lists everyone.
    srv = serve(_cfg(replicas.url, replicas.prefix))
    replicas.servers[1] = srv
    ch = grpc.insecure_channel(srv.address)
    replicas.channels.append(ch)
    stub, health = Stub(ch), health_pb2_grpc.HealthStub(ch)
    deadline = time.monotonic() + 5
    served = 0
    while time.monotonic() < deadline and served < 20:
        status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status
        if status == health_pb2.HealthCheckResponse.SERVING:
            assert _uids(stub) == want
            served += 1
    assert served == 20
    wait_until(lambda: _agents(stub) == _agents(replicas.stubs[0]), timeout=3, what="same rows as replica 0")


# --- ownership across replicas (mTLS) -----------------------------------------------------------
@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


def test_a_forged_newer_epoch_from_another_identity_is_refused_on_every_replica(
    valkey_url: str, pki: Pki
) -> None:
    prefix = unique_prefix()
    servers = [
        serve(_cfg(valkey_url, prefix, lease_ttl_ms=60_000, **tls_flags(pki.controller()))) for _ in range(3)
    ]
    channels: list[grpc.Channel] = []

    def as_(who: Path, i: int) -> Stub:
        ch = channel_as(servers[i].address, who, CONTROLLER_SERVER_NAME, ca=pki.ca.pem)
        channels.append(ch)
        return Stub(ch)

    try:
        victim = as_(pki.agent("pod-v"), 0)
        victim.RegisterAgent(
            controller_pb2.RegisterAgentRequest(
                pod=common_pb2.PodIdentity(pod_uid="pod-v", epoch=5), namespaces=[NS_ID]
            ),
            timeout=5,
        )
        # At once (no wait for any sync): the shared registry is the truth for every replica.
        for i in range(3):
            forger = as_(pki.agent(), i)  # a real agent certificate, but the shared one
            for attempt in (
                lambda forger=forger: forger.RegisterAgent(
                    controller_pb2.RegisterAgentRequest(
                        pod=common_pb2.PodIdentity(pod_uid="pod-v", epoch=MAX_EPOCH)
                    ),
                    timeout=5,
                ),
                lambda forger=forger: forger.Heartbeat(
                    controller_pb2.HeartbeatRequest(pod_uid="pod-v", epoch=5), timeout=5
                ),
            ):
                with pytest.raises(grpc.RpcError) as ei:
                    attempt()
                assert ei.value.code() == grpc.StatusCode.PERMISSION_DENIED, (i, ei.value.details())
                assert "is registered by identity" in (ei.value.details() or "")
                assert spiffe("agent") in (ei.value.details() or "")
        # The victim keeps epoch 5 everywhere, and may heartbeat through any replica.
        for i, s in enumerate(servers):
            as_(pki.agent("pod-v"), i).Heartbeat(
                controller_pb2.HeartbeatRequest(pod_uid="pod-v", epoch=5), timeout=5
            )
            wait_until(lambda s=s: s.controller.registry.get("pod-v") is not None, timeout=3, what="mirrored")
            rec = s.controller.registry.get("pod-v")
            assert rec is not None and rec.pod.epoch == 5
    finally:
        for ch in channels:
            ch.close()
        for s in servers:
            s.stop(0)
