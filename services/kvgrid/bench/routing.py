"""``kvgrid bench routing``: how good the controller's ``Score`` is as a router, on a real trace.

The Mooncake conversation trace (12,031 requests of one production hour, 512-token prefix blocks)
is replayed, arrival times kept, into a :class:`~kvgrid.bench.routing_sim.Cluster` of
simulated pods. Every policy sees the same cluster model and the same costs; only the choice of
pod differs:

- ``round_robin``: pods in turn;
- ``least_loaded``: fewest running + waiting requests (ties: in turn, so idle pods share new work);
- ``prefix``: longest prefix the pod holds itself (GPU or its L1), asked of the real controller
  with ``MatchPrefix`` (ties: least loaded, then in turn) — the "prefix-aware" routing of other
  routers;
- ``score``: the real controller's ``Score`` (lowest estimated time to first token, top 1).

For ``prefix`` and ``score`` a real ``kvgrid controller`` process runs here (gRPC on loopback). Each
simulated pod is an agent to it: it registers, serves the controller's snapshot pull
(``AgentService.Snapshot``), publishes every GPU and L1 cache change through its own
``PublishEvents`` stream (waiting for the ack before the next routing decision, so the index is
exact, as it would be with no lag) and reports its load (requests, GPU and L1 use) by ``Heartbeat``
before each decision. The controller's cost model is configured with the simulated hardware (the
bytes, bandwidths and prefill rate a deployment would measure); its queue term charges
``queue_ms_per_waiting`` = the trace's mean prompt prefill time per waiting request. No speculative
reservations (the acked events make them unnecessary here).

The reference in the same run is ``least_loaded``'s load spread and every alternative's TTFT; the
goal: Score's mean and p90 TTFT below every alternative's, its load spread within 10 % of
least-loaded's.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Annotated, Literal

import grpc
import msgspec

from kvgrid.api.v1 import agent_pb2, common_pb2, controller_pb2, controller_pb2_grpc
from kvgrid.bench.routing_sim import (
    CacheEvent,
    Cluster,
    Hardware,
    PodLoad,
    TraceRequest,
    load_trace,
    summarize,
)
from kvgrid.common.config import add_config_arguments, config_from_args
from kvgrid.common.hashing import CHUNK_KEY_BYTES, KeyNamespace
from kvgrid.common.procs import free_port, wait_serving

__all__ = ["POLICIES", "RoutingBenchConfig", "add_arguments", "replay", "run"]

ENV_PREFIX = "KVGRID_BENCH_ROUTING_"
DEFAULT_TRACE = "../shared/data/traces/mooncake_conversation_trace.jsonl"
Policy = Literal["round_robin", "least_loaded", "prefix", "score"]
POLICIES: tuple[Policy, ...] = ("round_robin", "least_loaded", "prefix", "score")
_USES_CONTROLLER = {"prefix", "score"}
_KINDS = {"admit": controller_pb2.EVENT_KIND_ADMIT, "evict": controller_pb2.EVENT_KIND_EVICT}


class RoutingBenchConfig(msgspec.Struct, frozen=True, kw_only=True):
    """``kvgrid bench routing``'s options: defaults < ``--config`` YAML < ``KVGRID_BENCH_ROUTING_*``
    env < flags. Hardware defaults: a Llama-3-8B engine per H200 (``routing_sim.Hardware``)."""

    trace: Annotated[str, msgspec.Meta(description="request trace (Mooncake JSON lines)")] = DEFAULT_TRACE
    requests: Annotated[int, msgspec.Meta(ge=0, description="replay the first N requests (0 = all)")] = 0
    pods: Annotated[int, msgspec.Meta(ge=1, le=256, description="simulated vLLM pods")] = 8
    policies: Annotated[list[Policy], msgspec.Meta(description="routing policies to compare")] = (
        msgspec.field(default_factory=lambda: list(POLICIES))
    )
    rate_scale: Annotated[
        float, msgspec.Meta(gt=0, description="arrival rate multiplier (2 = the trace twice as fast)")
    ] = 1.0
    prefill_tokens_per_s: Annotated[float, msgspec.Meta(gt=0, description="prefill rate of one pod")] = (
        10_000.0
    )
    gpu_blocks: Annotated[int, msgspec.Meta(ge=1, description="GPU prefix-cache blocks per pod")] = 1_500
    l1_blocks: Annotated[int, msgspec.Meta(ge=1, description="agent L1 blocks per pod")] = 4_096
    peer_gbps: Annotated[float, msgspec.Meta(gt=0, description="peer fetch GB/s")] = 0.9
    l1_gbps: Annotated[float, msgspec.Meta(gt=0, description="L1 -> GPU GB/s")] = 45.0
    decode_ms_per_token: Annotated[float, msgspec.Meta(ge=0, description="decode time per output token")] = (
        15.0
    )
    json: Annotated[bool, msgspec.Meta(description="print one JSON object instead of a table")] = False


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, RoutingBenchConfig, env_prefix=ENV_PREFIX)


def _hardware(cfg: RoutingBenchConfig) -> Hardware:
    return Hardware(
        prefill_tokens_per_s=cfg.prefill_tokens_per_s,
        gpu_blocks=cfg.gpu_blocks,
        l1_blocks=cfg.l1_blocks,
        peer_gbps=cfg.peer_gbps,
        l1_gbps=cfg.l1_gbps,
        decode_ms_per_token=cfg.decode_ms_per_token,
    )


@functools.lru_cache(maxsize=1 << 18)
def _key(block: int) -> bytes:
    """The chunk key of a trace block: a BLAKE2b digest of its id, as uniform as the real keys (a
    hash chain over token ids). The raw id (mostly zero bytes) made every key land in a few rows of
    the index's hash table, and probing those cost ~1 ms per key."""
    return hashlib.blake2b(block.to_bytes(8, "little"), digest_size=CHUNK_KEY_BYTES).digest()


