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

Layer-wise loads (:meth:`EngineCopier.scatter_staged`) copy the layers in stages of consecutive
layers, each layer waiting only for its own stage (:mod:`kvgrid.connector.staged_loads`: the stages,
:class:`~kvgrid.connector.staged_loads.StagedLoad` and the CUDA pipeline that queues them just in
time); the copier builds one plan per stage and kernel group over just those layers.

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
from typing import Any

import numpy as np
import torch

from kvgrid.agent.l1 import host_register, map_shared_pool
from kvgrid.agent.transfer import ChunkMover, DoneSignal, build_mover, chunk_block_ids
from kvgrid.api.v1 import agent_pb2
from kvgrid.common.groups import EngineGroupInfo
from kvgrid.connector.staged_loads import StagedLoad, StagePart, StagePipeline, stage_bounds
from kvgrid_kernels.pages import KernelGroupPages
from kvgrid_kernels.plan import TransferHandle, TransferPlan

__all__ = ["EngineCopier", "open_engine_copier"]

log = logging.getLogger(__name__)


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
        self._pipeline = StagePipeline(self) if device.type == "cuda" and self.stage_parts else None

    def scatter_streams(self) -> list[torch.cuda.Stream]:
        """CUDA: the streams the stages' scatters run on (one per stage plan)."""
        return [part.plan.kernel_stream for parts in self.stage_parts for part in parts]

    @property
    def num_stages(self) -> int:
        return len(self.stage_parts)

    def _build_stages(self, stages: int) -> list[list[StagePart]]:
        """Per stage, one plan per kernel group over the group's layers in that stage. Kernel groups
        list their layers in registration order, so a stage's layers of a group are consecutive.
        ``stages`` 0: none (no layer-wise loads here)."""
        if stages < 1:
            return []
        manager = self.mover.manager
        plan = self.mover.plan
        layout = plan.layout
        num_layers = 1 + max(i for kg in manager.kernel_groups for i in kg.layer_indices)
        out: list[list[StagePart]] = []
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
                parts.append(StagePart(k, layout.group_offsets[k] + j0 * lb, (j1 - j0) * lb, part_plan))
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
        self.release_when_landed(handle, release)

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

    def release_when_landed(self, handle: TransferHandle, release: Callable[[], Any]) -> None:
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
        """Like :meth:`scatter`, stage by stage (:mod:`kvgrid.connector.staged_loads`): the engine
        calls the answer's ``wait(stage)`` before a layer of that stage reads its KV. ``release``
        runs once every stage landed (or a copy failed). On CUDA the stages are queued when the
        engine asks for them (:class:`StagePipeline`); ``failed`` runs on the engine's thread if
        that fails, after the lease ended: the worker then reports the load's blocks for
        recomputation."""
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
