"""Helpers of the controller tests (fixtures are in conftest.py): random keys, a fake agent, polling."""

from __future__ import annotations

import os
import secrets


def rand_keys(n: int) -> list[bytes]:
    return [secrets.token_bytes(16) for _ in range(n)]


def unique_prefix() -> str:
    return f"kvgtest:{os.getpid()}:{secrets.token_hex(4)}:"


# --- a test-side agent: a real AgentService (Snapshot only) on loopback + a publishing client -----

import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from concurrent import futures  # noqa: E402

import grpc  # noqa: E402

from kvgrid.api.v1 import agent_pb2, agent_pb2_grpc, common_pb2, controller_pb2, controller_pb2_grpc  # noqa: E402

NS_ID = "0123456789abcdef0123456789abcdef"


def register_pod(stub: controller_pb2_grpc.ControllerServiceStub, uid: str, namespaces: list[str]) -> str:
    """Register pod ``uid`` (epoch 1, name ``name-<uid>``) serving ``namespaces``; returns its holder id."""
    pod = common_pb2.PodIdentity(pod_uid=uid, pod_name=f"name-{uid}", node_name="n", epoch=1)
    stub.RegisterAgent(controller_pb2.RegisterAgentRequest(pod=pod, namespaces=namespaces))
    return f"{uid}/1"


class _Snap(agent_pb2_grpc.AgentServiceServicer):
    def __init__(self, agent: FakeAgent) -> None:
        self.agent = agent

    def Snapshot(
        self, request: agent_pb2.SnapshotRequest, context: grpc.ServicerContext
    ) -> agent_pb2.SnapshotResponse:
        a = self.agent
        if a.before_snapshot is not None:
            a.before_snapshot()
        with a.lock:
            a.snapshots += 1
            resp = agent_pb2.SnapshotResponse(
                pod=a.pod, chunk_keys=sorted(a.keys), last_sequence=a.seq, namespaces=[a.namespace_id]
            )
        if a.after_snapshot is not None:
            a.after_snapshot()
        return resp


class FakeAgent:
    """The agent's side of the protocol, with the L1 truth as a set of keys.

    ``admit``/``evict`` change the truth and log an event with the next sequence number. With
    ``auto=True`` a thread keeps a PublishEvents stream open (re-registering and reopening it after
    any error, as a real agent does) and another heartbeats. As the real agent's publisher does,
    every new stream resends the logged events after the last acknowledged one (the controller skips
    those it applied), and a stream's request iterator ends with its stream: an ended stream's
    iterator must not take an event (gRPC drops a request taken for a call that is over).
    """

    def __init__(
        self,
        controller: str,
        pod_uid: str,
        *,
        epoch: int = 1,
        namespace_id: str = NS_ID,
        auto: bool = True,
        heartbeat_s: float = 0.1,
    ) -> None:
        self.lock = threading.Lock()
        self.keys: set[bytes] = set()
        self.seq = 0
        self.snapshots = 0
        self.before_snapshot: Callable[[], None] | None = None
        self.after_snapshot: Callable[[], None] | None = None
        self.namespace_id = namespace_id
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        agent_pb2_grpc.add_AgentServiceServicer_to_server(_Snap(self), self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.pod = common_pb2.PodIdentity(
            pod_uid=pod_uid,
            pod_name=f"name-{pod_uid}",
            node_name="node-a",
            epoch=epoch,
            agent_address=f"127.0.0.1:{port}",
        )
        self.controller = controller
        self.channel = grpc.insecure_channel(controller)
        self.stub = controller_pb2_grpc.ControllerServiceStub(self.channel)
        self._log: list[controller_pb2.ChunkEvent] = []
        self._logged = threading.Condition(self.lock)
        self._stop = threading.Event()
        self.heartbeating = threading.Event()
        self.heartbeating.set()
        self.acked = 0
        self._heartbeat_s = heartbeat_s
        self._threads: list[threading.Thread] = []
        if auto:
            for fn in (self._stream_loop, self._heartbeat_loop):
                t = threading.Thread(target=fn, daemon=True)
                t.start()
                self._threads.append(t)

    def register(self) -> controller_pb2.RegisterAgentResponse:
        return self.stub.RegisterAgent(
            controller_pb2.RegisterAgentRequest(pod=self.pod, namespaces=[self.namespace_id]), timeout=2
        )

    def _event(self, kind: int, keys: list[bytes]) -> controller_pb2.ChunkEvent:
        self.seq += 1
        return controller_pb2.ChunkEvent(
            sequence=self.seq,
            kind=kind,
            tier=common_pb2.TIER_L1,
            chunk_keys=keys,
            namespace=self.namespace_id,
        )

    def admit(self, keys: list[bytes]) -> controller_pb2.ChunkEvent:
        with self.lock:
            self.keys |= set(keys)
            ev = self._event(controller_pb2.EVENT_KIND_ADMIT, keys)
            self._log.append(ev)
            self._logged.notify_all()
            return ev

    def evict(self, keys: list[bytes]) -> controller_pb2.ChunkEvent:
        with self.lock:
            self.keys -= set(keys)
            ev = self._event(controller_pb2.EVENT_KIND_EVICT, keys)
            self._log.append(ev)
            self._logged.notify_all()
            return ev

    def truth(self) -> set[bytes]:
        with self.lock:
            return set(self.keys)

    def _requests(self, ended: threading.Event) -> Iterator[controller_pb2.PublishEventsRequest]:
        """One stream's requests: the pod, then every logged event after the last ack (in order),
        until the stream ended or the agent closes."""
        yield controller_pb2.PublishEventsRequest(pod=self.pod)
        sent = self.acked
        while True:
            with self.lock:
                while not (ended.is_set() or self._stop.is_set()) and not (
                    self._log and self._log[-1].sequence > sent
                ):
                    self._logged.wait(0.05)
                if ended.is_set() or self._stop.is_set():
                    return
                batch = [e for e in self._log if e.sequence > sent]
            for ev in batch:
                yield controller_pb2.PublishEventsRequest(events=[ev])
                sent = ev.sequence

    def _stream_loop(self) -> None:
        while not self._stop.is_set():
            ended = threading.Event()
            try:
                self.register()
                for resp in self.stub.PublishEvents(self._requests(ended)):
                    self.acked = resp.acked_sequence
            except grpc.RpcError:
                pass
            finally:
                ended.set()
            self._stop.wait(0.1)

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self._heartbeat_s):
            if not self.heartbeating.is_set():
                continue
            try:
                r = self.stub.Heartbeat(
                    controller_pb2.HeartbeatRequest(pod_uid=self.pod.pod_uid, epoch=self.pod.epoch), timeout=1
                )
                if r.reregister:
                    self.register()
            except grpc.RpcError:
                pass

    def close(self) -> None:
        self._stop.set()
        with self.lock:
            self._logged.notify_all()
        for t in self._threads:
            t.join(timeout=2)
        self.channel.close()
        self.server.stop(0)


def wait_until(cond: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> float:
    """Poll ``cond`` until true; returns the seconds it took (AssertionError on timeout)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if cond():
            return time.monotonic() - start
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def index_keys(stub: controller_pb2_grpc.ControllerServiceStub, pod_uid: str) -> set[bytes] | None:
    try:
        return set(
            stub.SnapshotIndex(controller_pb2.SnapshotIndexRequest(pod_uid=pod_uid), timeout=1).chunk_keys
        )
    except grpc.RpcError:
        return None
