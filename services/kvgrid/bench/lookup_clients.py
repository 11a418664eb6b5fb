"""Load generators of ``kvgrid bench lookup``, each run in its own process (so the server's CPU is
measured apart from the client's): single-query callers over gRPC, the lean lookup listener (in
plaintext or mTLS) and HTTP/JSON (Dynamo's indexer service), and agents streaming events through
``PublishEvents``.

Every caller sends pre-serialized request bytes cycling through a list and keeps ``concurrency``
calls in flight (one thread and one connection each); it reports calls, wall time, its own CPU
and every call's latency. Invariant: a client never checks answers (the bench checks them once,
outside the timed loop), so the loop costs the same for every system.
"""

from __future__ import annotations

import functools
import http.client
import json
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc

from kvgrid.api.v1 import agent_pb2, common_pb2, controller_pb2, controller_pb2_grpc
from kvgrid.common.tls import TlsFiles
from kvgrid.controller.lookup_server import ClientSsl, LookupClient

__all__ = [
    "cpu_seconds",
    "drive",
    "grpc_caller",
    "http_caller",
    "ingest",
    "ingest_messages",
    "json_body",
    "lean_caller",
    "lean_client",
    "vllm_controller",
]

Call = Callable[[bytes], object]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (from /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _loop(
    make_call: Callable[[], Call], payloads: list[bytes], seconds: float, concurrency: int, q: Any
) -> None:
    calls = [make_call() for _ in range(concurrency)]
    for c in calls:
        for p in payloads[:20]:  # warm up each connection
            c(p)
    lat: list[float] = []
    lock = threading.Lock()
    stop = time.perf_counter() + seconds

    def worker(k: int) -> None:
        call, mine, i = calls[k], [], k
        while time.perf_counter() < stop:
            t = time.perf_counter()
            call(payloads[i % len(payloads)])
            mine.append(time.perf_counter() - t)
            i += concurrency
        with lock:
            lat.extend(mine)

    cpu0 = time.process_time()
    t0 = time.perf_counter()
    with futures.ThreadPoolExecutor(concurrency) as ex:
        list(ex.map(worker, range(concurrency)))
    q.put({"calls": len(lat), "seconds": time.perf_counter() - t0, "cpu": time.process_time() - cpu0,
           "lat": sorted(lat), "warmup": 20 * concurrency})  # fmt: skip


def grpc_caller(
    addr: str, method: str, payloads: list[bytes], seconds: float, concurrency: int, q: Any
) -> None:
    """Unary calls of ``method`` (bytes in, bytes out: no client-side protobuf work)."""

    def make() -> Call:
        ch = grpc.insecure_channel(addr, options=[("grpc.use_local_subchannel_pool", 1)])
        call: grpc.UnaryUnaryMultiCallable[bytes, bytes] = ch.unary_unary(method)
        return call

    _loop(make, payloads, seconds, concurrency, q)


def lean_client(addr: str, tls_dir: str | None = None) -> LookupClient:
    """One connection to the lean lookup listener at ``addr``: plaintext, or with ``tls_dir`` (a
    directory holding ``tls.crt``, ``tls.key`` and ``ca.crt``, a router's files) mTLS, verifying
    the listener's certificate as a router does."""
    if tls_dir is None:
        return LookupClient(addr)
    files = TlsFiles(f"{tls_dir}/tls.crt", f"{tls_dir}/tls.key", f"{tls_dir}/ca.crt")
    return LookupClient(addr, ssl_context=ClientSsl(files).context())


def lean_caller(
    addr: str,
    method: int,
    payloads: list[bytes],
    seconds: float,
    concurrency: int,
    q: Any,
    *,
    tls_dir: str | None = None,
) -> None:
    """Calls of the lean lookup listener (:mod:`kvgrid.controller.lookup_server`); with ``tls_dir``
    over mTLS (see :func:`lean_client`; each connection's handshake is part of the warm-up)."""

    def make() -> Call:
        c = lean_client(addr, tls_dir)
        return lambda body: c.call_raw(method, body)

    _loop(make, payloads, seconds, concurrency, q)


def http_caller(
    addr: str, path: str, payloads: list[bytes], seconds: float, concurrency: int, q: Any
) -> None:
    """HTTP/1.1 keep-alive POSTs of JSON bodies (Dynamo's indexer service, LMCache's controller)."""
    host, _, port = addr.rpartition(":")
    headers = {"Content-Type": "application/json"}

    def make() -> Call:
        conn = http.client.HTTPConnection(host, int(port))

        def call(body: bytes) -> bytes:
            conn.request("POST", path, body, headers)
            r = conn.getresponse()
            out = r.read()
            if r.status != 200:
                raise RuntimeError(f"POST {path}: HTTP {r.status}: {out[:200]!r}")
            return out

        return call

    _loop(make, payloads, seconds, concurrency, q)


def drive(target: Callable[..., None], args: tuple, server_pid: int) -> dict[str, float]:
    """Run the caller ``target(*args, q)`` in a new process; throughput, latency and both CPUs."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(*args, q))
    cpu0 = cpu_seconds(server_pid)
    p.start()
    r = q.get(timeout=600)
    server_cpu = cpu_seconds(server_pid) - cpu0
    p.join(30)
    lat = r["lat"]
    return {
        "calls_s": r["calls"] / r["seconds"],
        "p50_ms": 1000 * lat[len(lat) // 2],
        "p99_ms": 1000 * lat[min(len(lat) - 1, int(len(lat) * 0.99))],
        "server_cpu_us": 1e6 * server_cpu / (r["calls"] + r["warmup"]),  # per call, warm-up counted in
        "client_cpu_us": 1e6 * r["cpu"] / max(1, r["calls"]),
    }


# --- agents: PublishEvents streams ---------------------------------------------------------------


def _snapshots(pod: common_pb2.PodIdentity, ns_id: str) -> grpc.GenericRpcHandler:
    """One pod's ``AgentService.Snapshot`` for the controller's pull: nothing held before the
    stream (the stream's events build the index)."""
    resp = agent_pb2.SnapshotResponse(pod=pod, last_sequence=0, namespaces=[ns_id])
    return grpc.method_handlers_generic_handler(
        "kvgrid.v1.AgentService",
        {
            "Snapshot": grpc.unary_unary_rpc_method_handler(
                lambda req, ctx: resp,
                request_deserializer=agent_pb2.SnapshotRequest.FromString,
                response_serializer=agent_pb2.SnapshotResponse.SerializeToString,
            )
        },
    )


def _stream_pod(ch: grpc.Channel, hello: bytes, msgs: list[bytes], start: threading.Barrier) -> float:
    """One agent's stream: ``hello`` (the pod identity, no events) opens it; once the controller's
    snapshot pull of the new stream is done (an ack without ``resync``), every stream of the wave
    passes ``start`` together and sends ``msgs`` (serialized PublishEventsRequest). The stream stays
    open until the last event is acknowledged (empty messages ask for the current ack, as an idle
    agent's would); returns the time of that ack (perf_counter)."""
    last = controller_pb2.PublishEventsRequest.FromString(msgs[-1]).events[-1].sequence
    synced, done = threading.Event(), threading.Event()
    poll = controller_pb2.PublishEventsRequest().SerializeToString()

    def requests() -> Iterator[bytes]:
        yield hello
        while not synced.wait(0.01):
            yield poll
        start.wait()
        yield from msgs
        while not done.wait(0.01):
            yield poll

    end = 0.0
    for ack in _raw_stream(ch, requests()):
        if not ack.resync_started:  # the snapshot pull of the new stream is done
            synced.set()
        if ack.acked_sequence >= last and not done.is_set():
            end = time.perf_counter()
            done.set()
    if not done.is_set():
        raise RuntimeError(f"PublishEvents ended before sequence {last} was acknowledged")
    return end


def _raw_stream(
    ch: grpc.Channel, requests: Iterator[bytes]
) -> Iterator[controller_pb2.PublishEventsResponse]:
    """PublishEvents with pre-serialized requests (the agent side costs no protobuf work)."""
    method: grpc.StreamStreamMultiCallable[bytes, controller_pb2.PublishEventsResponse] = ch.stream_stream(
        "/kvgrid.v1.ControllerService/PublishEvents",
        response_deserializer=controller_pb2.PublishEventsResponse.FromString,
    )
    return method(requests)


def _stamp(box: list[float]) -> None:
    box[0] = time.perf_counter()


def ingest(addr: str, per_pod: list[list[bytes]], ns_id: str, streams: int, q: Any) -> None:
    """Agents of every pod: register, open a stream and wait out the controller's snapshot pull,
    then stream their messages (``per_pod[i]``: serialized PublishEventsRequest), ``streams`` pods
    at a time. The clock of a wave runs from the moment all its streams start sending events to
    the last acknowledgement (steady-state ingest, as after an agent's start); reports the summed
    seconds of the waves."""
    ch = grpc.insecure_channel(addr)
    stub = controller_pb2_grpc.ControllerServiceStub(ch)
    busy = 0.0
    cpu = 0.0
    for lo in range(0, len(per_pod), streams):
        wave = range(lo, min(len(per_pod), lo + streams))
        servers = []
        pods = []
        for i in wave:
            server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
            pod = controller_pb2.PublishEventsRequest.FromString(per_pod[i][0]).pod
            port = server.add_insecure_port("127.0.0.1:0")
            pod.agent_address = f"127.0.0.1:{port}"
            server.add_generic_rpc_handlers((_snapshots(pod, ns_id),))
            server.start()
            servers.append(server)
            pods.append(pod)
            stub.RegisterAgent(controller_pb2.RegisterAgentRequest(pod=pod, namespaces=[ns_id]), timeout=10)
        t0 = [0.0]
        start = threading.Barrier(len(wave), action=functools.partial(_stamp, t0))
        hellos = [controller_pb2.PublishEventsRequest(pod=p).SerializeToString() for p in pods]
        c0 = time.process_time()
        with futures.ThreadPoolExecutor(len(wave)) as ex:
            n = len(wave)
            ends = list(ex.map(_stream_pod, [ch] * n, hellos, [per_pod[i] for i in wave], [start] * n))
        busy += max(ends) - t0[0]
        cpu += time.process_time() - c0
        for s in servers:
            s.stop(0)
    ch.close()
    q.put({"seconds": busy, "client_cpu": cpu})


def ingest_messages(
    pod_uid: str, events: list[tuple[str, list[bytes]]], ns_id: str, per_message: int
) -> list[bytes]:
    """One pod's admit events as serialized PublishEventsRequest messages (``per_message`` events
    each, sequence numbers from 1; the first message names the pod)."""
    pod = common_pb2.PodIdentity(pod_uid=pod_uid, pod_name=pod_uid, node_name="bench", epoch=1)
    tiers = {"l1": common_pb2.TIER_L1, "gpu": common_pb2.TIER_GPU}
    out = []
    for lo in range(0, len(events), per_message):
        msg = controller_pb2.PublishEventsRequest(pod=pod if lo == 0 else None)
        for seq, (tier, keys) in enumerate(events[lo : lo + per_message], start=lo + 1):
            msg.events.add(
                sequence=seq, kind=controller_pb2.EVENT_KIND_ADMIT, tier=tiers[tier], chunk_keys=keys,
                namespace=ns_id,
            )  # fmt: skip
        out.append(msg.SerializeToString())
    return out


# --- vLLM engines: KV events over ZMQ ------------------------------------------------------------


def vllm_controller(
    pods: list[str], endpoints: list[str], tokens_per_chunk: int, ns_id: str, conn: Any
) -> None:
    """A controller (no gRPC) subscribed to one vLLM KV-event publisher per pod, configured as
    ``vllm_sources`` configures it (pod UID, ZMQ endpoint, key namespace), its pods registered;
    driven over the pipe ``conn``: it sends ``("ready", pid)``, then answers ``("counts",)`` with
    the events each subscriber applied so far, ``("wait", entries, events, timeout_s)`` with
    ``(perf_counter when the index held ``entries`` entries, or None when it did not within
    ``timeout_s``, or 10 s after ``events`` events were applied, index entries, stored runs with an
    unknown parent, undecodable batches)``, and stops on ``("quit",)``. (Entries, not events, tell
    the end: a probe still in flight when the run starts is one more event, never an entry.)"""
    from kvgrid.common.hashing import KeyNamespace
    from kvgrid.common.identity import PodIdentity
    from kvgrid.controller.config import ControllerConfig, VllmEventSource
    from kvgrid.controller.core import Controller

    ns = KeyNamespace(model="bench", tokens_per_chunk=tokens_per_chunk)
    sources = [
        VllmEventSource(pod_uid=u, endpoint=e, namespace=ns) for u, e in zip(pods, endpoints, strict=True)
    ]
    ctl = Controller(ControllerConfig(listen="127.0.0.1:0", lease_ttl_ms=3_600_000, vllm_sources=sources))
    ctl.start()
    for u in pods:
        ctl.register(PodIdentity(pod_uid=u, pod_name=u, node_name="bench", epoch=1), [ns_id], 0)
    conn.send(("ready", os.getpid()))
    try:
        while True:
            cmd = conn.recv()
            if cmd[0] == "counts":
                conn.send([s.events for s in ctl.vllm])
            elif cmd[0] == "wait":
                _, total, events, timeout_s = cmd
                end = time.monotonic() + timeout_s
                done: float | None = None
                while time.monotonic() < end:
                    # the index's count takes its lock: read only once the events say it may be done
                    if sum(s.events for s in ctl.vllm) >= events:
                        if ctl.index.num_entries() >= total:
                            done = time.perf_counter()
                            break
                        end = min(end, time.monotonic() + 10.0)  # the rest comes soon, or never
                    time.sleep(0.002)
                unknown = sum(s.mapper.unknown_parents for s in ctl.vllm)
                conn.send((done, ctl.index.num_entries(), unknown, sum(s.errors for s in ctl.vllm)))
            else:
                return
    finally:
        ctl.stop()


def json_body(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()
