"""Test helpers that read MemoryIndex's compact table (the format of
``kvgrid/controller/index/_rowloops.py``): its invariants, its rows decoded to full mask words (so
the compiled and the Python loops can be compared whatever side rows they picked), and counters of
the row kinds' transitions a run went through."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvgrid.controller.index import NUM_TIERS, MemoryIndex
from kvgrid.controller.index import _rowscans as scans
from kvgrid.controller.index._rowloops import EMPTY, FULL, INLINE_SLOTS, LANES, NIL, SPILL, TOMB


def live_rows(mem: MemoryIndex) -> np.ndarray:
    return np.flatnonzero((mem._state & 1) != 0)


def decoded(mem: MemoryIndex) -> np.ndarray:
    """Every live row as [lo, hi, 3W mask words], sorted (where rows sit and which side rows they
    use do not matter)."""
    rows = live_rows(mem)
    words = scans.expand(mem._state, mem._tab, mem._side, mem._w, rows)
    return np.unique(np.concatenate([mem._tab[rows, :2], words], axis=1), axis=0)


def _lanes(x: int) -> list[int]:
    return [x >> 16 * j & 0xFFFF for j in range(LANES)]


def check_table(mem: MemoryIndex) -> None:
    """The compact table's invariants (see _rowloops' docstring)."""
    st, tab, side, w = mem._state, mem._tab, mem._side, mem._w
    cap = mem.capacity
    assert cap & (cap - 1) == 0 and cap >= 1024
    assert set(np.unique(st).tolist()) <= {EMPTY, FULL, TOMB, SPILL}
    live = live_rows(mem)
    ntomb = int(np.count_nonzero(st == TOMB))
    assert len(live) == mem.num_chunks(), f"{len(live)} live rows, num_chunks {mem.num_chunks()}"
    assert mem._used == len(live) + ntomb, f"used {mem._used}, live + tombstones {len(live) + ntomb}"
    assert mem._used <= 0.75 * cap
    assert len(np.unique(tab[live, :2], axis=0)) == len(live), "a key in two live rows"
    assert side.shape[1] == NUM_TIERS * w
    for i in np.flatnonzero(st == FULL).tolist():
        lanes = _lanes(int(tab[i, 2]))
        used = [v for v in lanes if v]
        assert used, f"row {i}: FULL without a holder"
        assert lanes[: len(used)] == used, f"row {i}: a free lane before a used one: {lanes}"
        assert all(v & 7 for v in used), f"row {i}: a lane without tiers: {lanes}"
        slots = [v >> 3 for v in used]
        assert slots == sorted(set(slots)), f"row {i}: lanes not in slot order: {lanes}"
    spill = np.flatnonzero(st == SPILL)
    idx = tab[spill, 2].astype(np.int64)
    assert len(spill) == mem.spilled_rows(), f"{len(spill)} SPILL rows, counted {mem.spilled_rows()}"
    assert len(set(idx.tolist())) == len(idx) and (idx < len(side)).all(), "side rows shared or out of range"
    if len(spill):
        s = side[idx]
        u = s[:, :w] | s[:, w : 2 * w] | s[:, 2 * w :]
        bits = np.unpackbits(np.ascontiguousarray(u).view(np.uint8), axis=1, bitorder="little")
        n = bits.sum(axis=1)
        assert (n > 0).all(), "a SPILL row without a holder"
        wide = bits[:, INLINE_SLOTS:].any(axis=1) if bits.shape[1] > INLINE_SLOTS else np.zeros(len(n), bool)
        assert ((n > LANES) | wide).all(), "a SPILL row whose holders fit the lanes"
    free, i = [], mem._head
    while i != NIL:
        assert 0 <= i < len(side) and len(free) <= len(side), f"free list broken at {i}"
        free.append(int(i))
        i = int(side[i, 0])
    assert not set(free) & set(idx.tolist()), "a side row both free and in use"
    assert len(free) + len(idx) == len(side), f"{len(free)} free + {len(idx)} used of {len(side)} side rows"


@dataclass
class Transitions:
    """Row-kind transitions a run made: inline rows spilled by inserts, side rows demoted by
    per-key removals and by scans (drop, replace), inline holders cleared by scans, and rehashes
    that moved inline and side rows together."""

    spilled: int = 0
    demoted_by_remove: int = 0
    demoted_by_scan: int = 0
    inline_cleared_by_scan: int = 0
    mixed_rehashes: int = 0
    inserted_at_lane: list[int] = field(default_factory=lambda: [0] * LANES)
    removed_at_lane: list[int] = field(default_factory=lambda: [0] * LANES)
    """Per-key writes to inline rows by lane position: a holder inserted there (the lanes above
    move up), or one of its tiers cleared there."""


class _Recorder:
    """Stands in for the per-key loop module of one MemoryIndex, counting transitions."""

    def __init__(self, inner: Any, mem: MemoryIndex, t: Transitions) -> None:
        self._inner, self._mem, self._t = inner, mem, t

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _lanes_of(self, raw: bytes, slot: int, tier: int, insert: bool) -> None:
        mem, out = self._mem, self._t.inserted_at_lane if insert else self._t.removed_at_lane
        for i in mem._rows(raw).tolist():
            if i < 0 or mem._state[i] != FULL:
                continue
            lanes = [v for v in _lanes(int(mem._tab[i, 2])) if v]
            mine = [j for j, v in enumerate(lanes) if v >> 3 == slot]
            if insert and not mine and len(lanes) < LANES:
                out[sum(v >> 3 < slot for v in lanes)] += 1
            elif not insert and mine and lanes[mine[0]] >> tier & 1:
                out[mine[0]] += 1

    def insert(self, *args: Any) -> Any:
        self._lanes_of(args[-1], args[-3], args[-2], True)
        out = self._inner.insert(*args)
        self._t.spilled += out[5]
        return out

    def remove(self, *args: Any) -> Any:
        self._lanes_of(args[-1], args[-3], args[-2], False)
        out = self._inner.remove(*args)
        self._t.demoted_by_remove += out[3]
        return out


def record_transitions(mem: MemoryIndex, t: Transitions) -> None:
    mem._k = _Recorder(mem._k, mem, t)  # type: ignore[assignment]
    clear, rehash = mem._clear, mem._rehash

    def recording_clear(slot: int, tbits: int, keep: np.ndarray | None = None) -> None:
        t.inline_cleared_by_scan += int(
            np.count_nonzero(scans._inline_hits(mem._state, mem._tab[:, 2], slot, tbits))
        )
        before = mem.spilled_rows()
        clear(slot, tbits, keep)
        t.demoted_by_scan += before - mem.spilled_rows()

    def recording_rehash(need: int) -> None:
        if np.count_nonzero(mem._state == SPILL) and np.count_nonzero(mem._state == FULL):
            t.mixed_rehashes += 1
        rehash(need)

    mem._clear = recording_clear  # type: ignore[method-assign]
    mem._rehash = recording_rehash  # type: ignore[method-assign]
