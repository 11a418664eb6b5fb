"""Lookup service: MatchPrefix ops/s and p50/p99 over gRPC, ingest events/s, bytes per index entry.

Workload: a shared-prefix multi-turn chat fleet. ``--prompts`` long system prompts; many
conversations, each pinned to one of ``--pods`` pods, each a system prompt followed by its own turns.
Every pod holds the system prompts it serves (L1, and GPU for the most recent ones) and its
conversations (L1, the latest turns also in GPU). Queries are ``--query-chunks``-chunk prefixes of
random conversations, answered by the real gRPC server on loopback from a separate client process
(requests serialized once up front and sent as bytes, answers received as bytes, so the client
costs little CPU: its CPU per call is measured and printed, as is the server's CPU per query).

MatchPrefix is measured unary, batched in the readable form (a PodMatch per listed pod) and batched
in the compact form (``BatchMatchPrefixRequest.compact``: pod table + packed arrays); the goal is
judged on the compact form. The compact form is also measured with packed requests
(``BatchMatchPrefixRequest.packed_*``: one key buffer per batch, no bytes object per key). What a
client pays to parse each form is measured in-process. Each measurement cycles through ~16k distinct
pre-built queries (``QUERIES_PER_RUN``), so it touches most of the index, as a fleet's traffic
would; the in-process figure repeats one batch (hot caches).

The bench's pods never heartbeat, so the controller runs with a one-hour lease, and the index is
checked to be intact after the last measurement (a lapsed lease would empty it and make every
later measurement meaningless).

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
import resource
import statistics
import threading
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from kvgrid.api.v1 import common_pb2, controller_pb2
from kvgrid.common.identity import PodIdentity
from kvgrid.controller import wire
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
QUERIES_PER_RUN = 16_384


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pods", type=int, default=64)
    parser.add_argument("--chunks", type=int, default=1_000_000, help="distinct indexed chunks (at least)")
    parser.add_argument("--prompts", type=int, default=4, help="shared system prompts")
    parser.add_argument("--prompt-chunks", type=int, default=16, help="chunks per system prompt")
    parser.add_argument("--turn-chunks", type=int, default=8, help="chunks added per conversation turn")
    parser.add_argument("--turns", type=int, default=6, help="turns per conversation")
    parser.add_argument("--query-chunks", type=int, default=32)
    parser.add_argument("--batch", type=int, default=64, help="queries per BatchMatchPrefix call")
    parser.add_argument("--concurrency", type=int, default=1, help="client calls in flight")
    parser.add_argument("--seconds", type=float, default=3.0, help="duration of each gRPC measurement")
    parser.add_argument("--max-pods", type=int, default=0, help="MatchPrefixRequest.max_pods (0 = every pod)")
    parser.add_argument(
        "--sweep",
        default="32,48",
        help="batch sizes also measured in the compact form (throughput vs latency; '' = none)",
    )
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
    call: grpc.UnaryUnaryMultiCallable[bytes, bytes] = ch.unary_unary(
        method
    )  # bytes in, bytes out: no client-side protobuf work
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

    cpu0 = time.process_time()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as ex:
        list(ex.map(worker, range(concurrency)))
    wall = time.perf_counter() - t0
    q.put({"calls": calls, "seconds": wall, "cpu": time.process_time() - cpu0, "lat": sorted(lat)})
    ch.close()


def _cpu_self() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _drive(addr: str, method: str, payloads: list[bytes], seconds: float, concurrency: int) -> dict[str, Any]:
    """Load ``addr`` from a separate client process; the server's CPU is this process's CPU meanwhile."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_client, args=(addr, method, payloads, seconds, concurrency, q))
    cpu0 = _cpu_self()
    p.start()
    r = q.get(timeout=seconds + 120)
    server_cpu = _cpu_self() - cpu0
    p.join(10)
    lat = r["lat"]
    return {
        "calls_s": r["calls"] / r["seconds"],
        "p50_ms": 1000 * lat[len(lat) // 2],
        "p99_ms": 1000 * lat[min(len(lat) - 1, int(len(lat) * 0.99))],
        # per call; the server's includes the 20 warm-up calls (counted in)
        "server_cpu_ms": 1000 * server_cpu / (r["calls"] + 20),
        "client_cpu_ms": 1000 * r["cpu"] / max(1, r["calls"]),
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


def _requests(
    w: Workload, batch: int, n: int, max_pods: int = 0
) -> list[controller_pb2.BatchMatchPrefixRequest]:
    out = []
    for _ in range(n):
        req = controller_pb2.BatchMatchPrefixRequest()
        for q in w.queries(batch):
            req.requests.add(chunk_keys=common_pb2.ChunkKeys(keys=q), namespace_id=NS_ID, max_pods=max_pods)
        out.append(req)
    return out


def _calls_for(batch: int) -> int:
    """Distinct pre-built calls per measurement: ~16k distinct queries whatever the batch size, so
    every measurement touches a similar share of the index (cache misses are most of a lookup)."""
    return max(32, QUERIES_PER_RUN // batch)


def _serialized(reqs: list[controller_pb2.BatchMatchPrefixRequest], compact: bool) -> list[bytes]:
    out = []
    for r in reqs:
        r.compact = compact
        out.append(r.SerializeToString())
    return out


def _packed(reqs: list[controller_pb2.BatchMatchPrefixRequest]) -> list[bytes]:
    """The same batches in the packed request form (one key buffer per batch), compact answers."""
    out = []
    for r in reqs:
        qs = [list(q.chunk_keys.keys) for q in r.requests]
        p = controller_pb2.BatchMatchPrefixRequest(
            packed_chunk_keys=b"".join(b"".join(q) for q in qs),
            packed_query_chunks=[len(q) for q in qs],
            packed_namespace_id=NS_ID,
            packed_max_pods=r.requests[0].max_pods if len(r.requests) else 0,
            compact=True,
        )
        out.append(p.SerializeToString())
    return out


def _parse_us(raw: bytes, queries: int, reps: int = 50) -> float:
    """Microseconds per query a client spends parsing ``raw`` (a BatchMatchPrefixResponse)."""
    t0 = time.perf_counter()
    for _ in range(reps):
        controller_pb2.BatchMatchPrefixResponse.FromString(raw)
    return 1e6 * (time.perf_counter() - t0) / (reps * queries)


def _same_answers(
    readable: controller_pb2.BatchMatchPrefixResponse, compact: controller_pb2.BatchMatchPrefixResponse
) -> bool:
    """The compact form decodes to exactly the readable form."""
    if len(readable.responses) != len(compact.compact):
        return False
    for r, c in zip(readable.responses, compact.compact, strict=True):
        got = [
            (compact.pods[i].pod_uid, compact.pods[i].pod_name, g, lo, p)
            for i, g, lo, p in zip(c.pod_index, c.gpu_chunks, c.l1_chunks, c.peer_chunks, strict=True)
        ]
        want = [(m.pod_uid, m.pod_name, m.gpu_chunks, m.l1_chunks, m.peer_chunks) for m in r.matches]
        if got != want or (r.num_query_chunks, r.peer_fetchable_chunks) != (
            c.num_query_chunks,
            c.peer_fetchable_chunks,
        ):
            return False
    return True


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
    cfg = ControllerConfig(
        listen="127.0.0.1:0", max_batch=max(4096, args.batch), grpc_workers=16, lease_ttl_ms=3_600_000
    )
    srv = serve(cfg, index=mem_index)
    for p in evs:
        srv.controller.registry.register(_holder(p).pod, [NS_ID])
    srv.controller._refresh_holders()
    echo, echo_addr = _echo_server()
    try:
        one = _serialized(_requests(w, 1, 512, args.max_pods), compact=False)
        reqs = _requests(w, args.batch, _calls_for(args.batch), args.max_pods)
        readable = _serialized(reqs, compact=False)
        compact = _serialized(reqs, compact=True)
        packed = _packed(reqs)
        # sanity: the answers are real, and both forms say the same
        with grpc.insecure_channel(
            srv.address
        ) as ch:  # closed: no client threads left in the server's process
            call: grpc.UnaryUnaryMultiCallable[bytes, bytes] = ch.unary_unary(METHOD)
            raw_r, raw_c = call(readable[0]), call(compact[0])
            if call(packed[0]) != raw_c:
                raise AssertionError("packed and per-query BatchMatchPrefix requests answer differently")
        resp = controller_pb2.BatchMatchPrefixResponse.FromString(raw_r)
        resp_c = controller_pb2.BatchMatchPrefixResponse.FromString(raw_c)
        if not _same_answers(resp, resp_c):
            raise AssertionError("compact and readable BatchMatchPrefix answers differ")
        hits = sum(1 for r in resp.responses if r.matches)
        pods_listed = statistics.mean(len(r.matches) for r in resp.responses)
        parse_r, parse_c = _parse_us(raw_r, args.batch), _parse_us(raw_c, args.batch)
        ctl = srv.controller
        qs = [ctl.resolve(wire.prefix_query_from_proto(r)) for r in reqs[0].requests]
        inproc = {}
        for form in ("readable", "compact"):
            t0 = time.perf_counter()
            for _ in range(20):
                wire.batch_match_to_proto(ctl.match_queries(qs), form == "compact").SerializeToString()
            inproc[form] = 20 * len(qs) / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(20):
            preq = controller_pb2.BatchMatchPrefixRequest.FromString(packed[0])
            wire.batch_match_to_proto(
                ctl.match_packed(wire.packed_from_proto(preq)), True
            ).SerializeToString()
        inproc["packed"] = 20 * len(qs) / (time.perf_counter() - t0)
        unary = _drive(srv.address, METHOD, one, args.seconds, args.concurrency)
        batch = _drive(srv.address, METHOD, readable, args.seconds, args.concurrency)
        fast = _drive(srv.address, METHOD, compact, args.seconds, args.concurrency)
        fastp = _drive(srv.address, METHOD, packed, args.seconds, args.concurrency)
        echo_b = _drive(echo_addr, ECHO, compact, args.seconds, args.concurrency)
        sweep = {}
        for size in [int(x) for x in args.sweep.split(",") if x.strip()]:
            d = _drive(
                srv.address,
                METHOD,
                _serialized(_requests(w, size, _calls_for(size), args.max_pods), compact=True),
                args.seconds,
                args.concurrency,
            )
            sweep[size] = {
                "ops_s": d["calls_s"] * size,
                "p50_ms": d["p50_ms"],
                "p99_ms": d["p99_ms"],
                "server_cpu_us_per_query": 1000 * d["server_cpu_ms"] / size,
            }
        if mem_index.num_entries() != entries:
            raise AssertionError(
                f"index changed during the run: {mem_index.num_entries()} != {entries} entries"
            )
    finally:
        echo.stop(0)
        srv.stop(0)
    nb = args.batch
    match_ops = fast["calls_s"] * nb
    echo_ops = echo_b["calls_s"] * nb
    say(f"answers: {hits}/{len(resp.responses)} queries hit; {pods_listed:.1f} pods listed per answer")
    say(
        f"answer bytes per query: readable {len(raw_r) / nb:,.0f}, compact {len(raw_c) / nb:,.0f}; "
        f"client parse {parse_r:.1f} / {parse_c:.1f} us per query"
    )
    say(
        f"BatchMatchPrefix x{nb} in-process (no gRPC, incl. serialization): readable "
        f"{inproc['readable']:,.0f} queries/s, compact {inproc['compact']:,.0f} queries/s, "
        f"packed request + compact {inproc['packed']:,.0f} queries/s (incl. request parsing)"
    )
    for label, d, per in (
        ("MatchPrefix unary", unary, 1),
        ("readable batch", batch, nb),
        ("compact batch", fast, nb),
        ("packed request, compact batch", fastp, nb),
    ):
        say(
            f"{label} over gRPC: {d['calls_s'] * per:,.0f} queries/s, call p50 {d['p50_ms']:.2f} ms, "
            f"p99 {d['p99_ms']:.2f} ms; server CPU {1000 * d['server_cpu_ms'] / per:.1f} us/query, "
            f"client CPU {1000 * d['client_cpu_ms'] / per:.1f} us/query"
        )
    say(
        f"echo of the compact request bytes: {echo_ops:,.0f} queries/s, p99 {echo_b['p99_ms']:.2f} ms; "
        f"server CPU {1000 * echo_b['server_cpu_ms'] / nb:.1f} us/query"
    )
    for size, d in sweep.items():
        say(
            f"  compact x{size}: {d['ops_s']:,.0f} queries/s, call p50 {d['p50_ms']:.2f} ms, "
            f"p99 {d['p99_ms']:.2f} ms; server CPU {d['server_cpu_us_per_query']:.1f} us/query"
        )
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "pods": args.pods,
        "chunks": chunks,
        "entries": entries,
        "query_chunks": args.query_chunks,
        "batch": nb,
        "concurrency": args.concurrency,
        "max_pods": args.max_pods,
        "pods_listed_per_answer": pods_listed,
        "ingest_events_s": ingest,
        "dict_insert_limit_s": dict_rate,
        "bytes_per_entry": bpe,
        "answer_bytes_per_query": {"readable": len(raw_r) / nb, "compact": len(raw_c) / nb},
        "client_parse_us_per_query": {"readable": parse_r, "compact": parse_c},
        "match_inprocess_ops_s": inproc,
        "match_unary_ops_s": unary["calls_s"],
        "match_unary_p50_ms": unary["p50_ms"],
        "match_unary_p99_ms": unary["p99_ms"],
        "match_readable_ops_s": batch["calls_s"] * nb,
        "match_readable_p50_ms": batch["p50_ms"],
        "match_readable_p99_ms": batch["p99_ms"],
        "match_ops_s": match_ops,
        "match_p50_ms": fast["p50_ms"],
        "match_p99_ms": fast["p99_ms"],
        "match_packed_ops_s": fastp["calls_s"] * nb,
        "match_packed_p50_ms": fastp["p50_ms"],
        "match_packed_p99_ms": fastp["p99_ms"],
        "server_cpu_us_per_query": {
            "unary": 1000 * unary["server_cpu_ms"],
            "readable": 1000 * batch["server_cpu_ms"] / nb,
            "compact": 1000 * fast["server_cpu_ms"] / nb,
            "packed": 1000 * fastp["server_cpu_ms"] / nb,
        },
        "client_cpu_us_per_query": {
            "unary": 1000 * unary["client_cpu_ms"],
            "readable": 1000 * batch["client_cpu_ms"] / nb,
            "compact": 1000 * fast["client_cpu_ms"] / nb,
            "packed": 1000 * fastp["client_cpu_ms"] / nb,
        },
        "echo_ops_s": echo_ops,
        "echo_p99_ms": echo_b["p99_ms"],
        "echo_server_cpu_us_per_query": 1000 * echo_b["server_cpu_ms"] / nb,
        "compact_batch_sweep": sweep,
        "ratio_match_vs_echo": match_ops / echo_ops,
        "ratio_ingest_vs_dict": ingest / dict_rate,
        "ratio_key_bytes_vs_entry": 16 / bpe,
        "goals": GOALS,
        "goal_ratios": {
            "match_ops_s": match_ops / GOALS["match_ops_s"],
            "match_p99_ms": GOALS["match_p99_ms"] / fast["p99_ms"],
            "match_packed_ops_s": fastp["calls_s"] * nb / GOALS["match_ops_s"],
            "match_packed_p99_ms": GOALS["match_p99_ms"] / fastp["p99_ms"],
            "ingest_events_s": ingest / GOALS["ingest_events_s"],
            "bytes_per_entry": GOALS["bytes_per_entry"] / bpe,
        },
    }
    if args.json:
        print(json.dumps(result))
    else:
        print("goals (ratio >= 1 meets the goal):")
        for k, v in result["goal_ratios"].items():
            print(
                f"  {k}: goal {GOALS[k.replace('_packed', '')]:,} -> measured {result[k]:,.2f}  ratio {v:.2f}"
            )
    return 0
