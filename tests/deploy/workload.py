"""A small real kvgrid deployment on loopback for the monitoring tests: one ``kvgrid controller`` and
two ``kvgrid agent`` processes, each serving Prometheus ``/metrics``, and a workload that makes every
metric the dashboards and alerts use appear (stores, a lookup that fetches from the peer agent, a
retrieve, controller queries).

Invariant: everything here is a real process talking real gRPC; nothing is stubbed.
"""

from __future__ import annotations

import itertools
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from kvgrid.api.v1 import common_pb2, controller_pb2, controller_pb2_grpc
from tests.agent.helpers import (
    BPC,
    NAMESPACE,
    AgentProc,
    keys_for,
    register_kv,
    start_agent,
    start_controller,
    wait_for,
)

NS_ID = NAMESPACE.namespace_id()
# Every prompt of a workload is new (a repeated one would be a local hit, not a peer fetch).
_PROMPTS = itertools.count(1000)


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return str(resp.read().decode())


@dataclass
class Deployment:
    controller_address: str
    controller_metrics_port: int
    agent_metrics_ports: list[int]
    agents: list[AgentProc] = field(default_factory=list)

    def metrics_ports(self) -> list[int]:
        return [self.controller_metrics_port, *self.agent_metrics_ports]


def _request_ids(first_block: int, num_chunks: int) -> list[list[int]]:
    return [list(range(first_block, first_block + num_chunks * bpc)) for bpc in BPC]


@contextmanager
def deployment(root: Path, free_port: Callable[[], int]) -> Iterator[Deployment]:
    """Controller + agents A and B (both registered) with their metrics ports; stopped on exit."""
    address = f"127.0.0.1:{free_port()}"
    dep = Deployment(address, free_port(), [free_port(), free_port()])
    ctrl = start_controller(address, "--prometheus-port", str(dep.controller_metrics_port))
    channel = grpc.insecure_channel(address)
    try:
        grpc.channel_ready_future(channel).result(timeout=60)
        for uid, port in zip(("pod-a", "pod-b"), dep.agent_metrics_ports, strict=True):
            d = root / uid
            d.mkdir()
            dep.agents.append(
                start_agent(
                    d,
                    "--controller-address",
                    address,
                    "--event-flush-interval-ms",
                    "20",
                    "--heartbeat-interval-ms",
                    "200",
                    "--prometheus-port",
                    str(port),
                    pod_uid=uid,
                    shm_dir=root,
                )
            )
        stub = controller_pb2_grpc.ControllerServiceStub(channel)
        wait_for(
            "both agents registered",
            lambda: stub.GetStats(controller_pb2.GetStatsRequest(), timeout=5).num_agents >= 2,
        )
        yield dep
    finally:
        for agent in dep.agents:
            agent.stop()
        channel.close()
        ctrl.terminate()
        ctrl.wait(10)


def _l1_chunks_on(stub: controller_pb2_grpc.ControllerServiceStub, pod_uid: str, keys: list[bytes]) -> int:
    query = controller_pb2.MatchPrefixRequest(chunk_keys=common_pb2.ChunkKeys(keys=keys), namespace_id=NS_ID)
    return sum(m.l1_chunks for m in stub.MatchPrefix(query, timeout=5).matches if m.pod_uid == pod_uid)


def run_workload(dep: Deployment, root: Path, rounds: int = 1) -> None:
    """Stores on A, a lookup on B that fetches A's chunks as a peer plus one that misses, a
    retrieve, evictions, and controller queries (MatchPrefix, Score): each round uses fresh prompts."""
    a, b = dep.agents
    clients = [a.client(), b.client()]
    channel = grpc.insecure_channel(dep.controller_address)
    stub = controller_pb2_grpc.ControllerServiceStub(channel)
    try:
        for i, c in enumerate(clients):
            d = root / f"engine-{i}-{time.monotonic_ns()}"
            d.mkdir()
            register_kv(c, f"e{i}", d, seed=i)
        for r in range(rounds):
            keys = keys_for(next(_PROMPTS), 4)
            stored = clients[0].store("e0", keys, _request_ids(0, len(keys)))
            assert stored.num_stored_chunks == len(keys), stored
            wait_for("A's chunks indexed", lambda k=keys: _l1_chunks_on(stub, a.pod_uid, k) == len(k))
            hit = clients[1].lookup("e1", f"req-{r}", keys)
            assert hit.num_peer_chunks > 0, hit
            clients[1].retrieve("e1", f"req-{r}", keys, _request_ids(32, len(keys)))
            clients[1].lookup("e1", f"miss-{r}", keys_for(next(_PROMPTS), 2))  # nobody holds these
            query = controller_pb2.MatchPrefixRequest(
                chunk_keys=common_pb2.ChunkKeys(keys=keys), namespace_id=NS_ID
            )
            stub.Score(controller_pb2.ScoreRequest(match=query), timeout=5)
        # Fill A's small L1 past its watermark so it evicts (the dashboards show evictions).
        for _ in range(40):
            clients[0].store("e0", keys_for(next(_PROMPTS), 4), _request_ids(0, 4))
    finally:
        channel.close()
        for c in clients:
            c.close()
