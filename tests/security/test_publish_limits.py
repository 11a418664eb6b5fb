"""The controller's PublishEvents streams under a starving agent, against a real controller serving
with mTLS.

The attacks these tests replay:

- An agent identity opened 24 PublishEvents streams that named a pod and then neither sent nor read
  anything. Each held one of the controller's gRPC threads for good (no server-side bound), so with
  16 threads another agent's events were never acknowledged and a router's MatchPrefix and Score
  waited. Now one caller (identity at IP address) has at most ``publish_streams_per_identity``
  streams open, a pod at most ``publish_streams_per_pod``, everyone together at most
  ``max_publish_streams`` (below ``grpc_workers``); one more is RESOURCE_EXHAUSTED naming the limit
  and its setting.
- Streams that stopped sending (named no pod, or left over after their pod reconnected, or of a
  pod whose lease lapsed) or stopped reading stayed open for good. Now they are cancelled after
  ``publish_idle_timeout_ms``; a quiet stream of a live pod (an agent with nothing to report) stays.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvgrid.api.v1 import common_pb2, controller_pb2, controller_pb2_grpc
from kvgrid.common.tls import CONTROLLER_SERVER_NAME
from kvgrid.controller.config import ControllerConfig
from kvgrid.controller.service import Server, serve
from tests.security.conftest import NS_ID, Pki, SnapshotAgent, read, tls_flags
from tests.security.pki import spiffe

Stub = controller_pb2_grpc.ControllerServiceStub


def _controller(pki: Pki, **flags: Any) -> Server:
    return serve(
        ControllerConfig(
            **{"listen": "127.0.0.1:0", "lease_ttl_ms": 60_000, **flags}, **tls_flags(pki.controller())
        )
    )


def _channel(server: Server, who: Path) -> grpc.Channel:
    """A connection of its own (no shared subchannel, no BDP probing: HTTP/2 keeps its 64 KiB
    window, so answers this test does not read stall the controller's sends)."""
    cert, key, ca = read(who)
    return grpc.secure_channel(
        server.address,
        grpc.ssl_channel_credentials(ca, key, cert),
        options=[
            ("grpc.ssl_target_name_override", CONTROLLER_SERVER_NAME),
            ("grpc.http2.bdp_probe", 0),
            ("grpc.use_local_subchannel_pool", 1),
        ],
    )


def _pod(uid: str, address: str = "") -> common_pb2.PodIdentity:
    return common_pb2.PodIdentity(pod_uid=uid, pod_name=f"name-{uid}", epoch=1, agent_address=address)


def _admit(seq: int, keys: list[bytes]) -> controller_pb2.PublishEventsRequest:
    return controller_pb2.PublishEventsRequest(
        events=[
            controller_pb2.ChunkEvent(
                sequence=seq, kind=controller_pb2.EVENT_KIND_ADMIT, tier=common_pb2.TIER_L1,
                chunk_keys=keys, namespace=NS_ID,
            )
        ]
    )  # fmt: skip


class Held:
    """A PublishEvents stream whose requests the test feeds (``send``) and ends (``close``); its
    answers are read by a thread of its own unless ``read=False`` (a client that stopped reading).
    gRPC tells a client the stream's status only once it read every answer before it."""

    def __init__(
        self,
        stub: Stub,
        first: controller_pb2.PublishEventsRequest | None,
        *,
        read: bool = True,
        timeout: float = 60,
    ) -> None:
        self.q: queue.Queue[controller_pb2.PublishEventsRequest | None] = queue.Queue()
        if first is not None:
            self.q.put(first)
        self.call = stub.PublishEvents(self._requests(), timeout=timeout)
        self.acks: list[int] = []
        if read:
            threading.Thread(target=self.drain, daemon=True).start()

    def _requests(self) -> Iterator[controller_pb2.PublishEventsRequest]:
        while True:
            m = self.q.get()
            if m is None:
                return
            yield m

    def drain(self) -> None:
        try:
            for a in self.call:
                self.acks.append(a.acked_sequence)
        except grpc.RpcError:
            pass

    def send(self, m: controller_pb2.PublishEventsRequest) -> None:
        self.q.put(m)

    def close(self) -> None:
        self.q.put(None)
        self.call.cancel()

    def outcome(self, timeout: float = 0.5) -> grpc.StatusCode | None:
        """The stream's status once it ended (None: still open after ``timeout``)."""
        deadline = time.monotonic() + timeout
        while not self.call.done():
            if time.monotonic() > deadline:
                return None
            time.sleep(0.02)
        return self.call.code()


def _wait(fn: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not fn():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _holds(stub: Stub, uid: str, keys: list[bytes]) -> bool:
    req = controller_pb2.MatchPrefixRequest(
        chunk_keys=common_pb2.ChunkKeys(keys=keys), namespace_id=NS_ID, candidate_pod_uids=[uid]
    )
    m = stub.MatchPrefix(req, timeout=5).matches
    return bool(m) and m[0].l1_chunks == len(keys)


def test_idle_unread_streams_of_one_identity_starve_no_one(pki: Pki) -> None:
    server = _controller(pki, grpc_workers=16, publish_streams_per_identity=4)  # 14 streams in all
    hog_uri = spiffe("agent")
    channels: list[grpc.Channel] = []
    held: list[Held] = []
    ok_snap = SnapshotAgent(pki.agent("pod-ok"), "pod-ok", 1, [], NS_ID)
    try:
        t0 = time.monotonic()
        # The attack: the shared agent certificate, 24 streams naming 24 pods, then nothing: no more
        # requests, no answer read.
        for i in range(24):
            ch = _channel(server, pki.agent())
            channels.append(ch)
            first = controller_pb2.PublishEventsRequest(pod=_pod(f"hog-{i}"))
            held.append(Held(Stub(ch), first, read=False))
        time.sleep(1.0)  # let the controller take them up

        # Another agent's stream is acknowledged and applied, and a router is answered, meanwhile.
        t1 = time.monotonic()
        ok_ch = _channel(server, pki.agent("pod-ok"))
        channels.append(ok_ch)
        ok = Stub(ok_ch)
        ok.RegisterAgent(controller_pb2.RegisterAgentRequest(pod=ok_snap.pod, namespaces=[NS_ID]), timeout=5)
        keys = [bytes([7]) * 16, bytes([8]) * 16]
        acks = list(
            ok.PublishEvents(
                iter([controller_pb2.PublishEventsRequest(pod=ok_snap.pod), _admit(1, keys)]), timeout=5
            )
        )
        assert len(acks) == 2
        router_ch = _channel(server, pki.router())
        channels.append(router_ch)
        router = Stub(router_ch)
        _wait(lambda: _holds(router, "pod-ok", keys), "the other agent's admit in the index", 3.0)
        score = router.Score(
            controller_pb2.ScoreRequest(
                match=controller_pb2.MatchPrefixRequest(
                    chunk_keys=common_pb2.ChunkKeys(keys=keys), namespace_id=NS_ID
                )
            ),
            timeout=5,
        )
        assert score.scores[0].match.pod_uid == "pod-ok"
        assert time.monotonic() - t1 < 3.0, "the other agent and the router waited for the hog"

        # The hog holds 4 streams; the other 20 were refused, naming the caller, the limit, the setting.
        refused = [h for h in held if h.outcome() is not None]
        assert len(refused) == 20, f"{24 - len(refused)} streams held, {len(refused)} refused"
        for h in refused:
            assert h.call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, h.call.details()
            details = h.call.details() or ""
            assert f"the caller '{hog_uri}@ipv4:127.0.0.1' already has 4 streams open" in details, details
            assert "the limit is 4 per caller (publish_streams_per_identity)" in details, details
        assert (
            server.streams is not None
            and server.streams.callers.open_streams(f"{hog_uri}@ipv4:127.0.0.1") == 4
        )
        assert time.monotonic() - t0 < 8.0
    finally:
        for h in held:
            h.close()
        for ch in channels:
            ch.close()
        ok_snap.stop()
        server.stop(0)


def test_a_pod_has_at_most_publish_streams_per_pod_open(pki: Pki) -> None:
    server = _controller(pki)
    me = pki.agent("pod-two")
    ch = _channel(server, me)
    streams: list[Held] = []
    try:
        stub = Stub(ch)
        for _ in range(3):
            streams.append(Held(stub, controller_pb2.PublishEventsRequest(pod=_pod("pod-two"))))
            time.sleep(0.3)
        assert [s.outcome() for s in streams[:2]] == [None, None]
        assert streams[2].outcome(5) == grpc.StatusCode.RESOURCE_EXHAUSTED
        details = streams[2].call.details() or ""
        assert "pod 'pod-two' already has 2 streams open on this controller" in details, details
        assert "the limit is 2 per pod (publish_streams_per_pod)" in details, details
    finally:
        for s in streams:
            s.close()
        ch.close()
        server.stop(0)


def test_all_streams_together_leave_threads_for_everyone_else(pki: Pki) -> None:
    server = _controller(pki, grpc_workers=8, max_publish_streams=3)
    channels: list[grpc.Channel] = []
    streams: list[Held] = []
    try:
        for uid in ("pod-a", "pod-b", "pod-c", "pod-d"):
            ch = _channel(server, pki.agent(uid))
            channels.append(ch)
            streams.append(Held(Stub(ch), controller_pb2.PublishEventsRequest(pod=_pod(uid)), read=False))
            time.sleep(0.3)
        assert [s.outcome() for s in streams[:3]] == [None, None, None]
        assert streams[3].outcome(5) == grpc.StatusCode.RESOURCE_EXHAUSTED
        details = streams[3].call.details() or ""
        assert "3 streams are open on this controller; the limit is 3 in all (max_publish_streams" in details
        router_ch = _channel(server, pki.router())
        channels.append(router_ch)
        t0 = time.monotonic()
        Stub(router_ch).ListAgents(controller_pb2.ListAgentsRequest(), timeout=5)
        assert time.monotonic() - t0 < 2.0
    finally:
        for s in streams:
            s.close()
        for ch in channels:
            ch.close()
        server.stop(0)


def test_streams_that_stopped_are_cancelled_after_the_idle_timeout(pki: Pki) -> None:
    server = _controller(pki, publish_idle_timeout_ms=1000, lease_ttl_ms=1500, sweep_interval_ms=50)
    channels: list[grpc.Channel] = []
    streams: list[Held] = []

    def stub_as(who: Path) -> Stub:
        ch = _channel(server, who)
        channels.append(ch)
        return Stub(ch)

    try:
        t0 = time.monotonic()
        silent = Held(stub_as(pki.agent("pod-silent")), None)  # never names a pod
        live_snap = SnapshotAgent(pki.agent("pod-live"), "pod-live", 1, [], NS_ID)
        live_stub = stub_as(pki.agent("pod-live"))
        live_stub.RegisterAgent(
            controller_pb2.RegisterAgentRequest(pod=live_snap.pod, namespaces=[NS_ID]), timeout=5
        )
        old = Held(live_stub, controller_pb2.PublishEventsRequest(pod=live_snap.pod))
        time.sleep(0.2)
        new = Held(live_stub, controller_pb2.PublishEventsRequest(pod=live_snap.pod))  # a reconnect
        streams += [silent, old, new]

        # No reader: requests flood in, answers pile up until the controller's send waits.
        flood_stub = stub_as(pki.agent("pod-flood"))
        flood = Held(flood_stub, controller_pb2.PublishEventsRequest(pod=_pod("pod-flood")), read=False)
        streams.append(flood)
        for seq in range(1, 20_001):
            flood.send(_admit(seq, [seq.to_bytes(16, "big")]))

        # The live pod heartbeats: its newest stream is quiet but stays; the rest end. The flooding
        # pod heartbeats too (its stream ends for not reading, not for a lapsed lease).
        beat = threading.Event()

        def heartbeats() -> None:
            while not beat.wait(0.2):
                live_stub.Heartbeat(controller_pb2.HeartbeatRequest(pod_uid="pod-live", epoch=1), timeout=5)
                flood_stub.Heartbeat(controller_pb2.HeartbeatRequest(pod_uid="pod-flood", epoch=1), timeout=5)

        hb = threading.Thread(target=heartbeats, daemon=True)
        hb.start()
        for s, what in ((silent, "the stream that named no pod"), (old, "the left-over stream")):
            assert s.outcome(6) == grpc.StatusCode.CANCELLED, f"{what} is still open"
        assert server.streams is not None
        flood_key = f"{spiffe('agent', 'pod-flood')}@ipv4:127.0.0.1"
        assert time.monotonic() - t0 < 6.0
        # It made progress until its answers filled the window (a few thousand), then idled 1 s.
        _wait(lambda: server.streams.callers.open_streams(flood_key) == 0, "the unread stream ended", 20)
        flood.drain()  # the answers sent before the cancel, then the status
        assert flood.outcome(5) == grpc.StatusCode.CANCELLED
        assert 100 < len(flood.acks) < 20_000, len(flood.acks)
        time.sleep(1.5)
        assert new.outcome(0) is None, "the live pod's quiet stream was ended"
        assert server.streams is not None and server.streams.cancelled == 3

        # Its heartbeats stop: once the lease lapsed the stream is ended too.
        beat.set()
        hb.join(5)
        assert new.outcome(6) == grpc.StatusCode.CANCELLED
        assert server.streams.open_streams == 0
        live_snap.stop()
    finally:
        for s in streams:
            s.close()
        for ch in channels:
            ch.close()
        server.stop(0)


def test_the_stream_bounds_stay_below_the_thread_pool() -> None:
    """One caller's streams, and all streams together, can never take every gRPC thread."""
    cfg = ControllerConfig()
    assert (cfg.grpc_workers, cfg.publish_streams_cap, cfg.publish_streams_per_caller) == (256, 224, 16)
    small = ControllerConfig(grpc_workers=8)
    assert (small.publish_streams_cap, small.publish_streams_per_caller) == (7, 7)
    cases: list[tuple[dict[str, int], str]] = [
        ({"grpc_workers": 8, "max_publish_streams": 8}, "max_publish_streams=8 >= grpc_workers=8"),
        ({"grpc_workers": 8, "publish_streams_per_identity": 9}, "per_identity=9 > max_publish_streams=7"),
        (
            {"max_publish_streams": 10, "publish_streams_per_identity": 11},
            "per_identity=11 > max_publish_streams=10",
        ),
    ]
    for flags, text in cases:
        with pytest.raises(ValueError, match="expected") as err:
            ControllerConfig(**flags)  # type: ignore[arg-type]
        assert text in str(err.value)