# --- simulated pods as agents of a real controller ---------------------------------------------


class _PodLink:
    """One simulated pod's agent side: registration, snapshot, acked event stream, heartbeats."""

    def __init__(self, stub: controller_pb2_grpc.ControllerServiceStub, index: int, ns_id: str) -> None:
        self.stub, self.ns_id = stub, ns_id
        self.lock = threading.Lock()
        self.l1: set[bytes] = set()
        self.seq = 0
        self.snapshotted = threading.Event()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
        # Only the method the controller calls on an agent here: its snapshot pull.
        snapshot = grpc.unary_unary_rpc_method_handler(
            lambda request, context: self.snapshot(),
            request_deserializer=agent_pb2.SnapshotRequest.FromString,
            response_serializer=agent_pb2.SnapshotResponse.SerializeToString,
        )
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("kvgrid.v1.AgentService", {"Snapshot": snapshot}),)
        )
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.pod = common_pb2.PodIdentity(
            pod_uid=f"sim-pod-{index}",
            pod_name=f"sim-pod-{index}",
            node_name="sim",
            epoch=1,
            agent_address=f"127.0.0.1:{port}",
        )
        self._out: queue.Queue[controller_pb2.PublishEventsRequest | None] = queue.Queue()
        stub.RegisterAgent(controller_pb2.RegisterAgentRequest(pod=self.pod, namespaces=[ns_id]), timeout=5)
        self._acks = stub.PublishEvents(self._requests())
        self._out.put(controller_pb2.PublishEventsRequest(pod=self.pod))
        self.wait_ack()
        self._last_load: PodLoad | None = None

    def snapshot(self) -> agent_pb2.SnapshotResponse:
        with self.lock:
            resp = agent_pb2.SnapshotResponse(
                pod=self.pod, chunk_keys=sorted(self.l1), last_sequence=self.seq, namespaces=[self.ns_id]
            )
        self.snapshotted.set()
        return resp

    def _requests(self) -> Iterator[controller_pb2.PublishEventsRequest]:
        while (msg := self._out.get()) is not None:
            yield msg

    def send(self, events: list[CacheEvent]) -> None:
        """Queue one message with ``events`` (this pod's, in order); :meth:`wait_ack` waits for it."""
        msgs = []
        with self.lock:
            for ev in events:
                keys = [_key(b) for b in ev.blocks]
                self.seq += 1
                if ev.tier == "l1":
                    (self.l1.update if ev.kind == "admit" else self.l1.difference_update)(keys)
                msgs.append(
                    controller_pb2.ChunkEvent(
                        sequence=self.seq,
                        kind=_KINDS[ev.kind],
                        tier=common_pb2.TIER_GPU if ev.tier == "gpu" else common_pb2.TIER_L1,
                        chunk_keys=keys,
                        namespace=self.ns_id,
                    )
                )
        self._out.put(controller_pb2.PublishEventsRequest(events=msgs))

    def wait_ack(self) -> None:
        """One ack per message: the controller has applied it to the index."""
        next(self._acks)

    def heartbeat(self, load: PodLoad, hw: Hardware) -> None:
        if self._last_load == load:
            return
        block_bytes = hw.block_tokens * hw.bytes_per_token
        report = controller_pb2.AgentLoad(
            running_requests=load.running,
            waiting_requests=load.waiting,
            gpu_kv_usage=load.gpu_used / hw.gpu_blocks,
            l1_used_bytes=load.l1_used * block_bytes,
            l1_capacity_bytes=hw.l1_blocks * block_bytes,
        )
        r = self.stub.Heartbeat(
            controller_pb2.HeartbeatRequest(pod_uid=self.pod.pod_uid, epoch=1, load=report), timeout=5
        )
        if r.reregister:
            raise RuntimeError(f"{self.pod.pod_uid}: the controller dropped the lease during the replay")
        self._last_load = load

    def close(self) -> None:
        self._out.put(None)
        self.server.stop(0)


