"""Ingestor vs lease sweeps: a dropped incarnation's late events never reach the index."""

from __future__ import annotations

import threading

import pytest

from kvgrid.common.errors import InvalidArgument
from kvgrid.common.identity import PodIdentity
from kvgrid.controller.index import IndexTier, MemoryIndex
from kvgrid.controller.ingest import AgentSnapshot, ChunkEvent, EventKind, Ingestor, check_events
from kvgrid.controller.registry import AgentRecord, Registry, UnknownPodError
from tests.controller.support import rand_keys, wait_until

POD = PodIdentity(pod_uid="pod-a", epoch=7, agent_address="127.0.0.1:1")


def _admit(seq: int, keys: list[bytes]) -> ChunkEvent:
    return ChunkEvent(sequence=seq, kind=EventKind.ADMIT, tier=IndexTier.L1, keys=tuple(keys))


def test_events_of_a_dropped_incarnation_are_refused_and_leave_nothing() -> None:
    index = MemoryIndex()
    truth: set[bytes] = set()

    # The agent's own answer (this test is about ordering, not transport; the gRPC pull is
    # covered by tests/controller/test_service.py).
    def snapshot(rec: AgentRecord, timeout_s: float) -> AgentSnapshot:
        return AgentSnapshot(rec.pod.pod_uid, rec.pod.epoch, sorted(truth), last_sequence=0)

    ingest = Ingestor(index, snapshot, retry_s=0.01)
    registry = Registry(lease_ttl_ms=60_000)
    try:
        rec = registry.register(POD, ()).record
        truth.update(k := rand_keys(3))
        ingest.publish(rec, [], new_stream=True)
        wait_until(lambda: ingest.is_synced(rec.holder), what="first sync")
        assert index.holder_keys(rec.holder, IndexTier.L1) == set(k)

        # What Controller._drop does when the lease lapses, while the agent's stream is still open.
        registry.remove(POD.pod_uid)
        rec.dropped = True
        ingest.forget(rec.holder)
        index.drop_holder(rec.holder)
        with pytest.raises(UnknownPodError, match="pod-a/7"):
            ingest.publish(rec, [_admit(1, rand_keys(2))], new_stream=False)
        assert index.holders() == [] and index.num_entries() == 0

        # The agent registers again (same incarnation): a fresh record syncs from its truth.
        rec2 = registry.register(POD, ()).record
        ingest.publish(rec2, [], new_stream=True)
        wait_until(lambda: ingest.is_synced(rec2.holder), what="sync after re-registering")
        assert index.holder_keys(rec2.holder, IndexTier.L1) == truth
    finally:
        ingest.close()


def test_events_dropped_from_a_full_resync_buffer_are_covered_by_a_newer_snapshot() -> None:
    index = MemoryIndex()
    truth: set[bytes] = set(rand_keys(2))
    seq = 0
    pulls: list[int] = []
    release = threading.Event()

    # The agent answers with its state at the moment the pull starts; the first pull is held back
    # while events pile up behind it.
    def snapshot(rec: AgentRecord, timeout_s: float) -> AgentSnapshot:
        keys, last = sorted(truth), seq
        pulls.append(last)
        release.wait(10)
        return AgentSnapshot(rec.pod.pod_uid, rec.pod.epoch, keys, last_sequence=last)

    ingest = Ingestor(index, snapshot, retry_s=0.01, max_buffered_events=3)
    registry = Registry(lease_ttl_ms=60_000)
    try:
        rec = registry.register(POD, ()).record
        ingest.publish(rec, [], new_stream=True)
        wait_until(lambda: len(pulls) == 1, what="first pull started")
        for _ in range(4):  # the 4th overflows the buffer of 3: all four are dropped
            seq += 1
            new = rand_keys(1)
            truth.update(new)
            ingest.publish(rec, [_admit(seq, new)], new_stream=False)
        release.set()
        wait_until(lambda: ingest.is_synced(rec.holder), what="synced")
        assert pulls == [0, 4]  # the stale first snapshot was not trusted
        assert index.holder_keys(rec.holder, IndexTier.L1) == truth
    finally:
        release.set()
        ingest.close()


