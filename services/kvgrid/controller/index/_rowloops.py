"""The compact row format of :class:`~kvgrid.controller.index.memory.MemoryIndex`, and the Python
twins of the compiled per-key loops (``_probe.c``): same names, same arguments, same rows left,
same answers. ``MemoryIndex`` calls whichever module it has (this one when the extension is not
built, or with ``native=False``).

Format. The table is ``tab`` (uint64 ``[cap, 3]``: the key's two words ``lo``, ``hi``, then ``x``)
plus ``state`` (uint8 ``[cap]``):

- ``EMPTY`` / ``TOMB``: no key (a tombstone keeps probe chains intact until the next rehash);
- ``FULL``: ``x`` holds the row's holders inline, up to :data:`LANES` 16-bit lanes, each
  ``slot << 3 | tiers`` (tier bits L1 1, GPU 2, L2 4, :class:`~kvgrid.controller.index.base.IndexTier`
  order), slot < :data:`INLINE_SLOTS`;
- ``SPILL``: ``x`` is the index of the row's *side row* in ``side`` (uint64 ``[n, 3w]``: the L1,
  GPU and L2 holder masks, ``w`` words each, the :class:`~kvgrid.controller.index.base.BatchView`
  layout).

Invariants (every write keeps them; tests/controller/test_index_stateful.py checks them after each
step): a FULL row's used lanes come first, sorted by slot, each with a tier bit, and it has at least
one; a row is FULL exactly when its holders fit the lanes (at most LANES holders, each slot below
INLINE_SLOTS), else SPILL with at least one bit set, so a row's form and content are a function of
its key and holders; live side rows are referenced by exactly one SPILL row; free side rows form a
list through their word 0 (``head`` first, :data:`NIL` ends it).
"""

from __future__ import annotations

import struct

import numpy as np

__all__ = [
    "EMPTY",
    "FULL",
    "INLINE_SLOTS",
    "LANES",
    "NIL",
    "ROW",
    "SPILL",
    "TIERS",
    "TOMB",
    "insert",
    "lanes_clear",
    "lanes_set",
    "place",
    "probe",
    "probe_words",
    "remove",
]

EMPTY, FULL, TOMB, SPILL = 0, 1, 2, 3  # FULL and SPILL are the live states (bit 0 set)
ROW = 3  # words per table row: lo, hi, x
LANES = 4
INLINE_SLOTS = 1 << 13  # 13 bits of slot per lane
NIL = (1 << 64) - 1
TIERS = 3


def _q(buf: np.ndarray) -> memoryview:
    """uint64 elements of a C-contiguous array (Python ints at a fraction of numpy's scalar cost)."""
    if not buf.size:  # no side rows yet (memoryview refuses to cast an empty shape)
        return memoryview(bytearray()).cast("Q")
    return buf.reshape(-1).data.cast("B").cast("Q")


def lanes_set(x: int, slot: int, tb: int) -> tuple[int, int]:
    """(new lanes, 1 set / 0 already set / -1 does not fit: spill) for tier bit ``tb`` of ``slot``."""
    j = 0
    while j < LANES:
        lane = x >> 16 * j & 0xFFFF
        if not lane or lane >> 3 > slot:
            break
        if lane >> 3 == slot:
            if lane & tb:
                return x, 0
            return x | tb << 16 * j, 1
        j += 1
    if x >> 16 * (LANES - 1) or slot >= INLINE_SLOTS:
        return x, -1
    low = x & ((1 << 16 * j) - 1)
    high = (x >> 16 * j) << 16 * (j + 1) & NIL  # the top lane was free
    return low | (slot << 3 | tb) << 16 * j | high, 1


def lanes_clear(x: int, slot: int, tb: int) -> tuple[int, bool]:
    """(new lanes, cleared) for tier bit ``tb`` of ``slot``; a lane left without tiers goes and the
    lanes above it move down."""
    for j in range(LANES):
        lane = x >> 16 * j & 0xFFFF
        if not lane or lane >> 3 > slot:
            return x, False
        if lane >> 3 != slot:
            continue
        if not lane & tb:
            return x, False
        if lane & 7 & ~tb:
            return x & ~(tb << 16 * j), True
        low = x & ((1 << 16 * j) - 1)
        return low | (x >> 16 * (j + 1)) << 16 * j, True
    return x, False


