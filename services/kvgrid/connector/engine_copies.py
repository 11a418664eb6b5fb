"""Loads and stores copied by the engine itself, over the agent's shared L1 (connector option
``engine_copies``).

Why: the agent's kernels run in another CUDA context, which the GPU time-slices with the engine's;
a 1 GiB transfer from there cost the engine's compute 17-22 % and moved at 29-31 GB/s, while the
same kernels queued in the engine's own context cost it 1-2 % at 46-49 GB/s (docs/benchmarks.md,
"Engine step while KV moves"). So when the agent keeps its L1 pool in a shared file
(``l1_shared_dir``), the worker maps that file, builds the same :class:`~kvgrid.agent.transfer.ChunkMover`
over its own KV tensors, and per load:

1. one Retrieve with ``engine_copies``: the agent copies nothing, holds the leading ready chunks for
   the request (a lease) and answers their byte offsets in the file;
2. the worker queues the scatter on the mover's streams, after the engine's fence event (the
   runner's zeroing of fresh blocks), and records the load-done event after it: the engine's stream
   waits for that event on the GPU before it reads the blocks, as for an agent-side load;
3. once the copy landed a completer thread sends Release, which ends the lease.

Layer-wise loads (:meth:`EngineCopier.scatter_staged`) copy the layers in ``stages`` stages of
consecutive layers, in order, and let each layer wait only for its own stage (a layer-wise
pipeline: loading stage s+1 overlaps the compute of stage s's layers). A stage is moved by plans over
just its layers (the chunk layout keeps each kernel group's layers contiguous, so a stage's bytes of
a chunk are one contiguous slice of it). On CUDA a stage moves by DMA into one of two GPU buffers
and is scattered from there, queued just in time by the engine's thread (:class:`_StagePipeline`: nothing
waits on the GPU ahead of compute that does not need it); a layer's attention waits for its
stage's event on the engine's stream, and the step's end (or a layer no stage names) for every
stage's. On CPU (no DMA engine to overlap with) a stage is copied by the engine's thread when its
first layer asks for it.

Stores (:meth:`EngineCopier.gather`, on the worker's saver thread): a Store with ``engine_copies``
reserves the new chunks' pages in the agent and answers their offsets; the worker gathers its blocks
there after the engine's fence and, once the bytes are in L1, a second Store makes them visible (a
failed copy drops them). The engine's stream never waits for a store: the agent's context would
time-slice with the engine's compute (the same 17-22 % as a load), its own streams cost ~1-2 %.

Invariants: a leased chunk is referenced in the agent, so it is neither evicted nor rewritten while
the engine reads it; a reserved chunk is invisible to every reader until its store finishes; the
worker's mover and the agent's agree on the chunk layout (same ``layout_id``, checked at
registration, else the worker falls back to agent-side copies). The mapping is page-locked for the
engine's context (``cudaHostRegister``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvgrid.agent.l1 import host_register, map_shared_pool
from kvgrid.agent.transfer import ChunkMover, DoneSignal, build_mover, chunk_block_ids
from kvgrid.api.v1 import agent_pb2
from kvgrid.common.groups import EngineGroupInfo
from kvgrid_kernels.cuda_driver import Driver
from kvgrid_kernels.pages import KernelGroupPages
from kvgrid_kernels.plan import PreparedRetrieve, TransferHandle, TransferPlan

__all__ = ["EngineCopier", "StagedLoad", "open_engine_copier", "stage_bounds"]

log = logging.getLogger(__name__)


def stage_bounds(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """``stages`` (at most ``num_layers``) ranges of consecutive layers covering ``[0, num_layers)``.

    With at least 3 stages and more layers than stages, sizes shrink towards the end and the last
    stage holds one layer. Why: when a layer computes about as fast as its KV copies (Llama-3-8B at
    8k tokens on the H200: 0.58 ms against 0.59 ms), the compute of stage s starts once its copy
    landed and never catches up, so the hit ends near ``copied(s) + compute(stages s..last)`` for the
    worst s. Weights falling by one per stage (``stages - 1 - s + stages // 2``, the last stage
    excepted) keep that sum nearly even across stages (docs/benchmarks.md, "Stages queued just in
    time"). A large first stage also covers the engine's thread reaching layer 0 and queueing the
    next DMAs: 1 or 2 layers first measured slower (same section)."""
    n = max(1, min(stages, num_layers))
    if n < 3 or num_layers == n:
        sizes = [num_layers // n + (s < num_layers % n) for s in range(n)]
    else:
        sizes = [*_share(num_layers - 1, [n - 1 - s + n // 2 for s in range(n - 1)]), 1]
    bounds, lo = [], 0
    for size in sizes:
        bounds.append((lo, lo + size))
        lo += size
    return bounds


def _share(total: int, weights: list[int]) -> list[int]:
    """``total`` split in proportion to ``weights`` (largest remainders; each share >= 1, and
    ``total >= len(weights)``)."""
    extra, whole = total - len(weights), sum(weights)
    exact = [extra * w / whole for w in weights]
    shares = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: shares[i] - exact[i])
    for i in by_remainder[: extra - sum(shares)]:
        shares[i] += 1
    return [1 + x for x in shares]


@dataclass(frozen=True)
class _StagePart:
    """One kernel group's layers of one stage: ``plan`` moves bytes ``[offset, offset + nbytes)``
    of every chunk."""

    group: int
    offset: int
    nbytes: int
    plan: TransferPlan


class StagedLoad:
    """A layer-wise load in flight: :meth:`wait` (stage) before a layer of that stage reads its KV,
    :meth:`finish` once the step's layers ran. Both run on the engine's thread.

    On CUDA its stages are queued by the copier's :class:`_StagePipeline` when the engine first asks
    for them; ``events[s]`` is stage s's completion event once queued. On CPU ``copy_stage`` copies
    one stage now."""

    def __init__(
        self,
        num_stages: int,
        release: Callable[[], Any],
        *,
        copy_stage: Callable[[int], object] | None = None,
        pipeline: _StagePipeline | None = None,
        offsets: Sequence[int] = (),
        block_ids: Sequence[np.ndarray] = (),
        fence: torch.cuda.Event | None = None,
        failed: Callable[[], Any] | None = None,
    ) -> None:
        self.num_stages = num_stages
        self.offsets = list(offsets)
        self.block_ids = list(block_ids)  # per kernel group, every chunk's (the same for every stage)
        self.fence = fence  # CUDA: the first stage's copy waits for it (the runner's zeroing)
        self.events: list[torch.cuda.Event | None] = [None] * num_stages
        self._pipeline = pipeline
        self._waited: tuple[int, int] = (-1, 0)  # CUDA: (stage, stream) of the last stream wait
        self._copy_stage = copy_stage  # CPU: copies one stage now
        self._copied = 0  # CPU: stages [0, _copied) are in the blocks
        self._release: Callable[[], Any] | None = release
        self._failed = failed
        self.closed = False
        """CUDA: its copier closed before every stage was queued (the lease ended then); the engine's
        thread abandons it at its next wait."""

    def wait(self, stage: int) -> None:
        """The engine's KV of ``stage`` is loaded before anything queued after this call reads it
        (CUDA: the engine's stream waits on the GPU; CPU: copied now, with the stages before it)."""
        if self._pipeline is not None:
            stream = torch.cuda.current_stream()
            if (stage, stream.cuda_stream) != self._waited:  # a stage's later layers: already waited
                pipeline = self._pipeline
                event = pipeline.through(self, stage)
                if event is not None:
                    stream.wait_event(event)
                    pipeline.fill()  # the next DMAs after the layer's wait: it is what the host is late for
                self._waited = (stage, stream.cuda_stream)
            return
        while self._copied <= stage and self._copy_stage is not None:
            try:
                self._copy_stage(self._copied)
            except BaseException:
                self._end()
                raise
            self._copied += 1
        if self._copied >= self.num_stages:
            self._end()

    def stage_events(self) -> list[torch.cuda.Event]:
        """CUDA: each queued stage's completion event, in stage order (for timing; empty on CPU)."""
        return [e for e in self.events if e is not None]

    def finish(self) -> None:
        """Every stage is loaded before what is queued next (the step's end, or layers no hook named)."""
        for stage in range(self.num_stages):
            self.wait(stage)

    def take_release(self) -> Callable[[], Any] | None:
        """The lease's release, handed out once (None after): run once the last stage's bytes left
        L1, or when the load failed."""
        release, self._release = self._release, None
        return release

    def abandon(self) -> None:
        """CUDA, the engine's thread, after a failure queueing some stage or a closed copier (the
        device was synchronized): no more stage of this load is queued; its waits return at once,
        its lease ends, and the worker reports its blocks for recomputation (``failed``, once)."""
        self._pipeline = None
        self._end()
        failed, self._failed = self._failed, None
        if failed is not None:
            failed()

    def _end(self) -> None:
        self._copy_stage = None
        if (release := self.take_release()) is not None:
            release()


_SLOTS = 2  # GPU buffers of the pipeline: a stage's DMA lands in one while the other's is scattered


@dataclass
class _Landing:
    """One stage of one load whose DMA into buffer ``slot`` is queued; ``prepared`` per part: its
    scatter, tables already uploaded."""

    load: StagedLoad
    stage: int
    slot: int
    prepared: list[PreparedRetrieve]
    landed: torch.cuda.Event


class _StagePipeline:
    """CUDA layer-wise loads of one copier, queued just in time (docs/benchmarks.md, "Stages queued
    just in time").

    Jobs are (load, stage) pairs in the order the engine needs them: by stage, then by the order the
    loads arrived. A job moves by DMA (``cuMemcpyAsync`` per chunk, no SM work) from L1 into one of two
    GPU buffers on the DMA stream, then a scatter reads it from there in place. The engine's thread
    queues a job's scatter when a layer first asks for its stage and, once the engine's stream waits for
    it, DMAs until two are in flight again (:meth:`fill`). A DMA into a buffer waits only for the
    scatter that last read that buffer, so the copy engine runs the stages back to back while the other
    buffer is scattered. What makes that work: the scatter's tables (chunk offsets, block ids) are
    uploaded on the DMA stream just after its DMA (:meth:`TransferPlan.prepare_retrieve`), so a scatter
    is kernels only. (With its own upload, a scatter's few bytes queued on the copy engine behind the
    next DMA, and stages landed in pairs on the H200; one buffer with each DMA waiting for the
    scatter before it avoids that but leaves the copy engine idle ~0.35 ms per stage.)

    Why just in time: a stream that waits on the GPU stalls every stream mapped to the same
    hardware queue (``CUDA_DEVICE_MAX_CONNECTIONS``, default 8, which vLLM keeps). Queued all at
    once before layer 0, the scatters' waits sat ahead of the whole forward, and where a scatter
    stream shared the engine stream's queue the compute waited for the whole load (H200, 8k: a hit
    of 40.6 ms; 27.1 ms with 32 queues). Queued just in time, what is queued after a wait needs
    that stage anyway. The step's own pinned uploads go first (vLLM's order): one queued after a
    DMA waits for the whole DMA train (docs/benchmarks.md, *a pinned upload behind a DMA train*).

    Invariants: a buffer is rewritten only after the scatter that last read it (``freed``); the
    first stage of a load waits for the load's fence; a load's lease is released (on the completer
    thread) once its last stage's DMA landed, as only the DMAs read L1, or at once when the load is
    abandoned (after a device sync); queueing a DMA changes ``pending`` and ``landing`` only once
    everything that can fail succeeded; buffers grow only in :meth:`add` (the loader thread, before
    the forward), sized for the load's largest stage -- a replaced buffer is recorded on every
    scatter stream, so the allocator reuses it only after the scatters queued on it ran.
    """

    def __init__(self, copier: EngineCopier) -> None:
        self.copier = copier
        self.dma = torch.cuda.Stream(copier.pool_device)
        self.buffers: list[torch.Tensor | None] = [None] * _SLOTS
        self.freed: list[torch.cuda.Event | None] = [None] * _SLOTS  # each buffer's last scatter
        self.next_slot = 0
        self.pending: list[tuple[StagedLoad, int]] = []  # no DMA queued yet, in the engine's order
        self.landing: list[_Landing] = []  # DMA queued, scatter not yet (at most _SLOTS)
        self.lock = threading.Lock()

    def add(self, load: StagedLoad) -> None:
        """A load's stages join the schedule (the loader thread); when nothing is moving, the first
        job's DMA starts now, before the engine's first layer asks. (One only: a load of the same
        step added next goes before this load's second stage.)"""
        n = len(load.offsets)
        with self.lock, torch.cuda.device(self.copier.pool_device):
            before = self.pending
            jobs = before + [(load, s) for s in range(load.num_stages)]
            self.pending = sorted(jobs, key=lambda job: job[1])  # stable: arrival order within a stage
            try:
                self._grow(n * max(self.copier.stage_bytes))
                if not self.landing:
                    self._queue_dma()
            except BaseException:
                self.pending = [job for job in self.pending if job[0] is not load]
                load._pipeline = None  # the caller syncs and ends this load's lease
                raise

    def through(self, load: StagedLoad, stage: int) -> torch.cuda.Event | None:
        """Queue every job up to (``load``, ``stage``) (the engine's thread); that stage's event, or
        None when the load was abandoned."""
        with self.lock, torch.cuda.device(self.copier.pool_device):
            if load.closed:
                load.abandon()
                return None
            try:
                while load.events[stage] is None and load._pipeline is not None:
                    if not self.landing:
                        if not self.pending:  # never added, or dropped: a bug, not a hang
                            raise RuntimeError(f"stage {stage} of a load is not scheduled")
                        self._queue_dma()
                    self._queue_scatter(self.landing[0])
                    self.landing.pop(0)
            except Exception:
                self._abandon_unqueued(also=load)
            return load.events[stage]

    def fill(self) -> None:
        """Queue DMAs until two are in flight (the engine's thread, after :meth:`through`'s stream
        wait: when the host is behind the GPU, the layer's compute is queued before these calls)."""
        with self.lock, torch.cuda.device(self.copier.pool_device):
            try:
                while self.pending and len(self.landing) < _SLOTS:
                    self._queue_dma()
            except Exception:
                self._abandon_unqueued()

    def _abandon_unqueued(self, also: StagedLoad | None = None) -> None:
        """A stage failed to queue (inside the forward): log it, drop every unqueued job and abandon
        their loads (and ``also``), whose blocks the worker reports for recomputation."""
        log.exception("kvgrid: queueing a layer-wise load failed; its blocks are recomputed")
        for other in self._drop_unqueued(also=also):
            other.abandon()

    def _drop_unqueued(self, also: StagedLoad | None = None) -> list[StagedLoad]:
        """After a failure or at close: synchronize the device (queued copies read leased chunks and
        write the buffers and blocks: a rare path), forget every job not yet scattered, and answer
        their loads (and ``also``), which the caller abandons."""
        torch.cuda.synchronize(self.copier.pool_device)
        loads = {id(ld): ld for ld, _ in self.pending}
        loads.update((id(job.load), job.load) for job in self.landing)
        if also is not None:
            loads[id(also)] = also
        self.landing, self.pending, self.freed = [], [], [None] * _SLOTS
        return list(loads.values())

    def close(self) -> None:
        """The copier closes (its completer and mapping go next): loads with stages not yet queued
        end their leases now and are abandoned by the engine's thread at their next wait."""
        with self.lock, torch.cuda.device(self.copier.pool_device):
            if self.pending or self.landing:
                for load in self._drop_unqueued():
                    load.closed = True
                    load._end()

    def _queue_dma(self) -> None:
        load, stage = self.pending[0]
        parts = self.copier.stage_parts[stage]
        n, slot = len(load.offsets), self.next_slot
        buf = self.buffers[slot]
        assert buf is not None and buf.numel() >= n * self.copier.stage_bytes[stage]  # grown in add
        dma = self.dma
        if (freed := self.freed[slot]) is not None:
            dma.wait_event(freed)
        if stage == 0 and load.fence is not None:
            dma.wait_event(load.fence)  # the scatters wait for the DMAs, so for the runner's zeroing too
        drv, raw, pool_ptr = Driver.get(), dma.cuda_stream, self.copier.pool.data_ptr()
        regions, base = [], 0  # per part: its chunks' slices of the buffer, back to back
        for part in parts:
            regions.append(buf[base : base + n * part.nbytes])
            base += n * part.nbytes
        for part, region in zip(parts, regions, strict=True):
            dst = region.data_ptr()
            for c, o in enumerate(load.offsets):
                drv.memcpy_async(dst + c * part.nbytes, pool_ptr + o + part.offset, part.nbytes, raw)
        # The scatter's tables go up on the DMA stream after the bytes: the copy engine starts on
        # the bytes at once (this takes ~0.3 ms of host), and the scatter waits for both.
        prepared: list[PreparedRetrieve] = []
        with torch.cuda.stream(dma):
            for part, region in zip(parts, regions, strict=True):
                views = [region[c * part.nbytes : (c + 1) * part.nbytes] for c in range(n)]
                prepared.append(part.plan.prepare_retrieve(views, [load.block_ids[part.group]]))
        landed = torch.cuda.Event()
        landed.record(dma)
        if stage == load.num_stages - 1 and load._release is not None:
            self.copier._release_when_landed(TransferHandle(landed), load._release)
            load._release = None
        self.pending.pop(0)
        self.next_slot = (slot + 1) % _SLOTS
        self.landing.append(_Landing(load, stage, slot, prepared, landed))

    def _queue_scatter(self, job: _Landing) -> None:
        event = job.landed
        for part, prepared in zip(self.copier.stage_parts[job.stage], job.prepared, strict=True):
            done = part.plan.launch_prepared(prepared, wait_event=event).event
            assert done is not None  # CUDA: every launch records its event
            event = done
        self.freed[job.slot] = job.load.events[job.stage] = event

    def _grow(self, nbytes: int) -> None:
        """Every buffer with room for ``nbytes``, replaced when a longer load comes. A replaced
        buffer is freed once nothing references it (a DMA landing in it keeps it through its views
        until its scatter is queued); recorded on the scatter streams, its memory is reused only
        after them."""
        for slot, buf in enumerate(self.buffers):
            if buf is None or buf.numel() < nbytes:
                self.buffers[slot] = None
                with torch.cuda.stream(self.dma):  # allocated where it is first written
                    buf = torch.empty(nbytes, dtype=torch.uint8, device=self.copier.pool_device)
                for stream in self.copier.scatter_streams():
                    buf.record_stream(stream)
                self.buffers[slot] = buf


class EngineCopier:
    """The engine's mapping of one agent's L1 file and a mover over the engine's KV tensors."""

    def __init__(
        self,
        pool: torch.Tensor,
        l1_file: str,
        mover: ChunkMover,
        groups: Sequence[EngineGroupInfo],
        done: torch.cuda.Event | None,
        device: torch.device,
        *,
        registered: bool = False,
        stages: int = 0,
    ) -> None:
        self.pool = pool
        self.l1_file = l1_file
        self.mover = mover
        self.groups = list(groups)
        self.registered = registered
        """The mapping is page-locked for this process's CUDA context (shared with other copiers of
        the same file in this process; unregistered when the last one closes)."""
        self._done = DoneSignal(done, device) if done is not None else None
        # Releases leases in the order the copies were queued, once each landed.
        self._completer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvgrid-lease")
        self.pool_device = device
        self.stage_of_layer: dict[int, int] = {}
        """Index of a registered layer tensor -> its stage (layer-wise loads)."""
        self.stage_parts = self._build_stages(stages)
        """Per stage, one part per kernel group with layers in it."""
        self.stage_bytes = [sum(p.nbytes for p in parts) for parts in self.stage_parts]
        """Per stage, its bytes of one chunk."""
        self._pipeline = _StagePipeline(self) if device.type == "cuda" and self.stage_parts else None

    def scatter_streams(self) -> list[torch.cuda.Stream]:
        """CUDA: the streams the stages' scatters run on (one per stage plan)."""
        return [part.plan.kernel_stream for parts in self.stage_parts for part in parts]

    @property
    def num_stages(self) -> int:
        return len(self.stage_parts)

    def _build_stages(self, stages: int) -> list[list[_StagePart]]:
        """Per stage, one plan per kernel group over the group's layers in that stage. Kernel groups
        list their layers in registration order, so a stage's layers of a group are consecutive.
        ``stages`` 0: none (no layer-wise loads here)."""
        if stages < 1:
            return []
        manager = self.mover.manager
        plan = self.mover.plan
        layout = plan.layout
        num_layers = 1 + max(i for kg in manager.kernel_groups for i in kg.layer_indices)
        out: list[list[_StagePart]] = []
        for s, (lo, hi) in enumerate(stage_bounds(num_layers, stages)):
            self.stage_of_layer.update((i, s) for i in range(lo, hi))
            parts = []
            for k, kg in enumerate(manager.kernel_groups):
                mine = [j for j, i in enumerate(kg.layer_indices) if lo <= i < hi]
                if not mine:
                    continue
                j0, j1 = mine[0], mine[-1] + 1
                if mine != list(range(j0, j1)):
                    raise ValueError(f"kernel group {k}'s layers {list(kg.layer_indices)} are not in order")
                pages = plan.groups[k]
                geometry = dataclasses.replace(pages.geometry, num_layers=j1 - j0)
                sub = KernelGroupPages(pages.layers[j0:j1], geometry, name=pages.name)
                lb = layout.layer_bytes(k)
                part_plan = TransferPlan([sub], plan.tokens_per_chunk, graphs=False)  # prepared launches
                parts.append(_StagePart(k, layout.group_offsets[k] + j0 * lb, (j1 - j0) * lb, part_plan))
            out.append(parts)
        return out

    def scatter(
        self,
        offsets: Sequence[int],
        block_ids: Sequence[Sequence[int]],
        skip_first_n_tokens: int,
        *,
        fence: torch.cuda.Event | None,
        release: Callable[[], Any],
    ) -> None:
        """Queue the copy of the leased chunks at ``offsets`` into ``block_ids`` (one list per engine
        group, from token 0) and return; ``release`` runs once the bytes landed (or the copy
        failed). The load-done event is recorded after the copy."""
        handle = None
        try:
            if offsets:
                ids = self._chunk_ids(offsets, block_ids, skip_first_n_tokens)
                n = self.mover.bytes_per_chunk
                buffers = [self.pool[o : o + n] for o in offsets]
                handle = self.mover.retrieve_async(buffers, ids, wait_event=fence)
            if self._done is not None:
                self._done.after(handle)
        except BaseException:
            if handle is not None:
                handle.wait()  # queued copies still read the leased chunks
            elif offsets and self.pool_device.type == "cuda":
                torch.cuda.synchronize(self.pool_device)  # a plan that raised midway may have queued some
            release()
            raise
        if handle is None:
            release()
            return
        self._release_when_landed(handle, release)

    def gather(
        self,
        offsets: Sequence[int],
        block_ids: Sequence[Sequence[int]],
        chunks: Sequence[int],
        *,
        fence: torch.cuda.Event | None,
    ) -> None:
        """Copy the engine's blocks of chunk ``chunks[j]`` (indices into the request's chunks;
        ``block_ids`` one list per engine group from token 0) into the reserved L1 room at
        ``offsets[j]``, after ``fence`` on the GPU; return once the bytes are in L1. Raises only
        once nothing of it is still being written (the agent frees the room of a failed copy)."""
        self._check_offsets(offsets)
        if not chunks:
            return
        ids = chunk_block_ids(self.mover, self.groups, block_ids, range(max(chunks) + 1))
        n = self.mover.bytes_per_chunk
        try:
            self.mover.store(
                [self.pool[o : o + n] for o in offsets],
                [[per_chunk[i] for i in chunks] for per_chunk in ids],
                wait_event=fence,
            )
        except BaseException:
            if self.pool_device.type == "cuda":
                torch.cuda.synchronize(self.pool_device)  # a plan that raised midway may have queued some
            raise

    def _check_offsets(self, offsets: Sequence[int]) -> None:
        """The agent's chunk offsets lie inside the mapped file (copies may go by raw pointer):
        ValueError otherwise, and the copy is reported failed."""
        n, size = self.mover.bytes_per_chunk, self.pool.numel()
        for o in offsets:
            if o < 0 or o + n > size:
                raise ValueError(f"chunk offset {o}: expected 0 <= offset <= {size - n} in {self.l1_file!r}")

    def _chunk_ids(
        self, offsets: Sequence[int], block_ids: Sequence[Sequence[int]], skip_first_n_tokens: int
    ) -> list[list[np.ndarray]]:
        """Per kernel group, each leased chunk's block ids, once the offsets are checked."""
        self._check_offsets(offsets)
        chunks = range(len(offsets))
        return chunk_block_ids(
            self.mover, self.groups, block_ids, chunks, skip_first_n_tokens, allow_holes=True
        )

    def _release_when_landed(self, handle: TransferHandle, release: Callable[[], Any]) -> None:
        """``release`` on the completer thread once ``handle`` landed (in queueing order)."""

        def land() -> None:
            try:
                handle.wait()
            finally:
                release()

        self._completer.submit(land)

    def scatter_staged(
        self,
        offsets: Sequence[int],
        block_ids: Sequence[Sequence[int]],
        skip_first_n_tokens: int,
        *,
        fence: torch.cuda.Event | None,
        release: Callable[[], Any],
        failed: Callable[[], Any] | None = None,
    ) -> StagedLoad:
        """Like :meth:`scatter`, stage by stage (module docstring): the engine calls the answer's
        ``wait(stage)`` before a layer of that stage reads its KV. ``release`` runs once every stage
        landed (or a copy failed). On CUDA the stages are queued when the engine asks for them
        (:class:`_StagePipeline`); ``failed`` runs on the engine's thread if that fails, after the
        lease ended: the worker then reports the load's blocks for recomputation."""
        if not offsets:
            release()
            return StagedLoad(0, lambda: None)
        try:
            ids = self._chunk_ids(offsets, block_ids, skip_first_n_tokens)
            flat = [np.concatenate(per_chunk) for per_chunk in ids]
            # Refused now, as a whole load is: the stages copy later, inside the forward.
            self.mover.plan.check_retrieve_ids(flat, len(offsets))
        except BaseException:
            release()
            raise
        if self._pipeline is None:  # CPU copies are synchronous: one stage per wait

            def copy_stage(stage: int) -> None:
                for part in self.stage_parts[stage]:
                    buffers = [self.pool[o + part.offset : o + part.offset + part.nbytes] for o in offsets]
                    part.plan.retrieve_async(buffers, [flat[part.group]])

            # The lease ends on the completer thread, as on CUDA: not inside the engine's forward.
            return StagedLoad(self.num_stages, lambda: self._completer.submit(release), copy_stage=copy_stage)
        load = StagedLoad(
            self.num_stages, release, pipeline=self._pipeline, offsets=offsets, block_ids=flat, fence=fence,
            failed=failed,
        )  # fmt: skip
        try:
            self._pipeline.add(load)
        except BaseException:
            torch.cuda.synchronize(self.pool_device)  # a DMA may be queued: it reads the leased chunks
            if (end := load.take_release()) is not None:
                end()
            raise
        return load

    def close(self) -> None:
        if self._pipeline is not None:
            self._pipeline.close()
        self._completer.shutdown(wait=True)
        if self.registered:
            _MAPPINGS.release(self.l1_file)
            self.registered = False


class _Mappings:
    """One page-locked mapping per L1 file in this process, shared by every copier that reads it
    (engines of one process, or a copier re-opened for the same agent): a second
    ``cudaHostRegister`` of the same file's pages is not needed, and where it fails the second
    copier's DMAs would come from pageable memory, synchronous for the host."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_file: dict[str, tuple[torch.Tensor, int]] = {}

    def acquire(self, path: str, nbytes: int) -> tuple[torch.Tensor, bool]:
        """The file's mapping and whether it is page-locked (then :meth:`release` it once)."""
        with self._lock:
            held = self._by_file.get(path)
            if held is not None and held[0].numel() == nbytes:
                self._by_file[path] = (held[0], held[1] + 1)
                return held[0], True
            pool = map_shared_pool(path, nbytes)
            if not host_register(pool):  # writable: stores gather into it
                return pool, False
            self._by_file[path] = (pool, 1)
            return pool, True

    def release(self, path: str) -> None:
        with self._lock:
            pool, users = self._by_file[path]
            if users > 1:
                self._by_file[path] = (pool, users - 1)
                return
            del self._by_file[path]
            rc = int(torch.cuda.cudart().cudaHostUnregister(pool.data_ptr()))
            if rc:
                log.warning("kvgrid: cudaHostUnregister of %r returned %d", path, rc)


_MAPPINGS = _Mappings()


def open_engine_copier(
    reg: agent_pb2.RegisterKVCachesResponse,
    tensors: list[torch.Tensor],
    groups: Sequence[EngineGroupInfo],
    hints: Sequence[Any],
    done: torch.cuda.Event | None,
    *,
    stages: int = 0,
) -> EngineCopier | None:
    """An :class:`EngineCopier` for what RegisterKVCaches answered, or None (with a warning) when the
    agent's L1 is private or the engine cannot copy the agent's layout. ``stages``: layer-wise loads
    move the layers in that many stages (:meth:`EngineCopier.scatter_staged`; 0: no such loads)."""
    if not reg.l1_file:
        return None
    try:
        mover = build_mover(tensors, list(groups), reg.tokens_per_chunk, layout_hints=hints)
        if mover.layout_id != reg.layout_id:
            raise ValueError(f"chunk layout {mover.layout_id} here, {reg.layout_id} in the agent")
        if tensors[0].is_cuda:
            with torch.cuda.device(tensors[0].device):  # page-locked for the engine's context
                pool, registered = _MAPPINGS.acquire(reg.l1_file, reg.l1_file_bytes)
        else:
            pool, registered = map_shared_pool(reg.l1_file, reg.l1_file_bytes), False
    except (OSError, ValueError) as e:
        log.warning("kvgrid: engine-side copies off, the agent copies (%s)", e)
        return None
    try:
        return EngineCopier(
            pool, reg.l1_file, mover, groups, done, tensors[0].device, registered=registered, stages=stages
        )
    except Exception as e:  # e.g. layers out of order for stages, or a CUDA error building plans
        if registered:
            _MAPPINGS.release(reg.l1_file)
        log.warning("kvgrid: engine-side copies off, the agent copies (%s: %s)", type(e).__name__, e)
        return None
