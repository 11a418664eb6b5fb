"""PublishEvents quotas: refusals are told to the publisher, one identity cannot fill the index, and
one identity cannot register pods without end. Real controllers over gRPC (mTLS where identities
matter).

The attack (seen with real processes): 1.5 M keys in PublishEvents were acknowledged OK and silently
capped per pod (the refusals only in a metric); extra pods registered with the shared agent
certificate then filled the total cap, after which a real agent's new chunks were never indexed.
Now every PublishEvents answer carries the keys refused since the previous one, by cap; the entries
of all pods of one mTLS identity are capped below the total (``max_entries_per_identity``, default
half of ``max_index_entries``); an identity registers at most ``max_pods_per_identity`` live pods
(RESOURCE_EXHAUSTED naming the identity and the bound).
"""

from __future__ import annotations

import queue
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvgrid.api.v1 import common_pb2, controller_pb2, controller_pb2_grpc
from kvgrid.common.tls import CONTROLLER_SERVER_NAME
from kvgrid.controller.config import ControllerConfig
from kvgrid.controller.service import Server, serve
from tests.controller.support import FakeAgent, index_keys, rand_keys, wait_until
from tests.security.conftest import NS_ID, Pki, SnapshotAgent, channel_as, tls_flags
from tests.security.pki import spiffe

Stub = controller_pb2_grpc.ControllerServiceStub


class Stream:
    """One PublishEvents stream driven message by message: each ``send`` returns its answer."""

    def __init__(self, stub: Stub, pod: common_pb2.PodIdentity) -> None:
        self._q: queue.Queue[controller_pb2.PublishEventsRequest | None] = queue.Queue()
        self._q.put(controller_pb2.PublishEventsRequest(pod=pod))
        self.call = stub.PublishEvents(iter(self._q.get, None), timeout=30)
        self.seq = 0
        self.first = next(self.call)

    def admit(self, keys: list[bytes]) -> controller_pb2.PublishEventsResponse:
        self.seq += 1
        ev = controller_pb2.ChunkEvent(
            sequence=self.seq,
            kind=controller_pb2.EVENT_KIND_ADMIT,
            tier=common_pb2.TIER_L1,
            chunk_keys=keys,
            namespace=NS_ID,
        )
        self._q.put(controller_pb2.PublishEventsRequest(events=[ev]))
        return next(self.call)

    def close(self) -> None:
        self._q.put(None)
        for _ in self.call:
            pass


def _synced(srv: Server, pod: common_pb2.PodIdentity) -> None:
    holder = f"{pod.pod_uid}/{pod.epoch}"
    wait_until(lambda: srv.controller.ingest.is_synced(holder), what=f"{holder} synced")


def _refused(resp: controller_pb2.PublishEventsResponse) -> tuple[int, int, int, int]:
    r = resp.refused
    return resp.refused_entries, r.pod_cap, r.identity_cap, r.total_cap


# --- refusals are reported (plaintext) -----------------------------------------------------------
@pytest.fixture
def capped() -> Iterator[Server]:
    srv = serve(
        ControllerConfig(
            listen="127.0.0.1:0", max_entries_per_pod=100, max_index_entries=250, resync_retry_ms=50
        )
    )
    yield srv
    srv.stop()


def test_refused_entries_are_reported_in_the_reply(capped: Server) -> None:
    stub = Stub(grpc.insecure_channel(capped.address))
    agents = [FakeAgent(capped.address, f"pod-{i}", auto=False) for i in range(3)]
    streams: list[Stream] = []
    try:
        for a in agents:
            a.register()
            _synced(capped, a.pod)
            s = Stream(stub, a.pod)
            streams.append(s)
            _synced(capped, a.pod)  # a new stream pulls a snapshot first
        a0, a1, a2 = streams
        # The attack of the report, scaled down: far more keys than the pod's cap in one message.
        resp = a0.admit(rand_keys(300))
        assert resp.acked_sequence == 1  # acknowledged (never resent) ...
        assert _refused(resp) == (200, 200, 0, 0)  # ... and the agent is told what was not indexed
        ok = a0.admit([])  # the next answer does not repeat it
        assert ok.refused_entries == 0 and not ok.HasField("refused")
        assert _refused(a0.admit(rand_keys(5))) == (5, 5, 0, 0)  # still at its cap
        assert _refused(a1.admit(rand_keys(100))) == (0, 0, 0, 0)
        # The index holds 200 of 250: the third pod gets 50, the rest is the total cap's refusal.
        assert _refused(a2.admit(rand_keys(80))) == (30, 0, 0, 30)
        assert capped.controller.caps.refused_by_cap == {"pod": 205, "identity": 0, "total": 30}
        held = index_keys(stub, "pod-2")
        assert held is not None and len(held) == 50
    finally:
        for s in streams:
            s.close()
        for a in agents:
            a.close()


