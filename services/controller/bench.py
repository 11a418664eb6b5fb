"""Lookup service: MatchPrefix ops/s and p50/p99 over gRPC, ingest events/s, bytes per index entry.

Workload: a shared-prefix multi-turn chat fleet. ``--prompts`` long system prompts; many
conversations, each pinned to one of ``--pods`` pods, each a system prompt followed by its own turns.
Every pod holds the system prompts it serves (L1, and GPU for the most recent ones) and its
conversations (L1, the latest turns also in GPU). Queries are ``--query-chunks``-chunk prefixes of
random conversations, answered by the real gRPC server on loopback from a separate client process
(pre-serialized requests, so the client costs little CPU).

Reference limits measured in the same run: the same request bytes echoed by a bare gRPC handler
(transport limit), a plain ``dict`` insert of the same keys (ingest limit) and the 16-byte key
itself (memory limit); ratios are printed next to the goals.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import random
import statistics
import threading
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from kvgrid.api.v1 import common_pb2, controller_pb2
from kvgrid.common.identity import PodIdentity
from kvgrid.controller.config import ControllerConfig
from kvgrid.controller.index import IndexTier, MemoryIndex
from kvgrid.controller.ingest import ChunkEvent, EventKind, Ingestor
from kvgrid.controller.registry import AgentRecord
from kvgrid.controller.service import serve

__all__ = ["add_arguments", "run"]

GOALS = {"match_ops_s": 30_000.0, "match_p99_ms": 3.0, "ingest_events_s": 500_000.0, "bytes_per_entry": 64.0}
NS_ID = "00" * 16
METHOD = "/kvgrid.v1.ControllerService/BatchMatchPrefix"
ECHO = "/bench.Echo/Echo"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pods", type=int, default=64)
    parser.add_argument("--chunks", type=int, default=1_000_000, help="distinct indexed chunks (at least)")
    parser.add_argument("--prompts", type=int, default=4, help="shared system prompts")
    parser.add_argument("--prompt-chunks", type=int, default=16, help="chunks per system prompt")
    parser.add_argument("--turn-chunks", type=int, default=8, help="chunks added per conversation turn")
    parser.add_argument("--turns", type=int, default=6, help="turns per conversation")
    parser.add_argument("--query-chunks", type=int, default=32)
    parser.add_argument("--batch", type=int, default=32, help="queries per BatchMatchPrefix call")
    parser.add_argument("--concurrency", type=int, default=4, help="client calls in flight")
    parser.add_argument("--seconds", type=float, default=3.0, help="duration of each gRPC measurement")
    parser.add_argument("--max-pods", type=int, default=0, help="MatchPrefixRequest.max_pods (0 = every pod)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


# --- workload -------------------------------------------------------------------------------------


class Workload:
    def __init__(self, a: argparse.Namespace, seed: int = 7) -> None:
        rng = random.Random(seed)
        self.rng = rng
        self.prompts = [[rng.randbytes(16) for _ in range(a.prompt_chunks)] for _ in range(a.prompts)]
        per_conv = a.turns * a.turn_chunks
        n_conv = -(-max(0, a.chunks - a.prompts * a.prompt_chunks) // per_conv)
        self.convs: list[tuple[int, int, list[bytes]]] = []  # (pod, prompt, own chunks)
        for _ in range(n_conv):
            self.convs.append(
                (
                    rng.randrange(a.pods),
                    rng.randrange(a.prompts),
                    [rng.randbytes(16) for _ in range(per_conv)],
                )
            )
        self.a = a

    def events(self) -> dict[int, list[tuple[IndexTier, list[bytes]]]]:
        """Per pod: admit events in arrival order (one per turn; GPU for the latest turn)."""
        out: dict[int, list[tuple[IndexTier, list[bytes]]]] = {p: [] for p in range(self.a.pods)}
        served: set[tuple[int, int]] = set()
        tc = self.a.turn_chunks
        for pod, prompt, own in self.convs:
            if (pod, prompt) not in served:
                served.add((pod, prompt))
                out[pod].append((IndexTier.L1, self.prompts[prompt]))
                out[pod].append((IndexTier.GPU, self.prompts[prompt]))
            for t in range(0, len(own), tc):
                out[pod].append((IndexTier.L1, own[t : t + tc]))
            out[pod].append((IndexTier.GPU, own[-tc:]))
        return out

    def queries(self, n: int) -> list[list[bytes]]:
        qs = []
        for _ in range(n):
            _, prompt, own = self.convs[self.rng.randrange(len(self.convs))]
            q = (self.prompts[prompt] + own)[: self.a.query_chunks]
            qs.append(q)
        return qs


def _holder(pod: int) -> AgentRecord:
    from kvgrid.controller.registry import AgentLoad

    p = PodIdentity(pod_uid=f"pod-{pod:03d}", pod_name=f"vllm-{pod}", epoch=1, agent_address="")
    return AgentRecord(
        pod=p,
        namespaces=(NS_ID,),
        l1_capacity_bytes=0,
        load=AgentLoad(),
        lease_deadline=1e18,
        registered_at=0,
    )


# --- measurements ---------------------------------------------------------------------------------


def _ingest(index: MemoryIndex, evs: dict[int, list[tuple[IndexTier, list[bytes]]]]) -> tuple[float, int]:
    """Feed every event through Ingestor.publish (sequence checks + index); returns (seconds, keys)."""
    ing = Ingestor(index, lambda r, t: None)  # type: ignore[arg-type,return-value]
    recs = {p: _holder(p) for p in evs}
    chunk_events = {}
    n = 0
    for p, lst in evs.items():
        ce = []
        for i, (tier, keys) in enumerate(lst):
            ce.append(ChunkEvent(sequence=i + 1, kind=EventKind.ADMIT, tier=tier, keys=tuple(keys)))
            n += len(keys)
        chunk_events[p] = ce
    for rec in recs.values():  # mark synced at sequence 0 without a pull
        st = ing._state(rec)
        st.synced = True
    t0 = time.perf_counter()
    for p, ce in chunk_events.items():
        for i in range(0, len(ce), 64):  # a PublishEvents message carries a batch of events
            ing.publish(recs[p], ce[i : i + 64], new_stream=False)
    dt = time.perf_counter() - t0
    ing.close()
    return dt, n


def _dict_limit(evs: dict[int, list[tuple[IndexTier, list[bytes]]]]) -> float:
    d: dict[bytes, int] = {}
    n = 0
    t0 = time.perf_counter()
    for lst in evs.values():
        for _, keys in lst:
            for k in keys:
                d[k] = 1
            n += len(keys)
    return n / (time.perf_counter() - t0)


def _client(addr: str, method: str, payloads: list[bytes], seconds: float, concurrency: int, q: Any) -> None:
    ch = grpc.insecure_channel(addr)
    call = ch.unary_unary(method)  # bytes in, bytes out: no client-side protobuf work
    for p in payloads[:20]:  # warm up
        call(p)
    lat: list[float] = []
    calls = 0
    stop = time.perf_counter() + seconds
    lock = threading.Lock()

    def worker(k: int) -> None:
        nonlocal calls
        i = k
        mine = []
        while time.perf_counter() < stop:
            t = time.perf_counter()
            call(payloads[i % len(payloads)])
            mine.append(time.perf_counter() - t)
            i += concurrency
        with lock:
            lat.extend(mine)
            calls += len(mine)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as ex:
        list(ex.map(worker, range(concurrency)))
    q.put({"calls": calls, "seconds": time.perf_counter() - t0, "lat": sorted(lat)})
    ch.close()


def _drive(addr: str, method: str, payloads: list[bytes], seconds: float, concurrency: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_client, args=(addr, method, payloads, seconds, concurrency, q))
    p.start()
    r = q.get(timeout=seconds + 120)
    p.join(10)
    lat = r["lat"]
    return {
        "calls_s": r["calls"] / r["seconds"],
        "p50_ms": 1000 * lat[len(lat) // 2],
        "p99_ms": 1000 * lat[min(len(lat) - 1, int(len(lat) * 0.99))],
    }


def _echo_server() -> tuple[grpc.Server, str]:
    server = grpc.server(ThreadPoolExecutor(max_workers=8))
    handler = grpc.method_handlers_generic_handler(
        "bench.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(lambda req, ctx: req)}
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def _payloads(w: Workload, batch: int, n: int, max_pods: int = 0) -> list[bytes]:
    out = []
    for _ in range(n):
        req = controller_pb2.BatchMatchPrefixRequest()
        for q in w.queries(batch):
            req.requests.add(chunk_keys=common_pb2.ChunkKeys(keys=q), namespace_id=NS_ID, max_pods=max_pods)
        out.append(req.SerializeToString())
    return out


def run(args: argparse.Namespace) -> int:
    say = (lambda *a: None) if args.json else print
    w = Workload(args)
    evs = w.events()
    say(
        f"workload: {args.pods} pods, {args.prompts} system prompts x {args.prompt_chunks} chunks, "
        f"{len(w.convs)} conversations x {args.turns} turns x {args.turn_chunks} chunks"
    )

    # 1. ingest rate (fresh index, no tracing) and the dict-insert limit
    index = MemoryIndex()
    dt, n_keys = _ingest(index, evs)
    ingest = n_keys / dt
    dict_rate = _dict_limit(evs)
    entries, chunks = index.num_entries(), index.num_chunks()
    say(
        f"ingest: {n_keys:,} chunk events in {dt:.2f} s = {ingest:,.0f} events/s "
        f"(dict insert limit {dict_rate:,.0f}/s); index: {chunks:,} chunks, {entries:,} entries"
    )

    # 2. memory per entry (tracemalloc over a second build of the same index)
    del index
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    mem_index = MemoryIndex()
    for p, lst in evs.items():
        h = _holder(p).holder
        for tier, keys in lst:
            mem_index.add(h, tier, keys)
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    bpe = used / max(1, mem_index.num_entries())
    say(
        f"memory: {used / 2**20:,.1f} MiB for {mem_index.num_entries():,} entries = {bpe:.1f} B/entry "
        f"({used / max(1, mem_index.num_chunks()):.1f} B/chunk; key itself 16 B)"
    )

    # 3. MatchPrefix over gRPC: the controller in this process, clients in another
    cfg = ControllerConfig(listen="127.0.0.1:0", max_batch=max(4096, args.batch), grpc_workers=16)
    srv = serve(cfg, index=mem_index)
    for p in evs:
        srv.controller.registry.register(_holder(p).pod, [NS_ID])
    srv.controller._refresh_holders()
    echo, echo_addr = _echo_server()
    try:
        one = _payloads(w, 1, 512, args.max_pods)
        batched = _payloads(w, args.batch, 256, args.max_pods)
        # sanity: the answers are real
        resp = controller_pb2.BatchMatchPrefixResponse.FromString(
            grpc.insecure_channel(srv.address).unary_unary(METHOD)(batched[0])
        )
        hits = sum(1 for r in resp.responses if r.matches)
        pods_listed = statistics.mean(len(r.matches) for r in resp.responses)
        t0 = time.perf_counter()
        reqs = controller_pb2.BatchMatchPrefixRequest.FromString(batched[0]).requests
        for _ in range(5):
            for r in reqs:
                srv.controller.match_response(srv.controller.parse_query(r))
        inproc = 5 * len(reqs) / (time.perf_counter() - t0)
        unary = _drive(srv.address, METHOD, one, args.seconds, args.concurrency)
        batch = _drive(srv.address, METHOD, batched, args.seconds, args.concurrency)
        echo_b = _drive(echo_addr, ECHO, batched, args.seconds, args.concurrency)
    finally:
        echo.stop(0)
        srv.stop(0)
    match_ops = batch["calls_s"] * args.batch
    echo_ops = echo_b["calls_s"] * args.batch
    say(f"answers: {hits}/{len(resp.responses)} queries hit; {pods_listed:.1f} pods listed per answer")
    say(f"MatchPrefix in-process (no gRPC): {inproc:,.0f} queries/s")
    say(
        f"MatchPrefix unary over gRPC: {unary['calls_s']:,.0f} queries/s, p50 {unary['p50_ms']:.2f} ms, "
        f"p99 {unary['p99_ms']:.2f} ms"
    )
    say(
        f"BatchMatchPrefix x{args.batch} over gRPC: {match_ops:,.0f} queries/s, "
        f"call p50 {batch['p50_ms']:.2f} ms, p99 {batch['p99_ms']:.2f} ms "
        f"(echo of the same bytes: {echo_ops:,.0f} queries/s, "
        f"p99 {echo_b['p99_ms']:.2f} ms)"
    )
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "pods": args.pods,
        "chunks": chunks,
        "entries": entries,
        "query_chunks": args.query_chunks,
        "batch": args.batch,
        "max_pods": args.max_pods,
        "ingest_events_s": ingest,
        "dict_insert_limit_s": dict_rate,
        "bytes_per_entry": bpe,
        "match_inprocess_ops_s": inproc,
        "match_unary_ops_s": unary["calls_s"],
        "match_unary_p50_ms": unary["p50_ms"],
        "match_unary_p99_ms": unary["p99_ms"],
        "match_ops_s": match_ops,
        "match_p50_ms": batch["p50_ms"],
        "match_p99_ms": batch["p99_ms"],
        "echo_ops_s": echo_ops,
        "echo_p99_ms": echo_b["p99_ms"],
        "ratio_match_vs_echo": match_ops / echo_ops,
        "ratio_ingest_vs_dict": ingest / dict_rate,
        "ratio_key_bytes_vs_entry": 16 / bpe,
        "goals": GOALS,
        "goal_ratios": {
            "match_ops_s": match_ops / GOALS["match_ops_s"],
            "match_p99_ms": GOALS["match_p99_ms"] / batch["p99_ms"],
            "ingest_events_s": ingest / GOALS["ingest_events_s"],
            "bytes_per_entry": GOALS["bytes_per_entry"] / bpe,
        },
    }
    if args.json:
        print(json.dumps(result))
    else:
        print("goals (ratio >= 1 meets the goal):")
        for k, v in result["goal_ratios"].items():
            print(f"  {k}: goal {GOALS[k]:,} -> measured {result[k]:,.2f}  ratio {v:.2f}")
    return 0
