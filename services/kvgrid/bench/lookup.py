"""``kvgrid bench lookup``: what a router sees per request, beside Dynamo's indexers, in one run.

Workload (:mod:`kvgrid.bench.lookup_workload`): a multi-turn chat fleet over ``--pods`` pods,
~``--chunks`` distinct chunks; queries are a fixed mix of a conversation's next turn (whole history
plus a new, uncached turn: the GPU tier is reached), an edit of an earlier turn, a new conversation
on a known system prompt, and complete misses.

What is measured, in this order:

1. **Ingest through the real stream**: every pod's agent registers and streams its admit events
   through ``PublishEvents`` (``--events-per-message`` events per message, ``--streams`` pods at a
   time, from a separate process, after the controller's snapshot pull of the new stream); event
   messages/s, events/s and chunk keys/s, and the controller's CPU per key. The index this builds
   is the one every lookup below uses, and it is checked complete.
2. **Memory**: RSS growth of the controller process over that ingest per (chunk, pod, tier) entry
   and per (chunk, pod) pair (the unit a tier-less index stores), ``tracemalloc`` of a second
   build of the same index, and the RSS growth of building it in a fresh process; with
   ``--churn-rounds N`` that process then replaces every admitted key N times (each event's keys
   re-admitted under new keys and the old ones removed, interleaved: tombstones, rehashes, side
   rows spilled and freed) and reports its RSS growth again (allocator growth included).
3. **Ingest through vLLM's KV events** (:func:`_vllm_ingest`): the messages the peer runner sends
   Dynamo's indexer service, on one ZMQ PUB socket per pod, into a controller configured with one
   ``vllm_sources`` entry per pod (its own process); events/s, keys/s and its CPU per key.
4. **Answers**: the same queries through gRPC ``MatchPrefix``, the lean lookup listener
   (:mod:`kvgrid.controller.lookup_server`; in plaintext, and with mTLS as ``kvgrid controller
   --lookup-port`` starts it with the ``tls_*`` files of a throwaway CA: :func:`_mtls_listener`),
   in-process, and packed batches must agree; with
   ``--peers`` every query's longest match must equal Dynamo's (in-process and service). Any
   difference stops the bench.
5. ``--rounds`` interleaved rounds of ``--seconds`` each: one query per call in-process (kvgrid
   ``Controller.match``; Dynamo ``RadixTree.find_matches``), one query per call over the network at
   each ``--concurrency`` (kvgrid gRPC ``MatchPrefix``, kvgrid lean listener in plaintext and with
   mTLS, Dynamo's indexer service ``/query_by_hash``), and kvgrid packed compact batches of
   ``--batch``. Medians and
   [min-max] over the rounds, kvgrid/Dynamo ratios per round, server CPU per query (from /proc of
   the serving process), client CPU, and the machine's load average at start and end.

``--transports`` replaces steps 2-5 with a comparison of the ways a router reaches the controller
for one query (one packed query per call, compact answer), on the same ingested index: the gRPC
port, the lean listener in plaintext, and the listener with mTLS and authorization as ``kvgrid
controller --lookup-port`` starts it with the ``tls_*`` files (a throwaway CA and certificates made
in the run: :func:`_throwaway_certificates`). Their answers must be byte-identical to the gRPC
port's before anything is timed; then ``--rounds`` interleaved rounds at each ``--concurrency``,
each transport's queries/s, p50, p99 and server CPU per query, and each as a ratio to gRPC's.

Peers (``--peers``) run in ``--peers-python`` (an environment with ``ai-dynamo-runtime``; its pins
conflict with kvgrid's environment) through :mod:`kvgrid.bench.lookup_peers`; a peer that is
not installed is reported as absent with the reason. Clients are Python in every case (gRPC's,
a socket, ``http.client``), each in its own process.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import functools
import gc
import importlib.util
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import grpc
import msgspec
import numpy as np

from kvgrid.api.v1 import common_pb2, controller_pb2, controller_pb2_grpc
from kvgrid.bench import lookup_clients as clients
from kvgrid.bench.lookup_workload import QUERY_MIX, Query, Workload
from kvgrid.common.tls import CONTROLLER_SERVER_NAME
from kvgrid.controller.compact import read_compact
from kvgrid.controller.config import ControllerConfig
from kvgrid.controller.core import PrefixQuery
from kvgrid.controller.index import IndexTier, MemoryIndex
from kvgrid.controller.lookup_server import (
    METHOD_BATCH_MATCH,
    LookupClient,
    LookupServer,
)
from kvgrid.controller.service import serve

__all__ = ["add_arguments", "run"]

NS_ID = "00" * 16
MATCH = "/kvgrid.v1.ControllerService/MatchPrefix"
BATCH_MATCH = "/kvgrid.v1.ControllerService/BatchMatchPrefix"
QUERIES = 4096  # distinct pre-built queries each measurement cycles through
CHECKED = 256  # queries whose answers are compared across paths and systems
GOAL_INGEST_KEYS_S = 500_000.0
TRANSPORTS = {  # --transports: name -> what it is (the --help text)
    "grpc": "the controller's gRPC port, plaintext",
    "listener": "the lean lookup listener (--lookup-port) in plaintext",
    "listener-mtls": (
        "the listener with mTLS and authorization, as `kvgrid controller --lookup-port` starts it with "
        "the tls_* files (a throwaway CA and certificates made in the run; needs the cryptography "
        "package, which kvgrid's test extra installs)"
    ),
}


def _transport_list(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in names if t not in TRANSPORTS]
    if unknown or not names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected distinct names from {', '.join(TRANSPORTS)}, comma-separated"
        )
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pods", type=int, default=64)
    parser.add_argument("--chunks", type=int, default=1_000_000, help="distinct indexed chunks (at least)")
    parser.add_argument("--prompts", type=int, default=4, help="shared system prompts")
    parser.add_argument("--prompt-chunks", type=int, default=16, help="chunks per system prompt")
    parser.add_argument("--turn-chunks", type=int, default=8, help="chunks added per conversation turn")
    parser.add_argument("--turns", type=int, default=6, help="cached turns per conversation")
    parser.add_argument("--batch", type=int, default=64, help="queries per packed BatchMatchPrefix call")
    parser.add_argument("--concurrency", default="1,4", help="calls in flight for the network rows")
    parser.add_argument("--seconds", type=float, default=2.0, help="duration of each measurement")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every measurement")
    parser.add_argument("--events-per-message", type=int, default=64, help="events per PublishEvents message")
    parser.add_argument("--streams", type=int, default=16, help="agents streaming at once during ingest")
    parser.add_argument(
        "--churn-rounds",
        type=int,
        default=0,
        help="after the fresh-process build, replace every admitted key this many times and report "
        "that process's RSS growth again (a long ingest: tombstones, rehashes, allocator growth)",
    )
    parser.add_argument(
        "--peers", action="store_true", help="also run Dynamo's indexers on the same workload"
    )
    parser.add_argument(
        "--peers-python",
        default=os.environ.get("KVGRID_PEERS_PYTHON", sys.executable),
        help="Python with ai-dynamo-runtime, pyzmq and msgspec installed (env KVGRID_PEERS_PYTHON)",
    )
    parser.add_argument(
        "--transports",
        type=_transport_list,
        metavar="T[,T...]",
        help=(
            "instead of the memory, in-process, batch and peer measurements, compare one packed query "
            "per call (compact answer) over these transports at each --concurrency, on the same "
            "ingested index: "
            + "; ".join(f"{k} = {v}" for k, v in TRANSPORTS.items())
            + ". Answers must be byte-identical to the gRPC port's first; prints queries/s, p50, p99 "
            "and server CPU per query of each, and each as a ratio to grpc's (when grpc is listed)"
        ),
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _pod_uid(p: int) -> str:
    return f"pod-{p:03d}"


def _match_request(q: Query) -> controller_pb2.MatchPrefixRequest:
    return controller_pb2.MatchPrefixRequest(chunk_keys=common_pb2.ChunkKeys(keys=q.keys), namespace_id=NS_ID)


def _packed(qs: list[Query]) -> bytes:
    return controller_pb2.BatchMatchPrefixRequest(
        packed_chunk_keys=b"".join(b"".join(q.keys) for q in qs),
        packed_query_chunks=[len(q.keys) for q in qs],
        packed_namespace_id=NS_ID,
        compact=True,
    ).SerializeToString()


def _best(resp: controller_pb2.MatchPrefixResponse) -> int:
    """Longest match any pod gets (what a tier-less peer index reports as its top score)."""
    return max((m.gpu_chunks + m.l1_chunks + m.l2_chunks + m.peer_chunks for m in resp.matches), default=0)


def _med(rs: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rs)


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


class _Peers:
    """The peer runner process (:mod:`kvgrid.bench.lookup_peers`), one JSON line per command."""

    def __init__(self, python: str, workload_file: str) -> None:
        script = Path(__file__).with_name("lookup_peers.py")
        self.proc = subprocess.Popen(
            [python, str(script), workload_file], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        first = self._read()
        self.error: str | None = first.get("error")

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            return {"error": f"peer runner exited with {self.proc.wait()}"}
        out: dict[str, Any] = json.loads(line)
        return out

    def call(self, cmd: str, *args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"cmd": cmd, "args": list(args)}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(30)


def _ingest(addr: str, w: Workload, args: argparse.Namespace) -> dict[str, float]:
    evs = w.events()
    per_pod = [
        clients.ingest_messages(_pod_uid(p), evs[p], NS_ID, args.events_per_message) for p in range(args.pods)
    ]
    n_msgs = sum(map(len, per_pod))
    n_events = sum(map(len, evs.values()))
    n_keys = sum(len(k) for lst in evs.values() for _, k in lst)
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=clients.ingest, args=(addr, per_pod, NS_ID, args.streams, q))
    cpu0 = clients.cpu_seconds(os.getpid())
    proc.start()
    r = q.get(timeout=1800)
    cpu = clients.cpu_seconds(os.getpid()) - cpu0
    proc.join(30)
    s = r["seconds"]
    return {
        "messages": n_msgs,
        "events": n_events,
        "keys": n_keys,
        "seconds": s,
        "messages_s": n_msgs / s,
        "events_s": n_events / s,
        "keys_s": n_keys / s,
        "server_cpu_us_per_key": 1e6 * cpu / n_keys,
    }


def _vllm_ingest(w: Workload, args: argparse.Namespace) -> dict[str, Any]:
    """Ingest through the vLLM KV-event path (:mod:`kvgrid.controller.vllm_events`): one ZMQ PUB
    socket per pod, as engines publish, feeding a controller in its own process subscribed to every
    one (:func:`~kvgrid.bench.lookup_clients.vllm_controller`). The messages are the ones the peer
    runner sends Dynamo's indexer service (vLLM's msgpack ``EventBatch``: one ``BlockStored`` per
    stored run of a pod's chains, one block of 4 tokens per chunk). A probe per pod (an
    ``AllBlocksCleared``, which adds nothing) is published until every subscriber has seen one;
    then the clock runs from the first event to the moment every block is in the index as one
    GPU-tier entry (the probes add none)."""
    import multiprocessing as mp

    import zmq

    from kvgrid.bench.lookup_peers import BLOCK, _vllm_batch

    chains = w.chains()
    pods = sorted(chains)
    zctx = zmq.Context()
    zctx.set(zmq.MAX_SOCKETS, len(pods) + 64)  # the default, 1,023, is short of 1,024 pods
    socks = []
    for _ in pods:
        sock = zctx.socket(zmq.PUB)
        sock.setsockopt(zmq.SNDHWM, 0)
        socks.append((sock, sock.bind_to_random_port("tcp://127.0.0.1")))
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    uids = [_pod_uid(p) for p in pods]
    endpoints = [f"tcp://127.0.0.1:{port}" for _, port in socks]
    proc = ctx.Process(target=clients.vllm_controller, args=(uids, endpoints, BLOCK, NS_ID, child_conn))
    proc.start()
    try:
        _, pid = conn.recv()
        seq = [0] * len(pods)
        probe = msgspec.msgpack.encode([time.time(), [["AllBlocksCleared"]], 0])
        pending = set(range(len(pods)))
        counts: list[int] = []
        deadline = time.monotonic() + 120
        while pending:  # ZMQ subscribers connect asynchronously: what a PUB sends before is lost
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM event subscribers of {len(pending)} pods never connected")
            for i in pending:
                seq[i] += 1
                socks[i][0].send_multipart([b"", seq[i].to_bytes(8, "big"), probe])
            time.sleep(0.05)
            conn.send(("counts",))
            counts = conn.recv()
            pending = {i for i in pending if not counts[i]}
        msgs = []
        for i, p in enumerate(pods):
            for parent, keys in chains[p]:
                seq[i] += 1
                msgs.append((i, _vllm_batch(seq[i], parent, keys)))
        n_keys = sum(len(k) for lst in chains.values() for _, k in lst)
        cpu0 = clients.cpu_seconds(pid)
        t0 = time.perf_counter()
        for i, frames in msgs:
            socks[i][0].send_multipart(frames)
        conn.send(("wait", n_keys, sum(counts) + len(msgs), 600.0))
        done, entries, unknown, errors = conn.recv()
        cpu = clients.cpu_seconds(pid) - cpu0
        conn.send(("quit",))
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.kill()
        for sock, _ in socks:
            sock.close(0)
        zctx.term()
    if done is None or entries != n_keys or unknown or errors:
        raise AssertionError(
            f"vLLM ZMQ ingest incomplete: {entries} GPU entries of {n_keys} blocks, {unknown} "
            f"stored runs with an unknown parent, {errors} undecodable batches"
        )
    s = done - t0
    return {
        "events": len(msgs),
        "keys": n_keys,
        "seconds": s,
        "events_s": len(msgs) / s,
        "keys_s": n_keys / s,
        "server_cpu_us_per_key": 1e6 * cpu / n_keys,
    }


def _tracemalloc_bytes(w: Workload) -> tuple[int, int]:
    """Bytes tracemalloc sees for a fresh build of the same index, and its entries."""
    evs = w.events()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    idx = MemoryIndex()
    for p, lst in evs.items():
        for tier, keys in lst:
            idx.add(f"{_pod_uid(p)}/1", IndexTier.L1 if tier == "l1" else IndexTier.GPU, keys)
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return used, idx.num_entries()


def _build_index(shape: tuple[int, ...], churn: int, q: Any) -> None:
    w = Workload(*shape)
    evs = w.events()
    _trim()
    rss0 = _rss()
    idx = MemoryIndex()
    for p, lst in evs.items():
        for tier, keys in lst:
            idx.add(f"{_pod_uid(p)}/1", IndexTier.L1 if tier == "l1" else IndexTier.GPU, keys)
    _trim()
    q.put(_rss() - rss0)
    entries = idx.num_entries()
    for r in range(churn):  # every event's keys re-admitted as round r + 1's, round r's removed
        for p, lst in evs.items():
            for tier, keys in lst:
                t = IndexTier.L1 if tier == "l1" else IndexTier.GPU
                idx.add(f"{_pod_uid(p)}/1", t, _round_keys(keys, r + 1))
                idx.remove(f"{_pod_uid(p)}/1", t, _round_keys(keys, r))
    if idx.num_entries() != entries:
        raise AssertionError(f"churn changed the index: {idx.num_entries()} != {entries} entries")
    _trim()
    q.put(_rss() - rss0)


def _round_keys(keys: list[bytes], r: int) -> list[bytes]:
    """``keys`` as churn round ``r`` admits them (round 0: themselves): the first word XORed with a
    constant of the round, so they stay uniform and distinct."""
    if not r:
        return keys
    a = np.frombuffer(b"".join(keys), dtype="<u8").copy()
    a[0::2] ^= np.uint64((0x9E3779B97F4A7C15 * r) & (2**64 - 1))
    raw = a.tobytes()
    return [raw[i : i + 16] for i in range(0, len(raw), 16)]


def _trim() -> None:
    """Give freed heap pages back to the OS (glibc), so RSS counts what is held, not what was
    once allocated; the peer runner does the same before reading its in-process tree's RSS."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _built_rss(args: argparse.Namespace) -> tuple[int, int]:
    """RSS growth of a fresh process over building the same index in-process (no gRPC, no ingest
    buffers: comparable with a peer's in-process index), and after ``--churn-rounds`` on it."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    shape = (args.pods, args.chunks, args.prompts, args.prompt_chunks, args.turns, args.turn_chunks)
    p = ctx.Process(target=_build_index, args=(shape, args.churn_rounds, q))
    p.start()
    built: int = q.get(timeout=1800)
    churned: int = q.get(timeout=3600)
    p.join(30)
    return built, churned


def _inproc(fn: Any, items: list[Any], seconds: float) -> dict[str, float]:
    for x in items[:50]:
        fn(x)
    lat = []
    i = 0
    stop = time.perf_counter() + seconds
    t0 = time.perf_counter()
    c0 = time.process_time()  # this process's CPU (all threads: the idle servers' count against us)
    while time.perf_counter() < stop:
        t = time.perf_counter()
        fn(items[i % len(items)])
        lat.append(time.perf_counter() - t)
        i += 1
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    lat.sort()
    return {
        "calls_s": len(lat) / wall,
        "p50_ms": 1000 * lat[len(lat) // 2],
        "p99_ms": 1000 * lat[int(len(lat) * 0.99)],
        "cpu_us": 1e6 * cpu / len(lat),
    }


def _workload_line(args: argparse.Namespace, w: Workload, queries: list[Query], kinds: dict[str, int]) -> str:
    return (
        f"workload: {args.pods} pods, {args.prompts} system prompts x {args.prompt_chunks} chunks, "
        f"{len(w.convs):,} conversations x {args.turns} turns x {args.turn_chunks} chunks; queries: "
        + ", ".join(f"{k} {v}" for k, v in kinds.items())
        + f" (mean {statistics.mean(len(q.keys) for q in queries):.0f} chunks)"
    )


def _ingest_line(args: argparse.Namespace, ingest: dict[str, float]) -> str:
    return (
        f"ingest through PublishEvents ({args.events_per_message} events/message, "
        f"{args.streams} streams): "
        f"{ingest['messages_s']:,.0f} messages/s = {ingest['events_s']:,.0f} events/s = "
        f"{ingest['keys_s']:,.0f} keys/s; controller CPU {ingest['server_cpu_us_per_key']:.2f} us/key"
    )


def run(args: argparse.Namespace) -> int:
    if getattr(args, "transports", None):
        return _run_transports(args)
    say = (lambda *a: None) if args.json else print
    load_start = os.getloadavg()
    w = Workload(args.pods, args.chunks, args.prompts, args.prompt_chunks, args.turns, args.turn_chunks)
    queries = w.queries(QUERIES)
    kinds = {k: sum(q.kind == k for q in queries) for k, _ in QUERY_MIX}
    say(_workload_line(args, w, queries, kinds))
    peers: _Peers | None = None
    peer_info: dict[str, Any] = {}
    tmp = tempfile.TemporaryDirectory(prefix="kvgrid-bench-")
    # 16 threads for the queries plus one per ingest stream; every agent of the bench streams from
    # this host: one caller for publish_streams_per_identity (plaintext counts by IP address).
    cfg = ControllerConfig(
        listen="127.0.0.1:0",
        max_batch=max(4096, args.batch),
        lease_ttl_ms=3_600_000,
        grpc_workers=16 + args.streams,
        max_publish_streams=args.streams,
        publish_streams_per_identity=args.streams,
    )
    rss0 = _rss()
    srv = serve(cfg)
    lean: LookupServer | None = None
    mtls: tuple[LookupServer, str] | None = None
    try:
        # 1-2. ingest through PublishEvents, RSS growth
        ingest = _ingest(srv.address, w, args)
        ctl = srv.controller
        entries, chunks = ctl.index.num_entries(), ctl.index.num_chunks()
        if entries != ingest["keys"]:
            raise AssertionError(
                f"index incomplete after ingest: {entries} entries, {ingest['keys']} admitted"
            )
        pairs = sum(len(k) for lst in w.chains().values() for _, k in lst)  # (chunk, pod) pairs
        rss_raw = _rss() - rss0
        _trim()  # what the controller holds, not what ingest once allocated (both are reported)
        rss = _rss() - rss0
        traced, traced_entries = _tracemalloc_bytes(w)
        built, churned = _built_rss(args)
        memory = {
            "entries": entries,
            "chunk_pod_pairs": pairs,
            "chunks": chunks,
            "rss_bytes": rss,
            "rss_untrimmed_per_entry": rss_raw / entries,
            "rss_per_entry": rss / entries,
            "rss_per_pair": rss / pairs,
            "tracemalloc_per_entry": traced / traced_entries,
            "tracemalloc_per_pair": traced / pairs,
            "built_rss_per_entry": built / entries,
            "built_rss_per_pair": built / pairs,
            "churn_rounds": args.churn_rounds,
            "churned_rss_per_pair": churned / pairs,
        }
        say(_ingest_line(args, ingest))
        say(
            f"index: {chunks:,} chunks, {entries:,} (chunk, pod, tier) entries, "
            f"{pairs:,} (chunk, pod) pairs; "
            f"controller RSS growth {rss / 2**20:,.1f} MiB after malloc_trim "
            f"({rss_raw / 2**20:,.1f} before) = {memory['rss_per_entry']:.1f} B/entry, "
            f"{memory['rss_per_pair']:.1f} B/pair; "
            f"tracemalloc {memory['tracemalloc_per_entry']:.1f} B/entry; index built in a fresh process: "
            f"RSS growth {memory['built_rss_per_entry']:.1f} B/entry, "
            f"{memory['built_rss_per_pair']:.1f} B/pair"
            + (
                f", after {args.churn_rounds} churn rounds {memory['churned_rss_per_pair']:.1f} B/pair"
                if args.churn_rounds
                else ""
            )
        )
        vllm = _vllm_ingest(w, args)
        say(
            f"ingest through vLLM KV events (ZMQ, {args.pods} publishers): {vllm['events_s']:,.0f} "
            f"events/s = {vllm['keys_s']:,.0f} keys/s; controller CPU {vllm['server_cpu_us_per_key']:.2f} "
            "us/key"
        )
        lean = LookupServer(ctl, "127.0.0.1:0")
        # the listener routers use in a cluster: mTLS, started by the code `kvgrid controller` runs
        if importlib.util.find_spec("cryptography") is not None:
            mtls = _mtls_listener(ctl, Path(tmp.name))
        else:
            say("lean listener mTLS: skipped (no cryptography package to make the throwaway certificates)")

        # 3. answers agree across paths (and with the peers)
        reqs = [_match_request(q) for q in queries]
        singles = [r.SerializeToString() for r in reqs]
        packed1 = [_packed([q]) for q in queries]  # one query per call, packed request, compact answer
        checked = queries[:CHECKED]
        with grpc.insecure_channel(srv.address) as ch:
            stub = controller_pb2_grpc.ControllerServiceStub(ch)
            via_grpc = [stub.MatchPrefix(r) for r in reqs[:CHECKED]]
            batched: list[controller_pb2.MatchPrefixResponse] = []
            for lo in range(0, CHECKED, args.batch):
                req = controller_pb2.BatchMatchPrefixRequest.FromString(
                    _packed(checked[lo : lo + args.batch])
                )
                batched += read_compact(stub.BatchMatchPrefix(req))
        lc = LookupClient(lean.address)
        via_lean = [lc.match(r) for r in reqs[:CHECKED]]
        lean_packed = [lc.call_raw(METHOD_BATCH_MATCH, b) for b in packed1[:CHECKED]]
        lc.close()
        if via_lean != via_grpc or batched != via_grpc:
            raise AssertionError("kvgrid answers differ between gRPC, the lean listener and packed batches")
        if mtls is not None:
            lc = clients.lean_client(mtls[0].address, mtls[1])
            if [lc.call_raw(METHOD_BATCH_MATCH, b) for b in packed1[:CHECKED]] != lean_packed:
                raise AssertionError("kvgrid answers differ between the lean listener with and without mTLS")
            lc.close()
        best = [_best(r) for r in via_grpc]
        pairs_bk = list(zip(best, checked, strict=True))
        by_kind = {k: statistics.mean(b for b, q in pairs_bk if q.kind == k) for k, _ in QUERY_MIX
                   if any(q.kind == k for q in checked)}  # fmt: skip
        say(
            "mean longest match (chunks) by query kind: "
            + ", ".join(f"{k} {v:.1f}" for k, v in by_kind.items())
            + f"; pods listed per answer {statistics.mean(len(r.matches) for r in via_grpc):.1f}"
        )
        if args.peers:
            wl = {
                "pods": args.pods,
                "chains": {str(p): c for p, c in w.chains().items()},
                "queries": [q.keys for q in queries],
            }
            wf = Path(tmp.name) / "workload.msgpack"
            wf.write_bytes(msgspec.msgpack.encode(wl))
            peers = _Peers(args.peers_python, str(wf))
            if peers.error is not None:
                peer_info["error"] = peers.error
                say(f"peers absent: {peers.error} (--peers-python {args.peers_python})")
                peers.close()
                peers = None
        http_bodies: list[bytes] = []
        if peers is not None:
            for name, cmd, extra in (
                ("dynamo_inproc", "dynamo_inproc", ()),
                ("dynamo_http", "dynamo_http", (4,)),
            ):
                r = peers.call(cmd, *extra)
                peer_info[name] = r
                if "error" in r:
                    say(f"{name}: failed: {r['error']}")
                    continue
                per_pair = r["rss_bytes"] / pairs
                r["rss_per_pair"] = per_pair
                say(
                    f"{name}: RSS growth {r['rss_bytes'] / 2**20:,.1f} MiB = {per_pair:.1f} B "
                    "per (chunk, pod) "
                    f"pair; events applied in {r.get('apply_s', r.get('ingest_s', 0)):.2f} s "
                    f"({r['events'] / r.get('apply_s', r.get('ingest_s', 1)):,.0f} events/s)"
                )
            theirs = peers.call("answers", CHECKED)
            for system, answers in theirs.items():
                if answers != best:
                    bad = next(i for i, (a, b) in enumerate(zip(answers, best, strict=True)) if a != b)
                    raise AssertionError(
                        f"Dynamo {system} answers differ from kvgrid's: query {bad} ({checked[bad].kind}): "
                        f"{answers[bad]} vs {best[bad]} chunks"
                    )
            say(f"answers: kvgrid == Dynamo ({', '.join(theirs)}) on {CHECKED} queries")
            if "error" not in peer_info.get("dynamo_http", {"error": 1}):
                http_bodies = [b.encode() for b in peers.call("bodies")["bodies"]]

        # 4. interleaved rounds
        conc = [int(c) for c in args.concurrency.split(",") if c.strip()]
        packed = [_packed(queries[lo : lo + args.batch]) for lo in range(0, len(queries), args.batch)]
        pqs = [PrefixQuery(chunk_keys=q.keys, namespace_id=NS_ID) for q in queries]
        rows: dict[str, list[dict[str, float]]] = {}

        def add(name: str, r: dict[str, float]) -> None:
            rows.setdefault(name, []).append(r)

        me = os.getpid()
        # The bench's own workload (millions of key objects) lives in the controller's process; a
        # real controller holds none of it, so it is frozen out of the garbage collector's scans
        # (the peer runner does the same with its copy).
        gc.collect()
        gc.freeze()
        dyn_pid = peer_info.get("dynamo_http", {}).get("pid")
        dyn_addr = peer_info.get("dynamo_http", {}).get("address", "")

        def network(
            name: str, target: Any, addr: str, method: Any, payloads: list[bytes], c: int, pid: int
        ) -> None:
            add(name, clients.drive(target, (addr, method, payloads, args.seconds, c), pid))

        for _ in range(args.rounds):
            add("kvgrid in-process, 1 query", _inproc(ctl.match, pqs, args.seconds))
            if peers is not None and "error" not in peer_info.get("dynamo_inproc", {"error": 1}):
                add("Dynamo in-process RadixTree, 1 query", peers.call("inproc_single", args.seconds))
            for c in conc:
                if c == conc[0]:  # the readable unary API, for reference
                    network(f"kvgrid gRPC MatchPrefix (readable), c={c}", clients.grpc_caller, srv.address,
                            MATCH, singles, c, me)  # fmt: skip
                network(f"kvgrid gRPC 1 packed query, compact, c={c}", clients.grpc_caller, srv.address,
                        BATCH_MATCH, packed1, c, me)  # fmt: skip
                network(f"kvgrid lean listener 1 packed query, compact, c={c}", clients.lean_caller,
                        lean.address, METHOD_BATCH_MATCH, packed1, c, me)  # fmt: skip
                if mtls is not None:
                    network(f"kvgrid lean listener mTLS 1 packed query, compact, c={c}",
                            functools.partial(clients.lean_caller, tls_dir=mtls[1]), mtls[0].address,
                            METHOD_BATCH_MATCH, packed1, c, me)  # fmt: skip
                if http_bodies and dyn_pid:
                    network(
                        f"Dynamo indexer service HTTP, c={c}",
                        clients.http_caller, dyn_addr, "/query_by_hash", http_bodies, c, dyn_pid,
                    )  # fmt: skip
            network(f"kvgrid gRPC packed compact x{args.batch}, c=1", clients.grpc_caller, srv.address,
                    BATCH_MATCH, packed, 1, me)  # fmt: skip
        if ctl.index.num_entries() != entries:
            raise AssertionError(
                f"index changed during the run: {ctl.index.num_entries()} != {entries} entries"
            )
    finally:
        if peers is not None:
            peers.close()
        if lean is not None:
            lean.stop()
        if mtls is not None:
            mtls[0].stop()
        srv.stop(0)
        tmp.cleanup()
    load_end = os.getloadavg()

    table: dict[str, dict[str, Any]] = {}
    for name, rs in rows.items():
        per = args.batch if name.startswith("kvgrid gRPC packed compact x") else 1
        table[name] = {
            "queries_s": _summary([r["calls_s"] * per for r in rs]),
            "p50_ms": _summary([r["p50_ms"] for r in rs]),
            "p99_ms": _summary([r["p99_ms"] for r in rs]),
        }
        if "server_cpu_us" in rs[0]:
            table[name]["server_cpu_us_per_query"] = statistics.median(r["server_cpu_us"] / per for r in rs)
            table[name]["client_cpu_us_per_query"] = statistics.median(r["client_cpu_us"] / per for r in rs)
        if "cpu_us" in rs[0]:  # in-process rows: the measuring process's CPU per query
            table[name]["cpu_us_per_query"] = _summary([r["cpu_us"] for r in rs])
    ratios: dict[str, dict[str, float]] = {}

    def ratio(name: str, ours: str, theirs: str) -> None:
        if ours in rows and theirs in rows:
            per_round = [a["calls_s"] / b["calls_s"] for a, b in zip(rows[ours], rows[theirs], strict=True)]
            ratios[name] = {
                **_summary(per_round),
                "p50": _med(rows[theirs], "p50_ms") / _med(rows[ours], "p50_ms"),
                "p99": _med(rows[theirs], "p99_ms") / _med(rows[ours], "p99_ms"),
            }  # fmt: skip
            if "cpu_us" in rows[ours][0] and "cpu_us" in rows[theirs][0]:
                # load-independent on a shared box: CPU time per query, not wall time
                cpu = _summary(
                    [b["cpu_us"] / a["cpu_us"] for a, b in zip(rows[ours], rows[theirs], strict=True)]
                )
                ratios[name].update({f"cpu_per_query_{k}": v for k, v in cpu.items()})

    ratio("in-process single query", "kvgrid in-process, 1 query", "Dynamo in-process RadixTree, 1 query")
    for c in conc:
        dyn = f"Dynamo indexer service HTTP, c={c}"
        ratio(f"network c={c}, gRPC", f"kvgrid gRPC 1 packed query, compact, c={c}", dyn)
        ratio(f"network c={c}, lean listener", f"kvgrid lean listener 1 packed query, compact, c={c}", dyn)
        mtls_row = f"kvgrid lean listener mTLS 1 packed query, compact, c={c}"
        ratio(f"network c={c}, lean listener mTLS", mtls_row, dyn)
    for name in ("dynamo_inproc", "dynamo_http"):
        info = peer_info.get(name, {})
        if "rss_per_pair" in info:
            # the service against the controller process, the in-process tree against a fresh build
            ours = memory["rss_per_pair" if name == "dynamo_http" else "built_rss_per_pair"]
            ratios[f"RSS per (chunk, pod) pair vs {name}"] = {"median": info["rss_per_pair"] / ours}
            if name == "dynamo_inproc" and args.churn_rounds:
                ratios[f"RSS per (chunk, pod) pair after churn vs {name}"] = {
                    "median": info["rss_per_pair"] / memory["churned_rss_per_pair"]
                }
    dyn_ingest = peer_info.get("dynamo_http", {})
    if "ingest_s" in dyn_ingest:  # the same vLLM event messages through each one's ZMQ path
        dyn_events_s = dyn_ingest["events"] / dyn_ingest["ingest_s"]
        ratios["ingest through vLLM KV events (ZMQ), events/s"] = {"median": vllm["events_s"] / dyn_events_s}
        ratios["ingest through PublishEvents vs Dynamo's ZMQ path, keys/s"] = {
            "median": ingest["keys_s"] / (vllm["keys"] / dyn_ingest["ingest_s"])
        }
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "load_average_start_end": [load_start[0], load_end[0]],
        "args": {
            k: v
            for k, v in vars(args).items()
            if k not in ("json", "func", "peers_python", "transports") and not callable(v)  # the handler
        },
        "query_kinds": kinds,
        "ingest": ingest,
        "ingest_goal_ratio": ingest["keys_s"] / GOAL_INGEST_KEYS_S,
        "vllm_ingest": vllm,
        "memory": memory,
        "peers": peer_info,
        "rows": table,
        "ratios_kvgrid_over_dynamo": ratios,
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"load average (1 min) at start {load_start[0]:.2f}, at end {load_end[0]:.2f}")
    print(
        f"{'measurement (' + str(args.rounds) + ' rounds: median [min-max])':<56} {'queries/s':>26} "
        f"{'p50 ms':>8} {'p99 ms':>8} {'CPU us/q':>9}"
    )
    for name, t in table.items():
        qs, p50, p99 = t["queries_s"], t["p50_ms"], t["p99_ms"]
        cpu = t.get("server_cpu_us_per_query", t.get("cpu_us_per_query", {}).get("median"))
        print(
            f"{name:<56} {qs['median']:>10,.0f} [{qs['min']:>6,.0f}-{qs['max']:>6,.0f}] "
            f"{p50['median']:>8.3f} {p99['median']:>8.3f} {'' if cpu is None else f'{cpu:9.0f}'}"
        )
    if ratios:
        print(
            "kvgrid / Dynamo (>= 1: kvgrid at least as good), throughput per round median [min-max], "
            "latency medians:"
        )
        for name, r in ratios.items():
            latency = f"; p50 {r['p50']:.2f}, p99 {r['p99']:.2f}" if "p50" in r else ""
            rng = f" [{r['min']:.2f}-{r['max']:.2f}]" if "min" in r else ""
            cpu = (
                f"; CPU per query {r['cpu_per_query_median']:.2f} "
                f"[{r['cpu_per_query_min']:.2f}-{r['cpu_per_query_max']:.2f}]"
                if "cpu_per_query_median" in r
                else ""
            )
            print(f"  {name}: {r['median']:.2f}{rng}{latency}{cpu}")
    print(
        f"ingest goal (>= {GOAL_INGEST_KEYS_S:,.0f} keys/s through PublishEvents): "
        f"ratio {result['ingest_goal_ratio']:.2f}"
    )
    return 0


# --- --transports: the ways a router reaches the controller for one query -----------------------


def _throwaway_certificates(directory: Path) -> tuple[str, str]:
    """A throwaway CA and two leaves it signs, made as tests/security/pki.py makes them (EC P-256,
    a URI SAN with the kvgrid identity, server and client authentication, valid for a day): the
    controller's (also the DNS SAN routers verify, ``kvgrid-controller``) and a router's, each
    written as ``tls.crt``, ``tls.key`` and ``ca.crt`` into a directory of its own under
    ``directory``. Returns (controller directory, router directory). Needs ``cryptography``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def cert(
        subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name | None, signer: Any, ca: bool
    ) -> x509.Certificate:
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject[-60:])])
        b = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(issuer or name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
        )
        if ca:
            b = b.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        else:
            sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(subject)]
            if "/role/controller" in subject:
                sans.append(x509.DNSName(CONTROLLER_SERVER_NAME))
            eku = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
            b = b.add_extension(x509.ExtendedKeyUsage(eku), critical=False)
        return b.sign(signer, hashes.SHA256())

    pem = serialization.Encoding.PEM
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = cert("kvgrid bench CA", ca_key, None, ca_key, ca=True)
    out = []
    for role in ("controller", "router"):
        key = ec.generate_private_key(ec.SECP256R1())
        leaf = cert(f"spiffe://cluster.local/ns/kvgrid-bench/role/{role}", key, ca.subject, ca_key, ca=False)
        d = directory / role
        d.mkdir(parents=True, exist_ok=True)
        (d / "tls.key").write_bytes(
            key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        )
        (d / "tls.crt").write_bytes(leaf.public_bytes(pem))
        (d / "ca.crt").write_bytes(ca.public_bytes(pem))
        out.append(str(d))
    return out[0], out[1]