def _lanes_into(x: int, ms: memoryview, base: int, w: int) -> None:
    """OR the holders of lanes ``x`` into the mask words at ``ms[base:base + 3w]``."""
    while x:
        lane = x & 0xFFFF
        s = lane >> 3
        for t in range(TIERS):
            if lane >> t & 1:
                ms[base + t * w + (s >> 6)] |= 1 << (s & 63)
        x >>= 16


def _demote(ms: memoryview, base: int, w: int) -> int | None:
    """The lanes of the side row at ``ms[base:]`` when its holders fit them, else None."""
    out = n = 0
    for k in range(w):
        a, g, d = ms[base + k], ms[base + w + k], ms[base + 2 * w + k]
        u = a | g | d
        if not u:
            continue
        if k >= INLINE_SLOTS // 64 or n + u.bit_count() > LANES:
            return None
        while u:
            b = (u & -u).bit_length() - 1
            tiers = (a >> b & 1) | (g >> b & 1) << 1 | (d >> b & 1) << 2
            out |= ((64 * k + b) << 3 | tiers) << 16 * n
            n += 1
            u &= u - 1
    return out


def _words(s: int, x: int, ms: memoryview, w: int) -> list[int]:
    """A live row's masks as ``3w`` words."""
    if s == SPILL:
        return ms[x * TIERS * w : (x + 1) * TIERS * w].tolist()
    out = [0] * (TIERS * w)
    while x:
        lane = x & 0xFFFF
        slot = lane >> 3
        for t in range(TIERS):
            if lane >> t & 1:
                out[t * w + (slot >> 6)] |= 1 << (slot & 63)
        x >>= 16
    return out


def _find(st: memoryview, mt: memoryview, mask: int, shift: int, lo: int, hi: int) -> int:
    i = (lo ^ hi >> 1) >> shift
    while True:
        s = st[i]
        if s & 1:
            if mt[3 * i] == lo and mt[3 * i + 1] == hi:
                return i
        elif s == EMPTY:
            return -1
        i = (i + 1) & mask


def _rows(
    state: np.ndarray, tab: np.ndarray, shift: int, side: np.ndarray, w: int, keys: bytes, stop: bool
) -> list[list[int]]:
    st, mt, ms = state.data.cast("B"), _q(tab), _q(side)
    mask = len(st) - 1
    n = len(keys) // 16
    it = iter(struct.unpack(f"<{2 * n}Q", keys))
    out = []
    for lo, hi in zip(it, it, strict=True):
        i = _find(st, mt, mask, shift, lo, hi)
        if i < 0:
            if stop:
                break
            out.append([0] * (TIERS * w))
        else:
            out.append(_words(st[i], mt[3 * i + 2], ms, w))
    return out


def probe(
    state: np.ndarray, tab: np.ndarray, shift: int, side: np.ndarray, w: int, keys: bytes, stop: bool
) -> tuple[list[int], list[int], list[int]]:
    """Per key the L1, GPU and L2 holder masks (ints); with ``stop``, up to the first absent key."""
    masks: tuple[list[int], list[int], list[int]] = ([], [], [])
    for r in _rows(state, tab, shift, side, w, keys, stop):
        for t in range(TIERS):
            ws = r[t * w : (t + 1) * w]
            masks[t].append(ws[0] if w == 1 else sum(v << 64 * k for k, v in enumerate(ws)))
    return masks


def probe_words(
    state: np.ndarray, tab: np.ndarray, shift: int, side: np.ndarray, w: int, keys: bytes, stop: bool
) -> bytes:
    """As :func:`probe`, the masks as raw rows of ``3w`` little-endian uint64 (zeros where absent)."""
    rows = _rows(state, tab, shift, side, w, keys, stop)
    return struct.pack(f"<{len(rows) * TIERS * w}Q", *(v for r in rows for v in r))


