"""In-memory backend of :class:`~kvgrid.controller.index.base.ChunkIndex` (the default).

One process, no dependencies: an open-addressing hash table over flat numpy arrays whose rows are
already in the :class:`~kvgrid.controller.index.base.BatchView` layout, so a batch lookup is a few
vectorized gathers (see :class:`MemoryIndex`). The per-key loops (one query's probe, one event's
insert, a rehash's placement) run in C (``_probe.c``) where the optional extension was built, else
in Python over memoryviews; both leave the same rows and give the same answers (tested).
"""

from __future__ import annotations

import heapq
import struct
import threading
import time
from collections.abc import Iterable, Sequence
from itertools import chain, repeat

import numpy as np

from kvgrid.common.hashing import CHUNK_KEY_BYTES
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

try:  # the compiled probe/insert loops (_probe.c), built by `pip install` where a C compiler exists
    import kvgrid.controller.index._probe as _native
except ImportError:  # no compiler at install time, or a big-endian host: the Python loops below
    _native = None  # type: ignore[assignment]

__all__ = ["NATIVE", "MemoryIndex"]

NATIVE = _native is not None
"""The compiled loops are importable (``MemoryIndex(native=None)`` then uses them)."""


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


_EMPTY, _FULL, _TOMB = 0, 1, 2  # row states of the open-addressing table
_MIN_CAP = 1024
_MAX_LOAD = 0.75  # (full + tombstone) rows / capacity before a rehash
_PAD = bytes(CHUNK_KEY_BYTES)  # stands in for missing chunks of short queries (masked out after)
_KEY = struct.Struct("<QQ")
_KEY_LEN = {CHUNK_KEY_BYTES}
_WINDOW = 16  # rows probed at once per key after the home row