def _ev(seq: int, kind: EventKind, tier: IndexTier, keys: list[bytes]) -> ChunkEvent:
    return ChunkEvent(sequence=seq, kind=kind, tier=tier, keys=tuple(keys))


def test_coalesced_admits_keep_event_order_across_tiers_evicts_and_gaps() -> None:
    """Consecutive admits of one tier are written together; a tier change, an evict or a gap ends
    the run, so the index equals applying the events one by one."""
    index = MemoryIndex()
    ingest = Ingestor(index, lambda rec, t: AgentSnapshot(rec.pod.pod_uid, rec.pod.epoch, [], 0))
    registry = Registry(lease_ttl_ms=60_000)
    L1, GPU, ADMIT, EVICT = IndexTier.L1, IndexTier.GPU, EventKind.ADMIT, EventKind.EVICT
    try:
        rec = registry.register(POD, ()).record
        ingest.publish(rec, [], new_stream=True)
        wait_until(lambda: ingest.is_synced(rec.holder), what="first sync")
        k = rand_keys(8)
        events = [
            _ev(1, ADMIT, L1, k[0:2]),
            _ev(2, ADMIT, L1, k[2:4]),
            _ev(3, ADMIT, GPU, k[0:1]),
            _ev(4, EVICT, L1, k[1:3]),  # must apply after 1-2 and before 5
            _ev(5, ADMIT, L1, k[2:3]),
            _ev(6, ADMIT, GPU, k[4:5]),
            _ev(7, EventKind.CLEAR, GPU, []),
            _ev(8, ADMIT, GPU, k[5:6]),
        ]
        assert ingest.publish(rec, events, new_stream=False) == (8, False)
        assert index.holder_keys(rec.holder, L1) == {k[0], k[2], k[3]}
        assert index.holder_keys(rec.holder, GPU) == {k[5]}
        assert ingest.events_applied == 2 + 2 + 1 + 2 + 1 + 1 + 1 + 1
        # a gap after a run: the run before it is applied and acknowledged, the rest waits
        acked, resync = ingest.publish(rec, [_ev(9, ADMIT, L1, k[6:7]), _ev(11, ADMIT, L1, k[7:8])], False)
        assert (acked, resync) == (9, True)
    finally:
        ingest.close()


def test_wire_events_bad_key_is_named_and_message_refused() -> None:
    # key lengths are checked once per message; a bad one is still named by event and position
    from kvgrid.api.v1 import common_pb2, controller_pb2
    from kvgrid.common.errors import InvalidArgument
    from kvgrid.controller.wire import events_from_proto

    k = rand_keys(4)
    msg = controller_pb2.PublishEventsRequest()
    msg.events.add(
        sequence=1, kind=controller_pb2.EVENT_KIND_ADMIT, tier=common_pb2.TIER_L1, chunk_keys=k[:2]
    )
    msg.events.add(
        sequence=2,
        kind=controller_pb2.EVENT_KIND_ADMIT,
        tier=common_pb2.TIER_GPU,
        chunk_keys=[k[2], k[3][:15]],
    )
    with pytest.raises(InvalidArgument, match=r"events\[1\]\.chunk_keys\[1\]: got 15 bytes"):
        events_from_proto(msg.events)
    msg.events[1].chunk_keys[1] = k[3]
    got = events_from_proto(msg.events)
    assert [(e.sequence, e.kind, e.tier, e.keys) for e in got] == [
        (1, EventKind.ADMIT, IndexTier.L1, tuple(k[:2])),
        (2, EventKind.ADMIT, IndexTier.GPU, tuple(k[2:])),
    ]


