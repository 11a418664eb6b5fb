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

import msgspec
from kvgrid.common.hashing import CHUNK_KEY_BYTES

__all__ = [
    "ChunkIndex",
    "IndexTier",
    "MemoryIndex",
    "PrefixView",
    "check_keys",
]


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


def check_keys(keys: Sequence[bytes], what: str = "chunk_keys") -> None:
    """Raise ValueError unless every key is CHUNK_KEY_BYTES bytes long."""
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
        return slot

    def release(self, holder: str) -> int | None:
        slot = self.by_holder.pop(holder, None)
        if slot is not None:
            del self.by_slot[slot]
            self._free.append(slot)
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
