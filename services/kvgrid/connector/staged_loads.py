"""Layer-wise engine-side loads: the stages, a load in flight, and the CUDA pipeline that queues them.

Layer-wise loads (:meth:`kvgrid.connector.engine_copies.EngineCopier.scatter_staged`) copy the
layers in ``stages`` stages of consecutive layers, in order, and let each layer wait only for its
own stage (a layer-wise pipeline: loading stage s+1 overlaps the compute of stage s's layers). A
stage is moved by plans over just its layers (the chunk layout keeps each kernel group's layers
contiguous, so a stage's bytes of a chunk are one contiguous slice of it). On CUDA a stage moves by
DMA into one of two GPU buffers and is scattered from there, queued just in time by the engine's
thread (:class:`StagePipeline`: nothing waits on the GPU ahead of compute that does not need it); a
layer's attention waits for its stage's event on the engine's stream, and the step's end (or a layer
no stage names) for every stage's. On CPU (no DMA engine to overlap with) a stage is copied by the
engine's thread when its first layer asks for it.

Invariants: each layer reads its KV only after its own stage landed (CUDA: the engine's stream waits
for the stage's event; CPU: the stage is copied first); a load's lease ends once its last stage's
bytes left L1, or when the load is abandoned (after a device sync); the pipeline's own invariants
are on :class:`StagePipeline`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from kvgrid_kernels.cuda_driver import Driver
from kvgrid_kernels.plan import PreparedRetrieve, TransferHandle, TransferPlan

__all__ = ["StageCopier", "StagePart", "StagePipeline", "StagedLoad", "stage_bounds"]

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
class StagePart:
    """One kernel group's layers of one stage: ``plan`` moves bytes ``[offset, offset + nbytes)``
    of every chunk."""

    group: int
    offset: int
    nbytes: int
    plan: TransferPlan


class StageCopier(Protocol):
    """What a :class:`StagePipeline` uses of its copier (an ``engine_copies.EngineCopier``)."""

    pool: torch.Tensor
    """The mapped L1 file."""
    pool_device: torch.device
    stage_parts: list[list[StagePart]]
    """Per stage, one part per kernel group with layers in it."""
    stage_bytes: list[int]
    """Per stage, its bytes of one chunk."""

    def scatter_streams(self) -> list[torch.cuda.Stream]: ...

    def release_when_landed(self, handle: TransferHandle, release: Callable[[], Any]) -> None: ...


class StagedLoad:
    """A layer-wise load in flight: :meth:`wait` (stage) before a layer of that stage reads its KV,
    :meth:`finish` once the step's layers ran. Both run on the engine's thread.

    On CUDA its stages are queued by the copier's :class:`StagePipeline` when the engine first asks
    for them; ``events[s]`` is stage s's completion event once queued. On CPU ``copy_stage`` copies
    one stage now."""

    def __init__(
        self,
        num_stages: int,
        release: Callable[[], Any],
        *,
        copy_stage: Callable[[int], object] | None = None,
        pipeline: StagePipeline | None = None,
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


class StagePipeline:
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

    def __init__(self, copier: StageCopier) -> None:
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
            self.copier.release_when_landed(TransferHandle(landed), load._release)
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