def _mtls_listener(ctl: Any, directory: Path) -> tuple[LookupServer, str]:
    """The lean listener with mTLS serving ``ctl``, started by the function ``kvgrid controller``
    calls (:func:`kvgrid.controller.cli.start_lookup_listener`) from a configuration with a
    ``lookup_port`` and the ``tls_*`` files of a throwaway CA (:func:`_throwaway_certificates`);
    returns it and the router's certificate directory for the callers."""
    from kvgrid.controller.cli import start_lookup_listener

    ctl_dir, router_dir = _throwaway_certificates(directory)
    with socket.socket() as s:  # a free port: lookup_port 0 means "off"
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    cfg = ControllerConfig(
        listen="127.0.0.1:0",
        lookup_port=port,
        tls_cert_file=f"{ctl_dir}/tls.crt",
        tls_key_file=f"{ctl_dir}/tls.key",
        tls_ca_file=f"{ctl_dir}/ca.crt",
    )
    listener = start_lookup_listener(cfg, ctl)
    assert listener is not None and listener.tls
    return listener, router_dir


def _run_transports(args: argparse.Namespace) -> int:
    """``--transports``: ingest as in :func:`run`, check that every transport's answers are the gRPC
    port's byte for byte, then time one packed query per call over each (module docstring)."""
    say = (lambda *a: None) if args.json else print
    transports: list[str] = args.transports
    if args.peers:
        print("kvgrid bench lookup: --peers does not apply with --transports", file=sys.stderr)
        return 2
    if "listener-mtls" in transports and importlib.util.find_spec("cryptography") is None:
        print(
            "kvgrid bench lookup: --transports listener-mtls makes throwaway certificates with the "
            "cryptography package, which is not installed: it comes with kvgrid's test extra "
            "(pip install -e '.[test]') or pip install cryptography",
            file=sys.stderr,
        )
        return 2
    load_start = os.getloadavg()
    w = Workload(args.pods, args.chunks, args.prompts, args.prompt_chunks, args.turns, args.turn_chunks)
    queries = w.queries(QUERIES)
    kinds = {k: sum(q.kind == k for q in queries) for k, _ in QUERY_MIX}
    say(_workload_line(args, w, queries, kinds))
    tmp = tempfile.TemporaryDirectory(prefix="kvgrid-bench-")
    cfg = ControllerConfig(
        listen="127.0.0.1:0",
        max_batch=4096,
        lease_ttl_ms=3_600_000,
        grpc_workers=16 + args.streams,  # as in run()
        max_publish_streams=args.streams,
        publish_streams_per_identity=args.streams,
    )
    srv = serve(cfg)
    listeners: list[LookupServer] = []
    rows: dict[str, list[dict[str, float]]] = {}
    conc = [int(c) for c in args.concurrency.split(",") if c.strip()]
    try:
        ingest = _ingest(srv.address, w, args)
        ctl = srv.controller
        entries = ctl.index.num_entries()
        if entries != ingest["keys"]:
            raise AssertionError(
                f"index incomplete after ingest: {entries} entries, {ingest['keys']} admitted"
            )
        say(_ingest_line(args, ingest))
        # name -> (caller run in its own process, address, method, tls_dir for the answers check)
        targets: dict[str, tuple[Any, str, Any, str | None]] = {}
        for name in transports:
            if name == "grpc":
                targets[name] = (clients.grpc_caller, srv.address, BATCH_MATCH, None)
            elif name == "listener":
                listeners.append(LookupServer(ctl, "127.0.0.1:0"))
                targets[name] = (clients.lean_caller, listeners[-1].address, METHOD_BATCH_MATCH, None)
            else:
                listener, router_dir = _mtls_listener(ctl, Path(tmp.name))
                listeners.append(listener)
                caller = functools.partial(clients.lean_caller, tls_dir=router_dir)
                targets[name] = (caller, listeners[-1].address, METHOD_BATCH_MATCH, router_dir)

        # answers: byte-identical to the gRPC port's, before anything is timed
        packed1 = [_packed([q]) for q in queries]  # one query per call, packed request, compact answer
        with grpc.insecure_channel(srv.address) as ch:
            call: grpc.UnaryUnaryMultiCallable[bytes, bytes] = ch.unary_unary(BATCH_MATCH)
            want = [call(b, timeout=10) for b in packed1[:CHECKED]]
        for name, (_, addr, method, tls_dir) in targets.items():
            if name == "grpc":
                got = want
            else:
                lc = clients.lean_client(addr, tls_dir)
                got = [lc.call_raw(method, b) for b in packed1[:CHECKED]]
                lc.close()
            bad = [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b]
            if bad:
                i = bad[0]
                raise AssertionError(
                    f"answers differ between transports: {name}'s differ from the gRPC port's on "
                    f"{len(bad)} of {CHECKED} queries (first: query {i}, {queries[i].kind}: "
                    f"{len(got[i])} vs {len(want[i])} bytes)"
                )
        say(f"answers: {', '.join(transports)} byte-identical to the gRPC port's on {CHECKED} queries")

        me = os.getpid()
        gc.collect()
        gc.freeze()  # as in run(): the bench's own workload is no controller's garbage
        for _ in range(args.rounds):
            for c in conc:
                for name in transports:
                    target, addr, method, _ = targets[name]
                    r = clients.drive(target, (addr, method, packed1, args.seconds, c), me)
                    rows.setdefault(f"{name}, c={c}", []).append(r)
        if ctl.index.num_entries() != entries:
            raise AssertionError(
                f"index changed during the run: {ctl.index.num_entries()} != {entries} entries"
            )
    finally:
        for lst in listeners:
            lst.stop()
        srv.stop(0)
        tmp.cleanup()
    load_end = os.getloadavg()

    table: dict[str, dict[str, Any]] = {
        name: {
            "queries_s": _summary([r["calls_s"] for r in rs]),
            "p50_ms": _summary([r["p50_ms"] for r in rs]),
            "p99_ms": _summary([r["p99_ms"] for r in rs]),
            "server_cpu_us_per_query": _summary([r["server_cpu_us"] for r in rs]),
            "client_cpu_us_per_query": _med(rs, "client_cpu_us"),
        }
        for name, rs in rows.items()
    }
    ratios: dict[str, dict[str, Any]] = {}  # transport / grpc at the same concurrency
    for name, rs in rows.items():
        base = rows.get(f"grpc, c={name.rpartition('=')[2]}")
        if base is None or name.startswith("grpc,"):
            continue
        ratios[name] = {
            "queries_s": _summary([a["calls_s"] / b["calls_s"] for a, b in zip(rs, base, strict=True)]),
            "p50_ms": _med(rs, "p50_ms") / _med(base, "p50_ms"),
            "p99_ms": _med(rs, "p99_ms") / _med(base, "p99_ms"),
            "server_cpu_us_per_query": _med(rs, "server_cpu_us") / _med(base, "server_cpu_us"),
        }
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "load_average_start_end": [load_start[0], load_end[0]],
        "args": {
            k: v
            for k, v in vars(args).items()
            if k not in ("json", "func", "peers_python") and not callable(v)
        },
        "query_kinds": kinds,
        "ingest": ingest,
        "transports": table,
        "ratios_to_grpc": ratios,
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"load average (1 min) at start {load_start[0]:.2f}, at end {load_end[0]:.2f}")
    print(
        f"{'one packed query per call (' + str(args.rounds) + ' rounds: median [min-max])':<48} "
        f"{'queries/s':>26} {'p50 ms':>8} {'p99 ms':>8} {'server CPU us/q':>16}"
    )
    for name, t in table.items():
        qs, cpu = t["queries_s"], t["server_cpu_us_per_query"]
        print(
            f"{name:<48} {qs['median']:>10,.0f} [{qs['min']:>6,.0f}-{qs['max']:>6,.0f}] "
            f"{t['p50_ms']['median']:>8.3f} {t['p99_ms']['median']:>8.3f} {cpu['median']:>16.1f}"
        )
    if ratios:
        print(
            "ratio to grpc at the same concurrency (queries/s: per round, median [min-max], > 1 is "
            "faster; p50, p99, server CPU per query: of the medians, < 1 is less):"
        )
        for name, rat in ratios.items():
            qr = rat["queries_s"]
            print(
                f"  {name}: queries/s {qr['median']:.2f} [{qr['min']:.2f}-{qr['max']:.2f}]; "
                f"p50 {rat['p50_ms']:.2f}, p99 {rat['p99_ms']:.2f}; "
                f"server CPU {rat['server_cpu_us_per_query']:.2f}"
            )
    return 0