class _Controller:
    """A real ``kvgrid controller`` process on loopback (its own GIL, as in a deployment), its cost
    model set to the simulated hardware, with one :class:`_PodLink` per simulated pod."""

    def __init__(self, hw: Hardware, pods: int, mean_prompt_tokens: float) -> None:
        address = f"127.0.0.1:{free_port()}"
        flags = {
            "listen": address,
            "lease-ttl-ms": 600_000,  # the replay heartbeats on load changes only
            "bytes-per-token": hw.bytes_per_token,
            "l1-gbps": hw.l1_gbps,
            "peer-gbps": hw.peer_gbps,
            "peer-latency-ms": hw.peer_latency_ms,
            "prefill-tokens-per-s": hw.prefill_tokens_per_s,
            "queue-ms-per-running": 0.0,  # decode does not slow prefill in the model
            "queue-ms-per-waiting": mean_prompt_tokens / hw.prefill_tokens_per_s * 1e3,
        }
        argv = [sys.executable, "-m", "kvgrid.cli", "controller"]
        for name, value in flags.items():
            argv += [f"--{name}", str(value)]
        env = {**os.environ, "OTEL_SDK_DISABLED": "true"}
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
        try:
            wait_serving(address, self.proc, "kvgrid controller")
        except RuntimeError as e:
            err = self.proc.stderr.read().decode(errors="replace")[-2000:] if self.proc.stderr else ""
            raise RuntimeError(f"{e}: {err}") from None
        self.channel = grpc.insecure_channel(address)
        self.stub = controller_pb2_grpc.ControllerServiceStub(self.channel)
        self.ns = common_pb2.KeyNamespace(model="mooncake-trace", tokens_per_chunk=hw.block_tokens)
        self.ns_id = KeyNamespace(model="mooncake-trace", tokens_per_chunk=hw.block_tokens).namespace_id()
        self.links = [_PodLink(self.stub, i, self.ns_id) for i in range(pods)]
        deadline = time.monotonic() + 10
        for link in self.links:  # the first snapshot pull settles the registration
            if not link.snapshotted.wait(max(0.0, deadline - time.monotonic())):
                raise RuntimeError(f"{link.pod.pod_uid}: the controller never pulled its snapshot")
        self.uid_index = {link.pod.pod_uid: i for i, link in enumerate(self.links)}

    def publish(self, events: list[CacheEvent]) -> None:
        """One message per pod with changes, sent to every pod's stream before waiting for any ack
        (the acks come back in parallel)."""
        by_pod: dict[int, list[CacheEvent]] = {}
        for ev in events:
            by_pod.setdefault(ev.pod, []).append(ev)
        for pod, evs in by_pod.items():
            self.links[pod].send(evs)
        for pod in by_pod:
            self.links[pod].wait_ack()

    def _match(self, blocks: tuple[int, ...]) -> controller_pb2.MatchPrefixRequest:
        return controller_pb2.MatchPrefixRequest(
            chunk_keys=common_pb2.ChunkKeys(keys=[_key(b) for b in blocks]), namespace=self.ns
        )

    def prefix_lengths(self, blocks: tuple[int, ...]) -> dict[int, int]:
        r = self.stub.MatchPrefix(self._match(blocks), timeout=5)
        return {self.uid_index[m.pod_uid]: m.gpu_chunks + m.l1_chunks for m in r.matches}

    def best_score(self, blocks: tuple[int, ...]) -> int:
        r = self.stub.Score(controller_pb2.ScoreRequest(match=self._match(blocks), top_k=1), timeout=5)
        return self.uid_index[r.scores[0].match.pod_uid]

    def close(self) -> None:
        for link in self.links:
            link.close()
        self.channel.close()
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stderr is not None:
            self.proc.stderr.close()


