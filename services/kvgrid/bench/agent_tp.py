"""``kvgrid bench agent --engines N``: the agent topology of a TP=N pod, measured.

N engine ranks (threads of the bench process, each with its own shared-memory or CUDA KV cache, its
own ``AgentClient`` and its own instance id) store and retrieve at the same time, served either by
one agent process (``--agents 1``, one L1 of N times the per-rank size) or by one agent process per
rank (``--agents N``, N L1s). Invariants the figures rely on:

- every round releases all ranks together (a barrier) and its aggregate rate is N ranks' bytes over
  the round's wall time, first start to last finish; the first round only warms up;
- the kernel-alone limit is measured in the same run with N ranks' ``TransferPlan`` copies at once,
  each into its own L1-like buffer;
- ranks store different tokens, so a shared agent never dedupes one rank's chunks against another's;
- agent CPU is the agents' user+system time (``/proc/<pid>/stat``) across the timed rounds;
- after timing, every rank stores fresh chunks, zeroes its KV cache, retrieves them and compares them
  bit-exact with what it held; a mismatch or a short store/retrieve fails the run (exit 1).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import torch

# agent_tp is the --engines mode of agent.py: the same dtypes, rounding and result header.
from kvgrid.bench.agent import _DTYPES, _result_header, _sig, _sync
from kvgrid.bench.agent_procs import AgentDidNotStart, shm_scratch, start_agent, stop_all

if TYPE_CHECKING:
    from kvgrid.bench.agent import AgentBenchConfig

__all__ = ["run_tp"]

_HINTS = {"backend": "FLASHINFER"}


class BenchFailed(Exception):
    """The run could not produce honest figures (an agent did not start, a call fell short)."""


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _Rank:
    """One engine rank: its KV cache (and shared-memory paths on cpu) and the block ids it moves."""

    def __init__(self, cfg: AgentBenchConfig, tmp: Path, rank: int) -> None:
        from kvgrid.common.layer_groups import KVLayerGroupsManager
        from kvgrid.common.layouts import detect_kv_format
        from kvgrid.engine.tensors import allocate_shared_tensor

        dtype = _DTYPES[cfg.dtype]
        num_blocks = cfg.tokens_per_chunk // cfg.block_size * cfg.chunks
        shape = (num_blocks, 2, cfg.block_size, cfg.kv_heads, cfg.head_size)
        self.tensors: list[torch.Tensor] = []
        self.paths: list[str] | None = [] if cfg.device == "cpu" else None
        for layer in range(cfg.layers):
            if self.paths is not None:
                path = tmp / f"rank{rank}-layer{layer}.kv"
                t = allocate_shared_tensor(path, shape, dtype)
                self.paths.append(str(path))
                t.copy_(torch.randn(shape, dtype=torch.float32).to(dtype))
            else:
                t = torch.randn(shape, device="cuda").to(dtype)
            self.tensors.append(t)
        self.manager = KVLayerGroupsManager(
            self.tensors,
            [detect_kv_format(t, _HINTS) for t in self.tensors],
            tokens_per_chunk=cfg.tokens_per_chunk,
        )
        self.ids = [list(range(num_blocks))]


def _round(pool: ThreadPoolExecutor, n: int, call: Callable[[int], None]) -> tuple[float, list[float]]:
    """Run ``call(rank)`` for all ranks released together; (wall seconds, per-call seconds)."""
    barrier = threading.Barrier(n)

    def one(rank: int) -> tuple[float, float]:
        barrier.wait()
        t0 = time.perf_counter()
        call(rank)
        return t0, time.perf_counter()

    spans = list(pool.map(one, range(n)))
    return max(e for _, e in spans) - min(s for s, _ in spans), [e - s for s, e in spans]


def _start_agent(uds: Path, l1_size: int, tmp: Path) -> subprocess.Popen[str]:
    try:
        proc, _ = start_agent(
            f"on {uds}",
            ["--uds-path", str(uds), "--tcp-port", "-1", "--l1-size", str(l1_size),
             "--shm-allowed-dirs", str(tmp), "--log-level", "warning"],
        )  # fmt: skip
    except AgentDidNotStart as e:
        raise BenchFailed(str(e)) from None
    return proc


def _figures(
    nbytes: int, walls: list[float], calls: list[float], kernel_walls: list[float]
) -> dict[str, float]:
    agent = nbytes / statistics.median(walls) / 1e9
    kernel = nbytes / statistics.median(kernel_walls) / 1e9
    q = statistics.quantiles(calls, n=100, method="inclusive")
    return {
        "agent_gbps": _sig(agent),
        "kernel_gbps": _sig(kernel),
        "ratio": _sig(agent / kernel),
        "p50_ms": _sig(statistics.median(calls) * 1e3),
        "p99_ms": _sig(q[98] * 1e3),
    }


def run_tp(cfg: AgentBenchConfig) -> int:
    try:
        with shm_scratch("kvgrid-bench-") as tmp:
            result = _measure(cfg, tmp)
    except BenchFailed as e:
        print(f"kvgrid bench agent: {e}", file=sys.stderr)
        return 1
    if cfg.json:
        print(json.dumps(result))
        return 0
    _print_table(cfg, result)
    return 0


def _measure(cfg: AgentBenchConfig, tmp: Path) -> dict[str, object]:
    from kvgrid.agent.transfer import kernel_group_pages
    from kvgrid.common.hashing import KeyNamespace, chunk_keys
    from kvgrid.engine.client import AgentClient
    from kvgrid_kernels import TransferPlan

    n = cfg.engines
    ranks = [_Rank(cfg, tmp, r) for r in range(n)]
    chunk_bytes = ranks[0].manager.bytes_per_chunk()
    per_rank = chunk_bytes * cfg.chunks
    pool = ThreadPoolExecutor(n)

    # Kernel alone: N ranks' plans at once, each into its own L1-like buffer.
    plans = [TransferPlan(kernel_group_pages(r.manager, r.tensors), cfg.tokens_per_chunk) for r in ranks]
    bufs = [
        list(
            torch.empty(per_rank, dtype=torch.uint8, pin_memory=cfg.device == "cuda")
            .view(cfg.chunks, chunk_bytes)
            .unbind(0)
        )
        for _ in ranks
    ]
    kernel_walls: dict[str, list[float]] = {"store": [], "retrieve": []}
    for i in range(cfg.iters + 1):
        for direction in ("store", "retrieve"):

            def copy(r: int, direction: str = direction) -> None:
                plan = plans[r]
                (plan.store if direction == "store" else plan.retrieve)(bufs[r], ranks[r].ids)
                _sync(cfg.device)

            wall, _ = _round(pool, n, copy)
            if i:
                kernel_walls[direction].append(wall)

    # Through the agents: one shared (L1 for N ranks) or one per rank.
    n_agents = 1 if cfg.agents == "1" else n
    l1_per_rank = per_rank * 3 + (64 << 20)
    procs: list[subprocess.Popen[str]] = []
    clients: list[AgentClient] = []
    walls: dict[str, list[float]] = {"store": [], "retrieve": []}
    calls: dict[str, list[float]] = {"store": [], "retrieve": []}
    try:
        for a in range(n_agents):
            procs.append(_start_agent(tmp / f"agent-{a}.sock", l1_per_rank * (n // n_agents), tmp))
        namespaces = [KeyNamespace(model="bench", tokens_per_chunk=cfg.tokens_per_chunk) for _ in ranks]
        for r, rank in enumerate(ranks):
            c = AgentClient(str(tmp / f"agent-{r % n_agents}.sock"), timeout_s=600)
            clients.append(c)
            c.register_kv_caches(
                f"rank{r}",
                rank.tensors,
                namespace=namespaces[r],
                shm_paths=rank.paths,
                layout_hints=[_HINTS] * len(rank.tensors),
            )

        def keys_for(r: int, i: int) -> list[bytes]:
            tokens = cfg.chunks * cfg.tokens_per_chunk
            return chunk_keys([(i * 100_003 + r * 7_919 + j) % 32_000 for j in range(tokens)], namespaces[r])

        cpu0 = wall0 = 0.0
        for i in range(cfg.iters + 1):
            if i == 1:  # the timed rounds start: CPU from here
                cpu0, wall0 = sum(_cpu_seconds(p.pid) for p in procs), time.perf_counter()
            keys = [keys_for(r, i) for r in range(n)]

            def store(r: int, keys: list[list[bytes]] = keys) -> None:
                got = clients[r].store(f"rank{r}", keys[r], ranks[r].ids).num_stored_chunks
                if got != cfg.chunks:
                    raise BenchFailed(f"rank {r} stored {got} of {cfg.chunks} chunks")

            def retrieve(r: int, keys: list[list[bytes]] = keys) -> None:
                got = clients[r].retrieve(f"rank{r}", "", keys[r], ranks[r].ids).num_retrieved_chunks
                _sync(cfg.device)
                if got != cfg.chunks:
                    raise BenchFailed(f"rank {r} retrieved {got} of {cfg.chunks} chunks")

            for direction, call in (("store", store), ("retrieve", retrieve)):
                wall, per_call = _round(pool, n, call)
                if i:
                    walls[direction].append(wall)
                    calls[direction].extend(per_call)
        agent_cpu = sum(_cpu_seconds(p.pid) for p in procs) - cpu0
        timed_wall = time.perf_counter() - wall0

        # Correctness, untimed: each rank's chunks come back bit-exact after its cache is zeroed.
        bit_exact: list[bool] = []
        for r, rank in enumerate(ranks):
            keys_v = keys_for(r, cfg.iters + 1)
            held = [t.clone() for t in rank.tensors]
            if clients[r].store(f"rank{r}", keys_v, rank.ids).num_stored_chunks != cfg.chunks:
                raise BenchFailed(f"rank {r}: the verification store fell short")
            for t in rank.tensors:
                t.zero_()
            got = clients[r].retrieve(f"rank{r}", "", keys_v, rank.ids).num_retrieved_chunks
            _sync(cfg.device)
            if got != cfg.chunks:
                raise BenchFailed(f"rank {r}: the verification retrieve fell short")
            bit_exact.append(all(torch.equal(h, t) for h, t in zip(held, rank.tensors, strict=True)))
        if not all(bit_exact):
            raise BenchFailed(
                f"retrieved bytes differ from the stored ones (bit-exact per rank: {bit_exact})"
            )
    finally:
        stop_all(clients, procs)
        pool.shutdown()

    total = per_rank * n
    return {
        "mode": "tp",
        **_result_header(cfg, chunk_bytes),
        "engines": n,
        "agents": cfg.agents,
        "agent_processes": len({p.pid for p in procs}),
        "store": _figures(total, walls["store"], calls["store"], kernel_walls["store"]),
        "retrieve": _figures(total, walls["retrieve"], calls["retrieve"], kernel_walls["retrieve"]),
        "agent_cpu_s": _sig(agent_cpu),
        "agent_cpu_cores": _sig(agent_cpu / timed_wall),
        "bit_exact": bit_exact,
    }  # fmt: skip


def _print_table(cfg: AgentBenchConfig, res: dict[str, object]) -> None:
    topology = "one shared agent" if cfg.agents == "1" else f"one agent per rank ({cfg.engines} agents)"
    print(
        f"{res['device']}: {cfg.engines} ranks at once, {topology}; each call {cfg.chunks} chunks x "
        f"{int(res['chunk_bytes']) / 2**20:.1f} MiB ({cfg.layers} layers, {cfg.kv_heads} heads x "  # type: ignore[call-overload]
        f"{cfg.head_size}, block {cfg.block_size}, {cfg.dtype})"
    )
    print(f"{'':10}{'agent GB/s':>12}{'kernel GB/s':>13}{'ratio':>8}{'p50 ms':>9}{'p99 ms':>9}")
    for direction in ("store", "retrieve"):
        d = res[direction]
        assert isinstance(d, dict)
        print(
            f"{direction:10}{d['agent_gbps']:>12.2f}{d['kernel_gbps']:>13.2f}{d['ratio']:>8.3f}"
            f"{d['p50_ms']:>9.2f}{d['p99_ms']:>9.2f}"
        )
    print(
        f"agent CPU: {res['agent_cpu_s']} s over the timed rounds ({res['agent_cpu_cores']} cores busy); "
        f"every rank's chunks came back bit-exact"
    )
