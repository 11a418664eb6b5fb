"""transfer kernels: store/retrieve GB/s per geometry vs the pinned-memcpy limit measured in the same run

For each geometry (Llama-3-8B in vLLM's unified and FlashAttention layouts, a sliding-window + full
attention hybrid, a DeepSeek-style MLA model) and each variant (``staged``: gather into GPU staging
+ pipelined DMA; ``direct``: zero-copy kernel writes/reads of pinned memory; ``torch``:
index_select/index_copy_ per layer; staged tuning variants), it times store and retrieve of 1 and 32
chunks and divides by the time of one contiguous pinned<->device copy of the same bytes.

GPU times are device time from the first to the last transfer operation (events), with the
stream held by a short sleep while the host queues the work, so host launch latency is excluded
from both the transfer and the limit (``ratio``). ``wall`` is one call after a full sync, queue +
wait, and ``h-ratio`` (host-inclusive) divides the same wall time of the pinned copy by it;
``queue_us`` is the host time to queue that one call (medians). ``staged``/``direct`` replay CUDA
graphs after a shape's first call; the ``-nograph`` variants queue call by call. With
``--lmcache-wheel``, LMCache 0.5.2's kernel is timed on the same KV tensors in the same run.
Also measured: how much a concurrent bf16 matmul slows down while 1 GiB moves.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..pages import KernelGroupPages, page_view
from ..plan import TransferHandle, TransferPlan
from . import lmcache_ref


@dataclass(frozen=True)
class GroupGeom:
    """One kernel group: ``shape`` is the per-layer tensor with the block axis at ``block_dim``."""

    num_layers: int
    shape: tuple[int, ...]  # with 0 where num_blocks goes
    block_dim: int
    plane_dim: int | None
    tokens_per_block: int
    dtype: torch.dtype = torch.bfloat16


GEOMETRIES: dict[str, tuple[str, list[GroupGeom]]] = {
    "llama3-8b": (
        "32 layers, 8 KV heads, head 128, block 16, bf16; vLLM unified [B,N,H,2*D] (NHD)",
        [GroupGeom(32, (0, 16, 8, 256), 0, None, 16)],
    ),
    "llama3-8b-fa": (
        "same, legacy FlashAttention [2,NB,16,8,128]: K and V planes",
        [GroupGeom(32, (2, 0, 16, 8, 128), 1, 0, 16)],
    ),
    "llama3-8b-fi": (
        "same, FlashInfer [NB,2,16,8,128]: K and V of a block adjacent (one page)",
        [GroupGeom(32, (0, 2, 16, 8, 128), 0, None, 16)],
    ),
    "hybrid-swa": (
        "40 sliding-window layers (block 32) + 8 full layers (block 16), 4 KV heads, head 256, bf16",
        [GroupGeom(40, (0, 32, 4, 512), 0, None, 32), GroupGeom(8, (0, 16, 4, 512), 0, None, 16)],
    ),
    "mla": (
        "DeepSeek-V3-style MLA: 61 layers [NB, 64, 576] bf16, block 64",
        [GroupGeom(61, (0, 64, 576), 0, None, 64)],
    ),
    "tiny": ("2 layers, 2 heads, head 8, block 4 (smoke test)", [GroupGeom(2, (0, 4, 2, 16), 0, None, 4)]),
}

TOKENS_PER_CHUNK = 256
VARIANTS_CUDA: dict[str, dict[str, Any]] = {
    "staged": {"mode": "staged"},  # the default: 2 MiB lead piece, then pieces up to 32 MiB
    "staged-nograph": {"mode": "staged", "graphs": False},  # queued call by call, no graph replay
    "staged-lead4": {"mode": "staged", "lead_bytes": 4 << 20},
    "staged-8MiB": {"mode": "staged", "pipeline_bytes": 8 << 20, "lead_bytes": 8 << 20, "staging_slots": 3},
    "staged-1piece": {"mode": "staged", "pipeline_bytes": 1 << 40, "lead_bytes": 1 << 40},
    "direct": {"mode": "direct"},
    "direct-nograph": {"mode": "direct", "graphs": False},
    "torch": {"mode": "torch"},
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where the KV cache lives: cuda (pinned L1, Triton kernels) or cpu (torch reference); "
        "default cuda when a GPU is visible",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    parser.add_argument(
        "--geometry", action="append", choices=sorted(GEOMETRIES), help="repeatable; default: all but tiny"
    )
    parser.add_argument("--chunks", default="1,32", help="comma-separated chunk counts (default 1,32)")
    parser.add_argument(
        "--variant", action="append", help=f"CUDA variants (default all: {', '.join(VARIANTS_CUDA)})"
    )
    parser.add_argument(
        "--repeats", type=int, default=0, help="timed repetitions (default: 25 for 1 chunk, 7 more)"
    )
    parser.add_argument("--no-matmul", action="store_true", help="skip the concurrent-matmul measurement")
    parser.add_argument(
        "--interference",
        action="store_true",
        help="also time an engine-like matmul loop while 1 GiB moves in another process and in a thread",
    )
    parser.add_argument(
        "--lmcache-wheel",
        help="an LMCache wheel (0.5.2): also time its multi_layer_kv_transfer kernel (into pinned "
        "memory, 1 chunk) on llama3-8b-fa, llama3-8b-fi and mla in the same run",
    )
    parser.add_argument("--out", help="also write the JSON document to this file")


# --------------------------------------------------------------------------------------- setup


def _make_groups(
    geoms: list[GroupGeom], max_chunks: int, device: str
) -> tuple[list[KernelGroupPages], list[Any]]:
    groups, keep = [], []
    for i, gg in enumerate(geoms):
        bpc = TOKENS_PER_CHUNK // gg.tokens_per_block
        nb = max_chunks * bpc + 64  # spare blocks so ids are a random subset
        shape = tuple(nb if s == 0 else s for s in gg.shape)
        views = []
        for _ in range(gg.num_layers):
            t = torch.empty(shape, dtype=gg.dtype, device=device)
            t.view(torch.uint8).random_(0, 256)  # random bytes, never zeros
            keep.append(t)
            views.append(page_view(t, gg.block_dim, gg.plane_dim))
        groups.append(KernelGroupPages.from_views(views, tokens_per_block=gg.tokens_per_block, name=f"g{i}"))
    return groups, keep


def _ids(plan: TransferPlan, n: int, rng: np.random.Generator) -> list[np.ndarray]:
    return [
        rng.permutation(g.num_blocks)[: n * bpc]
        for g, bpc in zip(plan.groups, plan.blocks_per_chunk, strict=True)
    ]


# --------------------------------------------------------------------------------------- timing


def _gpu_time(issue: Callable[[], torch.cuda.Event | None], repeats: int) -> tuple[float, float, float]:
    """(median device seconds, median wall seconds, median host seconds to queue). ``issue`` queues
    one operation after the current stream's work and returns its completion event (None: the
    current stream's position)."""
    cur = torch.cuda.current_stream()
    # wall time of one op, also sizes the gate that hides host queueing from the device timeline
    walls, issues = [], []
    for _ in range(max(5, repeats)):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ev = issue()
        issues.append(time.perf_counter() - t0)
        (ev or _record(cur)).synchronize()
        walls.append(time.perf_counter() - t0)
    gate_s = 2 * statistics.median(walls) + 2e-4
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(gate_s * 2.0e9))
        start = _record(cur)
        end = issue() or _record(cur)
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times), statistics.median(walls), statistics.median(issues)


