"""ControllerService over real gRPC on loopback: registry, ingest/resync, queries, bad input."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvgrid.api.v1 import common_pb2, controller_pb2, controller_pb2_grpc
from kvgrid.common.hashing import KeyNamespace, chunk_keys
from kvgrid.controller.config import ControllerConfig
from kvgrid.controller.service import Server, serve
from tests.controller.support import (
    NS_ID,
    FakeAgent,
    index_keys,
    rand_keys,
    unique_prefix,
    wait_until,
)

NS = KeyNamespace(model="tiny-model", tokens_per_chunk=16)


def _cfg(**kw: object) -> ControllerConfig:
    base: dict[str, object] = {"listen": "127.0.0.1:0", "lease_ttl_ms": 5_000, "sweep_interval_ms": 50}
    base.update(kw)
    return ControllerConfig(**base)  # type: ignore[arg-type]


@pytest.fixture
def controller_config() -> ControllerConfig:
    return _cfg(max_query_chunks=64, max_batch=8)


def _match(stub: controller_pb2_grpc.ControllerServiceStub, keys: list[bytes], ns: str = NS_ID, **kw: object):
    return stub.MatchPrefix(
        controller_pb2.MatchPrefixRequest(chunk_keys=common_pb2.ChunkKeys(keys=keys), namespace_id=ns, **kw)
    )


def _synced(stub: controller_pb2_grpc.ControllerServiceStub, agent: FakeAgent) -> bool:
    return index_keys(stub, agent.pod.pod_uid) == agent.truth()


def test_events_reach_the_index_and_match(
    server: Server, stub: controller_pb2_grpc.ControllerServiceStub
) -> None:
    tokens = list(range(16 * 5 + 3))
    keys = chunk_keys(tokens, NS)
    a = FakeAgent(server.address, "pod-a", namespace_id=NS.namespace_id())
    b = FakeAgent(server.address, "pod-b", namespace_id=NS.namespace_id())
    try:
        a.admit(keys[:3])
        b.admit(keys[:5])
        wait_until(lambda: _synced(stub, a) and _synced(stub, b), what="agents synced")
        m = stub.MatchPrefix(
            controller_pb2.MatchPrefixRequest(
                token_ids=common_pb2.TokenIds(ids=tokens),
                namespace=common_pb2.KeyNamespace(model="tiny-model", tokens_per_chunk=16),
            )
        )
        assert m.num_query_chunks == 5
        got = {p.pod_uid: (p.gpu_chunks, p.l1_chunks, p.peer_chunks) for p in m.matches}
        assert got == {"pod-b": (0, 5, 0), "pod-a": (0, 3, 2)}
        assert [p.pod_uid for p in m.matches] == ["pod-b", "pod-a"]
        assert m.matches[0].pod_name == "name-pod-b"
        assert m.peer_fetchable_chunks == 5
        a.evict(keys[1:2])
        wait_until(lambda: _synced(stub, a), what="evict applied")
        m = _match(stub, keys, ns=NS.namespace_id(), candidate_pod_uids=["pod-a"])
        # own L1 for chunks 0 and 2, peers for 1, 3 and 4
        assert [(p.pod_uid, p.l1_chunks, p.peer_chunks) for p in m.matches] == [("pod-a", 2, 3)]
        agents = stub.ListAgents(controller_pb2.ListAgentsRequest()).agents
        assert [(x.pod.pod_uid, x.num_chunks) for x in agents] == [("pod-a", 2), ("pod-b", 5)]
        assert all(x.lease_remaining_ms > 0 for x in agents)
        st = stub.GetStats(controller_pb2.GetStatsRequest())
        assert (st.num_entries, st.num_agents, st.index_backend) == (7, 2, "memory")
    finally:
        a.close()
        b.close()


def test_score_ranks_by_ttft_and_reserves(
    server: Server, stub: controller_pb2_grpc.ControllerServiceStub
) -> None:
    keys = rand_keys(8)
    a = FakeAgent(server.address, "pod-a")
    b = FakeAgent(server.address, "pod-b")
    try:
        a.admit(keys[:2])
        b.admit(keys[:8])
        wait_until(lambda: _synced(stub, a) and _synced(stub, b), what="agents synced")
        req = controller_pb2.ScoreRequest(
            match=controller_pb2.MatchPrefixRequest(
                chunk_keys=common_pb2.ChunkKeys(keys=keys), namespace_id=NS_ID
            ),
        )
        s = stub.Score(req)
        assert [x.match.pod_uid for x in s.scores] == ["pod-b", "pod-a"]
        assert s.scores[0].estimated_ttft_ms < s.scores[1].estimated_ttft_ms
        assert s.scores[1].prefill_ms == 0.0 and s.scores[1].peer_transfer_ms > 0  # a fetches 6 from b
        # Heavy load on b flips the choice.
        stub.Heartbeat(
            controller_pb2.HeartbeatRequest(
                pod_uid="pod-b", epoch=1, load=controller_pb2.AgentLoad(waiting_requests=100)
            )
        )
        b.heartbeating.clear()
        s = stub.Score(req)
        assert s.scores[0].match.pod_uid == "pod-a" and s.scores[1].queue_ms > 1000
        # An unknown candidate is scored as a pod that must recompute everything.
        req.match.candidate_pod_uids.extend(["pod-a", "pod-new"])
        s = stub.Score(req)
        assert [x.match.pod_uid for x in s.scores] == ["pod-a", "pod-new"]
        assert s.scores[1].prefill_ms > 0
        # reserve: a speculative GPU entry for the chosen pod on keys nobody holds yet.
        fresh = rand_keys(3)
        r = controller_pb2.ScoreRequest(
            match=controller_pb2.MatchPrefixRequest(
                chunk_keys=common_pb2.ChunkKeys(keys=fresh), namespace_id=NS_ID, candidate_pod_uids=["pod-a"]
            ),
            reserve=True,
            speculative_ttl_ms=1500,  # the next Match must come within it, on a stalled CI machine too
            top_k=1,
        )
        assert [x.match.pod_uid for x in stub.Score(r).scores] == ["pod-a"]
        m = _match(stub, fresh)
        assert [(p.pod_uid, p.gpu_chunks) for p in m.matches] == [("pod-a", 3)]
        time.sleep(1.6)
        assert list(_match(stub, fresh).matches) == []
    finally:
        a.close()
        b.close()


def _manual_stream(agent: FakeAgent) -> tuple[list, Iterator, callable]:
    """A PublishEvents stream the test feeds by hand: returns (sent queue, responses, send)."""
    import queue

    q: queue.Queue = queue.Queue()

    def gen():  # type: ignore[no-untyped-def]
        yield controller_pb2.PublishEventsRequest(pod=agent.pod)
        while True:
            ev = q.get()
            if ev is None:
                return
            yield controller_pb2.PublishEventsRequest(events=ev)

    responses = agent.stub.PublishEvents(gen())
    return q, responses, q.put


def test_gap_triggers_snapshot_and_buffered_events_survive(
    server: Server, stub: controller_pb2_grpc.ControllerServiceStub
) -> None:
    a = FakeAgent(server.address, "pod-a", auto=False)
    a.register()
    keys = rand_keys(10)
    resyncs = stub.GetStats(controller_pb2.GetStatsRequest()).resyncs
    q, responses, send = _manual_stream(a)
    try:
        first = next(responses)
        assert first.resync_started  # a new stream always resyncs
        # The agent holds nothing yet, so an empty index matches it before the pull is installed:
        # wait for the install itself (an event sent earlier would be buffered, not acked).
        wait_until(
            lambda: stub.GetStats(controller_pb2.GetStatsRequest()).resyncs > resyncs, what="initial sync"
        )
        assert _synced(stub, a)
        e1 = a.admit(keys[:2])
        send([e1])
        assert next(responses).acked_sequence == 1
        wait_until(lambda: index_keys(stub, "pod-a") == set(keys[:2]), what="event applied")
        a.admit(keys[2:4])  # seq 2 is "lost": never sent
        e3 = a.admit(keys[4:5])
        # While the pull runs, more events arrive; they must be buffered and applied after it.
        gate = threading.Event()
        pulled = threading.Event()

        def during_pull() -> None:
            pulled.set()
            gate.wait(5)

        a.after_snapshot = during_pull
        snaps = a.snapshots
        send([e3])
        r = next(responses)
        assert r.resync_started
        assert pulled.wait(5)
        e4 = a.admit(keys[5:7])
        e5 = a.evict(keys[0:1])
        send([e4, e5])
        assert next(responses).resync_started  # buffered while the pull is in flight
        gate.set()
        wait_until(lambda: _synced(stub, a), what="index equals agent truth after gap")
        assert a.snapshots == snaps + 1
        assert index_keys(stub, "pod-a") == set(keys[1:7])
        e6 = a.admit(keys[7:8])
        send([e6])
        wait_until(lambda: next(responses).acked_sequence == e6.sequence, what="ack of seq 6")
        assert index_keys(stub, "pod-a") == set(keys[1:8])
        assert stub.GetStats(controller_pb2.GetStatsRequest()).resyncs >= 2
    finally:
        q.put(None)
        a.close()


def test_newer_epoch_replaces_and_stale_epoch_is_refused(
    server: Server, stub: controller_pb2_grpc.ControllerServiceStub
) -> None:
    keys = rand_keys(4)
    old = FakeAgent(server.address, "pod-a", epoch=5)
    old.admit(keys[:3])
    wait_until(lambda: _synced(stub, old), what="old synced")
    old.close()
    new = FakeAgent(server.address, "pod-a", epoch=6)
    try:
        new.admit(keys[3:])
        wait_until(lambda: index_keys(stub, "pod-a") == {keys[3]}, what="new epoch replaced old entries")
        assert stub.GetStats(controller_pb2.GetStatsRequest()).num_entries == 1
        with pytest.raises(grpc.RpcError) as e:
            stub.RegisterAgent(controller_pb2.RegisterAgentRequest(pod=old.pod, namespaces=[NS_ID]))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "epoch 5 is older than the registered epoch 6" in e.value.details()
        ev = controller_pb2.ChunkEvent(sequence=1, kind=1, tier=common_pb2.TIER_L1, chunk_keys=keys[:1])
        reqs = iter([controller_pb2.PublishEventsRequest(pod=old.pod, events=[ev])])
        with pytest.raises(grpc.RpcError) as e:
            list(stub.PublishEvents(reqs))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        hb = controller_pb2.HeartbeatRequest(pod_uid="pod-a", epoch=5)
        with pytest.raises(grpc.RpcError) as e:
            stub.Heartbeat(hb)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert index_keys(stub, "pod-a") == {keys[3]}
    finally:
        new.close()


def test_lease_lapse_drops_entries() -> None:
    srv = serve(_cfg(lease_ttl_ms=1000))  # 20 heartbeats per lease: a stalled CI machine keeps b alive
    ch = grpc.insecure_channel(srv.address)
    stub = controller_pb2_grpc.ControllerServiceStub(ch)
    a = FakeAgent(srv.address, "pod-a", heartbeat_s=0.05)
    b = FakeAgent(srv.address, "pod-b", heartbeat_s=0.05)
    try:
        keys = rand_keys(6)
        a.admit(keys)
        b.admit(keys[:2])
        wait_until(lambda: _synced(stub, a) and _synced(stub, b), what="synced")
        time.sleep(2.1)  # heartbeats keep both alive past two lease lengths
        assert {x.pod.pod_uid for x in stub.ListAgents(controller_pb2.ListAgentsRequest()).agents} == {
            "pod-a",
            "pod-b",
        }
        a.close()  # stops heartbeating (and everything else)
        took = wait_until(lambda: index_keys(stub, "pod-a") is None, timeout=6, what="lease lapse")
        assert took < 3
        assert [p.pod_uid for p in _match(stub, keys).matches] == ["pod-b"]
        assert stub.GetStats(controller_pb2.GetStatsRequest()).num_entries == 2
        assert stub.GetStats(controller_pb2.GetStatsRequest()).expired_leases == 1
        m = _match(stub, keys)
        assert m.matches[0].l1_chunks == 2 and m.peer_fetchable_chunks == 2
    finally:
        b.close()
        ch.close()
        srv.stop()


def test_bad_input_is_rejected_and_nothing_changes(
    server: Server, stub: controller_pb2_grpc.ControllerServiceStub
) -> None:
    a = FakeAgent(server.address, "pod-a")
    keys = rand_keys(3)
    try:
        a.admit(keys)
        wait_until(lambda: _synced(stub, a), what="synced")
        before = stub.GetStats(controller_pb2.GetStatsRequest()).num_entries
        inv = grpc.StatusCode.INVALID_ARGUMENT
        cases = [
            (stub.MatchPrefix, controller_pb2.MatchPrefixRequest(), inv, "expected token_ids or chunk_keys"),
            (
                stub.MatchPrefix,
                controller_pb2.MatchPrefixRequest(
                    chunk_keys=common_pb2.ChunkKeys(keys=[b"abc"]), namespace_id=NS_ID
                ),
                inv,
                "got 3 bytes, expected a 16-byte chunk key",
            ),
            (
                stub.MatchPrefix,
                controller_pb2.MatchPrefixRequest(chunk_keys=common_pb2.ChunkKeys(keys=keys)),
                inv,
                "namespace_id",
            ),
            (
                stub.MatchPrefix,
                controller_pb2.MatchPrefixRequest(token_ids=common_pb2.TokenIds(ids=[1, 2])),
                inv,
                "namespace: required",
            ),
            (
                stub.MatchPrefix,
                controller_pb2.MatchPrefixRequest(
                    chunk_keys=common_pb2.ChunkKeys(keys=rand_keys(65)), namespace_id=NS_ID
                ),
                inv,
                "more than max_query_chunks=64",
            ),
            (
                stub.BatchMatchPrefix,
                controller_pb2.BatchMatchPrefixRequest(requests=[controller_pb2.MatchPrefixRequest()] * 9),
                inv,
                "more than max_batch=8",
            ),
            (
                stub.BatchMatchPrefix,
                controller_pb2.BatchMatchPrefixRequest(
                    requests=[
                        controller_pb2.MatchPrefixRequest(
                            chunk_keys=common_pb2.ChunkKeys(keys=keys), namespace_id=NS_ID
                        ),
                        controller_pb2.MatchPrefixRequest(),
                    ]
                ),
                inv,
                "requests[1]",
            ),
            (stub.Score, controller_pb2.ScoreRequest(), inv, "expected token_ids or chunk_keys"),
            (
                stub.Score,
                controller_pb2.ScoreRequest(
                    match=controller_pb2.MatchPrefixRequest(
                        chunk_keys=common_pb2.ChunkKeys(keys=keys), namespace_id=NS_ID
                    ),
                    reserve=True,
                    speculative_ttl_ms=10**9,
                ),
                inv,
                "speculative_ttl_ms=1000000000: expected <= 30000",
            ),
            (
                stub.BatchScore,
                controller_pb2.BatchScoreRequest(
                    requests=[controller_pb2.ScoreRequest(speculative_ttl_ms=10**9)]
                ),
                inv,
                "requests[0]: speculative_ttl_ms=1000000000",
            ),
            (stub.RegisterAgent, controller_pb2.RegisterAgentRequest(), inv, "pod_uid"),
            (
                stub.RegisterAgent,
                controller_pb2.RegisterAgentRequest(pod=a.pod, namespaces=["nothex"]),
                inv,
                "namespaces[0]",
            ),
            (
                stub.Heartbeat,
                controller_pb2.HeartbeatRequest(
                    pod_uid="pod-a", epoch=1, load=controller_pb2.AgentLoad(gpu_kv_usage=3.0)
                ),
                inv,
                "gpu_kv_usage",
            ),
            (
                stub.SnapshotIndex,
                controller_pb2.SnapshotIndexRequest(pod_uid="nobody"),
                grpc.StatusCode.NOT_FOUND,
                "nobody",
            ),
        ]
        for method, req, code, text in cases:
            with pytest.raises(grpc.RpcError) as e:
                method(req, timeout=2)
            assert e.value.code() == code, (req, e.value.details())
            assert text in e.value.details(), (text, e.value.details())
        bad_events = [
            [controller_pb2.ChunkEvent(sequence=9, kind=1, tier=common_pb2.TIER_L1, chunk_keys=[b"x" * 17])],
            [controller_pb2.ChunkEvent(sequence=9, kind=7, tier=common_pb2.TIER_L1)],
            [controller_pb2.ChunkEvent(sequence=9, kind=1, tier=common_pb2.TIER_PEER, chunk_keys=keys)],
            [
                controller_pb2.ChunkEvent(
                    sequence=9, kind=1, tier=common_pb2.TIER_L1, chunk_keys=keys, namespace="f" * 32
                )
            ],
            [
                controller_pb2.ChunkEvent(sequence=9, kind=2, tier=common_pb2.TIER_L1, chunk_keys=keys),
                controller_pb2.ChunkEvent(sequence=9, kind=1, tier=common_pb2.TIER_L1, chunk_keys=keys),
            ],
        ]
        for evs in bad_events:
            with pytest.raises(grpc.RpcError) as e:
                list(stub.PublishEvents(iter([controller_pb2.PublishEventsRequest(pod=a.pod, events=evs)])))
            assert e.value.code() == inv, e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            list(stub.PublishEvents(iter([controller_pb2.PublishEventsRequest()])))
        assert "first PublishEvents message must carry the pod" in e.value.details()
        # a tier the index does not store (peer-fetchable is derived) or no tier at all: named
        for t, name in ((common_pb2.TIER_PEER, "tier=3 (TIER_PEER)"), (9, "tier=9")):
            ev = controller_pb2.ChunkEvent(sequence=9, kind=1, tier=t, chunk_keys=keys)  # type: ignore[arg-type]
            with pytest.raises(grpc.RpcError) as e:
                list(stub.PublishEvents(iter([controller_pb2.PublishEventsRequest(pod=a.pod, events=[ev])])))
            assert e.value.code() == inv
            assert f"events[0].{name}: expected TIER_L1, TIER_GPU or TIER_L2" in e.value.details()
            req = controller_pb2.SnapshotIndexRequest(pod_uid=a.pod.pod_uid, tier=t)  # type: ignore[arg-type]
            with pytest.raises(grpc.RpcError) as e:
                stub.SnapshotIndex(req, timeout=2)
            assert e.value.code() == inv
            assert f"{name}: expected TIER_L1, TIER_GPU or TIER_L2" in e.value.details()
        # Nothing was applied, and the service keeps serving.
        assert stub.GetStats(controller_pb2.GetStatsRequest()).num_entries == before
        wait_until(lambda: _synced(stub, a), what="still in sync")
        assert [p.l1_chunks for p in _match(stub, keys).matches] == [3]
        assert stub.GetStats(controller_pb2.GetStatsRequest()).rejected_requests >= len(cases) + len(
            bad_events
        )
    finally:
        a.close()


def test_health_and_reflection(server: Server) -> None:
    ch = grpc.insecure_channel(server.address)
    try:
        h = health_pb2_grpc.HealthStub(ch)
        for name in ("", "kvgrid.v1.ControllerService"):
            assert (
                h.Check(health_pb2.HealthCheckRequest(service=name)).status
                == health_pb2.HealthCheckResponse.SERVING
            )
        r = reflection_pb2_grpc.ServerReflectionStub(ch)
        resp = next(r.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = {s.name for s in resp.list_services_response.service}
        assert "kvgrid.v1.ControllerService" in names
    finally:
        ch.close()


def test_redis_replicas_share_the_index(valkey_url: str) -> None:
    prefix = unique_prefix()
    one = serve(_cfg(index_backend="redis", redis_url=valkey_url, redis_prefix=prefix))
    two = serve(_cfg(index_backend="redis", redis_url=valkey_url, redis_prefix=prefix))
    ch = grpc.insecure_channel(two.address)
    stub2 = controller_pb2_grpc.ControllerServiceStub(ch)
    a = FakeAgent(one.address, "pod-a")
    try:
        keys = rand_keys(4)
        a.admit(keys)
        wait_until(
            lambda: [p.l1_chunks for p in _match(stub2, keys).matches] == [4], what="replica two sees pod-a"
        )
        assert _match(stub2, keys).matches[0].pod_uid == "pod-a"
        assert stub2.GetStats(controller_pb2.GetStatsRequest()).index_backend == "redis"
    finally:
        a.close()
        ch.close()
        one.controller.index.flush()  # type: ignore[attr-defined]
        one.stop()
        two.stop()