def insert(
    state: np.ndarray,
    tab: np.ndarray,
    shift: int,
    side: np.ndarray,
    w: int,
    head: int,
    slot: int,
    tier: int,
    keys: bytes,
) -> tuple[int, int, int, int, int, int]:
    """Set (slot, tier) on every key's row, inserting absent keys (the first tombstone on a chain is
    reused); a row whose holders outgrow the lanes moves to the free side row ``head``. Stops
    before a key that needs a side row when none is free. Returns (keys done, new rows, rows taken
    from empty, bits set, free head, rows spilled)."""
    st, mt, ms = state.data.cast("B"), _q(tab), _q(side)
    mask, sw, tb, bit = len(st) - 1, TIERS * w, 1 << tier, 1 << (slot & 63)
    col = tier * w + (slot >> 6)
    n = len(keys) // 16
    it = iter(struct.unpack(f"<{2 * n}Q", keys))
    done = fresh = used = added = spilled = 0
    for lo, hi in zip(it, it, strict=True):
        i = (lo ^ hi >> 1) >> shift
        tomb = -1
        while True:
            s = st[i]
            if s & 1:
                if mt[3 * i] == lo and mt[3 * i + 1] == hi:
                    break
            elif s == EMPTY:
                break
            elif tomb < 0:
                tomb = i
            i = (i + 1) & mask
        if s == SPILL:
            p = mt[3 * i + 2] * sw + col
            if not ms[p] & bit:
                ms[p] |= bit
                added += 1
            done += 1
            continue
        old = mt[3 * i + 2] if s == FULL else 0
        x, rc = lanes_set(old, slot, tb)
        if rc < 0 and head == NIL:
            break  # no free side row: the caller adds some
        if s != FULL:
            if tomb >= 0:
                i = tomb
            else:
                used += 1
            mt[3 * i], mt[3 * i + 1] = lo, hi
            st[i] = FULL
            fresh += 1
        if rc < 0:  # spill: the lanes and the new bit into the free side row
            j, base = head, head * sw
            head = ms[base]
            ms[base : base + sw] = memoryview(bytes(8 * sw)).cast("Q")
            _lanes_into(old, ms, base, w)
            ms[base + col] |= bit
            mt[3 * i + 2] = j
            st[i] = SPILL
            spilled += 1
            rc = 1
        else:
            mt[3 * i + 2] = x
        added += rc
        done += 1
    return done, fresh, used, added, head, spilled


def remove(
    state: np.ndarray,
    tab: np.ndarray,
    shift: int,
    side: np.ndarray,
    w: int,
    head: int,
    slot: int,
    tier: int,
    keys: bytes,
) -> tuple[int, int, int, int]:
    """Clear (slot, tier) on every key's row; a row left without holders becomes a tombstone, a side
    row whose holders fit the lanes again goes back to them. Returns (bits cleared, rows emptied,
    free head, side rows freed)."""
    st, mt, ms = state.data.cast("B"), _q(tab), _q(side)
    mask, sw, tb, bit = len(st) - 1, TIERS * w, 1 << tier, 1 << (slot & 63)
    col = tier * w + (slot >> 6)
    n = len(keys) // 16
    it = iter(struct.unpack(f"<{2 * n}Q", keys))
    removed = killed = freed = 0
    for lo, hi in zip(it, it, strict=True):
        i = _find(st, mt, mask, shift, lo, hi)
        if i < 0:
            continue
        x = mt[3 * i + 2]
        if st[i] == FULL:
            x, ok = lanes_clear(x, slot, tb)
            if not ok:
                continue
            mt[3 * i + 2] = x
        else:
            base = x * sw
            if not ms[base + col] & bit:
                continue
            ms[base + col] &= ~bit
            lanes = _demote(ms, base, w)
            if lanes is not None:  # fits the lanes again: free the side row
                ms[base] = head
                head = x
                mt[3 * i + 2] = x = lanes
                st[i] = FULL
                freed += 1
        removed += 1
        if st[i] == FULL and not x:
            st[i] = TOMB  # the key stays in the row; the state says it is gone
            killed += 1
    return removed, killed, head, freed


def place(state: np.ndarray, tab: np.ndarray, shift: int, rows: np.ndarray, states: np.ndarray) -> None:
    """Insert whole ``rows`` (keys distinct, each live in ``states``) into the empty table
    ``state``/``tab``: vectorized rounds, each free row taken by one key per round."""
    mask = len(state) - 1
    pos = ((rows[:, 0] ^ (rows[:, 1] >> np.uint64(1))) >> np.uint64(shift)).astype(np.intp)
    todo = np.arange(len(rows))
    while len(todo):
        p = pos[todo]
        free = state[p] == EMPTY
        _, first = np.unique(p[free], return_index=True)  # one winner per free row per round
        win = todo[free][first]
        wp = pos[win]
        state[wp] = states[win]
        tab[wp] = rows[win]
        lost = np.ones(len(todo), dtype=bool)
        lost[np.flatnonzero(free)[first]] = False
        todo = todo[lost]
        pos[todo] = (pos[todo] + 1) & mask
