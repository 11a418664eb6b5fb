"""How much an engine's step slows down while KV moves, with the mover in another process (its own
CUDA context, as the sidecar agent runs its kernels) or in a thread of the engine's process (the
engine's context, as engine-side kernels over shared pinned memory would run).

The engine is a loop of steps of one 8192^3 bf16 matmul each (device time per step from events,
median). The mover stores (or retrieves) 1 GiB (32 chunks of Llama-3-8B KV, the default staged
plan, its own KV tensors and pinned pool) back to back for the whole measuring window and reports
its GB/s. Steps alone are measured in the same run, right before. MPS is not used: it would change
how the machine's GPU is shared for everyone on it.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

STEPS = 150
MATMUL = 8192
CHUNKS = 32


def _mover_setup() -> tuple[Any, list[torch.Tensor], list[np.ndarray], list[Any]]:
    from ..plan import TransferPlan
    from .transfer import GEOMETRIES, TOKENS_PER_CHUNK, _ids, _make_groups

    groups, keep = _make_groups(GEOMETRIES["llama3-8b"][1], CHUNKS, "cuda")
    plan = TransferPlan(groups, TOKENS_PER_CHUNK)
    pool = torch.empty(CHUNKS * plan.bytes_per_chunk, dtype=torch.uint8, pin_memory=True)
    chunks = [pool[i * plan.bytes_per_chunk : (i + 1) * plan.bytes_per_chunk] for i in range(CHUNKS)]
    ids = _ids(plan, CHUNKS, np.random.default_rng(5))
    for _ in range(3):  # warm-up: compile, staging, graph capture
        plan.store(chunks, ids)
        plan.retrieve(chunks, ids)
    return plan, chunks, ids, [keep, pool]


def _move_until(
    plan: Any, chunks: list[torch.Tensor], ids: list[np.ndarray], store: bool, stop: Any
) -> float:
    """Transfers back to back until ``stop()``; returns GB/s."""
    moved, t0 = 0, time.perf_counter()
    while not stop():
        (plan.store if store else plan.retrieve)(chunks, ids)
        moved += len(chunks) * plan.bytes_per_chunk
    return moved / (time.perf_counter() - t0) / 1e9


def _move_into(
    out: list[float], plan: Any, chunks: list[torch.Tensor], ids: list[np.ndarray], store: bool, stop: Any
) -> None:
    out.append(_move_until(plan, chunks, ids, store, stop.is_set))


def _mover_process(conn: Connection) -> None:
    plan, chunks, ids, _keep = _mover_setup()
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg == "quit":
            return
        conn.send(_move_until(plan, chunks, ids, msg == "store", conn.poll))
        conn.recv()  # the "stop" that ended the loop


def _steps(a: torch.Tensor, b: torch.Tensor, n: int) -> float:
    """Median device ms of one step (one matmul) over ``n`` back-to-back steps."""
    evs = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    evs[0].record()
    for i in range(n):
        torch.mm(a, b)
        evs[i + 1].record()
    evs[-1].synchronize()
    return statistics.median(evs[i].elapsed_time(evs[i + 1]) for i in range(n))


def measure() -> list[dict[str, Any]]:
    a = torch.randn(MATMUL, MATMUL, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(MATMUL, MATMUL, dtype=torch.bfloat16, device="cuda")
    _steps(a, b, 10)
    rows: list[dict[str, Any]] = []
    # another process: its own context
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_mover_process, args=(child,), daemon=True)
    proc.start()
    try:
        if parent.recv() != "ready":
            raise RuntimeError("mover process did not start")
        for direction in ("store", "retrieve"):
            alone = _steps(a, b, STEPS)
            parent.send(direction)
            time.sleep(0.05)  # the mover is moving
            with_mover = _steps(a, b, STEPS)
            parent.send("stop")
            gbps = parent.recv()
            rows.append(_row("another process", direction, alone, with_mover, gbps))
        parent.send("quit")
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.kill()
    # a thread of this process: the same context as the engine
    plan, chunks, ids, _keep = _mover_setup()
    for direction in ("store", "retrieve"):
        alone = _steps(a, b, STEPS)
        stop = threading.Event()
        result: list[float] = []
        t = threading.Thread(target=_move_into, args=(result, plan, chunks, ids, direction == "store", stop))
        t.start()
        time.sleep(0.05)
        with_mover = _steps(a, b, STEPS)
        stop.set()
        t.join()
        rows.append(_row("same process (thread)", direction, alone, with_mover, result[0]))
    return rows


def _row(where: str, direction: str, alone: float, with_mover: float, gbps: float) -> dict[str, Any]:
    return {
        "mover": where,
        "direction": direction,
        "step_ms_alone": alone,
        "step_ms_with_mover": with_mover,
        "slowdown_pct": (with_mover / alone - 1) * 100,
        "mover_gbps": gbps,
    }
