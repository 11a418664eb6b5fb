"""Loads copied by the engine itself, over the agent's shared L1 (connector option ``engine_copies``).

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

Invariants: a leased chunk is referenced in the agent, so it is neither evicted nor rewritten while
the engine reads it; the worker's mover and the agent's agree on the chunk layout (same
``layout_id``, checked at registration, else the worker falls back to agent-side loads). The
mapping is page-locked for the engine's context (``cudaHostRegister``, read-only: loads only read L1).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from kvgrid.agent.l1 import host_register, map_shared_pool
from kvgrid.agent.transfer import ChunkMover, DoneSignal, build_mover, chunk_block_ids
from kvgrid.api.v1 import agent_pb2
from kvgrid.common.groups import EngineGroupInfo

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
    ) -> None:
        self.pool = pool
        self.l1_file = l1_file
        self.mover = mover
        self.groups = list(groups)
        self.registered = registered
        """The mapping is page-locked for this process's CUDA context (unregistered at close)."""
        self._done = DoneSignal(done, device) if done is not None else None
        # Releases leases in the order the copies were queued, once each landed.
        self._completer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvgrid-lease")

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
                chunks = range(len(offsets))
                ids = chunk_block_ids(
                    self.mover, self.groups, block_ids, chunks, skip_first_n_tokens, allow_holes=True
                )
                n = self.mover.bytes_per_chunk
                buffers = [self.pool[o : o + n] for o in offsets]
                handle = self.mover.retrieve_async(buffers, ids, wait_event=fence)
            if self._done is not None:
                self._done.after(handle)
        except BaseException:
            release()
            raise
        if handle is None:
            release()
            return
        done = handle

        def land() -> None:
            try:
                done.wait()
            finally:
                release()

        self._completer.submit(land)

    def close(self) -> None:
        self._completer.shutdown(wait=True)
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.pool.data_ptr())
            self.registered = False


def open_engine_copier(
    reg: agent_pb2.RegisterKVCachesResponse,
    tensors: list[torch.Tensor],
    groups: Sequence[EngineGroupInfo],
    hints: Sequence[Any],
    done: torch.cuda.Event | None,
) -> EngineCopier | None:
    """An :class:`EngineCopier` for what RegisterKVCaches answered, or None (with a warning) when the
    agent's L1 is private or the engine cannot copy the agent's layout."""
    if not reg.l1_file:
        return None
    try:
        mover = build_mover(tensors, list(groups), reg.tokens_per_chunk, layout_hints=hints)
        if mover.layout_id != reg.layout_id:
            raise ValueError(f"chunk layout {mover.layout_id} here, {reg.layout_id} in the agent")
        pool = map_shared_pool(reg.l1_file, reg.l1_file_bytes)
    except (OSError, ValueError) as e:
        log.warning("kvgrid: engine-side copies off, the agent copies (%s)", e)
        return None
    registered = tensors[0].is_cuda and host_register(pool, read_only=True)
    return EngineCopier(pool, reg.l1_file, mover, groups, done, tensors[0].device, registered=registered)
