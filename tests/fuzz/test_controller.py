"""Fuzz every ControllerService RPC of a real controller process (PublishEvents as sequences of
mutated stream messages). Every answer is OK or a named client-facing status with a message; the
controller keeps serving (every 200 messages and at the end a live test agent's new chunks show up
in MatchPrefix) and its RSS stays bounded.

At every liveness check the fuzzer also leaves one more PublishEvents stream idle (it names a pod
of its own, sends one event and then nothing; at most :data:`IDLE_STREAMS` at once): the controller
must cancel each once its pod's lease lapsed and it was idle for ``publish_idle_timeout_ms``, while
everyone else is served. Its log must show no failed gRPC callback (a response stream closed from
grpcio's event thread while it ran)."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator

import grpc

from kvgrid.api.v1 import common_pb2, controller_pb2, controller_pb2_grpc
from tests.controller.support import FakeAgent
from tests.fuzz import grpc_driver
from tests.fuzz.conftest import IDLE_TIMEOUT_MS, MAX_MESSAGE_BYTES, ControllerProc
from tests.fuzz.controller_cases import CONTROLLER_SERVICE, NS_ID, pools, rpcs
from tests.fuzz.fuzzlib import Liveness, Mutator, Oracle, RawCaller, budget, log_tail, rng_for, rss_bytes

CI_MESSAGES = 1500
RSS_SLACK = 96 << 20
BYTES_PER_ENTRY = 600
"""RSS allowed: BYTES_PER_ENTRY per index entry the fuzzed events added (docs/capacity.md: 86-489 B
per entry in a controller process, by holder slots), plus RSS_SLACK for what plateaus rather than
grows with the message count: glibc arenas of the 256 gRPC worker threads, gRPC's buffers for 4 MiB
messages, the resync buffers of the fuzzed pods (leases lapse after 2 s). Measured: +34 MiB after
1,500 messages, +62 MiB after 20,000, +93 MiB after 100,000 (the least of ten samples, 2-core box:
the controller's Python objects stay flat, ~53k, the rest is native memory); one sample swings by up
to 80 MiB between two liveness checks. A leak of 1 KiB a message fails ``make fuzz`` (100,000
messages)."""


IDLE_STREAMS = 4
IDLE_BOUND_S = 2 + IDLE_TIMEOUT_MS / 1000 + 15
"""An idle stream must have ended this long after it went idle: its pod's lease (2 s) lapses, the
watchdog sees it idle for ``publish_idle_timeout_ms``, plus slack for a loaded 2-core machine."""


class IdleStream:
    """A PublishEvents stream that names pod ``uid``, sends one admit and then nothing (its answers
    are read, so the controller is told the stream's end)."""

    def __init__(self, channel: grpc.Channel, uid: str, address: str) -> None:
        self.uid = uid
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        pod = common_pb2.PodIdentity(pod_uid=uid, pod_name=uid, epoch=1, agent_address=address)
        event = controller_pb2.ChunkEvent(
            sequence=1, kind=controller_pb2.EVENT_KIND_ADMIT, tier=common_pb2.TIER_L1,
            chunk_keys=[secrets.token_bytes(16)], namespace=NS_ID,
        )  # fmt: skip
        msgs = [
            controller_pb2.PublishEventsRequest(pod=pod),
            controller_pb2.PublishEventsRequest(events=[event]),
        ]
        self.call = controller_pb2_grpc.ControllerServiceStub(channel).PublishEvents(self._requests(msgs))
        self.code: grpc.StatusCode | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _requests(
        self, msgs: list[controller_pb2.PublishEventsRequest]
    ) -> Iterator[controller_pb2.PublishEventsRequest]:
        yield from msgs
        self._stop.wait()

    def _read(self) -> None:
        try:
            for _ in self.call:
                pass
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            self.code = e.code()

    @property
    def ended(self) -> bool:
        return not self._reader.is_alive()

    def close(self) -> None:
        self._stop.set()
        self.call.cancel()


class IdleStreams:
    """Opens one idle stream per :meth:`tick` (at most :data:`IDLE_STREAMS` open) and checks that
    the controller ended each one within :data:`IDLE_BOUND_S` with CANCELLED."""

    def __init__(self, channel: grpc.Channel, address: str) -> None:
        self.channel, self.address = channel, address
        self.open: list[IdleStream] = []
        self.opened = self.ended = 0

    def tick(self, ctl: ControllerProc, *, more: bool = True) -> None:
        now = time.monotonic()
        for s in list(self.open):
            if s.ended:
                assert s.code == grpc.StatusCode.CANCELLED, f"idle stream of {s.uid} ended with {s.code}"
                self.open.remove(s)
                self.ended += 1
            elif now - s.t0 > IDLE_BOUND_S:
                raise AssertionError(
                    f"the idle PublishEvents stream of {s.uid} is still open {now - s.t0:.1f} s after it "
                    f"went idle (publish_idle_timeout_ms={IDLE_TIMEOUT_MS}); the controller's log ends:\n"
                    f"{log_tail(ctl.log)}"
                )
        if more and len(self.open) < IDLE_STREAMS:
            self.open.append(IdleStream(self.channel, f"fz-idle-{self.opened}", self.address))
            self.opened += 1

    def finish(self, ctl: ControllerProc) -> None:
        """Wait for the controller to end every idle stream still open (AssertionError past the bound)."""
        while self.open:
            self.tick(ctl, more=False)
            time.sleep(0.2)

    def close(self) -> None:
        for s in self.open:
            s.close()


def settled_rss(pid: int, samples: int = 10, every_s: float = 0.3) -> int:
    """The controller's RSS once the last requests' buffers are freed: the least of a few samples
    (one sample may catch a 4 MiB request's transient copies: +80 MiB seen between two checks)."""
    out = rss_bytes(pid)
    for _ in range(samples - 1):
        time.sleep(every_s)
        out = min(out, rss_bytes(pid))
    return out


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
        idle = IdleStreams(channel, snap.pod.agent_address)

        def check() -> None:
            check_controller(controller)
            idle.tick(controller)

        live = Liveness(check)
        grpc_driver.run(oracle, targets, methods, mut, min(300, n // 5), live, MAX_MESSAGE_BYTES)
        rss0 = settled_rss(controller.proc.pid)
        grpc_driver.run(oracle, targets, methods, mut, n, live, MAX_MESSAGE_BYTES)
        check_controller(controller)
        idle.finish(controller)
        rss1 = settled_rss(controller.proc.pid)
        entries = controller.stub.GetStats(controller_pb2.GetStatsRequest(), timeout=10).num_entries
    finally:
        idle.close()
        channel.close()
        snap.close()
    print(
        f"[fuzz controller] RSS {rss0 >> 20} -> {rss1 >> 20} MiB; {entries} index entries; "
        f"liveness checks {live.runs + 1}; idle streams ended by the controller {idle.ended} of {idle.opened}"
    )
    oracle.assert_clean()
    assert idle.ended == idle.opened > 0, (idle.ended, idle.opened)
    failed = controller.log.read_text(errors="replace").count("Exception calling callback")
    assert not failed, f"grpcio logged {failed} failed callbacks:\n{log_tail(controller.log)}"
    bound = RSS_SLACK + BYTES_PER_ENTRY * entries
    assert rss1 - rss0 < bound, (
        f"controller RSS grew {(rss1 - rss0) >> 20} MiB over {oracle.messages} messages "
        f"(bound {bound >> 20} MiB for {entries} index entries)"
    )
