"""Fuzz every ControllerService RPC of a real controller process (PublishEvents as sequences of
mutated stream messages). Every answer is OK or a named client-facing status with a message; the
controller keeps serving (every 200 messages and at the end a live test agent's new chunks show up
in MatchPrefix) and its RSS stays bounded."""

from __future__ import annotations

import secrets
import time

import grpc

from kvgrid.api.v1 import common_pb2, controller_pb2
from tests.controller.support import FakeAgent
from tests.fuzz import grpc_driver
from tests.fuzz.conftest import MAX_MESSAGE_BYTES, ControllerProc
from tests.fuzz.controller_cases import CONTROLLER_SERVICE, NS_ID, pools, rpcs
from tests.fuzz.fuzzlib import Liveness, Mutator, Oracle, RawCaller, budget, log_tail, rng_for, rss_bytes

CI_MESSAGES = 1500
RSS_SLACK = 96 << 20
BYTES_PER_ENTRY = 600
"""RSS allowed: BYTES_PER_ENTRY per index entry the fuzzed events added (docs/capacity.md: 86-489 B
per entry in a controller process, by holder slots), plus RSS_SLACK for what plateaus rather than
grows with the message count: glibc arenas of the 256 gRPC worker threads, gRPC's buffers for 4 MiB
messages, the resync buffers of the fuzzed pods (leases lapse after 2 s). Measured: +34 MiB after
1,500 messages, +62 MiB after 20,000 (flat from ~6,000 on). A leak of 1 KiB a message fails
``make fuzz`` (100,000 messages)."""


def check_controller(ctl: ControllerProc) -> None:
    """A valid request still succeeds: GetStats, and chunks the live agent admits now show up."""
    ctl.alive()
    keys = [secrets.token_bytes(16) for _ in range(3)]
    ctl.pod.admit(keys)
    req = controller_pb2.MatchPrefixRequest(
        chunk_keys=common_pb2.ChunkKeys(keys=keys),
        namespace_id=NS_ID,
        candidate_pod_uids=[ctl.pod.pod.pod_uid],
    )
    deadline = time.monotonic() + 20
    try:
        ctl.stub.GetStats(controller_pb2.GetStatsRequest(), timeout=10)
        while True:
            m = ctl.stub.MatchPrefix(req, timeout=10).matches
            if m and m[0].l1_chunks == len(keys):
                return
            if time.monotonic() > deadline:
                stats = ctl.stub.GetStats(controller_pb2.GetStatsRequest(), timeout=10)
                raise AssertionError(
                    f"the live agent's admitted chunks never showed up: {m}; acked {ctl.pod.acked} of "
                    f"{ctl.pod.seq} events; controller stats {stats}; its log ends:\n{log_tail(ctl.log)}"
                )
            time.sleep(0.02)
    except grpc.RpcError as e:
        raise AssertionError(
            f"the controller no longer serves a valid request: {e.code()}: {e.details()}\n"
            f"its log ends:\n{log_tail(ctl.log)}"
        ) from None


def test_controller_fuzz(controller: ControllerProc) -> None:
    n = budget(CI_MESSAGES)
    rng = rng_for("controller")
    snap = FakeAgent(controller.address, "fz-pod-0", namespace_id=NS_ID, auto=False)
    channel = grpc.insecure_channel(
        controller.address, options=[("grpc.max_receive_message_length", 64 << 20)]
    )
    try:
        methods = rpcs(snap.pod.agent_address, controller.pod.pod.pod_uid)
        served = {m.name for m in controller_pb2.DESCRIPTOR.services_by_name["ControllerService"].methods}
        assert {r.name for r in methods} == served, "a new ControllerService RPC needs a seed"
        mut = Mutator(rng, pools(snap.pod.agent_address))
        targets = [grpc_driver.Target("tcp", RawCaller(channel, CONTROLLER_SERVICE))]
        oracle = Oracle("controller")
        live = Liveness(lambda: check_controller(controller))
        grpc_driver.run(oracle, targets, methods, mut, min(300, n // 5), live, MAX_MESSAGE_BYTES)
        rss0 = rss_bytes(controller.proc.pid)
        grpc_driver.run(oracle, targets, methods, mut, n, live, MAX_MESSAGE_BYTES)
        check_controller(controller)
        rss1 = rss_bytes(controller.proc.pid)
        entries = controller.stub.GetStats(controller_pb2.GetStatsRequest(), timeout=10).num_entries
    finally:
        channel.close()
        snap.close()
    print(
        f"[fuzz controller] RSS {rss0 >> 20} -> {rss1 >> 20} MiB; {entries} index entries; "
        f"liveness checks {live.runs + 1}"
    )
    oracle.assert_clean()
    bound = RSS_SLACK + BYTES_PER_ENTRY * entries
    assert rss1 - rss0 < bound, (
        f"controller RSS grew {(rss1 - rss0) >> 20} MiB over {oracle.messages} messages "
        f"(bound {bound >> 20} MiB for {entries} index entries)"
    )
