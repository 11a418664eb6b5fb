"""The controller's chunk index: which holder (pod incarnation) has which chunk key in which tier.

One small interface (:class:`ChunkIndex`) with backends side by side: :class:`MemoryIndex` here
(default, embedded) and ``kvgrid.controller.index_redis.RedisIndex`` (several controller replicas
share one Valkey/Redis). Every backend passes the same conformance suite
(``tests/test_controller_index.py``).

The index stores facts and answers lookups; it never scores (``scoring.py`` does) and never
decides who is alive (``registry.py`` does). A *holder* is the text ``<pod_uid>/<epoch>``
(:attr:`kvgrid.common.identity.PodIdentity.holder_id`); inside a backend each live holder gets a
small integer *slot*, and a lookup returns per chunk two bitmasks over slots (GPU holders, L1
holders), so prefix matching (:mod:`kvgrid.controller.matching`) is a handful of integer ops per
chunk whatever the number of pods.
"""

from __future__ import annotations

import enum
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from itertools import chain, repeat
from typing import Any

import msgspec
import numpy as np
from kvgrid.common.hashing import CHUNK_KEY_BYTES

__all__ = [
    "BatchView",
    "ChunkIndex",
    "IndexTier",
    "MemoryIndex",
    "PrefixView",
    "batch_view_from_prefix_views",
    "check_keys",
]


_TO_BYTES: Any = int.to_bytes  # mapped over (value, length, byteorder) triples at C speed


class IndexTier(enum.IntEnum):
    """Tiers the index stores (peer-fetchable is derived at match time, never stored)."""

    L1 = 0
    GPU = 1


class PrefixView(msgspec.Struct, frozen=True):
    """What the index knows about the leading chunks of one query.

    ``l1[i]`` / ``gpu[i]``: bitmask over slots of the holders of chunk ``i`` in that tier
    (speculative entries are folded into ``gpu``). The lists stop at the first chunk nobody holds:
    a prefix cannot continue past it. ``slots`` maps slot number -> holder id for every slot set
    in any mask.
    """

    l1: list[int]
    gpu: list[int]
    slots: dict[int, str]


class BatchView(msgspec.Struct, frozen=True):
    """What the index knows about the chunks of a batch of queries, as machine words.

    ``words[j, b]`` (uint64, shape ``[n, B, 2 * nwords]``, ``n`` = longest query): the L1 holder
    bitmask of chunk ``j`` of query ``b`` in words ``[0, nwords)`` (little-endian: slot ``s`` is bit
    ``s % 64`` of word ``s // 64``), then its GPU holder bitmask (speculative entries folded in).
    Chunks past a query's end, or that nobody holds, are all zeros (a prefix cannot continue past
    them, so rows after the first zero row are irrelevant and may be zero too).
    ``holders``: slot -> holder id for every slot that may be set. ``slots_version``: a number that
    changes whenever the slot table does, or None when the backend cannot promise that (callers
    then must not cache anything derived from ``holders``).
    """

    words: np.ndarray
    holders: dict[int, str]
    slots_version: int | None = None

    @property
    def nwords(self) -> int:
        return int(self.words.shape[2]) // 2


