"""Admit/evict events from a real agent process to the real controller (in this process), including a
controller restart that the agent survives by reconnecting (the new controller resyncs from the
agent's Snapshot over TCP)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from kvgrid.agent.events import EventLog
from kvgrid.api.v1 import common_pb2, controller_pb2, controller_pb2_grpc
from kvgrid.controller.config import ControllerConfig
from kvgrid.controller.service import serve
from kvgrid.engine.client import AgentClient
from tests.agent.helpers import NAMESPACE, block_ids, keys_for, register_kv, start_agent


def test_event_log_numbers_acks_and_drops_the_oldest() -> None:
    log = EventLog(max_buffer=3)
    log.on_admit("ns", [b"a" * 16])
    log.on_evict("ns", [b"a" * 16])
    assert log.last_sequence() == 2
    assert [e.sequence for e in log.wait_after(0, 0)] == [1, 2]
    assert log.wait_after(0, 0)[1].to_proto().kind == controller_pb2.EVENT_KIND_EVICT
    log.ack(1)
    assert [e.sequence for e in log.wait_after(0, 0)] == [2]
    for _ in range(4):
        log.on_admit("ns", [b"b" * 16])
    assert log.pending() == 3 and log.dropped == 2
    assert [e.sequence for e in log.wait_after(0, 0)] == [4, 5, 6]  # the gap tells the controller to resync
    counting = EventLog(buffer=False)
    counting.on_admit("ns", [b"c" * 16])
    assert counting.last_sequence() == 1 and counting.pending() == 0


def wait_for(cond: Callable[[], bool], timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def l1_match(address: str, keys: list[bytes]) -> int:
    with grpc.insecure_channel(address) as ch:
        resp = controller_pb2_grpc.ControllerServiceStub(ch).MatchPrefix(
            controller_pb2.MatchPrefixRequest(
                chunk_keys=common_pb2.ChunkKeys(keys=keys), namespace_id=NAMESPACE.namespace_id()
            ),
            timeout=5,
        )
    return max((m.l1_chunks for m in resp.matches if m.pod_uid == "uid-agent-test"), default=0)


def test_agent_events_reach_the_controller_and_survive_its_restart(tmp_path: Path) -> None:
    cfg = ControllerConfig(listen="127.0.0.1:0", lease_ttl_ms=5_000, sweep_interval_ms=50)  # type: ignore[call-arg]
    ctl = serve(cfg)
    address = ctl.address
    # One chunk is 5 pages of 4 KiB; the pool holds 10 chunks.
    agent = start_agent(
        tmp_path,
        "--controller-address",
        address,
        "--event-flush-interval-ms",
        "20",
        "--heartbeat-interval-ms",
        "200",
        "--reconnect-initial-backoff-ms",
        "50",
        "--reconnect-max-backoff-ms",
        "500",
        "--high-watermark",
        "1.0",
        "--low-watermark",
        "1.0",
        l1_size=f"{10 * 5 * 4096}",
    )
    try:
        with AgentClient(agent.uds_path) as c:
            register_kv(c, "e", tmp_path, seed=2)
            a = keys_for(1, 4)
            assert c.store("e", a, block_ids(0, 4)).num_stored_chunks == 4
            assert wait_for(lambda: l1_match(address, a) == 4)

            # Controller goes away; the agent keeps serving and buffers its events.
            ctl.stop()
            b = keys_for(2, 4)
            assert c.store("e", b, block_ids(0, 4)).num_stored_chunks == 4
            ctl = serve(ControllerConfig(listen=address, lease_ttl_ms=5_000, sweep_interval_ms=50))  # type: ignore[call-arg]
            # The new controller learns everything: from the resent events and/or a snapshot pull.
            assert wait_for(lambda: l1_match(address, a) == 4 and l1_match(address, b) == 4)

            # Eviction: a third prompt pushes the least recently used chunks (a's) out.
            d = keys_for(3, 4)
            assert c.store("e", d, block_ids(0, 4)).num_stored_chunks == 4
            assert c.health().num_evictions == 2
            assert wait_for(lambda: l1_match(address, d) == 4 and l1_match(address, a) == 0)
            snap = c.snapshot()
            assert snap.pod.epoch == agent.epoch
            assert snap.last_sequence >= 4  # admit a, admit b, evict, admit d
    finally:
        agent.stop()
        ctl.stop()


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
