"""``kvgrid bench tier``: the disk tier's write (spill) and read-back GB/s against a raw sequential
write and read of the same bytes on the same filesystem, measured in the same run.

The chunks live in an L1 pool (``L1Pool``, page aligned, as in the agent). The tier side is the
agent's own path: ``TierChain.submit`` of each chunk to the background writer (checksum of the
bytes + one ``writev`` of header page and chunk into ``<name>.tmp``, rename), timed until the
writer drained; then ``TierChain.read_into`` of every chunk into a second pool (``readv`` +
header check + XXH3-128 verification). The limit is one file written with one ``os.write`` per
chunk of the same bytes, then read back with ``os.readv`` into the same buffers. Both go through
the page cache (no fsync on either side), so with less data than free RAM they measure the
kernel's copy speed rather than the device's; use ``--chunks`` large enough to exceed RAM for the
device. Ratios are tier / raw (goal >= 0.85); the median of ``--iters`` runs, raw and tier
alternating.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Annotated

import msgspec
import numpy as np

from kvgrid.agent.l1 import Chunk, L1Pool
from kvgrid.agent.tiers.base import HEADER_BYTES
from kvgrid.agent.tiers.disk import DiskBlobStore
from kvgrid.agent.tiers.tier import Tier, TierChain
from kvgrid.common.config import ByteSize, add_config_arguments, config_from_args

__all__ = ["TierBenchConfig", "add_arguments", "run"]

ENV_PREFIX = "KVGRID_BENCH_TIER_"


def _d(text: str) -> msgspec.Meta:
    return msgspec.Meta(description=text)


class TierBenchConfig(msgspec.Struct, frozen=True, kw_only=True):
    """``kvgrid bench tier``'s options: defaults < ``--config`` YAML < ``KVGRID_BENCH_TIER_*`` env < flags."""

    dir: Annotated[
        str, _d("directory on the filesystem to measure (a scratch subdirectory is made and removed)")
    ] = "/var/tmp"
    chunk_size: Annotated[ByteSize, _d("bytes per chunk (32MiB: a 256-token Llama-3-8B bf16 chunk)")] = (
        32 * 1024 * 1024
    )
    chunks: Annotated[int, _d("chunks written and read per run"), msgspec.Meta(gt=0)] = 16
    iters: Annotated[int, _d("runs per figure (median)"), msgspec.Meta(gt=0)] = 3
    json: Annotated[bool, _d("print one JSON object instead of a table")] = False


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, TierBenchConfig, env_prefix=ENV_PREFIX)


def _raw_write(path: Path, views: list[np.ndarray]) -> float:
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for v in views:
            mv = v.data
            while mv:
                mv = mv[os.write(fd, mv) :]
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def _raw_read(path: Path, views: list[np.ndarray]) -> float:
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        for v in views:
            mv = v.data
            while mv:
                n = os.readv(fd, [mv])
                if n == 0:
                    raise OSError(f"{path}: short read")
                mv = mv[n:]
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def _tier_write(chain: TierChain, chunks: list[Chunk]) -> float:
    t0 = time.perf_counter()
    for c in chunks:
        chain.submit(c)
    if not chain.drain(600):
        raise RuntimeError("tier writer did not drain in 600 s")
    return time.perf_counter() - t0


