"""CUDA-graph replay of a whole transfer: the plan's host cost per call drops to a handful of
driver calls.

A transfer shape (mode, direction, chunk count, which (chunk, group) sections move, word sizes) is
run the regular way the first time it is seen (Triton compiles and loads its kernels); the second
time, the whole device side (block-id upload, every gather/scatter launch, every staging DMA and the
cross-stream ordering between them) is captured once into a graph on the plan's kernel stream and
instantiated ``INSTANCES`` times, each instance with its own pinned host buffer for the upload and
its own completion event. Every later call of that shape only:

- takes the next instance whose last replay completed (one event query; none free: regular path),
- writes its block ids (and, for ``direct``, chunk offsets) into that instance's host buffer,
- points the instance's DMA nodes at this call's chunk buffers if they moved
  (``cuGraphExecMemcpyNodeSetParams``),
- makes the kernel stream wait for the caller's stream (or ``wait_event``), launches the instance
  there and records its completion event, which the :class:`TransferHandle` carries.

Invariants:

- The device work and its order are those of the regular path (same kernels, same pieces, same
  staging slots, same DMAs), so the bytes written are identical; only the host side differs.
- Every replay runs on the kernel stream and rejoins it, so replays are ordered with each other
  (which is why the instances of a shape can share one device id buffer); the staging slots are
  shared with the regular path, and a switch between the two paths orders them through the slot
  events (see ``TransferPlan._use_staging``).
- An instance's host buffer is rewritten only after its previous replay completed (its event).
  A handle's event is re-recorded by a later replay of the same instance, so a handle may report
  "not done" longer than needed, never earlier.
- Updating an executable graph affects only later launches (CUDA guarantee), so a call never changes
  a transfer already queued.
- Any driver failure while capturing or updating, or a graph whose copy nodes are not exactly the
  expected upload and DMAs, disables graphs for the plan (the regular path from then on); the
  reason is kept in ``graph_error``.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .cuda_driver import CUDA_ERROR_NOT_READY, Driver, Memcpy3D

if TYPE_CHECKING:
    from .plan import TransferHandle, TransferPlan, _Piece

MAX_GRAPHS = 32  # shapes kept per plan (least recently used dropped)
INSTANCES = 4  # executable copies per shape: replays of one shape queued at once without waiting
MAX_SEEN = 4096  # shapes remembered as seen once (the next sighting captures)


@dataclass
class _DmaNode:
    node: int
    params: Memcpy3D  # this instance's copy (set_address mutates it)
    side: str  # the side that is a chunk buffer: "dst" (store) or "src" (retrieve)
    chunk: int
    offset: int  # bytes from the chunk buffer's start
    current: int  # the chunk-side address the executable graph holds now


@dataclass
class _Instance:
    exe: int
    host: torch.Tensor  # pinned int64: what the upload node copies to the shared device id buffer
    np: np.ndarray
    done: torch.cuda.Event  # recorded after each replay; handed out in the TransferHandle
    dmas: list[_DmaNode]


@dataclass
class _Graph:
    graph: int
    dev_ids: torch.Tensor  # the upload's destination, shared by the instances (replays are ordered)
    instances: list[_Instance] = field(default_factory=list)
    next: int = 0
    id_pos: np.ndarray | None = None  # staged: host-buffer words that take block ids ...
    id_src: np.ndarray | None = None  # ... and which entry of the concatenated ids each takes

    def destroy(self, drv: Driver) -> None:
        for inst in self.instances:
            # The host buffers go back to torch's pinned pool, which does not know the upload node
            # reads them: wait for the last replay first (the executable itself would be freed
            # after an in-flight launch anyway).
            inst.done.synchronize()
            drv.destroy_graph(inst.exe, 0)
        drv.destroy_graph(0, self.graph)
        self.instances = []
        self.graph = 0


def _pinned(words: int) -> torch.Tensor:
    return torch.empty(max(words, 1), dtype=torch.int64, pin_memory=True)


class GraphRunner:
    """The graph cache of one :class:`TransferPlan` (which calls it under its lock)."""

    def __init__(self, plan: TransferPlan) -> None:
        self.plan = plan
        self.drv = Driver.get()
        self.ctx = 0
        self.graphs: OrderedDict[tuple[Any, ...], _Graph] = OrderedDict()
        self.seen: set[tuple[Any, ...]] = set()
        self.error: str | None = None
        self.launches = 0  # transfers queued as graph replays (tests and benches read it)
        self._events: list[int] = []

    # ------------------------------------------------------------------ per call

    def run(
        self,
        key: tuple[Any, ...],
        chunks: list[torch.Tensor],
        ids: list[np.ndarray],
        to_chunk: bool,
        wait_event: torch.cuda.Event | None,
        pieces: list[_Piece] | None = None,
        aligns: tuple[int, ...] | None = None,
    ) -> TransferHandle | None:
        """Queue the transfer as a replay (``pieces`` for staged, ``aligns`` for direct), or return
        None (first sighting, every instance busy, failure): the caller runs the regular path."""
        if self.error is not None:
            return None
        g = self.graphs.get(key)
        if g is None and key not in self.seen:
            if len(self.seen) > MAX_SEEN:  # shapes seen once are only a hint: forget them in bulk
                self.seen.clear()
            self.seen.add(key)
            return None
        try:
            if g is None:
                g = self._capture(key, chunks, ids, pieces, aligns, to_chunk)
            else:
                self.graphs.move_to_end(key)
            return self._launch(g, chunks, ids, aligns, pieces is not None, wait_event)
        except Exception as e:  # any driver failure: the regular path from now on
            self.error = f"{type(e).__name__}: {e}"
            self.close()
            return None

    def _launch(
        self,
        g: _Graph,
        chunks: list[torch.Tensor],
        ids: list[np.ndarray],
        aligns: tuple[int, ...] | None,
        staged: bool,
        wait_event: torch.cuda.Event | None,
    ) -> TransferHandle | None:
        from .plan import TransferHandle

        plan, drv = self.plan, self.drv
        inst = g.instances[g.next]
        rc = drv.raw_event_query(inst.done.cuda_event)
        if rc:
            if rc == CUDA_ERROR_NOT_READY:
                return None  # its host buffer may still be read
            drv.check("cuEventQuery", rc)
        g.next = (g.next + 1) % len(g.instances)
        if g.id_pos is not None:
            flat = ids[0] if len(ids) == 1 else np.concatenate(ids)
            inst.np[g.id_pos] = flat[g.id_src]
        else:
            assert aligns is not None
            values = plan._direct_values(chunks, ids, aligns)
            np.concatenate(values, out=inst.np[: sum(v.size for v in values)])
        if inst.dmas:
            ptrs = [c.data_ptr() for c in chunks]
            for d in inst.dmas:
                addr = ptrs[d.chunk] + d.offset
                if addr != d.current:
                    d.params.set_address(d.side, addr)
                    rc = drv.raw_exec_memcpy_set(inst.exe, d.node, ctypes.byref(d.params), self.ctx)
                    drv.check("cuGraphExecMemcpyNodeSetParams", rc)
                    d.current = addr
        # The calls below are the whole per-transfer cost, so results are checked inline.
        ks = plan._kernel_stream.cuda_stream
        if wait_event is None:
            start = plan._start_event_raw
            if rc := drv.raw_event_record(start, plan._caller_raw_stream()):
                drv.check("cuEventRecord", rc)
            if rc := drv.raw_stream_wait_event(ks, start, 0):
                drv.check("cuStreamWaitEvent", rc)
        elif wait_event.cuda_event:  # like torch: waiting on a never-recorded event is a no-op
            drv.check("cuStreamWaitEvent", drv.raw_stream_wait_event(ks, wait_event.cuda_event, 0))
        if staged and plan._staging_user != "graph":
            plan._use_staging("graph")
        if rc := drv.raw_graph_launch(inst.exe, ks):
            drv.check("cuGraphLaunch", rc)
        if rc := drv.raw_event_record(inst.done.cuda_event, ks):
            drv.check("cuEventRecord", rc)
        self.launches += 1
        return TransferHandle(inst.done, (chunks,))

    # ------------------------------------------------------------------ capture

    def _event(self, i: int) -> int:
        while len(self._events) <= i:
            self._events.append(self.drv.event_create())
        return self._events[i]

    def _capture(
        self,
        key: tuple[Any, ...],
        chunks: list[torch.Tensor],
        ids: list[np.ndarray],
        pieces: list[_Piece] | None,
        aligns: tuple[int, ...] | None,
        to_chunk: bool,
    ) -> _Graph:
        with torch.cuda.device(self.plan.device):
            return self._capture_on_device(key, chunks, ids, pieces, aligns, to_chunk)

    def _capture_on_device(
        self,
        key: tuple[Any, ...],
        chunks: list[torch.Tensor],
        ids: list[np.ndarray],
        pieces: list[_Piece] | None,
        aligns: tuple[int, ...] | None,
        to_chunk: bool,
    ) -> _Graph:
        plan, drv = self.plan, self.drv
        if not self.ctx:
            self.ctx = drv.current_context()
        plan._start_raw()
        if pieces is not None:
            template = plan._staged_values(pieces, ids, first_slot=0)
        else:
            assert aligns is not None
            template = plan._direct_values(chunks, ids, aligns)
        sizes = [v.size for v in template]
        n = sum(sizes)
        host0 = _pinned(n)
        ks_t = plan._kernel_stream
        ks = ks_t.cuda_stream
        caller = torch.cuda.current_stream(plan.device)
        # Allocated on the kernel stream: a later reuse of this memory is ordered after the replays.
        torch.cuda.set_stream(ks_t)
        try:
            dev_ids = torch.empty(max(n, 1), dtype=torch.int64, device=plan.device)
            staging = plan._staging_buffer() if pieces is not None else None
            for i in range(2 * plan.staging_slots + 2):  # every event the capture uses exists first
                self._event(i)
            parts, off = [], 0
            for size in sizes:
                parts.append(dev_ids[off : off + size])
                off += size
            drv.begin_capture(ks)
            graph = 0
            try:
                if n:
                    drv.memcpy_async(dev_ids.data_ptr(), host0.data_ptr(), n * 8, ks)
                if pieces is None:
                    assert aligns is not None
                    plan._launch_direct(chunks, parts, aligns, to_chunk, ks)
                else:
                    assert staging is not None
                    self._sequence_staged(chunks, parts, pieces, to_chunk, staging)
            finally:
                graph = drv.end_capture(ks)
        finally:
            torch.cuda.set_stream(caller)
        g = _Graph(graph, dev_ids)
        try:
            # Captured kernel nodes would run at the graph's default priority, behind the engine's
            # kernels; the regular path's gathers/scatters run on the high-priority kernel stream.
            drv.set_kernel_priorities(graph, drv.stream_priority(ks))
            upload, dmas = self._index_nodes(g.graph, chunks, dev_ids.data_ptr(), host0.data_ptr(), n)
            if pieces is not None and len(dmas) != len(pieces):
                raise RuntimeError(f"captured {len(dmas)} DMA nodes for {len(pieces)} pieces")
            if pieces is not None:  # staged: the slot offsets are constants, only ids change
                g.id_pos, g.id_src = _id_positions(sizes, pieces, ids, plan.layout.blocks_per_chunk)
            for i in range(INSTANCES):
                host = host0 if i == 0 else _pinned(n)
                hnp = host.numpy()
                np.concatenate(template, out=hnp[:n])
                exe = drv.instantiate(graph, node_priority=True)
                inst = _Instance(exe, host, hnp, torch.cuda.Event(enable_timing=True), [])
                g.instances.append(inst)
                if upload is not None and i > 0:
                    node, params = upload
                    mine = Memcpy3D.from_buffer_copy(params)
                    mine.set_address("src", host.data_ptr())
                    drv.check(
                        "cuGraphExecMemcpyNodeSetParams",
                        drv.raw_exec_memcpy_set(exe, node, ctypes.byref(mine), self.ctx),
                    )
                for node, params, side, c, offset, addr in dmas:
                    inst.dmas.append(_DmaNode(node, Memcpy3D.from_buffer_copy(params), side, c, offset, addr))
                inst.done.record(ks_t)  # creates the event; a fresh instance is free at once
        except Exception:
            g.destroy(drv)
            raise
        self.graphs[key] = g
        if len(self.graphs) > MAX_GRAPHS:
            _, old = self.graphs.popitem(last=False)
            old.destroy(drv)
        return g

    def _sequence_staged(
        self,
        chunks: list[torch.Tensor],
        parts: list[torch.Tensor],
        pieces: list[_Piece],
        to_chunk: bool,
        staging: torch.Tensor,
    ) -> None:
        """The regular staged order (``TransferPlan._run_staged``) with capture-local events: slot
        ``k % S`` for piece ``k``, gathers on the kernel stream, DMAs on the first copy stream."""
        plan, drv = self.plan, self.drv
        ks = plan._kernel_stream.cuda_stream
        cs = plan._copy_streams[0].cuda_stream
        slots = plan.staging_slots
        ready = [self._event(i) for i in range(slots)]
        free = [self._event(slots + i) for i in range(slots)]
        fork, join = self._event(2 * slots), self._event(2 * slots + 1)
        base = staging.data_ptr()
        used = [False] * slots

        def record(ev: int, stream: int) -> None:
            drv.check("cuEventRecord", drv.raw_event_record(ev, stream))

        def wait(stream: int, ev: int) -> None:
            drv.check("cuStreamWaitEvent", drv.raw_stream_wait_event(stream, ev, 0))

        if not to_chunk:
            record(fork, ks)
            wait(cs, fork)
        for k, piece in enumerate(pieces):
            s = k % slots
            slot_addr = base + s * plan._slot_bytes
            chunk_addr = chunks[piece.chunk].data_ptr() + piece.offset
            if to_chunk:
                if used[s]:
                    wait(ks, free[s])
                plan._launch_piece(piece, parts[2 * k], parts[2 * k + 1], True, ks)
                record(ready[s], ks)
                wait(cs, ready[s])
                drv.memcpy_async(chunk_addr, slot_addr, piece.nbytes, cs)
                record(free[s], cs)
            else:
                if used[s]:
                    wait(cs, free[s])
                drv.memcpy_async(slot_addr, chunk_addr, piece.nbytes, cs)
                record(ready[s], cs)
                wait(ks, ready[s])
                plan._launch_piece(piece, parts[2 * k], parts[2 * k + 1], False, ks)
                record(free[s], ks)
            used[s] = True
        record(join, cs)  # the copy stream rejoins the kernel stream (a capture must end joined)
        wait(ks, join)

    def _index_nodes(
        self, graph: int, chunks: list[torch.Tensor], dev_ids: int, host: int, n: int
    ) -> tuple[tuple[int, Memcpy3D] | None, list[tuple[int, Memcpy3D, str, int, int, int]]]:
        """The upload node (host buffer -> ``dev_ids``) and, per DMA node, its chunk side."""
        ranges = [(c.data_ptr(), c.data_ptr() + c.numel()) for c in chunks]
        upload = None
        dmas = []
        for node, params in self.drv.memcpy_nodes(graph):
            src, dst = params.address("src"), params.address("dst")
            if src == host and dst == dev_ids and upload is None:
                upload = (node, params)
                continue
            for side, addr in (("dst", dst), ("src", src)):
                hit = next((i for i, (lo, hi) in enumerate(ranges) if lo <= addr < hi), None)
                if hit is not None:
                    dmas.append((node, params, side, hit, addr - ranges[hit][0], addr))
                    break
            else:
                raise RuntimeError(f"graph memcpy node {src:#x} -> {dst:#x} matches no chunk buffer")
        if n and upload is None:
            raise RuntimeError("the captured graph has no upload node")
        return upload, dmas

    def close(self) -> None:
        # best effort: also runs at interpreter teardown, when the driver may be gone
        for g in self.graphs.values():
            with contextlib.suppress(Exception):
                g.destroy(self.drv)
        self.graphs.clear()
        for ev in self._events:
            with contextlib.suppress(Exception):
                self.drv.event_destroy(ev)
        self._events = []

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # never raise under GC
            self.close()


def _id_positions(
    sizes: list[int], pieces: list[_Piece], ids: list[np.ndarray], blocks_per_chunk: tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray]:
    """Staged upload layout (per piece: slot offset word, then its chunk's block ids of its group):
    the host-buffer positions of block ids and their index into the groups' concatenated ids."""
    group_base = np.cumsum([0, *(v.size for v in ids)])
    pos, src, off = [], [], 0
    for k, piece in enumerate(pieces):
        bpc = blocks_per_chunk[piece.group]
        first = int(group_base[piece.group]) + piece.chunk * bpc
        pos.append(np.arange(off + sizes[2 * k], off + sizes[2 * k] + bpc))
        src.append(np.arange(first, first + bpc))
        off += sizes[2 * k] + sizes[2 * k + 1]
    return np.concatenate(pos), np.concatenate(src)
