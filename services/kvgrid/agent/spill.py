"""The tier writer's side of the L1 cache (:class:`~kvgrid.agent.cache.ChunkCache`), under its lock.

Lower tiers (optional, ``spill``): a chunk evicted from L1 that no lower tier holds yet leaves
the index at once (an evict event, invisible to readers) but keeps its pages until the tier
writer has written it (``begin_spill``/``end_spill``); eviction counts those pages as free to
come, so it does not evict more to make up for them. When a store or fetch cannot allocate, spills
the writer has not started are given up first (``dropped_spills``): the request path never waits
for a disk or the network. A Lookup may take a chunk back from the writer (``rescue_spilling``):
its pages still hold the bytes, so it returns to the index without I/O.

Invariant (spill reads): a chunk's pages are freed, and so may be reused, only when nothing reads
them: it is out of the index, unreferenced, and no spill write is reading them. A write reads them
from the ``begin_spill`` that let it start until its ``end_spill`` (``_spill_reads``, by chunk
object, not by key); a rescue does not end it. So a rescued chunk evicted again while its write is
in flight is neither freed (``clear``, an eviction for a fragmented pool, a tier already holding
the key) nor queued again nor given up: it goes back to waiting for that write, whose
``end_spill`` frees its pages. A later store never overwrites bytes a tier write is still reading
(which would put a record on disk whose bytes do not match the checksum hashed from them).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from kvgrid.agent.l1 import Chunk, L1Pool

if TYPE_CHECKING:
    from kvgrid.agent.cache import CacheListener
    from kvgrid.agent.eviction import EvictionPolicy

__all__ = ["SpillSide", "SpillSink"]


class SpillSink(Protocol):
    """Where chunks evicted from L1 go (``kvgrid.agent.tiers.TierChain``)."""

    def holds(self, namespace_id: str, key: bytes) -> bool: ...
    def submit(self, chunk: Chunk) -> None: ...


def index_key(namespace_id: str, key: bytes) -> bytes:
    """The index (and eviction-policy) key of ``key`` stored in ``namespace_id``: keys are fixed
    length, so ``key + namespace_id`` is unambiguous."""
    return key + namespace_id.encode()


class SpillSide:
    """Chunks evicted from L1 whose pages wait for the tier writer: give them up, take them back,
    and the writer's begin/end of a write. Part of :class:`~kvgrid.agent.cache.ChunkCache` (its
    state, its lock)."""

    _lock: threading.RLock
    _chunks: dict[bytes, Chunk]
    _spilling: dict[bytes, Chunk]
    _spill_reads: dict[int, Chunk]
    _spilling_bytes: int
    dropped_spills: int
    pool: L1Pool
    policy: EvictionPolicy
    listener: CacheListener

    def _drop_spills_locked(self, pages: int) -> None:
        """Give up queued spills (newest first: the writer takes the oldest next) until a run of
        ``pages`` pages is free. A spill the writer has started is never given up: it reads the
        pages until its ``end_spill``."""
        reads = self._spill_reads
        for ikey in [k for k, c in reversed(self._spilling.items()) if id(c) not in reads]:
            if self.pool.allocator.largest_free_run() >= pages:
                return
            chunk = self._spilling.pop(ikey)
            self._spilling_bytes -= chunk.num_pages * self.pool.page_bytes
            self.pool.free(chunk.start_page, chunk.num_pages)
            self.dropped_spills += 1

    def rescue_spilling(self, keys: Sequence[bytes], layout_id: str, *, namespace_id: str) -> int:
        """Put the leading ``keys`` that were evicted but still wait for the tier writer back into
        the index (their pages still hold the bytes; no I/O). Returns how many came back. A write
        already started goes on (it still reads the pages: they stay in ``_spill_reads``, so no
        eviction frees them before its ``end_spill``, which then leaves them to the index); a
        write not started yet is skipped (``begin_spill`` says False)."""
        admitted: list[bytes] = []
        with self._lock:
            for key in keys:
                ikey = index_key(namespace_id, key)
                chunk = self._spilling.get(ikey)
                if chunk is None or chunk.layout_id != layout_id or ikey in self._chunks:
                    break
                del self._spilling[ikey]
                self._spilling_bytes -= chunk.num_pages * self.pool.page_bytes
                self._chunks[ikey] = chunk
                self.policy.on_insert(ikey)
                admitted.append(key)
            if admitted:
                self.listener.on_admit(namespace_id, admitted)
        return len(admitted)

    def begin_spill(self, chunk: Chunk) -> bool:
        """The writer is about to read ``chunk``'s pages; False if the cache took them back, or if
        another write of this chunk is still reading them (it was queued twice: rescued before its
        write started, then evicted again; one write of the same bytes is enough). From True until
        :meth:`end_spill` the pages are never freed."""
        ikey = index_key(chunk.namespace_id, chunk.key)
        with self._lock:
            if self._spilling.get(ikey) is not chunk or id(chunk) in self._spill_reads:
                return False
            self._spill_reads[id(chunk)] = chunk
            return True

    def end_spill(self, chunk: Chunk) -> None:
        """The writer is done with ``chunk`` (written or failed; after a :meth:`begin_spill` that
        said True): free its pages, unless a rescue put it back into the index."""
        ikey = index_key(chunk.namespace_id, chunk.key)
        with self._lock:
            self._spill_reads.pop(id(chunk), None)
            if self._spilling.get(ikey) is chunk:
                del self._spilling[ikey]
                self._spilling_bytes -= chunk.num_pages * self.pool.page_bytes
                self.pool.free(chunk.start_page, chunk.num_pages)
