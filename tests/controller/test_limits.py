"""Bounded controller state: one registrant cannot grow the index without end.

The attack: an agent (or anyone who can open a PublishEvents stream) admits more and more chunk
keys; each one used to become an index entry (~60-80 B of controller memory) with no cap. Now
admits and snapshots beyond ``max_entries_per_pod`` / ``max_index_entries`` are not indexed, are
counted (``kvgrid_controller_rejected_entries``) and mark the pod over quota, while the stream stays
up and evictions keep working.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from kvgrid.api.v1 import controller_pb2, controller_pb2_grpc
from kvgrid.common.telemetry import setup_telemetry
from kvgrid.controller.config import ControllerConfig
from kvgrid.controller.index import IndexTier, MemoryIndex
from kvgrid.controller.limits import EntryCaps
from kvgrid.controller.service import Server, serve
from tests.controller.support import FakeAgent, index_keys, rand_keys, wait_until

PER_POD = 100
TOTAL = 250


@pytest.fixture
def capped() -> Iterator[tuple[Server, InMemoryMetricReader]]:
    reader = InMemoryMetricReader()
    telemetry = setup_telemetry("kvgrid-controller-limits-test", metric_readers=[reader])
    cfg = ControllerConfig(
        listen="127.0.0.1:0", max_entries_per_pod=PER_POD, max_index_entries=TOTAL, resync_retry_ms=50
    )
    srv = serve(cfg, telemetry=telemetry)
    yield srv, reader
    srv.stop()


def _points(reader: InMemoryMetricReader) -> dict[str, int]:
    data = reader.get_metrics_data()
    assert data is not None
    out: dict[str, int] = {}
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                for p in m.data.data_points:
                    if hasattr(p, "value"):
                        out[m.name] = int(p.value)
    return out


def _ended_streams(reader: InMemoryMetricReader) -> list[str]:
    """Status codes of PublishEvents calls that ended (an open stream is not recorded yet)."""
    data = reader.get_metrics_data()
    assert data is not None
    return [
        str(p.attributes["code"])
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == "kvgrid_rpc_server_calls"
        for p in m.data.data_points
        if p.attributes["method"] == "PublishEvents"
    ]


def _synced(srv: Server, agent: FakeAgent) -> None:
    """Every event of ``agent`` was applied (or refused) by the controller."""
    holder = f"{agent.pod.pod_uid}/{agent.pod.epoch}"
    ing = srv.controller.ingest
    wait_until(
        lambda: ing.is_synced(holder) and ing.last_sequence(holder) == agent.seq, what="events applied"
    )


def test_defaults_are_documented() -> None:
    cfg = ControllerConfig()
    assert cfg.max_entries_per_pod == 1 << 20
    assert cfg.max_index_entries == 1 << 23


def test_one_pod_cannot_publish_past_its_cap(capped: tuple[Server, InMemoryMetricReader]) -> None:
    srv, reader = capped
    stub = controller_pb2_grpc.ControllerServiceStub(grpc.insecure_channel(srv.address))
    a = FakeAgent(srv.address, "pod-a")
    try:
        wait_until(lambda: a.snapshots > 0, what="first snapshot")
        keys = rand_keys(3 * PER_POD)
        for i in range(0, len(keys), 30):  # the attack: keep admitting
            a.admit(keys[i : i + 30])
        _synced(srv, a)
        assert _ended_streams(reader) == []  # the stream was not failed: it is still open
        held = index_keys(stub, "pod-a")
        assert held is not None and len(held) == PER_POD and held <= a.truth()
        assert srv.controller.index.num_entries() == PER_POD
        assert srv.controller.caps.rejected_entries == 2 * PER_POD
        assert srv.controller.caps.over_quota == {"pod-a/1": 2 * PER_POD}
        pts = _points(reader)
        assert pts["kvgrid_controller_rejected_entries"] == 2 * PER_POD
        assert pts["kvgrid_controller_over_quota_pods"] == 1
        # Evictions are applied; room freed is used again by later admits.
        gone = sorted(held)[:10]
        a.evict(gone)
        fresh = rand_keys(10)
        a.admit(fresh)
        _synced(srv, a)
        assert _ended_streams(reader) == []
        held2 = index_keys(stub, "pod-a")
        assert held2 == (held - set(gone)) | set(fresh)
    finally:
        a.close()


def test_many_pods_cannot_pass_the_total_cap(capped: tuple[Server, InMemoryMetricReader]) -> None:
    srv, _ = capped
    agents = [FakeAgent(srv.address, f"pod-{i}") for i in range(3)]
    try:
        for a in agents:
            wait_until(lambda a=a: a.snapshots > 0, what="first snapshot")  # type: ignore[misc]
            a.admit(rand_keys(PER_POD))
            _synced(srv, a)
        assert srv.controller.index.num_entries() == TOTAL
        assert srv.controller.caps.rejected_entries == 3 * PER_POD - TOTAL
        st = controller_pb2_grpc.ControllerServiceStub(grpc.insecure_channel(srv.address)).GetStats(
            controller_pb2.GetStatsRequest()
        )
        assert st.num_entries == TOTAL
    finally:
        for a in agents:
            a.close()


def test_a_snapshot_past_the_cap_is_cut_to_it(capped: tuple[Server, InMemoryMetricReader]) -> None:
    srv, _ = capped
    stub = controller_pb2_grpc.ControllerServiceStub(grpc.insecure_channel(srv.address))
    a = FakeAgent(srv.address, "pod-s", auto=False)
    try:
        a.keys = set(rand_keys(PER_POD + 40))  # what it claims to hold when it registers
        assert a.register().snapshot_requested
        wait_until(lambda: srv.controller.ingest.is_synced("pod-s/1"), what="snapshot applied")
        held = index_keys(stub, "pod-s")
        assert held is not None and len(held) == PER_POD and held <= a.truth()
        assert srv.controller.caps.rejected_entries == 40
        # A later snapshot that fits takes the pod out of over-quota.
        a.keys = set(sorted(a.keys)[:50])
        srv.controller.ingest.resync_all(srv.controller.registry.all())
        wait_until(lambda: index_keys(stub, "pod-s") == a.truth(), what="smaller snapshot applied")
        assert srv.controller.caps.over_quota == {}
    finally:
        a.close()


def test_caps_hold_under_concurrent_admits() -> None:
    """Several writers at once never take the index past the total cap (bounds reserved first)."""
    import threading

    idx = MemoryIndex()
    caps = EntryCaps(idx, per_pod=10_000, total=1_000)
    barrier = threading.Barrier(8)

    def writer(i: int) -> None:
        barrier.wait()
        for _ in range(20):
            caps.add(f"pod-{i}/1", IndexTier.L1, rand_keys(25))

    ts = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert idx.num_entries() == 1_000
    assert caps.rejected_entries == 8 * 20 * 25 - 1_000


def test_l2_entries_count_toward_the_caps_like_the_others() -> None:
    idx = MemoryIndex()
    caps = EntryCaps(idx, per_pod=10, total=15)
    assert caps.add("pod-a/1", IndexTier.L1, rand_keys(4)) == 0
    assert caps.add("pod-a/1", IndexTier.L2, rand_keys(8)) == 2  # 4 + 6 = the pod's cap
    assert idx.holder_tier_entries("pod-a/1", IndexTier.L2) == 6
    assert caps.replace("pod-b/1", IndexTier.L2, rand_keys(9)) == 4  # 10 + 5 = the total cap
    assert idx.num_entries() == 15 and caps.rejected_entries == 6


def test_caps_read_a_pods_l2_entries_from_the_index() -> None:
    idx = MemoryIndex()
    idx.add("pod-a/1", IndexTier.L2, rand_keys(8))  # written before these caps existed (a restart)
    caps = EntryCaps(idx, per_pod=10, total=100)
    assert caps.add("pod-a/1", IndexTier.L1, rand_keys(5)) == 3
    assert idx.holder_entries("pod-a/1") == 10