# --- the replay ---------------------------------------------------------------------------------


def replay(
    policy: Policy,
    trace: list[TraceRequest],
    pods: int,
    hw: Hardware,
    progress: Callable[[int], None] | None = None,
) -> dict[str, float]:
    """Route every request of ``trace`` with ``policy``; returns :func:`routing_sim.summarize`'s
    figures plus ``route_us`` (mean wall time of one routing decision, controller calls included)
    and ``event_keys_per_pod_s`` (chunk keys of every cache event, per pod and trace second)."""
    cluster = Cluster(pods, hw)
    ctl = (
        _Controller(hw, pods, statistics.fmean(r.input_tokens for r in trace) if trace else 0.0)
        if policy in _USES_CONTROLLER
        else None
    )
    route_s = 0.0
    event_keys = 0
    try:
        for rid, req in enumerate(trace):
            events = cluster.advance(req.arrival_ms)
            event_keys += sum(len(ev.blocks) for ev in events)
            loads = cluster.loads()

            def busy(i: int, loads: list[PodLoad] = loads) -> int:
                return loads[i].running + loads[i].waiting

            t0 = time.perf_counter()
            if ctl is not None:
                ctl.publish(events)
                for link, load in zip(ctl.links, loads, strict=True):
                    link.heartbeat(load, hw)
            if policy == "round_robin":
                pod = rid % pods
            elif policy == "least_loaded":
                pod = min(range(pods), key=lambda i: (busy(i), (i - rid) % pods))
            elif policy == "prefix":
                assert ctl is not None
                have = ctl.prefix_lengths(req.blocks)
                pod = min(range(pods), key=lambda i: (-have.get(i, 0), busy(i), (i - rid) % pods))
            else:
                assert ctl is not None
                pod = ctl.best_score(req.blocks)
            route_s += time.perf_counter() - t0
            cluster.submit(rid, pod, req)
            if progress is not None and rid and rid % 1000 == 0:
                progress(rid)
        event_keys += sum(len(ev.blocks) for ev in cluster.drain())
    finally:
        if ctl is not None:
            ctl.close()
    out = summarize(cluster.served, pods, hw)
    out["route_us"] = route_s / max(1, len(trace)) * 1e6
    # what the index must ingest: GPU and L1 admits and evictions, per pod and second of the trace
    span_s = (trace[-1].arrival_ms - trace[0].arrival_ms) / 1e3 if len(trace) > 1 else 0.0
    out["event_keys_per_pod_s"] = event_keys / pods / span_s if span_s else 0.0
    return out