def batch_view_from_prefix_views(views: Sequence[PrefixView]) -> BatchView:
    """Pack per-query :class:`PrefixView` masks into a :class:`BatchView` (any backend)."""
    holders: dict[int, str] = {}
    for v in views:
        holders.update(v.slots)
    nwords = max(1, -(-(max(holders, default=0) + 1) // 64))
    nb = 8 * nwords
    n = max((len(v.l1) for v in views), default=0)
    words = np.zeros((len(views), n, 2 * nwords), dtype=np.uint64)
    for b, v in enumerate(views):
        if v.l1:
            raw = b"".join(
                m.to_bytes(nb, "little") + g.to_bytes(nb, "little") for m, g in zip(v.l1, v.gpu, strict=True)
            )
            words[b, : len(v.l1)] = np.frombuffer(raw, dtype="<u8").reshape(len(v.l1), 2 * nwords)
    return BatchView(words=np.ascontiguousarray(words.transpose(1, 0, 2)), holders=holders)


def check_keys(keys: Sequence[bytes], what: str = "chunk_keys") -> None:
    """Raise ValueError unless every key is CHUNK_KEY_BYTES bytes long."""
    if set(map(type, keys)) == {bytes} and set(map(len, keys)) == {CHUNK_KEY_BYTES}:
        return  # the common case, checked at C speed
    for i, k in enumerate(keys):
        if not isinstance(k, bytes) or len(k) != CHUNK_KEY_BYTES:
            got = f"{len(k)} bytes" if isinstance(k, bytes) else type(k).__name__
            raise ValueError(f"{what}[{i}]: got {got}, expected a {CHUNK_KEY_BYTES}-byte chunk key")


class ChunkIndex(ABC):
    """Chunk key -> holders, per tier. Thread-safe. Keys are 16-byte chunk keys."""

    backend: str = "abstract"

    @abstractmethod
    def add(self, holder: str, tier: IndexTier, keys: Sequence[bytes]) -> None:
        """Record that ``holder`` holds ``keys`` in ``tier`` (idempotent)."""

    @abstractmethod
    def remove(self, holder: str, tier: IndexTier, keys: Sequence[bytes]) -> None:
        """Forget ``keys`` in ``tier`` of ``holder`` (missing entries are ignored)."""

    @abstractmethod
    def replace(self, holder: str, tier: IndexTier, keys: Iterable[bytes]) -> None:
        """Make ``holder``'s entries in ``tier`` exactly ``keys``, atomically for readers."""

    @abstractmethod
    def drop_holder(self, holder: str) -> int:
        """Remove every entry (all tiers, speculative too) of ``holder``; returns entries removed."""

    @abstractmethod
    def lookup(self, keys: Sequence[bytes]) -> PrefixView:
        """Holder masks of the leading chunks of ``keys`` (see :class:`PrefixView`)."""

    def lookup_batch(self, queries: Sequence[Sequence[bytes]]) -> BatchView:
        """Holder masks of the chunks of every query as machine words (see :class:`BatchView`).

        The default packs :meth:`lookup` per query; backends override it with something faster.
        """
        return batch_view_from_prefix_views([self.lookup(q) for q in queries])

    @abstractmethod
    def add_speculative(self, holder: str, keys: Sequence[bytes], ttl_ms: int) -> None:
        """Short-lived GPU-tier entries for a pod a router just chose (cover the event blind window)."""

    @abstractmethod
    def holder_keys(self, holder: str, tier: IndexTier) -> set[bytes]:
        """Every key ``holder`` holds in ``tier`` (resync checks, debugging; may be slow)."""

    @abstractmethod
    def holder_entries(self, holder: str) -> int:
        """Number of (chunk, tier) entries of ``holder``."""

    @abstractmethod
    def holders(self) -> list[str]:
        """Holders that have a slot (hold, or held, entries and were not dropped)."""

    @abstractmethod
    def num_entries(self) -> int:
        """Number of (chunk, holder, tier) entries, speculative ones excluded."""

    @abstractmethod
    def num_chunks(self) -> int:
        """Number of distinct chunk keys with at least one holder."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""


class _Slots:
    """Holder id <-> small slot number; freed slots are reused (lowest first)."""

    def __init__(self) -> None:
        self.by_holder: dict[str, int] = {}
        self.by_slot: dict[int, str] = {}
        self._free: list[int] = []
        self.version = 0  # bumped on every change of the table (callers cache per version)

    def get_or_assign(self, holder: str) -> int:
        slot = self.by_holder.get(holder)
        if slot is None:
            if self._free:
                self._free.sort()
                slot = self._free.pop(0)
            else:
                slot = len(self.by_holder)
            self.by_holder[holder] = slot
            self.by_slot[slot] = holder
            self.version += 1
        return slot

    def release(self, holder: str) -> int | None:
        slot = self.by_holder.pop(holder, None)
        if slot is not None:
            del self.by_slot[slot]
            self._free.append(slot)
            self.version += 1
        return slot


class MemoryIndex(ChunkIndex):
    """In-process index: one dict ``key -> int`` packing both tiers' holder bitmasks.

    Value layout: bits ``[0, W)`` are the L1 holders' slots, bits ``[W, 2W)`` the GPU holders'
    (``W`` = :attr:`width`, a power of two >= the number of slots; when slots outgrow it every value
    is re-packed once). One small int per chunk instead of a set per chunk keeps an entry at a
    few tens of bytes (measured by ``kvgrid bench lookup``); the price is that dropping a holder
    or replacing its entries scans the dict (only when that holder has entries; a resync after a
    controller restart starts empty and skips the scan).
    """

    backend = "memory"

    def __init__(self, width: int = 64) -> None:
        if width < 1 or width & (width - 1):
            raise ValueError(f"width={width}: expected a power of two >= 1")
        self.width = width
        self._map: dict[bytes, int] = {}
        self._slots = _Slots()
        self._counts: dict[tuple[int, IndexTier], int] = {}
        self._spec: dict[bytes, dict[int, float]] = {}
        self._lock = threading.RLock()

    # --- helpers ------------------------------------------------------------------------------
    def _bit(self, slot: int, tier: IndexTier) -> int:
        return 1 << (slot + (self.width if tier is IndexTier.GPU else 0))

    def _slot(self, holder: str) -> int:
        slot = self._slots.get_or_assign(holder)
        if slot >= self.width:
            self._grow(slot + 1)
        return slot

    def _grow(self, need: int) -> None:
        new = self.width
        while new < need:
            new *= 2
        low = (1 << self.width) - 1
        old = self.width
        self._map = {k: (v & low) | ((v >> old) << new) for k, v in self._map.items()}
        self.width = new

    def _count(self, slot: int, tier: IndexTier, delta: int) -> None:
        self._counts[(slot, tier)] = self._counts.get((slot, tier), 0) + delta

    # --- writes -------------------------------------------------------------------------------
    def add(self, holder: str, tier: IndexTier, keys: Sequence[bytes]) -> None:
        check_keys(keys)
        with self._lock:
            slot = self._slot(holder)
            bit = self._bit(slot, tier)
            m = self._map
            added = 0
            for k in keys:
                v = m.get(k, 0)
                if not v & bit:
                    m[bytes(k)] = v | bit
                    added += 1
            self._count(slot, tier, added)

    def remove(self, holder: str, tier: IndexTier, keys: Sequence[bytes]) -> None:
        check_keys(keys)
        with self._lock:
            slot = self._slots.by_holder.get(holder)
            if slot is None:
                return
            bit = self._bit(slot, tier)
            m = self._map
            removed = 0
            for k in keys:
                v = m.get(k, 0)
                if v & bit:
                    v &= ~bit
                    if v:
                        m[k] = v
                    else:
                        del m[k]
                    removed += 1
            self._count(slot, tier, -removed)

    def _clear_bits(self, clear: int, keep: set[bytes] | None = None) -> int:
        """Clear ``clear`` bits in every value (except keys in ``keep``); returns bits cleared."""
        m = self._map
        hits = [k for k, v in m.items() if v & clear and (keep is None or k not in keep)]
        cleared = 0
        for k in hits:
            v = m[k]
            cleared += (v & clear).bit_count()
            v &= ~clear
            if v:
                m[k] = v
            else:
                del m[k]
        return cleared

    def replace(self, holder: str, tier: IndexTier, keys: Iterable[bytes]) -> None:
        new = set(keys)
        check_keys(list(new))
        with self._lock:
            slot = self._slot(holder)
            bit = self._bit(slot, tier)
            if self._counts.get((slot, tier), 0):
                self._clear_bits(bit, keep=new)
            m = self._map
            for k in new:
                m[k] = m.get(k, 0) | bit
            self._counts[(slot, tier)] = len(new)

    def drop_holder(self, holder: str) -> int:
        with self._lock:
            slot = self._slots.by_holder.get(holder)
            if slot is None:
                return 0
            n = self._counts.pop((slot, IndexTier.L1), 0) + self._counts.pop((slot, IndexTier.GPU), 0)
            if n:
                self._clear_bits(self._bit(slot, IndexTier.L1) | self._bit(slot, IndexTier.GPU))
            for k in [k for k, d in self._spec.items() if slot in d]:
                d = self._spec[k]
                del d[slot]
                if not d:
                    del self._spec[k]
            self._slots.release(holder)
            return n

    def add_speculative(self, holder: str, keys: Sequence[bytes], ttl_ms: int) -> None:
        check_keys(keys)
        deadline = time.monotonic() + ttl_ms / 1000.0
        with self._lock:
            slot = self._slot(holder)
            for k in keys:
                self._spec.setdefault(bytes(k), {})[slot] = deadline
            if len(self._spec) > 4 * len(keys) + 1024:
                self._expire_speculative(time.monotonic())

    def _expire_speculative(self, now: float) -> None:
        for k in list(self._spec):
            d = self._spec[k]
            for s in [s for s, t in d.items() if t <= now]:
                del d[s]
            if not d:
                del self._spec[k]

    # --- reads --------------------------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes]) -> PrefixView:
        w = self.width
        low = (1 << w) - 1
        l1: list[int] = []
        gpu: list[int] = []
        with self._lock:
            get = self._map.get
            spec = self._spec
            now = time.monotonic() if spec else 0.0
            union = 0
            for k in keys:
                v = get(k, 0)
                g = v >> w
                if spec:
                    d = spec.get(k)
                    if d:
                        for s, t in d.items():
                            if t > now:
                                g |= 1 << s
                if not v and not g:
                    break
                l1.append(v & low)
                gpu.append(g)
                union |= v & low | g
            by_slot = self._slots.by_slot
            slots = {}
            while union:
                b = union & -union
                s = b.bit_length() - 1
                slots[s] = by_slot[s]
                union ^= b
        return PrefixView(l1=l1, gpu=gpu, slots=slots)

    def lookup_batch(self, queries: Sequence[Sequence[bytes]]) -> BatchView:
        # One dict get per key at C speed (map over the whole batch), one int.to_bytes per key, one
        # frombuffer per batch: the packed ints go straight to words. Short queries are padded with
        # a key that is never stored; rows past a query's first unheld chunk are not truncated
        # (matching stops at the first all-zero row anyway).
        lens = list(map(len, queries))
        n = max(lens, default=0)
        if lens.count(n) == len(lens):
            keys = list(chain.from_iterable(queries))
        else:
            keys = list(chain.from_iterable(chain(q, repeat(b"", n - len(q))) for q in queries))
        with self._lock:
            width = self.width  # under the lock: _grow re-packs every value
            vals = list(map(self._map.get, keys, repeat(0)))
            if self._spec:
                self._fold_speculative(keys, vals, time.monotonic())
            holders = dict(self._slots.by_slot)
            version = self._slots.version
        w = width if width % 64 == 0 else 64  # narrow (test-only) widths are re-packed to 64
        if w != width:
            low = (1 << width) - 1
            vals = [(v & low) | ((v >> width) << 64) for v in vals]
        nb = 2 * w // 8
        raw = b"".join(map(_TO_BYTES, vals, repeat(nb), repeat("little")))
        words = np.frombuffer(raw, dtype="<u8").reshape(len(lens), n, nb // 8)
        return BatchView(
            words=np.ascontiguousarray(words.transpose(1, 0, 2)), holders=holders, slots_version=version
        )

    def _fold_speculative(self, keys: Sequence[bytes], vals: list[int], now: float) -> None:
        """Add live speculative holders to the GPU half of ``vals`` (caller holds the lock)."""
        w = self.width
        for i, d in enumerate(map(self._spec.get, keys)):
            if d:
                g = 0
                for s, t in d.items():
                    if t > now:
                        g |= 1 << s
                vals[i] |= g << w

    def holder_keys(self, holder: str, tier: IndexTier) -> set[bytes]:
        with self._lock:
            slot = self._slots.by_holder.get(holder)
            if slot is None:
                return set()
            bit = self._bit(slot, tier)
            return {k for k, v in self._map.items() if v & bit}

    def holder_entries(self, holder: str) -> int:
        with self._lock:
            slot = self._slots.by_holder.get(holder)
            if slot is None:
                return 0
            return self._counts.get((slot, IndexTier.L1), 0) + self._counts.get((slot, IndexTier.GPU), 0)

    def holders(self) -> list[str]:
        with self._lock:
            return list(self._slots.by_holder)

    def num_entries(self) -> int:
        with self._lock:
            return sum(self._counts.values())

    def num_chunks(self) -> int:
        return len(self._map)
