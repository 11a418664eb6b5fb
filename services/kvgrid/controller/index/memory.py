"""In-memory backend of :class:`~kvgrid.controller.index.base.ChunkIndex` (the default).

One process, no dependencies: an open-addressing hash table over flat numpy arrays with *compact
rows*: a key and one word that holds up to four (slot, tiers) holders inline, or, for a chunk with
more holders (a system prompt), the index of a side row of full mask words in the
:class:`~kvgrid.controller.index.base.BatchView` layout. A row costs 25 bytes whatever the number
of pods. The format and its invariants are in ``_rowloops.py``. The per-key loops (one query's
probe, one event's insert or removal, a rehash's placement) run in C (``_probe.c``) where the
optional extension was built, else in Python (``_rowloops.py``, the same functions); both leave the
same rows and give the same answers (tested). Whole-table scans are numpy (``_rowscans.py``).
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Iterable, Sequence
from itertools import chain, repeat
from types import ModuleType

import numpy as np

from kvgrid.common.hashing import CHUNK_KEY_BYTES
from kvgrid.controller.index import _rowloops, _rowscans
from kvgrid.controller.index._rowloops import NIL, ROW
from kvgrid.controller.index._slots import Slots
from kvgrid.controller.index.base import (
    NUM_TIERS,
    BatchView,
    ChunkIndex,
    IndexTier,
    MaskView,
    PrefixView,
    WordsView,
    check_keys,
)

try:  # the compiled per-key loops (_probe.c), built by `pip install` where a C compiler exists
    import kvgrid.controller.index._probe as _native
except ImportError:  # no compiler at install time, or a big-endian host: _rowloops serves
    _native = None  # type: ignore[assignment]

__all__ = ["NATIVE", "MemoryIndex"]

NATIVE = _native is not None
"""The compiled loops are importable (``MemoryIndex(native=None)`` then uses them)."""


_MIN_CAP = 1024
_MAX_LOAD = 0.75  # (live + tombstone) rows / capacity before a rehash
_PAD = bytes(CHUNK_KEY_BYTES)  # stands in for missing chunks of short queries (masked out after)
_KEY_LEN = {CHUNK_KEY_BYTES}


class MemoryIndex(ChunkIndex):
    """In-process index: an open-addressing hash table of compact rows in flat numpy arrays.

    ``_tab`` (uint64 ``[capacity, 3]``) holds per row a key (two words) and ``x``; ``_state``
    (uint8) says empty, full (``x`` = up to four inline holders), tombstone, or spill (``x`` = a
    row of ``_side``: ``3 * W`` mask words, L1, GPU then L2, slot ``s`` bit ``s % 64`` of word
    ``s // 64``; ``W`` doubles when slots outgrow it). The capacity is a power of two; a key's home
    row is the top bits of ``lo ^ (hi >> 1)`` (keys are cryptographic hashes; structured keys still
    work, with longer chains); collisions probe linearly. Past 3/4 live-or-tombstone rows the table
    is rebuilt without tombstones at load <= 1/2, and the side rows are compacted with it.

    Lookups return mask words (the :class:`BatchView` layout) expanded from the rows; writes of a
    few keys (event batches) probe per key (in C, or in Python); scans (drop a holder, replace,
    holder_keys) are vectorized over the inline words and the side rows.
    """

    backend = "memory"

    def __init__(self, width: int = 64, native: bool | None = None) -> None:
        if width < 1 or width & (width - 1):
            raise ValueError(f"width={width}: expected a power of two >= 1")
        if native and _native is None:
            raise ValueError("native=True: the compiled _probe extension is not built here")
        # the per-key loops: compiled, or their Python twins (same functions, same rows and answers)
        self._c: ModuleType | None = _native if native is not False else None
        self._k: ModuleType = self._c if self._c is not None else _rowloops
        self._w = max(1, width // 64)  # mask words per tier (side rows)
        self._slots = Slots()
        self._counts: dict[tuple[int, IndexTier], int] = {}
        self._spec: dict[bytes, dict[int, float]] = {}  # key -> slot -> deadline (monotonic s)
        # Invariants: every (key, slot) in _spec is in _spec_keys[slot], and has a heap entry with its
        # deadline (the heap may also hold stale entries of refreshed or dropped ones: skipped when
        # popped). Expiry pops the heap's due front, so a reservation costs O(its keys) (amortised),
        # whatever the number of live ones.
        self._spec_keys: dict[int, set[bytes]] = {}
        self._spec_due: list[tuple[float, bytes, int]] = []
        self._lock = threading.RLock()
        self._n = 0  # live rows (distinct chunks)
        self._side = np.zeros((0, NUM_TIERS * self._w), dtype=np.uint64)
        self._head = NIL  # first free side row
        self._spilled = 0  # side rows in use
        self._holders_copy: tuple[int, dict[int, str]] = (-1, {})  # (slots version, by_slot copy)
        self._alloc(_MIN_CAP)

    @property
    def width(self) -> int:
        """Slots the mask words can hold (grows by whole words)."""
        return 64 * self._w

    @property
    def capacity(self) -> int:
        """Rows of the hash table (a power of two)."""
        return len(self._state)

    # --- table --------------------------------------------------------------------------------
    def _alloc(self, cap: int) -> None:
        self._state = np.zeros(cap, dtype=np.uint8)
        self._tab = np.zeros((cap, ROW), dtype=np.uint64)
        self._shift = 64 - (cap.bit_length() - 1)
        self._used = 0  # live + tombstone rows

    def _rehash(self, need: int) -> None:
        """Rebuild the table without tombstones, at load <= 1/2 with ``need`` more keys.

        Invariant: the new table is built completely beside the old one and swapped in only after
        every row was placed; a failure leaves the old table (and every answer) as it was.
        """
        cap = _MIN_CAP
        while 2 * (self._n + need) > cap:
            cap *= 2
        rows, states, side, head = _rowscans.compact_side(self._state, self._tab, self._side)
        state = np.zeros(cap, dtype=np.uint8)
        tab = np.zeros((cap, ROW), dtype=np.uint64)
        shift = 64 - (cap.bit_length() - 1)
        self._k.place(state, tab, shift, rows, states)
        self._state, self._tab, self._shift, self._used = state, tab, shift, len(rows)
        self._side, self._head = side, head

    def _grow_words(self, need_slots: int) -> None:
        w = nw = self._w
        while 64 * nw < need_slots:
            nw *= 2
        side = np.zeros((len(self._side), NUM_TIERS * nw), dtype=np.uint64)
        for t in range(NUM_TIERS):  # each tier's words move to the start of its wider block
            side[:, t * nw : t * nw + w] = self._side[:, t * w : (t + 1) * w]
        self._w, self._side = nw, side  # word 0 (the free list's link) stays word 0

    def _slot(self, holder: str) -> int:
        slot = self._slots.get_or_assign(holder)
        if slot >= 64 * self._w:
            self._grow_words(slot + 1)
        return slot

    def _room(self, n: int) -> None:
        if self._used + n > _MAX_LOAD * len(self._state):
            self._rehash(n)

    def _count(self, slot: int, tier: IndexTier, delta: int) -> None:
        self._counts[(slot, tier)] = self._counts.get((slot, tier), 0) + delta

    def _insert(self, slot: int, tier: IndexTier, raw: bytes) -> int:
        """Set (slot, tier) on the keys of ``raw``, adding side rows whenever the free ones run out;
        returns the bits set. Caller holds the lock and made room for the keys."""
        total = 0
        while True:
            done, fresh, used, added, self._head, spilled = self._k.insert(
                self._state, self._tab, self._shift, self._side, self._w, self._head, slot, int(tier), raw
            )
            self._n += fresh
            self._used += used
            self._spilled += spilled
            total += added
            if 16 * done == len(raw):
                return total
            raw = raw[16 * done :]
            self._side, self._head = _rowscans.grow_side(self._side, self._head)

    def _clear(self, slot: int, tbits: int, keep: np.ndarray | None = None) -> None:
        """Clear ``slot`` in the tiers ``tbits`` on every row but ``keep``; caller holds the lock."""
        killed, self._head, freed = _rowscans.clear_slot(
            self._state, self._tab, self._side, self._w, self._head, slot, tbits, keep
        )
        self._n -= killed
        self._spilled -= freed

    # --- writes -------------------------------------------------------------------------------
    def add(self, holder: str, tier: IndexTier, keys: Sequence[bytes]) -> None:
        raw = self._joined(keys)
        with self._lock:
            slot = self._slot(holder)
            self._room(len(keys))
            self._count(slot, tier, self._insert(slot, tier, raw))

    def remove(self, holder: str, tier: IndexTier, keys: Sequence[bytes]) -> None:
        raw = self._joined(keys)
        with self._lock:
            slot = self._slots.by_holder.get(holder)
            if slot is None:
                return
            removed, killed, self._head, freed = self._k.remove(
                self._state, self._tab, self._shift, self._side, self._w, self._head, slot, int(tier), raw
            )
            self._n -= killed
            self._spilled -= freed
            self._count(slot, tier, -removed)

    @staticmethod
    def _joined(keys: Sequence[bytes]) -> bytes:
        """``keys`` as one buffer, checked in the join's pass (check_keys only to name a bad key)."""
        try:
            raw = b"".join(keys)
        except TypeError:
            raw = b""
        if len(raw) != CHUNK_KEY_BYTES * len(keys) or set(map(len, keys)) - _KEY_LEN:
            check_keys(keys)
        return raw

    def replace(self, holder: str, tier: IndexTier, keys: Iterable[bytes]) -> None:
        new = list(set(keys))
        check_keys(new)
        raw = b"".join(new)
        with self._lock:
            slot = self._slot(holder)
            if self._counts.get((slot, tier), 0):
                keep = self._rows(raw) if new else None
                self._clear(slot, 1 << tier, None if keep is None else keep[keep >= 0])
            self._room(len(new))
            self._insert(slot, tier, raw)
            self._counts[(slot, tier)] = len(new)

    def drop_holder(self, holder: str) -> int:
        with self._lock:
            slot = self._slots.by_holder.get(holder)
            if slot is None:
                return 0
            n = sum(self._counts.pop((slot, tier), 0) for tier in IndexTier)
            if n:
                self._clear(slot, (1 << NUM_TIERS) - 1)
            for k in self._spec_keys.pop(slot, ()):
                d = self._spec[k]
                del d[slot]
                if not d:
                    del self._spec[k]
            self._slots.release(holder)
            return n

    def add_speculative(self, holder: str, keys: Sequence[bytes], ttl_ms: int) -> None:
        check_keys(keys)
        now = time.monotonic()
        deadline = now + ttl_ms / 1000.0
        with self._lock:
            slot = self._slot(holder)
            mine = self._spec_keys.setdefault(slot, set())
            for k in keys:
                k = bytes(k)
                self._spec.setdefault(k, {})[slot] = deadline
                mine.add(k)
                heapq.heappush(self._spec_due, (deadline, k, slot))
            self._expire_speculative(now)

    def _expire_speculative(self, now: float) -> None:
        """Drop the entries whose deadline passed (the heap's due front)."""
        due, spec = self._spec_due, self._spec
        while due and due[0][0] <= now:
            t, k, slot = heapq.heappop(due)
            d = spec.get(k)
            if d is None or d.get(slot) != t:
                continue  # refreshed with a later deadline, or dropped with its holder
            del d[slot]
            self._spec_keys[slot].discard(k)
            if not d:
                del spec[k]

    # --- reads --------------------------------------------------------------------------------
    def _rows(self, raw: bytes) -> np.ndarray:
        """Row of every key of ``raw`` (-1 where absent), vectorized; caller holds the lock."""
        k = np.frombuffer(raw, dtype="<u8").reshape(-1, 2)
        lo, hi = k[:, 0].astype(np.uint64), k[:, 1].astype(np.uint64)
        return _rowscans.probe_rows(self._state, self._tab, self._shift, lo, hi)

    def _gather(self, raw: bytes) -> np.ndarray:
        """Mask words ``[keys, 3W]`` of the keys of ``raw`` (zeros where absent), writable; caller
        holds the lock. Compiled: one prefetched probe per key; else a vectorized probe."""
        n, w = len(raw) // CHUNK_KEY_BYTES, self._w
        if not n:
            return np.zeros((0, NUM_TIERS * w), dtype=np.uint64)
        if self._c is not None:
            out = self._c.probe_words(self._state, self._tab, self._shift, self._side, w, raw, False)
            return np.frombuffer(out, dtype=np.uint64).reshape(n, NUM_TIERS * w).copy()
        return _rowscans.expand(self._state, self._tab, self._side, w, self._rows(raw))

    def _holders(self) -> tuple[int, dict[int, str]]:
        """(slots version, slot -> holder) as a copy kept per version; caller holds the lock."""
        version = self._slots.version
        if self._holders_copy[0] != version:
            self._holders_copy = (version, dict(self._slots.by_slot))
        return version, self._holders_copy[1]

    def lookup(self, keys: Sequence[bytes]) -> PrefixView:
        raw = self._joined(keys)
        l1: list[int] = []
        gpu: list[int] = []
        l2: list[int] = []
        with self._lock:
            w = self._w
            words = self._gather(raw)
            if self._spec:
                self._fold_speculative(keys, words, time.monotonic(), len(keys), 1)
            union = 0
            for row in words:
                if not row.any():
                    break
                m = int.from_bytes(row[:w].astype("<u8").tobytes(), "little")
                g = int.from_bytes(row[w : 2 * w].astype("<u8").tobytes(), "little")
                d = int.from_bytes(row[2 * w :].astype("<u8").tobytes(), "little")
                l1.append(m)
                gpu.append(g)
                l2.append(d)
                union |= m | g | d
            by_slot = self._slots.by_slot
            slots = {}
            while union:
                b = union & -union
                s = b.bit_length() - 1
                slots[s] = by_slot[s]
                union ^= b
        return PrefixView(l1=l1, gpu=gpu, slots=slots, l2=l2 if any(l2) else None)

    def lookup_one(self, keys: Sequence[bytes] | np.ndarray) -> MaskView:
        # One query: one probe chain per key (numpy's per-call cost is most of a single query's
        # lookup), stopping at the first chunk nobody holds; in C when built, else in Python.
        if isinstance(keys, np.ndarray):
            raw = np.ascontiguousarray(keys, dtype="<u8").tobytes()
        else:
            check_keys(keys)
            raw = b"".join(keys)
        with self._lock:
            w, spec = self._w, self._spec
            # with speculative entries every key's masks come back, folded here, then cut
            l1, gpu, l2 = self._k.probe(self._state, self._tab, self._shift, self._side, w, raw, not spec)
            if spec:
                now = time.monotonic()
                for i in range(len(l1)):
                    d = spec.get(raw[16 * i : 16 * i + 16])
                    if d:
                        for slot, t in d.items():
                            if t > now:
                                gpu[i] |= 1 << slot
                    if not l1[i] and not gpu[i] and not l2[i]:
                        del l1[i:], gpu[i:], l2[i:]
                        break
            version, holders = self._holders()
        return MaskView(l1=l1, gpu=gpu, holders=holders, slots_version=version, nwords=w, l2=l2)

    def lookup_words(self, keys: Sequence[bytes] | np.ndarray) -> WordsView:
        raw = (
            np.ascontiguousarray(keys, dtype="<u8").tobytes()
            if isinstance(keys, np.ndarray)
            else self._joined(keys)
        )
        with self._lock:
            w, spec = self._w, self._spec
            # with speculative entries every key's row comes back (a zero row may gain a holder)
            words = self._k.probe_words(self._state, self._tab, self._shift, self._side, w, raw, not spec)
            if spec:
                words = self._fold_words(raw, words, w)
            version, holders = self._holders()
        return WordsView(words=words, holders=holders, slots_version=version, nwords=w)

    def _fold_words(self, raw: bytes, words: bytes, w: int) -> bytes:
        """OR live speculative holders into the GPU words of ``words`` (one row per key of ``raw``);
        caller holds the lock."""
        out = bytearray(words)
        mv = memoryview(out).cast("Q")
        now = time.monotonic()
        for i in range(len(raw) // CHUNK_KEY_BYTES):
            d = self._spec.get(raw[CHUNK_KEY_BYTES * i : CHUNK_KEY_BYTES * (i + 1)])
            if d:
                for s, t in d.items():
                    if t > now:
                        mv[NUM_TIERS * w * i + w + (s >> 6)] |= 1 << (s & 63)
        return bytes(out)

    def lookup_batch(self, queries: Sequence[Sequence[bytes]]) -> BatchView:
        # Keys go chunk-major ([chunk, query]) before probing, so the gathered rows are the
        # BatchView as is. Short queries are padded with zero keys (their rows are zeroed after).
        lens = list(map(len, queries))
        n, nq = max(lens, default=0), len(lens)
        ragged = lens.count(n) != nq
        if ragged:
            keys: list[bytes] = list(chain.from_iterable(chain(q, repeat(_PAD, n - len(q))) for q in queries))
        else:
            keys = list(chain.from_iterable(queries))
        k = np.frombuffer(b"".join(keys), dtype="<u8").reshape(nq, n, 2).transpose(1, 0, 2)
        raw = np.ascontiguousarray(k).tobytes()
        with self._lock:
            words = self._gather(raw)
            if self._spec:
                self._fold_speculative(keys, words, time.monotonic(), n, nq)
            holders = dict(self._slots.by_slot)
            version = self._slots.version
        words = words.reshape(n, nq, words.shape[1])
        if ragged:
            words[np.arange(n)[:, None] >= np.asarray(lens)[None, :]] = 0
        return BatchView(words=words, holders=holders, slots_version=version)

    def lookup_packed(self, keys: np.ndarray, counts: np.ndarray) -> BatchView:
        # As lookup_batch without bytes objects: the words go chunk-major, short queries padded
        # with zero keys (their rows zeroed after).
        nq = len(counts)
        n = int(counts.max()) if nq else 0
        ragged = nq > 0 and int(counts.min()) != n
        if ragged:
            pad = np.arange(n)[None, :] < counts[:, None]  # [nq, n]: a real key
            k = np.zeros((nq, n, 2), dtype=np.uint64)
            k[pad] = keys
        else:
            pad = None
            k = keys.reshape(nq, n, 2)
        raw = np.ascontiguousarray(k.transpose(1, 0, 2), dtype="<u8").tobytes()
        with self._lock:
            words = self._gather(raw)
            if self._spec:
                qraw = k.astype("<u8").tobytes()
                qkeys = [qraw[i : i + CHUNK_KEY_BYTES] for i in range(0, len(qraw), CHUNK_KEY_BYTES)]
                self._fold_speculative(qkeys, words, time.monotonic(), n, nq)
            holders = dict(self._slots.by_slot)
            version = self._slots.version
        words = words.reshape(n, nq, words.shape[1])
        if pad is not None:
            words[~pad.T] = 0
        return BatchView(words=words, holders=holders, slots_version=version)

    def _fold_speculative(
        self, keys: Sequence[bytes], words: np.ndarray, now: float, n: int, nq: int
    ) -> None:
        """OR live speculative holders into the GPU words: ``keys`` query-major (``nq`` queries of
        ``n``), ``words`` rows chunk-major; caller holds the lock."""
        w = self._w
        for i, d in enumerate(map(self._spec.get, keys)):
            if d:
                r = (i % n) * nq + i // n
                for s, t in d.items():
                    if t > now:
                        words[r, w + (s >> 6)] |= np.uint64(1 << (s & 63))

    def holder_keys(self, holder: str, tier: IndexTier) -> set[bytes]:
        with self._lock:
            slot = self._slots.by_holder.get(holder)
            if slot is None:
                return set()
            rows = _rowscans.slot_rows(self._state, self._tab, self._side, self._w, slot, int(tier))
            raw = np.ascontiguousarray(self._tab[rows, :2]).astype("<u8").tobytes()
        b = CHUNK_KEY_BYTES
        return {raw[i : i + b] for i in range(0, len(raw), b)}

    def holder_entries(self, holder: str) -> int:
        with self._lock:
            slot = self._slots.by_holder.get(holder)
            if slot is None:
                return 0
            return sum(self._counts.get((slot, tier), 0) for tier in IndexTier)

    def holder_tier_entries(self, holder: str, tier: IndexTier) -> int:
        with self._lock:
            slot = self._slots.by_holder.get(holder)
            return 0 if slot is None else self._counts.get((slot, tier), 0)

    def holders(self) -> list[str]:
        with self._lock:
            return list(self._slots.by_holder)

    def num_entries(self) -> int:
        with self._lock:
            return sum(self._counts.values())

    def num_chunks(self) -> int:
        return self._n

    def spilled_rows(self) -> int:
        """Chunks whose holders live in side rows (more than four, or a slot past the lanes)."""
        return self._spilled