def _scaled(trace: list[TraceRequest], rate_scale: float) -> list[TraceRequest]:
    if rate_scale == 1.0:
        return trace
    return [msgspec.structs.replace(r, arrival_ms=r.arrival_ms / rate_scale) for r in trace]


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(RoutingBenchConfig, args, env_prefix=ENV_PREFIX)
    path = Path(cfg.trace)
    if not path.is_file():
        print(
            f"--trace {cfg.trace}: no such file (expected the Mooncake conversation trace, JSON lines; "
            f"from a kvgrid checkout it is at {DEFAULT_TRACE})",
            file=sys.stderr,
        )
        return 2
    hw = _hardware(cfg)
    trace = _scaled(load_trace(path, cfg.requests), cfg.rate_scale)
    span_s = (trace[-1].arrival_ms - trace[0].arrival_ms) / 1e3 if trace else 0.0
    demand = sum(r.input_tokens for r in trace) / max(span_s, 1e-9)
    header = (
        f"{len(trace)} requests over {span_s:.0f} s, {cfg.pods} pods at {hw.prefill_tokens_per_s:.0f} "
        f"prefill tokens/s: offered load {demand / (cfg.pods * hw.prefill_tokens_per_s):.2f} of the "
        f"cluster's prefill capacity before any cache hit"
    )
    print(header, file=sys.stderr if cfg.json else sys.stdout)
    results: dict[str, dict[str, float]] = {}
    for policy in cfg.policies:
        t0 = time.monotonic()
        progress = (
            None
            if cfg.json
            else (
                lambda n, p=policy, t0=t0: print(
                    f"  {p}: {n}/{len(trace)} requests, {time.monotonic() - t0:.0f} s", flush=True
                )
            )
        )
        results[policy] = replay(policy, trace, cfg.pods, hw, progress)
        results[policy]["wall_s"] = time.monotonic() - t0
    ref = results.get("least_loaded")
    if cfg.json:
        print(
            json.dumps({"config": msgspec.to_builtins(cfg), "pods": cfg.pods, "results": results}, indent=2)
        )
        return 0
    print(
        f"{'policy':<13} {'hit':>5} {'gpu':>5} {'l1':>5} {'peer':>5}  {'TTFT mean':>9} {'p50':>7} {'p90':>7} "
        f"{'p99':>7} ms  {'spread':>6}  {'route':>7}  {'wall':>6}"
    )
    for name, r in results.items():
        print(
            f"{name:<13} {r['hit']:5.3f} {r['gpu_hit']:5.3f} {r['l1_hit']:5.3f} {r['peer_hit']:5.3f}  "
            f"{r['ttft_mean_ms']:9.0f} {r['ttft_p50_ms']:7.0f} {r['ttft_p90_ms']:7.0f} "
            f"{r['ttft_p99_ms']:7.0f}     {r['load_max_over_mean']:6.2f}  {r['route_us']:5.0f}µs  "
            f"{r['wall_s']:5.0f}s"
        )
    print(
        "cache events (GPU and L1 admits + evictions) per pod and second: "
        + ", ".join(f"{name} {r['event_keys_per_pod_s']:.1f} keys" for name, r in results.items())
    )
    if "score" in results:
        s = results["score"]
        for name, r in results.items():
            if name != "score":
                print(
                    f"score / {name}: TTFT mean {s['ttft_mean_ms'] / r['ttft_mean_ms']:.2f}, "
                    f"p90 {s['ttft_p90_ms'] / r['ttft_p90_ms']:.2f}"
                )
        if ref is not None:
            spread = s["load_max_over_mean"] / ref["load_max_over_mean"]
            print(f"load spread, score / least_loaded: {spread:.2f}")
    return 0
