"""Chunk checksums: GB/s of each candidate over chunk-sized buffers, against a plain memory copy of
the same bytes measured in the same run (ratio = checksum GB/s / copy GB/s; 1.0 means checksumming a
chunk costs as much as copying it once).

Candidates: XXH3-128 (``xxhash``, the one kvgrid uses, ``kvgrid.common.checksum``), BLAKE2b-128
(hashlib, no dependency, cryptographic), CRC32 (zlib; weak, 32 bits, for reference). Single
thread, like the agent's store and fetch paths.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
import zlib
from collections.abc import Callable
from functools import partial
from typing import Annotated, Any

import msgspec
import numpy as np
import xxhash

from kvgrid.common.config import add_config_arguments, config_from_args

ENV_PREFIX = "KVGRID_BENCH_CHECKSUM_"
_WARMUP = 2


class ChecksumBenchConfig(msgspec.Struct, frozen=True, kw_only=True):
    """``kvgrid bench checksum``'s options: defaults < ``--config`` YAML < ``KVGRID_BENCH_CHECKSUM_*``
    env < flags."""

    sizes_kib: Annotated[list[int], msgspec.Meta(description="buffer sizes in KiB")] = msgspec.field(
        default_factory=lambda: [64, 1024, 32768]
    )
    min_bytes: Annotated[int, msgspec.Meta(description="bytes per timed run (at least)")] = 256 << 20
    repeat: Annotated[int, msgspec.Meta(description="timed runs per case; the median is reported")] = 7
    seed: Annotated[int, msgspec.Meta(description="seed of the random bytes")] = 0
    store_path: Annotated[
        bool,
        msgspec.Meta(
            description="also time the agent's store path: copy chunks of the largest size into an "
            "L1 pool and commit them (the commit computes the checksums); needs the agent extra (torch)"
        ),
    ] = True
    store_chunks: Annotated[int, msgspec.Meta(description="chunks per store in --store-path")] = 8
    json: Annotated[bool, msgspec.Meta(description="print one JSON object instead of text")] = False

    def __post_init__(self) -> None:
        if not self.sizes_kib or min(self.sizes_kib) <= 0:
            raise ValueError(f"--sizes-kib {self.sizes_kib}: expected sizes > 0")
        for name in ("min_bytes", "repeat", "store_chunks"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, ChecksumBenchConfig, env_prefix=ENV_PREFIX)


def _candidates() -> dict[str, Callable[[np.ndarray], object]]:
    return {
        "xxh3_128": lambda b: xxhash.xxh3_128_digest(b),
        "blake2b_128": lambda b: hashlib.blake2b(b, digest_size=16).digest(),
        "crc32": lambda b: zlib.crc32(b),
    }


def _aligned(nbytes: int, align: int = 64 * 1024) -> np.ndarray:
    """A uint8 array starting on an ``align`` boundary, as L1 chunks do (the pool's page size).

    Both sides of the copy aligned alike: numpy's default allocations put a 16-byte skew between two
    buffers, and on this AMD host glibc's ``rep movsb`` copy then runs at a tenth of its speed
    (4K aliasing), which would make the reference meaningless."""
    raw = np.empty(nbytes + align, dtype=np.uint8)
    skew = (-raw.ctypes.data) % align
    return raw[skew : skew + nbytes]


def _gbps(fn: Callable[[], object], nbytes: int, loops: int, repeat: int) -> float:
    for _ in range(_WARMUP):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(loops):
            fn()
        times.append(time.perf_counter() - t0)
    return nbytes * loops / statistics.median(times) / 1e9


def store_path(nbytes: int, chunks: int, repeat: int) -> dict[str, float]:
    """Median ms, per chunk, of the two passes a stored chunk's bytes get on the agent's own code:
    the copy into a freshly reserved L1 chunk (the engine's store) and the checksum the agent takes
    of that L1 chunk when it first serves it to a peer (``kvgrid.agent.peers.sender``). Both are timed
    directly, never as a difference of two timings (which noise can make negative)."""
    import torch

    from kvgrid.agent.cache import ChunkCache
    from kvgrid.agent.l1 import L1Pool
    from kvgrid.common.checksum import chunk_checksum

    cache = ChunkCache(
        L1Pool((chunks + 1) * nbytes, page_bytes=64 * 1024, pin=False), high_watermark=1.0, low_watermark=1.0
    )
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    copy_s: list[float] = []
    checksum_s: list[float] = []
    for it in range(repeat + 1):
        keys = [(it * chunks + i).to_bytes(16, "little") for i in range(chunks)]
        res = cache.reserve_store(keys, namespace_id="0" * 32, layout_id="L", nbytes=nbytes)
        t0 = time.perf_counter()
        for _, chunk in res.new_chunks:
            chunk.buffer.copy_(src)
        t1 = time.perf_counter()
        cache.commit(res)
        t2 = time.perf_counter()
        for _, chunk in res.new_chunks:
            chunk.checksum = chunk_checksum(chunk.buffer.numpy()[: chunk.nbytes])
        t3 = time.perf_counter()
        if it:  # the first round warms up
            copy_s.append((t1 - t0) / chunks)
            checksum_s.append((t3 - t2) / chunks)
        cache.clear()
    copy, checksum = (statistics.median(x) * 1e3 for x in (copy_s, checksum_s))
    return {
        "chunk_bytes": nbytes,
        "chunks": chunks,
        "copy_ms_per_chunk": copy,
        "checksum_ms_per_chunk": checksum,
        "checksum_to_copy": checksum / copy,
    }


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(ChecksumBenchConfig, args, env_prefix=ENV_PREFIX)
    rng = np.random.default_rng(cfg.seed)
    rows: list[dict[str, Any]] = []
    for kib in cfg.sizes_kib:
        nbytes = kib * 1024
        src = _aligned(nbytes)
        src[:] = rng.integers(0, 256, size=nbytes, dtype=np.uint8)
        dst = _aligned(nbytes)
        dst[:] = 0  # touch every page before timing
        loops = max(1, -(-cfg.min_bytes // nbytes))
        copy = _gbps(partial(np.copyto, dst, src), nbytes, loops, cfg.repeat)
        row: dict[str, Any] = {"size_kib": kib, "copy_gb_per_s": copy, "results": {}}
        for name, fn in _candidates().items():
            gbps = _gbps(partial(fn, src), nbytes, loops, cfg.repeat)
            row["results"][name] = {"gb_per_s": gbps, "ratio_to_copy": gbps / copy}
        rows.append(row)
    store = None
    if cfg.store_path:
        try:
            store = store_path(max(cfg.sizes_kib) * 1024, cfg.store_chunks, cfg.repeat)
        except ImportError as e:  # a torch-free install (no agent extra): no L1 pool to time
            print(f"store path not timed: {e} (needs the agent extra)")
    if cfg.json:
        out = {"repeat": cfg.repeat, "min_bytes": cfg.min_bytes, "rows": rows, "store_path": store}
        print(json.dumps(out, indent=2))
        return 0
    print(f"chunk checksums, one thread, median of {cfg.repeat} runs of >= {cfg.min_bytes >> 20} MiB each")
    for row in rows:
        print(f"  {row['size_kib']:>6} KiB  memory copy {row['copy_gb_per_s']:6.2f} GB/s")
        for name, r in row["results"].items():
            print(f"           {name:<12} {r['gb_per_s']:6.2f} GB/s   ratio {r['ratio_to_copy']:.2f}")
    if store is not None:
        print(
            f"  store path, {store['chunks']} x {int(store['chunk_bytes']) >> 10} KiB: copy into L1 "
            f"{store['copy_ms_per_chunk']:.2f} ms per chunk, checksum when first served "
            f"{store['checksum_ms_per_chunk']:.2f} ms per chunk, {store['checksum_to_copy']:.2f}x the copy"
        )
    return 0
