"""Vectorized (numpy) operations over the whole compact table of
:class:`~kvgrid.controller.index.memory.MemoryIndex`: the batch probe and expansion of the Python
fallback, the scans of one holder (drop, replace, holder_keys), demotion of side rows and the side
rows' growth and compaction. One implementation serves the compiled and the Python per-key loops
alike. The row format and its invariants are in ``_rowloops.py``; every function here keeps them.
"""

from __future__ import annotations

import numpy as np

from kvgrid.controller.index._rowloops import EMPTY, FULL, INLINE_SLOTS, LANES, NIL, SPILL, TIERS, TOMB

__all__ = ["clear_slot", "compact_side", "expand", "grow_side", "probe_rows", "slot_rows"]

_SHIFTS = np.arange(0, 16 * LANES, 16, dtype=np.uint64)
_LANE = np.uint64(0xFFFF)
_WINDOW = 16  # rows probed at once per key after the home row


def _lanes(x: np.ndarray) -> np.ndarray:
    """``[m, LANES]`` lanes of the inline words ``x``."""
    return (x[:, None] >> _SHIFTS) & _LANE


def _pack(lanes: np.ndarray) -> np.ndarray:
    """Inline words of ``[m, LANES]`` lanes, used lanes first in slot order (the canonical form)."""
    key = np.where(lanes == 0, np.uint64(1 << 16), lanes)
    key.sort(axis=1)
    key[key == 1 << 16] = 0
    return np.bitwise_or.reduce(key << _SHIFTS, axis=1)