class MemoryIndex(ChunkIndex):
    """In-process index: an open-addressing hash table in flat numpy arrays.

    Row ``i`` of the table (``_tab[i]``, uint64) holds a key as two words, then ``3 * W`` mask words
    (``_words`` is a view of them): the L1 holders' slots in words ``[0, W)``, the GPU holders' in
    ``[W, 2W)``, the L2 holders' in ``[2W, 3W)`` (slot ``s`` is bit ``s % 64`` of word ``s // 64``;
    ``W`` doubles when slots outgrow it), i.e. the :class:`BatchView` layout. ``_state`` says per row
    empty, full or tombstone. The capacity is a power of two; a key's home row is the top bits of
    ``lo ^ (hi >> 1)`` (keys are cryptographic hashes; structured keys still work, with longer
    chains); collisions probe linearly. Past 3/4 full-or-tombstone rows the table is rebuilt
    without tombstones at load <= 1/2.

    A batch lookup takes every key's home row at once (one cache miss per key, overlapped across
    the batch, unlike per-key dict lookups), then windows of ``_WINDOW`` rows for the few keys not
    settled there. Writes of a few keys (event batches) probe per key (in C, or in Python through
    memoryviews); scans (drop a holder, replace, holder_keys) are vectorized over one mask column.
    41 B per row with up to 64 slots (``kvgrid bench lookup`` measures bytes per entry).
    """

    backend = "memory"

    def __init__(self, width: int = 64, native: bool | None = None) -> None:
        if width < 1 or width & (width - 1):
            raise ValueError(f"width={width}: expected a power of two >= 1")
        if native and _native is None:
            raise ValueError("native=True: the compiled _probe extension is not built here")
        # the single-query probe and the event insert in C (same answers as the Python loops)
        self._c = _native if native is not False else None
        self._w = max(1, width // 64)  # mask words per tier
        self._slots = _Slots()
        self._counts: dict[tuple[int, IndexTier], int] = {}
        self._spec: dict[bytes, dict[int, float]] = {}  # key -> slot -> deadline (monotonic s)
        # Invariants: every (key, slot) in _spec is in _spec_keys[slot], and has a heap entry with its
        # deadline (the heap may also hold stale entries of refreshed or dropped ones: skipped when
        # popped). Expiry pops the heap's due front, so a reservation costs O(its keys) (amortised),
        # whatever the number of live ones.
        self._spec_keys: dict[int, set[bytes]] = {}
        self._spec_due: list[tuple[float, bytes, int]] = []
        self._lock = threading.RLock()
        self._n = 0  # full rows (distinct chunks)
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
        state, tab, shift = self._fresh(cap)
        self._swap(state, tab, shift, used=0)

    def _fresh(self, cap: int) -> tuple[np.ndarray, np.ndarray, int]:
        """Empty (state, table, shift) of ``cap`` rows at the current mask width."""
        state = np.zeros(cap, dtype=np.uint8)
        tab = np.zeros((cap, 2 + NUM_TIERS * self._w), dtype=np.uint64)
        return state, tab, 64 - (cap.bit_length() - 1)

    def _swap(self, state: np.ndarray, tab: np.ndarray, shift: int, used: int) -> None:
        self._state = state
        self._shift = shift
        self._used = used  # full + tombstone rows
        self._set_tab(tab)

    def _set_tab(self, tab: np.ndarray) -> None:
        self._tab = tab
        self._klo, self._khi, self._words = tab[:, 0], tab[:, 1], tab[:, 2:]
        self._stride = tab.shape[1]
        # memoryviews give Python ints per element at a fraction of numpy's scalar indexing cost
        self._mt = tab.reshape(-1).data.cast("B").cast("Q")
        self._mst = self._state.data.cast("B")

    @staticmethod
    def _home_of(lo: np.ndarray, hi: np.ndarray, shift: int) -> np.ndarray:
        # keys are cryptographic hashes: their top bits are already uniform (any key still works,
        # structured ones only probe longer)
        return ((lo ^ (hi >> np.uint64(1))) >> np.uint64(shift)).astype(np.intp)

    def _home(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        return self._home_of(lo, hi, self._shift)

    def _probe(self, lo: np.ndarray, hi: np.ndarray, words: np.ndarray | None = None) -> np.ndarray:
        """Row of every key (``lo``/``hi`` arrays), -1 where absent; with ``words`` (zeros,
        ``[len(lo), 3W]``) also copies the found masks. Vectorized over all keys: one round at the
        home rows (most keys end there), then windows of the next ``_WINDOW`` rows per unfinished key
        (a chain ends at its key or at an empty row). ``np.take`` of whole rows: key and masks share
        a cache line, and take is several times faster than fancy indexing of a 2-D array."""
        mask = len(self._state) - 1
        state, tab = self._state, self._tab
        out = np.full(len(lo), -1, dtype=np.intp)
        pos = self._home(lo, hi)
        st = state.take(pos)
        rows = tab.take(pos, axis=0)
        hit = (st == _FULL) & (rows[:, 0] == lo) & (rows[:, 1] == hi)
        out[hit] = pos[hit]
        if words is not None:
            words[hit] = rows[hit, 2:]
        todo = np.flatnonzero((st != _EMPTY) & ~hit)
        step = np.arange(1, _WINDOW + 1)
        while len(todo):
            m = len(todo)
            p = (pos[todo, None] + step) & mask  # [m, window]
            st = state.take(p)
            rows = tab.take(p.reshape(-1), axis=0).reshape(m, _WINDOW, -1)
            match = (st == _FULL) & (rows[:, :, 0] == lo[todo, None]) & (rows[:, :, 1] == hi[todo, None])
            stop = match | (st == _EMPTY)
            first = stop.argmax(axis=1)
            r = np.arange(m)
            found = match[r, first]  # the chain reached the key before any empty row
            out[todo[found]] = p[r, first][found]
            if words is not None:
                words[todo[found]] = rows[r[found], first[found], 2:]
            todo = todo[~stop[r, first]]  # no stop in the window: probe the next one
            pos[todo] = (pos[todo] + _WINDOW) & mask
        return out

    def _rehash(self, need: int) -> None:
        """Rebuild the table without tombstones, at load <= 1/2 with ``need`` more keys.

        Invariant: the new table is built completely beside the old one and swapped in only after
        every row was placed; a failure leaves the old table (and every answer) as it was.
        """
        cap = _MIN_CAP
        while 2 * (self._n + need) > cap:
            cap *= 2
        rows = np.ascontiguousarray(self._tab[self._state == _FULL])
        state, tab, shift = self._fresh(cap)
        self._place(state, tab, shift, rows)
        self._swap(state, tab, shift, used=len(rows))

    def _place(self, state: np.ndarray, tab: np.ndarray, shift: int, rows: np.ndarray) -> None:
        """Insert whole ``rows`` (keys distinct) into the empty table ``state``/``tab``: in C one
        row after another, else vectorized rounds (each free row taken by one key per round)."""
        if self._c is not None:
            self._c.place(state, tab, tab.shape[1], shift, rows)
            return
        mask = len(state) - 1
        pos = self._home_of(rows[:, 0], rows[:, 1], shift)
        todo = np.arange(len(rows))
        while len(todo):
            p = pos[todo]
            free = state[p] == _EMPTY
            _, first = np.unique(p[free], return_index=True)  # one winner per free row per round
            win = todo[free][first]
            wp = pos[win]
            state[wp] = _FULL
            tab[wp] = rows[win]
            lost = np.ones(len(todo), dtype=bool)
            lost[np.flatnonzero(free)[first]] = False
            todo = todo[lost]
            pos[todo] = (pos[todo] + 1) & mask

    def _grow_words(self, need_slots: int) -> None:
        w = self._w
        nw = w
        while 64 * nw < need_slots:
            nw *= 2
        tab = np.zeros((len(self._state), 2 + NUM_TIERS * nw), dtype=np.uint64)
        tab[:, :2] = self._tab[:, :2]
        for t in range(NUM_TIERS):  # each tier's words move to the start of its wider block
            tab[:, 2 + t * nw : 2 + t * nw + w] = self._tab[:, 2 + t * w : 2 + (t + 1) * w]
        self._w = nw
        self._set_tab(tab)

    def _slot(self, holder: str) -> int:
        slot = self._slots.get_or_assign(holder)
        if slot >= 64 * self._w:
            self._grow_words(slot + 1)
        return slot

    def _col(self, slot: int, tier: IndexTier) -> tuple[int, int]:
        """(word column, bit) of ``slot`` in ``tier``."""
        return int(tier) * self._w + (slot >> 6), 1 << (slot & 63)

    def _row(self, key: bytes) -> int:
        """Row of ``key``, or -1 (one probe chain in Python)."""
        lo, hi = _KEY.unpack(key)
        mask = len(self._state) - 1
        i = (lo ^ hi >> 1) >> self._shift
        st, mt, stride = self._mst, self._mt, self._stride
        while True:
            s = st[i]
            if s == _EMPTY:
                return -1
            if s == _FULL and mt[i * stride] == lo and mt[i * stride + 1] == hi:
                return i
            i = (i + 1) & mask

    def _insert_rows(self, keys: Iterable[bytes]) -> list[int]:
        """Row of every key, inserting absent ones (masks zero); caller made room and holds the lock.

        One probe chain per key in Python over memoryviews (event batches are a few keys: numpy's
        per-call cost would dominate); the first tombstone on a chain is reused.
        """
        mask = len(self._state) - 1
        shift = self._shift
        st, mt, stride = self._mst, self._mt, self._stride
        unpack = _KEY.unpack
        out = []
        for k in keys:
            lo, hi = unpack(k)
            i = (lo ^ hi >> 1) >> shift
            tomb = -1
            while True:
                s = st[i]
                if s == _EMPTY:
                    break
                if s == _FULL:
                    if mt[i * stride] == lo and mt[i * stride + 1] == hi:
                        break
                elif tomb < 0:
                    tomb = i
                i = (i + 1) & mask
            if s != _FULL:
                if tomb >= 0:
                    i = tomb
                else:
                    self._used += 1
                st[i] = _FULL
                mt[i * stride] = lo
                mt[i * stride + 1] = hi
                self._n += 1
            out.append(i)
        return out

    def _room(self, n: int) -> None:
        if self._used + n > _MAX_LOAD * len(self._state):
            self._rehash(n)

    def _kill(self, rows: np.ndarray) -> None:
        """Turn rows whose masks became all zero into tombstones."""
        if len(rows):
            dead = rows[~self._words[rows].any(axis=1)]
            self._state[dead] = _TOMB
            self._n -= len(dead)

    def _count(self, slot: int, tier: IndexTier, delta: int) -> None:
        self._counts[(slot, tier)] = self._counts.get((slot, tier), 0) + delta

    # --- writes -------------------------------------------------------------------------------
    def add(self, holder: str, tier: IndexTier, keys: Sequence[bytes]) -> None:
        raw = self._joined(keys) if self._c is not None else None
        if raw is None:
            check_keys(keys)
        with self._lock:
            slot = self._slot(holder)
            col, bit = self._col(slot, tier)
            self._room(len(keys))
            if self._c is not None and raw is not None:
                new, used, added = self._c.insert(
                    self._state, self._tab, self._stride, self._shift, 2 + col, bit, raw
                )
                self._n += new
                self._used += used
                self._count(slot, tier, added)
                return
            # _insert_rows inlined: this loop is the ingest rate
            mask, shift = len(self._state) - 1, self._shift
            st, mt, stride = self._mst, self._mt, self._stride
            off = 2 + col
            words = iter(struct.unpack(f"<{2 * len(keys)}Q", b"".join(keys)))  # one call per event
            added = new = used = 0
            for lo, hi in zip(words, words, strict=True):
                i = (lo ^ hi >> 1) >> shift
                tomb = -1
                while True:
                    s = st[i]
                    if s == _FULL:
                        j = i * stride
                        if mt[j] == lo and mt[j + 1] == hi:
                            break
                    elif s == _EMPTY:
                        break
                    elif tomb < 0:
                        tomb = i
                    i = (i + 1) & mask
                if s != _FULL:
                    if tomb >= 0:
                        i = tomb  # reuse the first tombstone on the chain
                    else:
                        used += 1
                    st[i] = _FULL
                    j = i * stride
                    mt[j] = lo
                    mt[j + 1] = hi
                    new += 1
                j = i * stride + off
                v = mt[j]
                if not v & bit:
                    mt[j] = v | bit
                    added += 1
            self._n += new
            self._used += used
            self._count(slot, tier, added)

    def remove(self, holder: str, tier: IndexTier, keys: Sequence[bytes]) -> None:
        check_keys(keys)
        with self._lock:
            slot = self._slots.by_holder.get(holder)
            if slot is None:
                return
            col, bit = self._col(slot, tier)
            stride, off = self._stride, 2 + col
            mt, st = self._mt, self._mst
            removed = 0
            for k in keys:
                i = self._row(k)
                if i < 0:
                    continue
                j = i * stride + off
                v = mt[j]
                if v & bit:
                    mt[j] = v & ~bit
                    removed += 1
                    if not any(mt[i * stride + 2 : (i + 1) * stride]):
                        st[i] = _TOMB  # the key stays in the row; the state says it is gone
                        self._n -= 1
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

    def _keys_array(self, keys: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
        a = np.frombuffer(b"".join(keys), dtype="<u8").reshape(len(keys), 2)
        return a[:, 0].astype(np.uint64), a[:, 1].astype(np.uint64)

    def _clear_column(self, col: int, bit: int, keep: np.ndarray | None = None) -> int:
        """Clear ``bit`` in column ``col`` of every full row (except rows in ``keep``)."""
        c = self._words[:, col]
        hit = (c & np.uint64(bit)) != 0
        if keep is not None and len(keep):
            hit[keep] = False
        rows = np.flatnonzero(hit)
        self._words[rows, col] = c[rows] & ~np.uint64(bit)
        self._kill(rows)
        return len(rows)

    def replace(self, holder: str, tier: IndexTier, keys: Iterable[bytes]) -> None:
        new = list(set(keys))
        check_keys(new)
        with self._lock:
            slot = self._slot(holder)
            col, bit = self._col(slot, tier)
            if self._counts.get((slot, tier), 0):
                keep = self._probe(*self._keys_array(new)) if new else None
                self._clear_column(col, bit, None if keep is None else keep[keep >= 0])
            self._room(len(new))
            stride, off = self._stride, 2 + col
            mt = self._mt
            for i in self._insert_rows(new):
                mt[i * stride + off] |= bit
            self._counts[(slot, tier)] = len(new)

    def drop_holder(self, holder: str) -> int:
        with self._lock:
            slot = self._slots.by_holder.get(holder)
            if slot is None:
                return 0
            n = sum(self._counts.pop((slot, tier), 0) for tier in IndexTier)
            if n:
                for tier in IndexTier:
                    self._clear_column(*self._col(slot, tier))
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
    def _gather(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """Mask words ``[len(lo), 3W]`` of the keys ``lo``/``hi`` (zeros where absent); caller holds
        the lock."""
        out = np.zeros((len(lo), NUM_TIERS * self._w), dtype=np.uint64)
        if len(lo):
            self._probe(lo, hi, out)
        return out

    def lookup(self, keys: Sequence[bytes]) -> PrefixView:
        l1: list[int] = []
        gpu: list[int] = []
        l2: list[int] = []
        with self._lock:
            w = self._w
            words = self._gather(*self._keys_array(keys))
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
        if self._c is not None:
            return self._lookup_one_c(keys)
        n = len(keys)
        if isinstance(keys, np.ndarray):
            words = iter(keys.reshape(-1).tolist())
        else:
            check_keys(keys)
            words = iter(struct.unpack(f"<{2 * n}Q", b"".join(keys)))
        l1: list[int] = []
        gpu: list[int] = []
        l2: list[int] = []
        with self._lock:
            mask, shift, w = len(self._state) - 1, self._shift, self._w
            st, mt, stride = self._mst, self._mt, self._stride
            spec, now = self._spec, time.monotonic()
            for lo, hi in zip(words, words, strict=True):
                i = (lo ^ hi >> 1) >> shift
                m = g = d = 0
                while True:
                    s = st[i]
                    if s == _FULL:
                        j = i * stride
                        if mt[j] == lo and mt[j + 1] == hi:
                            if w == 1:
                                m, g, d = mt[j + 2], mt[j + 3], mt[j + 4]
                            else:
                                for k in range(w):
                                    m |= mt[j + 2 + k] << (64 * k)
                                    g |= mt[j + 2 + w + k] << (64 * k)
                                    d |= mt[j + 2 + 2 * w + k] << (64 * k)
                            break
                    elif s == _EMPTY:
                        break
                    i = (i + 1) & mask
                if spec:
                    sp = spec.get(_KEY.pack(lo, hi))
                    if sp:
                        for slot, t in sp.items():
                            if t > now:
                                g |= 1 << slot
                if not m and not g and not d:
                    break
                l1.append(m)
                gpu.append(g)
                l2.append(d)
            version = self._slots.version
            if self._holders_copy[0] != version:
                self._holders_copy = (version, dict(self._slots.by_slot))
            holders = self._holders_copy[1]
        return MaskView(l1=l1, gpu=gpu, holders=holders, slots_version=version, nwords=w, l2=l2)

    def _lookup_one_c(self, keys: Sequence[bytes] | np.ndarray) -> MaskView:
        if isinstance(keys, np.ndarray):
            raw = np.ascontiguousarray(keys, dtype="<u8").tobytes()
        else:
            check_keys(keys)
            raw = b"".join(keys)
        assert self._c is not None
        with self._lock:
            w, spec = self._w, self._spec
            # with speculative entries every key's masks come back, folded here, then cut
            l1, gpu, l2 = self._c.probe(self._state, self._tab, self._stride, self._shift, w, raw, not spec)
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
            version = self._slots.version
            if self._holders_copy[0] != version:
                self._holders_copy = (version, dict(self._slots.by_slot))
            holders = self._holders_copy[1]
        return MaskView(l1=l1, gpu=gpu, holders=holders, slots_version=version, nwords=w, l2=l2)

    def lookup_words(self, keys: Sequence[bytes] | np.ndarray) -> WordsView:
        if self._c is None:
            return super().lookup_words(keys)
        if isinstance(keys, np.ndarray):
            raw = np.ascontiguousarray(keys, dtype="<u8").tobytes()
        else:
            raw = self._joined(keys)
        with self._lock:
            w, spec = self._w, self._spec
            # with speculative entries every key's row comes back (a zero row may gain a holder)
            words = self._c.probe_words(self._state, self._tab, self._stride, self._shift, w, raw, not spec)
            if spec:
                words = self._fold_words(raw, words, w)
            version = self._slots.version
            if self._holders_copy[0] != version:
                self._holders_copy = (version, dict(self._slots.by_slot))
            holders = self._holders_copy[1]
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
        lo, hi = k[:, :, 0].astype(np.uint64).reshape(-1), k[:, :, 1].astype(np.uint64).reshape(-1)
        with self._lock:
            words = self._gather(lo, hi)
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
        lo = np.ascontiguousarray(k[:, :, 0].T).reshape(-1)
        hi = np.ascontiguousarray(k[:, :, 1].T).reshape(-1)
        with self._lock:
            words = self._gather(lo, hi)
            if self._spec:
                raw = k.astype("<u8").tobytes()
                qkeys = [raw[i : i + CHUNK_KEY_BYTES] for i in range(0, len(raw), CHUNK_KEY_BYTES)]
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
            col, bit = self._col(slot, tier)
            rows = np.flatnonzero(self._words[:, col] & np.uint64(bit))
            raw = np.stack([self._klo[rows], self._khi[rows]], axis=1).astype("<u8").tobytes()
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