def test_the_agent_counts_what_the_controller_refused(capped: Server) -> None:
    """The real agent publisher reads the new answer fields (counter by cap, rate-limited warning)."""
    from kvgrid.agent.events import EventLog, EventPublisher
    from kvgrid.common.identity import PodIdentity

    snap = FakeAgent(capped.address, "pod-real", auto=False)  # serves the snapshot pulls
    log_ = EventLog()
    pub = EventPublisher(
        capped.address,
        log_,
        PodIdentity(pod_uid="pod-real", epoch=1, agent_address=snap.pod.agent_address),
        namespaces=lambda: [NS_ID],
        l1_capacity_bytes=0,
        load=controller_pb2.AgentLoad,
        flush_interval_s=0.02,
    )
    pub.start()
    try:
        wait_until(pub.connected.is_set, what="publisher connected")
        _synced(capped, snap.pod)
        log_.on_admit(NS_ID, rand_keys(130))

        # Refusals are told with the answer to the next message that is applied (the first may be
        # buffered while the stream's snapshot pull runs): keep admitting until it arrives.
        def told() -> bool:
            if pub.refused_entries["pod"] < 30:
                log_.on_admit(NS_ID, rand_keys(1))
                return False
            return True

        wait_until(told, what="refusals reported to the agent")
        assert pub.refused_entries["identity"] == pub.refused_entries["total"] == 0
        assert capped.controller.index.holder_entries("pod-real/1") == 100
    finally:
        pub.stop()
        snap.close()


# --- identities (mTLS) ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


class Tls:
    """A real mTLS controller and stubs presenting given identities."""

    def __init__(self, pki: Pki, **cfg: Any) -> None:
        self.pki = pki
        self.srv = serve(ControllerConfig(listen="127.0.0.1:0", **tls_flags(pki.controller()), **cfg))
        self._channels: list[grpc.Channel] = []
        self._agents: list[SnapshotAgent] = []

    def stub(self, who: Path) -> Stub:
        ch = channel_as(self.srv.address, who, CONTROLLER_SERVER_NAME, ca=self.pki.ca.pem)
        self._channels.append(ch)
        return Stub(ch)

    def pod(self, who: Path, uid: str) -> common_pb2.PodIdentity:
        """A pod whose snapshot (empty, sequence 0) the controller can pull over mTLS."""
        a = SnapshotAgent(self.pki.agent(), uid, 1, [], NS_ID)
        self._agents.append(a)
        return a.pod

    def register(self, stub: Stub, pod: common_pb2.PodIdentity) -> None:
        stub.RegisterAgent(controller_pb2.RegisterAgentRequest(pod=pod, namespaces=[NS_ID]), timeout=5)

    def stop(self) -> None:
        for ch in self._channels:
            ch.close()
        for a in self._agents:
            a.stop()
        self.srv.stop()


