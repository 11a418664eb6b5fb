"""Key -> chunk store over the L1 pool: prefix lookups, reservations that commit all-or-nothing,
reference counts, request holds (pins, leases), and watermark eviction that never touches a chunk
in use.

Byte movement is not done here: a store *reserves* chunks (fresh pool pages, invisible to readers),
the caller copies into them, then *commits* (or *aborts*, which frees them). A retrieve *acquires*
the leading hits (refcount +1, so eviction cannot take them mid-copy), copies, then *releases*.

Every state change and every event callback happens under one lock, so a snapshot's key set and
its last event sequence number always agree.

Lower tiers (optional, ``spill``): a chunk evicted from L1 that no lower tier holds yet keeps its
pages until the tier writer has written it; the writer's side, and the invariant that keeps those
pages from reuse while a write reads them, are ``kvgrid.agent.spill`` (:class:`SpillSide`).

Request holds (lookup pins with a TTL, engine-copies leases) are references the table in
``kvgrid.agent.holds`` owns (:attr:`ChunkCache.holds`); due pins expire before every walk that
may allocate.

Pending chunks (asynchronous promotion from a lower tier, ``kvgrid.agent.promotion``): a chunk may
be committed before its bytes are read (``Chunk.ready`` unset), referenced by its promotion so
eviction cannot take it. Readers of bytes use :meth:`ChunkCache.acquire_ready_prefix`, which waits
for them and stops at a failed one; :meth:`finish_pending` / :meth:`fail_pending` end them. A
failed chunk leaves the index at once (an evict event) and its pages are freed when its last
reference goes, so a reader still holding it never sees its pages reused.

Tenant isolation: chunks are indexed by (namespace_id, key), never by key alone. Every read (prefix
walk, pin, acquire, ``contains``, ``layout_of``) names the reader's namespace and sees only chunks
stored in that namespace; a chunk another namespace stored under the same key is invisible to it
(a plain miss, ``not_found``: its layout or presence is never revealed), and a store in one
namespace neither reuses nor displaces another namespace's chunk under the same key.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvgrid.agent.eviction import EvictionPolicy, LRUPolicy
from kvgrid.agent.holds import Owner, RequestHolds
from kvgrid.agent.l1 import Chunk, L1Pool
from kvgrid.agent.spill import SpillSide, SpillSink
from kvgrid.agent.spill import index_key as _index_key
from kvgrid.common.agent_results import MissCause

__all__ = [
    "CacheListener",
    "CacheStats",
    "ChunkCache",
    "MissCause",
    "SpillSink",
    "StoreReservation",
]


class CacheListener(Protocol):
    """Receives admit/evict notifications, called with the cache lock held (keep it quick)."""

    def on_admit(self, namespace_id: str, keys: Sequence[bytes]) -> None: ...
    def on_evict(self, namespace_id: str, keys: Sequence[bytes]) -> None: ...
    def last_sequence(self) -> int: ...


class _NullListener:
    def on_admit(self, namespace_id: str, keys: Sequence[bytes]) -> None:
        return None

    def on_evict(self, namespace_id: str, keys: Sequence[bytes]) -> None:
        return None

    def last_sequence(self) -> int:
        return 0


@dataclass
class StoreReservation:
    """What a store will hold once committed: per requested chunk index, the chunk (``new`` ones
    are freshly reserved and must be filled by the caller)."""

    namespace_id: str
    layout_id: str
    entries: list[tuple[int, Chunk, bool]] = field(default_factory=list)  # (index, chunk, new)
    stopped_at: int | None = None
    """Index of the first chunk that could not be reserved (memory pressure), None if all fit."""
    reason: str = ""
    done: bool = False

    @property
    def new_chunks(self) -> list[tuple[int, Chunk]]:
        return [(i, c) for i, c, new in self.entries if new]


@dataclass(frozen=True)
class CacheStats:
    capacity_bytes: int
    used_bytes: int
    num_chunks: int
    num_pins: int
    evictions: int
    evicted_bytes: int
    allocation_failures: int
    spilling_chunks: int = 0
    """Chunks evicted from L1 whose pages wait for the tier writer."""
    dropped_spills: int = 0
    """Evicted chunks never written to a lower tier (L1 needed their pages first)."""


def _index_suffix(namespace_id: str) -> bytes:
    """What :func:`~kvgrid.agent.spill.index_key` appends to every key of ``namespace_id`` (hot
    loops compute it once)."""
    return namespace_id.encode()


class ChunkCache(SpillSide):
    """The L1 chunk index, by (namespace_id, key). Thread-safe."""

    def __init__(
        self,
        pool: L1Pool,
        policy: EvictionPolicy | None = None,
        *,
        high_watermark: float = 0.95,
        low_watermark: float = 0.85,
        listener: CacheListener | None = None,
        clock: Callable[[], float] = time.monotonic,
        spill: SpillSink | None = None,
    ) -> None:
        if not 0.0 < low_watermark <= high_watermark <= 1.0:
            raise ValueError(
                f"watermarks low={low_watermark}, high={high_watermark}: expected 0 < low <= high <= 1"
            )
        self.pool = pool
        self.policy = policy if policy is not None else LRUPolicy()
        self.high_watermark = high_watermark
        self.low_watermark = low_watermark
        self.listener: CacheListener = listener if listener is not None else _NullListener()
        self._lock = threading.RLock()
        self._chunks: dict[bytes, Chunk] = {}  # by _index_key(namespace_id, key)
        # Pins and leases of engine requests (references, under this lock).
        self.holds = RequestHolds(self, clock)
        self.evictions = 0
        self.evicted_bytes = 0
        self.allocation_failures = 0
        self.spill = spill
        self._spilling: dict[bytes, Chunk] = {}  # by index key: out of the index, pages held
        # id(chunk) -> chunk, from begin_spill to end_spill: a write reads its pages (never freed).
        self._spill_reads: dict[int, Chunk] = {}
        self._spilling_bytes = 0
        self.dropped_spills = 0

    # ---- queries -------------------------------------------------------------------------

    def _walk(
        self, keys: Sequence[bytes], namespace_id: str, layout_id: str
    ) -> tuple[list[Chunk], MissCause]:
        hits: list[Chunk] = []
        get, suffix = self._chunks.get, _index_suffix(namespace_id)
        for key in keys:
            chunk = get(key + suffix)
            if chunk is None:
                return hits, MissCause.NOT_FOUND
            if chunk.layout_id != layout_id:
                return hits, MissCause.LAYOUT_MISMATCH
            hits.append(chunk)
        return hits, MissCause.NONE

    def contains(self, key: bytes, *, namespace_id: str) -> bool:
        """Whether ``namespace_id`` holds ``key``."""
        with self._lock:
            return _index_key(namespace_id, key) in self._chunks

    def layout_of(self, key: bytes, *, namespace_id: str) -> str | None:
        """layout_id of the chunk ``namespace_id`` holds under ``key``, None if it holds none."""
        with self._lock:
            chunk = self._chunks.get(_index_key(namespace_id, key))
            return None if chunk is None else chunk.layout_id

    def prefix_length(
        self, keys: Sequence[bytes], layout_id: str, *, namespace_id: str
    ) -> tuple[int, MissCause]:
        """Leading chunks ``namespace_id`` holds (no refs taken, no LRU touch)."""
        with self._lock:
            hits, cause = self._walk(keys, namespace_id, layout_id)
            return len(hits), cause

    def acquire_prefix(
        self, keys: Sequence[bytes], layout_id: str, *, namespace_id: str
    ) -> tuple[list[Chunk], MissCause]:
        """Leading hits of ``namespace_id`` with a reference each (release them with :meth:`release`)."""
        with self._lock:
            self.holds.expire_locked()
            hits, cause = self._walk(keys, namespace_id, layout_id)
            touch, suffix = self.policy.on_access, _index_suffix(namespace_id)  # every hit is namespace_id's
            for c in hits:
                c.refcount += 1
                touch(c.key + suffix)
            return hits, cause

    def acquire_ready_prefix(
        self, keys: Sequence[bytes], layout_id: str, *, namespace_id: str
    ) -> tuple[list[Chunk], MissCause]:
        """:meth:`acquire_prefix`, then wait for chunks still being promoted from a lower tier; the
        run stops before the first whose promotion failed (cause ``tier_failed``). Only chunks
        whose bytes are final and verified come back (referenced)."""
        chunks, cause = self.acquire_prefix(keys, layout_id, namespace_id=namespace_id)
        for i, c in enumerate(chunks):
            # Waits outside the lock (the promotion needs it to finish); a chunk that never was
            # pending is ready, so it costs no call.
            if (c.ready is not None or c.failed) and not c.wait_ready():
                self.release(chunks[i:])
                return chunks[:i], MissCause.TIER_FAILED
        return chunks, cause

    def _deref_locked(self, c: Chunk) -> None:
        c.refcount -= 1
        if c.failed and c.refcount == 0:
            self.pool.free(c.start_page, c.num_pages)  # out of the index since it failed

    def release(self, chunks: Iterable[Chunk]) -> None:
        with self._lock:
            for c in chunks:
                if c.refcount <= 0:
                    raise AssertionError(f"chunk {c.key.hex()} released more often than acquired")
                self._deref_locked(c)

    # ---- store ---------------------------------------------------------------------------

    def reserve_store(
        self,
        keys: Sequence[bytes],
        *,
        namespace_id: str,
        layout_id: str,
        nbytes: int,
        skip_first_n: int = 0,
    ) -> StoreReservation:
        """Reserve room for every missing chunk, in order, stopping at the first that does not fit.

        Present chunks (same namespace and layout) are referenced, not copied again. Chunks before
        ``skip_first_n`` are only referenced if present. A key held with another layout is
        treated as a collision and stops the store there (reason ``layout_mismatch``).
        """
        res = StoreReservation(namespace_id=namespace_id, layout_id=layout_id)
        entries, get, touch = res.entries, self._chunks.get, self.policy.on_access
        suffix = _index_suffix(namespace_id)
        with self._lock:
            self.holds.expire_locked()
            for i, key in enumerate(keys):
                ikey = key + suffix
                chunk = get(ikey)
                if chunk is not None:
                    if chunk.layout_id != layout_id:
                        res.stopped_at, res.reason = i, f"layout_mismatch: chunk {i} held with another layout"
                        break
                    chunk.refcount += 1
                    touch(ikey)
                    entries.append((i, chunk, False))
                    continue
                if i < skip_first_n:
                    continue
                got = self._allocate_locked(nbytes)
                if got is None:
                    self.allocation_failures += 1
                    res.stopped_at = i
                    res.reason = (
                        f"l1_full: chunk {i} of {len(keys)} needs {nbytes} bytes; "
                        f"{self.pool.used_bytes} of {self.pool.capacity_bytes} bytes in use and "
                        f"nothing evictable"
                    )
                    break
                start, pages, view = got
                new = Chunk(key, namespace_id, layout_id, start, pages, nbytes, view, refcount=1)
                entries.append((i, new, True))
        return res

    def commit_pending(self, res: StoreReservation, upto: int) -> tuple[int, dict[int, Chunk]]:
        """Commit the entries of chunk index < ``upto`` before their bytes are in: each new chunk
        pending (``Chunk.ready`` unset) with one reference for whoever fills it, which
        :meth:`finish_pending` or :meth:`fail_pending` drops. Returns the leading chunks held and,
        by chunk index, the new chunks this commit made visible (a key another store committed
        first keeps that copy; ours is freed and must not be filled)."""
        fresh = {i: c for i, c, new in res.entries if new and i < upto}
        for c in fresh.values():
            c.ready = threading.Event()
            c.refcount += 1  # the filler's reference: outlives the commit
        held, _ = self.commit(res, upto=upto)
        return held, {i: c for i, c in fresh.items() if c.committed}

    def commit(self, res: StoreReservation, upto: int | None = None) -> tuple[int, int]:
        """Make reserved chunks visible. Returns (leading chunks held, chunks already present).

        A key that another store committed meanwhile keeps the first copy; ours is freed. With
        ``upto``, only entries of chunk index < ``upto`` are committed and the rest are aborted
        (a peer fetch that ended early: chunks it did not fill completely are never visible).
        """
        if res.done:
            raise AssertionError("reservation committed or aborted twice")
        res.done = True
        admitted: list[bytes] = []
        held: set[int] = set()
        present = 0
        with self._lock:
            for i, chunk, new in res.entries:
                if not new:
                    self._deref_locked(chunk)  # a present chunk may be a failed promotion's
                else:
                    chunk.refcount -= 1
                if upto is not None and i >= upto:
                    if new:
                        self.pool.free(chunk.start_page, chunk.num_pages)
                    continue
                held.add(i)
                if not new:
                    present += 1
                    continue
                ikey = _index_key(chunk.namespace_id, chunk.key)
                if ikey in self._chunks:
                    self.pool.free(chunk.start_page, chunk.num_pages)
                    present += 1
                    continue
                chunk.committed = True
                self._chunks[ikey] = chunk
                self.policy.on_insert(ikey)
                admitted.append(chunk.key)
            if admitted:
                self.listener.on_admit(res.namespace_id, admitted)
            self._evict_to_watermark_locked(0)
        leading = 0
        while leading in held:
            leading += 1
        return leading, present

    def abort(self, res: StoreReservation) -> None:
        """Free every reserved chunk and drop the references: nothing of the store is kept."""
        if res.done:
            return
        res.done = True
        with self._lock:
            for _, chunk, new in res.entries:
                if new:
                    chunk.refcount -= 1
                    self.pool.free(chunk.start_page, chunk.num_pages)
                else:
                    self._deref_locked(chunk)

    # ---- eviction ------------------------------------------------------------------------

    def _evict_locked(
        self, want_free_bytes: int, *, stop_when_allocatable: int = 0, spill: bool = True
    ) -> None:
        """Evict unreferenced chunks (policy order) until ``used <= capacity - want_free_bytes``
        (pages waiting for the tier writer count as free) or, with ``stop_when_allocatable``,
        until a run of that many pages is free. With ``spill`` (and a sink), a victim no lower
        tier holds goes to the sink instead of being freed."""
        evicted: dict[str, list[bytes]] = {}
        target_used = self.pool.capacity_bytes - want_free_bytes
        for ikey in self.policy.candidates():
            if stop_when_allocatable:
                if self.pool.allocator.largest_free_run() >= stop_when_allocatable:
                    break
            elif self.pool.used_bytes - self._spilling_bytes <= target_used:
                break
            chunk = self._chunks[ikey]
            if chunk.refcount > 0:
                continue
            del self._chunks[ikey]
            self.policy.on_remove(ikey)
            if id(chunk) in self._spill_reads:
                # Rescued while its write was in flight and evicted again: it waits for that
                # write again (which frees its pages), whatever ``spill`` says; not queued twice.
                assert ikey not in self._spilling, "two chunks of one key wait for the writer"
                self._spilling[ikey] = chunk
                self._spilling_bytes += chunk.num_pages * self.pool.page_bytes
            elif (
                spill
                and self.spill is not None
                and ikey not in self._spilling  # an older copy of the same bytes is on its way
                and not self.spill.holds(chunk.namespace_id, chunk.key)
            ):
                self._spilling[ikey] = chunk
                self._spilling_bytes += chunk.num_pages * self.pool.page_bytes
                self.spill.submit(chunk)
            else:
                self.pool.free(chunk.start_page, chunk.num_pages)
            self.evictions += 1
            self.evicted_bytes += chunk.nbytes
            evicted.setdefault(chunk.namespace_id, []).append(chunk.key)
        for ns, keys in evicted.items():
            self.listener.on_evict(ns, keys)

    def _evict_to_watermark_locked(self, incoming_bytes: int) -> None:
        cap = self.pool.capacity_bytes
        if self.pool.used_bytes + incoming_bytes > self.high_watermark * cap:
            self._evict_locked(int(cap - self.low_watermark * cap) + incoming_bytes)

    def _allocate_locked(self, nbytes: int) -> tuple[int, int, torch.Tensor] | None:
        self._evict_to_watermark_locked(self.pool.pages_for(nbytes) * self.pool.page_bytes)
        got = self.pool.allocate(nbytes)
        if got is None and self._spilling:
            # The request path never waits for the tier writer: give up writes not started yet.
            self._drop_spills_locked(self.pool.pages_for(nbytes))
            got = self.pool.allocate(nbytes)
        if got is None:
            # Enough bytes may be free but fragmented: evict until one run is large enough
            # (freed now, not spilled: this allocation needs the pages).
            self._evict_locked(0, stop_when_allocatable=self.pool.pages_for(nbytes), spill=False)
            got = self.pool.allocate(nbytes)
        return got

    # ---- pending chunks (asynchronous promotion) -------------------------------------------

    def finish_pending(self, chunk: Chunk, checksum: bytes) -> None:
        """A promotion filled ``chunk`` and verified it: readers may use it; the promotion's
        reference goes."""
        chunk.checksum = checksum
        with self._lock:
            self._deref_locked(chunk)
        assert chunk.ready is not None
        chunk.ready.set()

    def fail_pending(self, chunks: Sequence[Chunk]) -> None:
        """A promotion could not fill ``chunks`` (refused record, store error, cancelled): they
        leave the index (evict events), waiting readers see them failed, and their pages are freed
        once the last reference (the promotion's, or a reader's) goes."""
        evicted: dict[str, list[bytes]] = {}
        with self._lock:
            for c in chunks:
                c.failed = True
                ikey = _index_key(c.namespace_id, c.key)
                if self._chunks.get(ikey) is c:
                    del self._chunks[ikey]
                    self.policy.on_remove(ikey)
                    evicted.setdefault(c.namespace_id, []).append(c.key)
                self._deref_locked(c)
            for ns, keys in evicted.items():
                self.listener.on_evict(ns, keys)
        for c in chunks:
            assert c.ready is not None
            c.ready.set()

    def held_only_by_promotion(self, chunks: Sequence[Chunk]) -> bool:
        """Whether nobody but their promotion references ``chunks`` (no pin, no reader, no store):
        a cancelled promotion may then drop them instead of reading them."""
        with self._lock:
            return all(c.refcount == 1 for c in chunks)

    def clear(self) -> int:
        """Drop every unreferenced chunk (admin reset). Returns how many went."""
        with self._lock:
            before = len(self._chunks)
            self._evict_locked(self.pool.capacity_bytes, spill=False)
            return before - len(self._chunks)

    # ---- pins (the request holds table, ``kvgrid.agent.holds``) ---------------------------

    def pin(
        self, owner: Owner, keys: Sequence[bytes], layout_id: str, ttl_s: float, *, namespace_id: str
    ) -> tuple[int, MissCause]:
        """:meth:`RequestHolds.pin <kvgrid.agent.holds.RequestHolds.pin>` of :attr:`holds`."""
        return self.holds.pin(owner, keys, layout_id, ttl_s, namespace_id=namespace_id)

    def unpin(self, owner: Owner) -> int:
        """Drop ``owner``'s pin; returns how many chunk pins went."""
        return self.holds.unpin(owner)

    def expire_pins(self) -> int:
        return self.holds.expire()

    # ---- snapshot / stats ----------------------------------------------------------------

    def snapshot(self) -> tuple[dict[str, list[bytes]], int]:
        """Every committed key per namespace id, and the listener's last sequence number."""
        with self._lock:
            out: dict[str, list[bytes]] = {}
            for chunk in self._chunks.values():
                out.setdefault(chunk.namespace_id, []).append(chunk.key)
            return out, self.listener.last_sequence()

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(
                capacity_bytes=self.pool.capacity_bytes,
                used_bytes=self.pool.used_bytes,
                num_chunks=len(self._chunks),
                num_pins=self.holds.pinned_chunks(),
                evictions=self.evictions,
                evicted_bytes=self.evicted_bytes,
                allocation_failures=self.allocation_failures,
                spilling_chunks=len(self._spilling),
                dropped_spills=self.dropped_spills,
            )