def _tier_read(chain: TierChain, chunks: list[Chunk], dst: list[np.ndarray]) -> float:
    t0 = time.perf_counter()
    # As the agent's Lookup reads tier chunks back: pipelined, verified.
    got = chain.read_many(
        chunks[0].namespace_id, chunks[0].layout_id, [(c.key, d) for c, d in zip(chunks, dst, strict=True)]
    )
    if len(got) != len(chunks):
        raise RuntimeError(f"tier read stopped after {len(got)} of {len(chunks)} chunks")
    return time.perf_counter() - t0


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(TierBenchConfig, args, env_prefix=ENV_PREFIX)
    base = Path(cfg.dir)
    if not base.is_dir():
        print(f"kvgrid bench tier: --dir {cfg.dir!r}: expected an existing directory", file=sys.stderr)
        return 2
    total = cfg.chunk_size * cfg.chunks
    page = 64 * 1024
    span = -(-cfg.chunk_size // page) * page
    src_pool = L1Pool(span * cfg.chunks, page_bytes=page, pin=False)
    dst_pool = L1Pool(span * cfg.chunks, page_bytes=page, pin=False)
    rng = np.random.default_rng(0)
    src = [src_pool.tensor[i * span : i * span + cfg.chunk_size].numpy() for i in range(cfg.chunks)]
    dst = [dst_pool.tensor[i * span : i * span + cfg.chunk_size].numpy() for i in range(cfg.chunks)]
    for v in src:
        v[:] = rng.integers(0, 256, v.nbytes, dtype=np.uint8)
    scratch = Path(tempfile.mkdtemp(prefix="kvgrid-bench-tier-", dir=base))
    times: dict[str, list[float]] = {"raw_write": [], "raw_read": [], "tier_write": [], "tier_read": []}
    ns, layout = "bench", "bench-layout"
    try:
        for it in range(cfg.iters):
            raw = scratch / "raw.bin"
            chain = TierChain(
                [Tier(DiskBlobStore(scratch / "tier"), (HEADER_BYTES + span) * (cfg.chunks + 1))]
            )
            try:
                chunks = [
                    Chunk(
                        i.to_bytes(16, "big"),
                        ns,
                        layout,
                        0,
                        1,
                        cfg.chunk_size,
                        src_pool.tensor[i * span :][: cfg.chunk_size],
                    )
                    for i in range(cfg.chunks)
                ]

                # Alternate which side goes first, so neither always meets a warmer cache.
                order: list[tuple[str, Callable[[], float], Callable[[], float]]] = [
                    ("raw", partial(_raw_write, raw, src), partial(_raw_read, raw, dst)),
                    ("tier", partial(_tier_write, chain, chunks), partial(_tier_read, chain, chunks, dst)),
                ]
                if it % 2:
                    order.reverse()
                for name, write, read in order:
                    times[f"{name}_write"].append(write())
                    times[f"{name}_read"].append(read())
                    if not all(np.array_equal(s, d) for s, d in zip(src, dst, strict=True)):
                        raise RuntimeError(f"{name} read back different bytes")
                    for d in dst:
                        d[:] = 0
                if chain.write_failures:
                    raise RuntimeError(f"{chain.write_failures} tier writes failed")
            finally:
                chain.close()
                raw.unlink(missing_ok=True)
                shutil.rmtree(scratch / "tier", ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    gbps = {k: total / statistics.median(v) / 1e9 for k, v in times.items()}
    result = {
        "dir": str(base),
        "chunk_bytes": cfg.chunk_size,
        "chunks": cfg.chunks,
        "iters": cfg.iters,
        # Four significant digits, not decimals: slow rates (a loaded VM) would lose their precision
        # and the printed ratios would no longer be the ratios of the printed figures.
        **{f"{k}_gbps": float(f"{v:.4g}") for k, v in gbps.items()},
        "write_ratio": float(f"{gbps['tier_write'] / gbps['raw_write']:.4g}"),
        "read_ratio": float(f"{gbps['tier_read'] / gbps['raw_read']:.4g}"),
    }
    if cfg.json:
        print(json.dumps(result))
        return 0
    print(
        f"disk tier vs raw sequential I/O in {base}: "
        f"{cfg.chunks} x {cfg.chunk_size} bytes, median of {cfg.iters}"
    )
    print(f"{'':8}{'raw GB/s':>10}{'tier GB/s':>11}{'ratio':>8}")
    for way in ("write", "read"):
        print(f"{way:8}{gbps[f'raw_{way}']:10.2f}{gbps[f'tier_{way}']:11.2f}{result[f'{way}_ratio']:8.2f}")
    return 0