def probe_rows(state: np.ndarray, tab: np.ndarray, shift: int, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Row of every key, -1 where absent: one round at the home rows (most keys end there), then
    windows of the next ``_WINDOW`` rows per unfinished key. ``np.take`` of whole rows: the key and
    its lanes share a cache line, and take is several times faster than fancy indexing."""
    mask = len(state) - 1
    out = np.full(len(lo), -1, dtype=np.intp)
    pos = ((lo ^ (hi >> np.uint64(1))) >> np.uint64(shift)).astype(np.intp)
    st = state.take(pos)
    rows = tab.take(pos, axis=0)
    hit = ((st & 1) != 0) & (rows[:, 0] == lo) & (rows[:, 1] == hi)
    out[hit] = pos[hit]
    todo = np.flatnonzero((st != EMPTY) & ~hit)
    step = np.arange(1, _WINDOW + 1)
    while len(todo):
        m = len(todo)
        p = (pos[todo, None] + step) & mask  # [m, window]
        st = state.take(p)
        rows = tab.take(p.reshape(-1), axis=0).reshape(m, _WINDOW, -1)
        match = ((st & 1) != 0) & (rows[:, :, 0] == lo[todo, None]) & (rows[:, :, 1] == hi[todo, None])
        stop = match | (st == EMPTY)
        first = stop.argmax(axis=1)
        r = np.arange(m)
        found = match[r, first]  # the chain reached the key before any empty row
        out[todo[found]] = p[r, first][found]
        todo = todo[~stop[r, first]]  # no stop in the window: probe the next one
        pos[todo] = (pos[todo] + _WINDOW) & mask
    return out


def expand(state: np.ndarray, tab: np.ndarray, side: np.ndarray, w: int, rows: np.ndarray) -> np.ndarray:
    """Mask words ``[len(rows), 3w]`` of ``rows`` (zeros where -1)."""
    out = np.zeros((len(rows), TIERS * w), dtype=np.uint64)
    found = np.flatnonzero(rows >= 0)
    r = rows[found]
    x = tab[r, 2]
    sp = state[r] == SPILL
    out[found[sp]] = side[x[sp].astype(np.intp)]
    inl, lanes = found[~sp], _lanes(x[~sp])
    for j in range(LANES):
        lane = lanes[:, j]
        used = lane != 0
        dst, lane = inl[used], lane[used]
        slot = lane >> np.uint64(3)
        word, bit = (slot >> np.uint64(6)).astype(np.intp), np.uint64(1) << (slot & np.uint64(63))
        for t in range(TIERS):
            on = (lane >> np.uint64(t)) & np.uint64(1) != 0
            out[dst[on], t * w + word[on]] |= bit[on]  # one lane per row: no index repeats
    return out


def _inline_hits(state: np.ndarray, x: np.ndarray, slot: int, tbits: int) -> np.ndarray:
    """Rows whose lanes hold ``slot`` with any of ``tbits``."""
    hit = np.zeros(len(x), dtype=bool)
    want, tb = np.uint64(slot << 3), np.uint64(tbits)
    for s in _SHIFTS:
        lane = (x >> s) & _LANE
        hit |= ((lane & np.uint64(0xFFF8)) == want) & ((lane & tb) != 0)
    hit &= state == FULL
    return hit


def _spill_hits(
    state: np.ndarray, x: np.ndarray, side: np.ndarray, w: int, slot: int, tbits: int
) -> tuple[np.ndarray, np.ndarray]:
    """(SPILL rows, per tier whether each has ``slot``): ``[len(rows), TIERS]`` bools."""
    rows = np.flatnonzero(state == SPILL)
    idx = x[rows].astype(np.intp)
    bit = np.uint64(1 << (slot & 63))
    has = np.zeros((len(rows), TIERS), dtype=bool)
    for t in range(TIERS):
        if tbits >> t & 1:
            has[:, t] = (side[idx, t * w + (slot >> 6)] & bit) != 0
    return rows, has


def slot_rows(
    state: np.ndarray, tab: np.ndarray, side: np.ndarray, w: int, slot: int, tier: int
) -> np.ndarray:
    """Rows whose holders include (slot, tier), ascending."""
    x = tab[:, 2]
    rows, has = _spill_hits(state, x, side, w, slot, 1 << tier)
    return np.union1d(np.flatnonzero(_inline_hits(state, x, slot, 1 << tier)), rows[has.any(axis=1)])


def clear_slot(
    state: np.ndarray,
    tab: np.ndarray,
    side: np.ndarray,
    w: int,
    head: int,
    slot: int,
    tbits: int,
    keep: np.ndarray | None = None,
) -> tuple[int, int, int]:
    """Clear ``slot`` in the tiers of ``tbits`` on every live row except ``keep``; rows left without
    holders become tombstones, side rows that fit the lanes again go back to them. Returns (rows
    emptied, free head, side rows freed)."""
    x = tab[:, 2]
    hit = _inline_hits(state, x, slot, tbits)
    if keep is not None and len(keep):
        hit[keep] = False
    rows = np.flatnonzero(hit)
    killed = 0
    if len(rows):
        lanes = _lanes(x[rows])
        mine = ((lanes >> np.uint64(3)) == slot) & ((lanes & np.uint64(7)) != 0)
        lanes[mine] &= ~np.uint64(tbits)
        lanes[(lanes & np.uint64(7)) == 0] = 0
        nx = _pack(lanes)
        x[rows] = nx
        dead = rows[nx == 0]
        state[dead] = TOMB
        killed = len(dead)
    srows, has = _spill_hits(state, x, side, w, slot, tbits)
    if keep is not None and len(keep):
        has[np.isin(srows, keep)] = False
    touched = has.any(axis=1)
    srows, has = srows[touched], has[touched]
    if not len(srows):
        return killed, head, 0
    idx = x[srows].astype(np.intp)
    bit = np.uint64(1 << (slot & 63))
    for t in range(TIERS):
        col = t * w + (slot >> 6)
        side[idx[has[:, t]], col] &= ~bit
    k, head, freed = _demote(state, x, side, w, head, srows)
    return killed + k, head, freed


def _demote(
    state: np.ndarray, x: np.ndarray, side: np.ndarray, w: int, head: int, rows: np.ndarray
) -> tuple[int, int, int]:
    """SPILL ``rows`` (ascending) whose holders fit the lanes go back to them; their side rows join
    the free list in that order. Returns (rows emptied, free head, side rows freed)."""
    idx = x[rows].astype(np.intp)
    s = side[idx]
    u = s[:, :w] | s[:, w : 2 * w] | s[:, 2 * w :]
    bits = np.unpackbits(np.ascontiguousarray(u).view(np.uint8), axis=1, bitorder="little")
    ok = bits.sum(axis=1) <= LANES
    if bits.shape[1] > INLINE_SLOTS:
        ok &= ~bits[:, INLINE_SLOTS:].any(axis=1)
    sel = np.flatnonzero(ok)
    if not len(sel):
        return 0, head, 0
    ri, slots = np.nonzero(bits[sel])  # row-major: each row's slots ascending
    word, b = slots >> 6, (slots & 63).astype(np.uint64)
    tiers = np.zeros(len(ri), dtype=np.uint64)
    for t in range(TIERS):
        tiers |= ((s[sel[ri], t * w + word] >> b) & np.uint64(1)) << np.uint64(t)
    first = np.searchsorted(ri, np.arange(len(sel)))
    nth = (np.arange(len(ri)) - first[ri]).astype(np.uint64)
    nx = np.zeros(len(sel), dtype=np.uint64)
    np.add.at(nx, ri, ((slots.astype(np.uint64) << np.uint64(3)) | tiers) << (np.uint64(16) * nth))
    back, freed = rows[sel], idx[sel]
    x[back] = nx
    state[back] = np.where(nx == 0, TOMB, FULL)
    side[freed[0], 0] = head  # pushed in order: the last one is the new head
    side[freed[1:], 0] = freed[:-1]
    return int(np.count_nonzero(nx == 0)), int(freed[-1]), len(sel)


def grow_side(side: np.ndarray, head: int) -> tuple[np.ndarray, int]:
    """``side`` with twice the rows (64 at least), the new ones on the free list before ``head``."""
    n = len(side)
    new = np.zeros((max(64, 2 * n), side.shape[1]), dtype=np.uint64)
    new[:n] = side
    new[n:-1, 0] = np.arange(n + 1, len(new), dtype=np.uint64)
    new[-1, 0] = head
    return new, n


def compact_side(
    state: np.ndarray, tab: np.ndarray, side: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """The live rows (copied, each SPILL row renumbered to its new side row), their states, and the
    side rows of those alone (no free ones: a later spill grows them): (rows, states, side, head)."""
    live = (state & 1) != 0
    rows, states = np.ascontiguousarray(tab[live]), np.ascontiguousarray(state[live])
    sp = states == SPILL
    idx = rows[sp, 2].astype(np.intp)
    rows[sp, 2] = np.arange(len(idx), dtype=np.uint64)
    return rows, states, np.ascontiguousarray(side[idx]), NIL