def _record(stream: torch.cuda.Stream) -> torch.cuda.Event:
    ev = torch.cuda.Event(enable_timing=True)
    ev.record(stream)
    return ev


def _timed_handle(h: TransferHandle) -> torch.cuda.Event:
    assert h.event is not None
    return h.event


def _cpu_time(fn: Callable[[], None], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# --------------------------------------------------------------------------------------- runs


class _Op:
    """One store or retrieve of the first ``n`` chunks, rotating through block-id sets."""

    def __init__(
        self, plan: TransferPlan, chunks: list[torch.Tensor], id_sets: list[list[np.ndarray]], store: bool
    ):
        self.plan, self.chunks, self.id_sets, self.store = plan, chunks, id_sets, store
        self.k = 0

    def __call__(self) -> TransferHandle:
        ids = self.id_sets[self.k % len(self.id_sets)]
        self.k += 1
        if self.store:
            return self.plan.store_async(self.chunks, ids)
        return self.plan.retrieve_async(self.chunks, ids)

    def timed(self) -> torch.cuda.Event:
        return _timed_handle(self())

    def blocking(self) -> None:
        self().wait()


class _Copy:
    """One contiguous copy ``dst <- src`` on the current stream (the limit)."""

    def __init__(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.dst, self.src = dst, src

    def __call__(self) -> None:
        self.dst.copy_(self.src, non_blocking=True)


def _row(
    name: str,
    variant: str,
    direction: str,
    n: int,
    total: int,
    timing: tuple[float, float, float],
    limit: tuple[float, float, float],
) -> dict[str, Any]:
    dt, wall, queue = timing
    return {
        "geometry": name,
        "variant": variant,
        "direction": direction,
        "chunks": n,
        "bytes": total,
        "seconds": dt,
        "gbps": total / dt / 1e9,
        "wall_gbps": total / wall / 1e9,
        "queue_us": queue * 1e6,
        "limit_gbps": total / limit[0] / 1e9,
        "ratio": limit[0] / dt,
        # host-inclusive: one call after a sync, queue + wait, against the same for the pinned copy
        "limit_wall_gbps": total / limit[1] / 1e9,
        "host_ratio": limit[1] / wall,
        "limit_queue_us": limit[2] * 1e6,
    }


def _bench_geometry(
    name: str,
    geoms: list[GroupGeom],
    args: argparse.Namespace,
    chunk_counts: list[int],
    rows: list[dict[str, Any]],
) -> None:
    device = args.device
    max_chunks = max(chunk_counts)
    groups, keep = _make_groups(geoms, max_chunks, device)
    rng = np.random.default_rng(0)
    cuda = device == "cuda"
    variants = args.variant or (list(VARIANTS_CUDA) if cuda else ["torch"])
    nbytes = TransferPlan(groups, TOKENS_PER_CHUNK, mode="torch").bytes_per_chunk
    pool = torch.empty(max_chunks * nbytes, dtype=torch.uint8, pin_memory=cuda)
    pool.random_(0, 256)
    chunks = [pool[i * nbytes : (i + 1) * nbytes] for i in range(max_chunks)]
    dev_buf = torch.empty(max_chunks * nbytes, dtype=torch.uint8, device=device)
    dev_buf.random_(0, 256)
    for n in chunk_counts:
        repeats = args.repeats or (25 if n == 1 else 7)
        total = n * nbytes
        # the limit: one contiguous copy of the same bytes
        to_host, to_dev = _Copy(pool[:total], dev_buf[:total]), _Copy(dev_buf[:total], pool[:total])
        if cuda:
            lim_d2h = _gpu_time(to_host, repeats)
            lim_h2d = _gpu_time(to_dev, repeats)
        else:
            t = _cpu_time(to_host, repeats)
            lim_d2h = lim_h2d = (t, t, t)
        for variant in variants:
            plan = TransferPlan(groups, TOKENS_PER_CHUNK, **(VARIANTS_CUDA[variant] if cuda else {}))
            id_sets = [_ids(plan, n, rng) for _ in range(4)]
            for direction, limit in (("store", lim_d2h), ("retrieve", lim_h2d)):
                op = _Op(plan, chunks[:n], id_sets, direction == "store")
                if cuda:
                    op()  # warm-up: compile, staging allocation
                    torch.cuda.synchronize()
                    dt, wall, queue = _gpu_time(op.timed, repeats)
                else:
                    dt = wall = queue = _cpu_time(op.blocking, repeats)
                rows.append(_row(name, variant, direction, n, total, (dt, wall, queue), limit))
        if cuda and n == 1 and args.lmcache_ops is not None and name in lmcache_ref.FORMATS:
            lmc = lmcache_ref.LMCacheOp(
                args.lmcache_ops, name, keep, TOKENS_PER_CHUNK, geoms[0].tokens_per_block, rng
            )
            if lmc.nbytes != total:
                raise RuntimeError(f"{name}: LMCache object of {lmc.nbytes} B vs a {total} B chunk")
            for direction, limit in (("store", lim_d2h), ("retrieve", lim_h2d)):
                call = functools.partial(lmc, direction == "store")
                call()  # warm-up
                torch.cuda.synchronize()
                timing = _gpu_time(call, repeats)
                rows.append(_row(name, "lmcache-0.5.2", direction, n, lmc.nbytes, timing, limit))


def _matmul_slowdown(variants: list[str]) -> list[dict[str, Any]]:
    """Slowdown of back-to-back 8192^3 bf16 matmuls on the current stream while 1 GiB moves."""
    out: list[dict[str, Any]] = []
    geoms = GEOMETRIES["llama3-8b"][1]
    groups, _keep = _make_groups(geoms, 32, "cuda")
    nbytes = TransferPlan(groups, TOKENS_PER_CHUNK, mode="torch").bytes_per_chunk
    pool = torch.empty(32 * nbytes, dtype=torch.uint8, pin_memory=True)
    chunks = [pool[i * nbytes : (i + 1) * nbytes] for i in range(32)]
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    rng = np.random.default_rng(1)
    cur = torch.cuda.current_stream()

    def matmuls(k: int) -> None:
        for _ in range(k):
            torch.mm(a, b)

    matmuls(3)
    torch.cuda.synchronize()
    one = _gpu_time(functools.partial(matmuls, 1), 5)[0]
    for variant in variants:
        if VARIANTS_CUDA[variant]["mode"] not in ("staged", "direct"):
            continue
        plan = TransferPlan(groups, TOKENS_PER_CHUNK, **VARIANTS_CUDA[variant])
        ids = _ids(plan, 32, rng)
        plan.store(chunks, ids)  # warm-up
        move = _gpu_time(_Op(plan, chunks, [ids], store=True).timed, 3)[0]
        k = max(4, int(move / one))
        alone = _gpu_time(functools.partial(matmuls, k), 3)[0]
        for direction in ("store", "retrieve"):
            times, moves = [], []
            for _ in range(3):
                torch.cuda.synchronize()
                torch.cuda._sleep(int(0.05 * 2.0e9))  # the host queues both meanwhile
                start = _record(cur)
                h = (
                    plan.store_async(chunks, ids)
                    if direction == "store"
                    else plan.retrieve_async(chunks, ids)
                )
                matmuls(k)
                end = _record(cur)
                end.synchronize()
                h.wait()
                times.append(start.elapsed_time(end) / 1e3)
                moves.append(start.elapsed_time(_timed_handle(h)) / 1e3)
            with_t = statistics.median(times)
            out.append(
                {
                    "variant": variant,
                    "direction": direction,
                    "matmuls": k,
                    "matmul_alone_s": alone,
                    "matmul_with_transfer_s": with_t,
                    "slowdown_pct": (with_t / alone - 1) * 100,
                    "transfer_gbps_during": len(chunks) * nbytes / statistics.median(moves) / 1e9,
                }
            )
    return out


def run(args: argparse.Namespace) -> int:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available here; use --device cpu")
    chunk_counts = [int(x) for x in str(args.chunks).split(",") if x.strip()]
    if not chunk_counts or min(chunk_counts) <= 0:
        raise ValueError(f"--chunks {args.chunks!r}: expected positive comma-separated counts")
    for v in args.variant or ():
        if v not in VARIANTS_CUDA:
            raise ValueError(f"--variant {v!r}: expected one of {sorted(VARIANTS_CUDA)}")
    names = args.geometry or [g for g in GEOMETRIES if g != "tiny"]
    args.lmcache_ops = None
    if args.lmcache_wheel and args.device == "cuda":
        args.lmcache_ops = lmcache_ref.load_c_ops(args.lmcache_wheel)
    rows: list[dict[str, Any]] = []
    for name in names:
        _bench_geometry(name, GEOMETRIES[name][1], args, chunk_counts, rows)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    matmul: list[dict[str, Any]] = []
    if args.device == "cuda" and not args.no_matmul:
        matmul = _matmul_slowdown(args.variant or list(VARIANTS_CUDA))
    interference: list[dict[str, Any]] = []
    if args.device == "cuda" and args.interference:
        from . import interference as interference_mod

        interference = interference_mod.measure()
    meta: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "tokens_per_chunk": TOKENS_PER_CHUNK,
        "geometries": {n: GEOMETRIES[n][0] for n in names},
    }
    if args.device == "cuda":
        import triton

        meta["triton"] = triton.__version__
    doc = json.dumps(
        {"meta": meta, "results": rows, "matmul": matmul, "interference": interference}, indent=1
    )
    if args.out:
        with open(args.out, "w") as f:
            f.write(doc)
    if args.json:
        print(doc)
        return 0
    print(f"# {meta['device']}  torch {meta['torch']}  {meta.get('triton', '')}  {meta['date']}")
    head = [
        "geometry",
        "variant",
        "dir",
        "chunks",
        "MiB",
        "GB/s",
        "limit",
        "ratio",
        "wall",
        "h-ratio",
        "queue_us",
    ]
    print("{:12} {:14} {:8} {:>6} {:>7} {:>7} {:>7} {:>6} {:>7} {:>7} {:>8}".format(*head))
    for r in rows:
        print(
            f"{r['geometry']:12} {r['variant']:14} {r['direction']:8} {r['chunks']:6d} "
            f"{r['bytes'] / 2**20:7.1f} {r['gbps']:7.2f} {r['limit_gbps']:7.2f} {r['ratio']:6.3f} "
            f"{r['wall_gbps']:7.2f} {r['host_ratio']:7.3f} {r['queue_us']:8.1f}"
        )
    for m in matmul:
        print(
            f"matmul x{m['matmuls']} while 1 GiB {m['direction']}s ({m['variant']}): "
            f"{m['matmul_alone_s'] * 1e3:.2f} ms -> {m['matmul_with_transfer_s'] * 1e3:.2f} ms "
            f"(+{m['slowdown_pct']:.1f}%), transfer {m['transfer_gbps_during']:.1f} GB/s"
        )
    for m in interference:
        print(
            f"engine step while 1 GiB {m['direction']}s in {m['mover']}: {m['step_ms_alone']:.3f} ms -> "
            f"{m['step_ms_with_mover']:.3f} ms ({m['slowdown_pct']:+.1f}%), mover {m['mover_gbps']:.1f} GB/s"
        )
    return 0
