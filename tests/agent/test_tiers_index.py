"""The agent's lower tiers in the controller's index, through real processes: a controller (gRPC) and
two agents, one with a disk tier. A prefix evicted from L1 onto disk shows up as ``l2_chunks`` in
MatchPrefix and Score ranks its pod above a cold one; after a controller restart (a resync from a
snapshot that lists L1 only) the agent lists its L2 again; evicted from the last tier, the prefix
is gone from the index."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from kvgrid.agent.tiers.base import HEADER_BYTES, record_name
from kvgrid.api.v1 import common_pb2, controller_pb2, controller_pb2_grpc
from kvgrid.client import PodRanker

from .helpers import (
    NAMESPACE,
    TOKENS_PER_CHUNK,
    AgentProc,
    block_ids,
    keys_for,
    register_kv,
    start_controller,
    start_pod_agent,
    wait_for,
)

NS_ID = NAMESPACE.namespace_id()


def _query(keys: list[bytes]) -> controller_pb2.MatchPrefixRequest:
    return controller_pb2.MatchPrefixRequest(
        chunk_keys=common_pb2.ChunkKeys(keys=keys),
        namespace_id=NS_ID,
        candidate_pod_uids=["pod-disk", "pod-cold"],
    )


def _counts(stub: controller_pb2_grpc.ControllerServiceStub, keys: list[bytes]) -> dict[str, tuple]:
    """pod -> (gpu, l1, l2, peer) of MatchPrefix; {} while the controller is not serving."""
    try:
        resp = stub.MatchPrefix(_query(keys), timeout=5)
    except grpc.RpcError:
        return {}
    return {m.pod_uid: (m.gpu_chunks, m.l1_chunks, m.l2_chunks, m.peer_chunks) for m in resp.matches}


def test_l2_chunks_in_match_and_score_resync_and_eviction(
    tmp_path: Path, free_port: Callable[[], int]
) -> None:
    address = f"127.0.0.1:{free_port()}"
    ctrl = start_controller(address)
    disk = tmp_path / "disk-tier"
    agents: list[AgentProc] = []
    channel = grpc.insecure_channel(address)
    try:
        grpc.channel_ready_future(channel).result(timeout=60)
        stub = controller_pb2_grpc.ControllerServiceStub(channel)
        # L1 of 16 chunks of 20 KiB, eviction 60% -> 30%; a disk tier of 12 records, nothing below it
        hot = start_pod_agent(
            tmp_path, "pod-disk", address, "--high-watermark", "0.6", "--low-watermark", "0.3",
            "--tier-disk-path", str(disk), "--tier-disk-size", str(12 * (HEADER_BYTES + 20 * 1024)),
            l1_size="320KiB",
        )  # fmt: skip
        agents.append(hot)
        agents.append(start_pod_agent(tmp_path, "pod-cold", address, l1_size="320KiB"))
        wait_for(
            "both agents registered", lambda: stub.GetStats(controller_pb2.GetStatsRequest()).num_agents == 2
        )
        c = hot.client()
        register_kv(c, "e", tmp_path, seed=5)
        a, src = keys_for(1, 4), block_ids(0, 4)

        def on_disk(keys: list[bytes]) -> list[bool]:
            return [(disk / (record_name(NS_ID, k) + ".kvc")).exists() for k in keys]

        def in_l1(keys: list[bytes]) -> list[bool]:
            held = set(c.snapshot().chunk_keys)
            return [k in held for k in keys]

        assert c.store("e", a, src).num_stored_chunks == 4
        wait_for("A in pod-disk's L1 in the index", lambda: _counts(stub, a).get("pod-disk") == (0, 4, 0, 0))

        # Fillers push A out of L1 onto the disk tier.
        for f in range(40):
            c.store("e", keys_for(100 + f, 4), src)
            if all(on_disk(a)) and not any(in_l1(a)):
                break
            time.sleep(0.05)  # the writer runs between stores
        assert all(on_disk(a)) and not any(in_l1(a))
        wait_for("A as L2 chunks of pod-disk", lambda: _counts(stub, a).get("pod-disk") == (0, 0, 4, 0))
        assert "pod-cold" not in _counts(stub, a)  # a peer's L2 is not fetchable: nothing to list

        score = stub.Score(controller_pb2.ScoreRequest(match=_query(a)), timeout=5)
        ranked = [s.match.pod_uid for s in score.scores]
        assert ranked == ["pod-disk", "pod-cold"]
        best, cold = score.scores
        assert best.match.l2_chunks == 4 and best.l2_transfer_ms > 0 and best.prefill_ms == 0
        assert cold.l2_transfer_ms == 0 and cold.prefill_ms > 0
        assert best.estimated_ttft_ms < cold.estimated_ttft_ms
        # A router's client sees the same: pod-disk first, its prefix in L2.
        ranker = PodRanker(address, NAMESPACE, timeout_s=5, static_pods=["pod-disk", "pod-cold"])
        try:
            top = ranker.rank([(1 * 7919 + i) % 50_000 for i in range(4 * TOKENS_PER_CHUNK)]).pods[0]
        finally:
            ranker.close()
        assert (top.pod.pod_uid, top.l1_chunks, top.l2_chunks) == ("pod-disk", 0, 4)
        snap = stub.SnapshotIndex(
            controller_pb2.SnapshotIndexRequest(pod_uid="pod-disk", tier=common_pb2.TIER_L2), timeout=5
        )
        assert set(a) <= set(snap.chunk_keys)

        # A new controller knows nothing: the agents reconnect, it pulls their snapshots (L1 only)
        # and asks pod-disk for its L2 listing, which brings A back.
        ctrl.terminate()
        ctrl.wait(10)
        ctrl = start_controller(address)
        wait_for("A listed again after the resync", lambda: _counts(stub, a).get("pod-disk") == (0, 0, 4, 0))

        # Evicted from the last tier: gone from the index.
        for f in range(40):
            c.store("e", keys_for(200 + f, 4), src)
            if not any(on_disk(a)):
                break
            time.sleep(0.05)
        assert not any(on_disk(a)) and not any(in_l1(a))
        wait_for("A gone from the index", lambda: _counts(stub, a) == {})
        snap = stub.SnapshotIndex(
            controller_pb2.SnapshotIndexRequest(pod_uid="pod-disk", tier=common_pb2.TIER_L2), timeout=5
        )
        assert not set(a) & set(snap.chunk_keys) and len(snap.chunk_keys) > 0  # fillers are there
    finally:
        for agent in agents:
            agent.stop()
        channel.close()
        if ctrl.poll() is None:
            ctrl.terminate()
        try:
            ctrl.wait(10)
        except subprocess.TimeoutExpired:
            ctrl.kill()