def _code(fn: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        fn()
    return err.value.code(), err.value.details() or ""


def test_an_identity_at_its_quota_leaves_room_for_the_others(pki: Pki) -> None:
    """The shared agent certificate registers extra pods and admits without end: its pods together
    stop at max_entries_per_identity, and a per-pod agent's new chunks are still indexed."""
    tls = Tls(pki, max_entries_per_pod=100, max_entries_per_identity=150, max_index_entries=300)
    try:
        shared = tls.stub(pki.agent())
        streams = []
        for i in range(4):  # the attacker's pods: 4 x 100 would fill the total cap
            pod = tls.pod(pki.agent(), f"extra-{i}")
            tls.register(shared, pod)
            _synced(tls.srv, pod)
            s = Stream(shared, pod)
            _synced(tls.srv, pod)
            streams.append(s)
        refused = [_refused(s.admit(rand_keys(100))) for s in streams]
        assert refused == [(0, 0, 0, 0), (50, 0, 50, 0), (100, 0, 100, 0), (100, 0, 100, 0)]
        caps = tls.srv.controller.caps
        assert caps.over_quota_identities == {spiffe("agent"): 250}
        # A well-behaved agent of another identity: its chunks are indexed.
        real = tls.stub(pki.agent("pod-real"))
        pod = tls.pod(pki.agent("pod-real"), "pod-real")
        tls.register(real, pod)
        _synced(tls.srv, pod)
        s = Stream(real, pod)
        _synced(tls.srv, pod)
        streams.append(s)
        keys = rand_keys(80)
        assert _refused(s.admit(keys)) == (0, 0, 0, 0)
        router = tls.stub(pki.router())
        assert index_keys(real, "pod-real") == set(keys)  # SnapshotIndex answers the pod's owner
        hit = router.MatchPrefix(
            controller_pb2.MatchPrefixRequest(
                chunk_keys=common_pb2.ChunkKeys(keys=keys[:4]), namespace_id=NS_ID
            ),
            timeout=5,
        )
        assert [m.pod_uid for m in hit.matches] == ["pod-real"]
        assert tls.srv.controller.index.num_entries() == 150 + 80
        for st in streams:
            st.close()
    finally:
        tls.stop()


def test_pods_per_identity_are_bounded(pki: Pki) -> None:
    tls = Tls(pki, max_pods_per_identity=3, lease_ttl_ms=1_000, sweep_interval_ms=50)
    try:
        shared = tls.stub(pki.agent())
        pods = [common_pb2.PodIdentity(pod_uid=f"p{i}", epoch=1) for i in range(5)]
        for p in pods[:3]:
            tls.register(shared, p)
        code, text = _code(lambda: tls.register(shared, pods[3]))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert spiffe("agent") in text and "max_pods_per_identity=3" in text and "'p3'" in text
        # An event stream cannot register it implicitly either.
        code, text = _code(lambda: list(shared.PublishEvents(iter([
            controller_pb2.PublishEventsRequest(pod=pods[4])
        ]), timeout=5)))  # fmt: skip
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_pods_per_identity=3" in text
        assert tls.srv.controller.registry.get("p3") is None
        assert tls.srv.controller.registry.get("p4") is None
        # A registered pod may register again and restart (new epoch): it is not one more pod.
        tls.register(shared, pods[0])
        tls.register(shared, common_pb2.PodIdentity(pod_uid="p1", epoch=2))
        # Another identity is not counted with it.
        tls.register(tls.stub(pki.agent("solo")), common_pb2.PodIdentity(pod_uid="solo", epoch=1))
        # Once leases lapse, their pods no longer count.
        wait_until(lambda: tls.srv.controller.registry.get("p0") is None, what="leases lapsed")
        tls.register(shared, pods[3])
    finally:
        tls.stop()


def test_defaults_do_not_refuse_a_chart_like_deployment(pki: Pki) -> None:
    """The chart's default: every agent presents the one shared certificate. 64 pods register and
    publish a normal volume (docs/capacity.md A2: ~11k entries per GPU; here 8,000 each, 512k in
    all); nothing is refused with the default settings."""
    cfg = ControllerConfig(listen="127.0.0.1:0", **tls_flags(pki.controller()))
    assert cfg.max_pods_per_identity >= 64
    assert cfg.max_entries_per_identity == 0
    assert cfg.max_entries_per_pod < cfg.identity_entry_cap == cfg.max_index_entries // 2
    assert cfg.publish_streams_cap >= 64
    # In a cluster each pod streams from its own IP address, a caller of its own for
    # publish_streams_per_identity; here all 64 share 127.0.0.1, so that one bound is raised.
    tls = Tls(pki, publish_streams_per_identity=64)
    try:
        shared = tls.stub(pki.agent())
        n_pods, per_pod = 64, 8_000
        streams = []
        for i in range(n_pods):
            pod = tls.pod(pki.agent(), f"chart-{i}")
            tls.register(shared, pod)
            streams.append((pod, Stream(shared, pod)))
        for pod, _ in streams:
            _synced(tls.srv, pod)
        refused = 0
        for _, s in streams:
            for _ in range(2):
                refused += s.admit(rand_keys(per_pod // 2)).refused_entries
        assert refused == 0
        ctl = tls.srv.controller
        assert ctl.index.num_entries() == n_pods * per_pod
        assert ctl.caps.rejected_entries == 0 and ctl.caps.over_quota_identities == {}
        assert len(ctl.caps.pods_of(spiffe("agent"))) == n_pods
        for _, s in streams:
            s.close()
    finally:
        tls.stop()


def test_identity_cap_holds_under_concurrent_admits() -> None:
    """Pods of one identity writing at once never take it past its cap (reserved before writing);
    holders of no identity (plaintext) have no identity cap."""
    import threading

    from kvgrid.controller.index import IndexTier, MemoryIndex
    from kvgrid.controller.limits import EntryCaps

    idx = MemoryIndex()
    caps = EntryCaps(idx, per_pod=10_000, total=100_000, per_identity=600)
    for i in range(8):
        caps.bind(f"pod-{i}/1", "id-a" if i % 2 else "id-b")
    barrier = threading.Barrier(9)

    def writer(holder: str) -> None:
        barrier.wait()
        for _ in range(20):
            caps.add(holder, IndexTier.L1, rand_keys(25))

    ts = [threading.Thread(target=writer, args=(f"pod-{i}/1",)) for i in range(9)]  # pod-8: none
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    per_id = {"id-a": 0, "id-b": 0}
    for i in range(8):
        per_id["id-a" if i % 2 else "id-b"] += idx.holder_entries(f"pod-{i}/1")
    assert per_id == {"id-a": 600, "id-b": 600}
    assert idx.holder_entries("pod-8/1") == 500
    assert caps.refused_by_cap == {"pod": 0, "identity": 2 * (4 * 500 - 600), "total": 0}
    assert caps.pods_of("id-a") == {"pod-1", "pod-3", "pod-5", "pod-7"}
    caps.forget("pod-1/1")
    assert caps.pods_of("id-a") == {"pod-3", "pod-5", "pod-7"}