def test_l2_events_and_snapshots_with_or_without_l2_keys() -> None:
    """TIER_L2 events go to the L2 entries; a snapshot that lists L2 keys replaces them, one that
    does not (the agent's Snapshot today) leaves them and asks the agent once for its listing."""
    index = MemoryIndex()
    l1, l2 = rand_keys(2), rand_keys(3)
    listed: list[list[bytes] | None] = [None]

    def snapshot(rec: AgentRecord, timeout_s: float) -> AgentSnapshot:
        return AgentSnapshot(rec.pod.pod_uid, rec.pod.epoch, l1, last_sequence=2, l2_keys=listed[0])

    ingest = Ingestor(index, snapshot, retry_s=0.01)
    registry = Registry(lease_ttl_ms=60_000)
    try:
        rec = registry.register(POD, ()).record
        ingest.publish(rec, [], new_stream=True)
        wait_until(lambda: ingest.is_synced(rec.holder), what="first sync")
        assert ingest.take_l2_listing_request(rec.holder) is True  # L1-only snapshot: list L2 again
        assert ingest.take_l2_listing_request(rec.holder) is False  # once
        ingest.publish(
            rec,
            [
                _ev(3, EventKind.CLEAR, IndexTier.L2, []),  # the agent's listing: CLEAR, then admits
                _ev(4, EventKind.ADMIT, IndexTier.L2, l2),
                _ev(5, EventKind.EVICT, IndexTier.L2, l2[:1]),
            ],
            new_stream=False,
        )
        assert index.holder_keys(rec.holder, IndexTier.L2) == set(l2[1:])
        assert index.holder_keys(rec.holder, IndexTier.L1) == set(l1)
        # a resync from an L1-only snapshot keeps the L2 entries (events keep them current)
        ingest.publish(rec, [], new_stream=True)
        wait_until(lambda: ingest.is_synced(rec.holder), what="second sync")
        assert index.holder_keys(rec.holder, IndexTier.L2) == set(l2[1:])
        assert ingest.take_l2_listing_request(rec.holder) is True
        # a snapshot that lists L2 keys replaces them, and asks for nothing
        listed[0] = l2[:1]
        ingest.publish(rec, [], new_stream=True)
        wait_until(lambda: ingest.is_synced(rec.holder), what="third sync")
        assert index.holder_keys(rec.holder, IndexTier.L2) == {l2[0]}
        assert ingest.take_l2_listing_request(rec.holder) is False
    finally:
        ingest.close()


def test_l2_events_may_name_a_namespace_the_pod_no_longer_serves() -> None:
    gone = "b" * 32  # records of an engine that left, still in the pod's disk tier
    l2 = ChunkEvent(
        sequence=1, kind=EventKind.EVICT, tier=IndexTier.L2, keys=tuple(rand_keys(1)), namespace=gone
    )
    check_events([l2], ["a" * 32], max_keys=10)
    l1 = ChunkEvent(sequence=1, kind=EventKind.EVICT, tier=IndexTier.L1, keys=l2.keys, namespace=gone)
    with pytest.raises(InvalidArgument, match=r"events\[0\]\.namespace='b{32}': not one of the pod's"):
        check_events([l1], ["a" * 32], max_keys=10)


def test_the_l2_listing_request_reaches_the_agent_once_by_heartbeat_or_ack() -> None:
    from kvgrid.controller.config import ControllerConfig
    from kvgrid.controller.core import Controller, EventMessage

    gate = threading.Event()
    gate.set()

    def snapshot(rec: AgentRecord, timeout_s: float) -> AgentSnapshot:
        gate.wait(10)
        return AgentSnapshot(rec.pod.pod_uid, rec.pod.epoch, [], last_sequence=0)

    ctl = Controller(ControllerConfig(resync_retry_ms=10), snapshots=snapshot)
    try:
        ctl.register(POD, [], 0)
        wait_until(lambda: ctl.ingest.is_synced(POD.holder_id), what="first sync")
        lease = ctl.heartbeat(POD.pod_uid, POD.epoch, None)
        assert lease.l2_listing_requested
        assert not ctl.heartbeat(POD.pod_uid, POD.epoch, None).l2_listing_requested  # once
        # a new stream resyncs again: this time the request comes with an ack
        gate.clear()  # the pull waits until the first ack is out
        acks = ctl.publish(iter([EventMessage(POD, []), EventMessage(None, [])]))
        assert not next(acks).l2_listing_requested
        gate.set()
        wait_until(lambda: ctl.ingest.is_synced(POD.holder_id), what="second sync")
        assert next(acks).l2_listing_requested
        assert not ctl.heartbeat(POD.pod_uid, POD.epoch, None).l2_listing_requested
    finally:
        gate.set()
        ctl.stop()
