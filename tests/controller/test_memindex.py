"""MemoryIndex internals: the open-addressing table (growth, tombstones, long probe chains, wide masks).

The behaviour every backend shares is in test_controller_index.py; these pin what only the numpy
table can get wrong.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvgrid.controller.index import IndexTier, MemoryIndex
from kvgrid.controller.index.memory import NATIVE
from kvgrid.controller.matching import match_words
from tests.controller.memtable import check_table, decoded
from tests.controller.support import rand_keys

L1, GPU, L2 = IndexTier.L1, IndexTier.GPU, IndexTier.L2
TIERS = (L1, GPU, L2)


def _held(index: MemoryIndex, keys: list[bytes]) -> list[bool]:
    """Per key: does the batch lookup find any holder (one query per key)."""
    view = index.lookup_batch([[k] for k in keys])
    return view.words[0].any(axis=1).tolist()


def _colliding(n: int) -> list[bytes]:
    """Keys whose home row is the same in any table: equal first 8 bytes, second 8 bytes that
    differ only in the lowest bits (the hash keeps top bits)."""
    return [bytes(8) + i.to_bytes(8, "little") for i in range(n)]


def test_growth_rehash_keeps_every_key() -> None:
    index = MemoryIndex()
    start = index.capacity
    keys = rand_keys(5000)
    for i in range(0, len(keys), 8):  # event-sized batches
        index.add("a/1", L1, keys[i : i + 8])
    index.add("b/1", GPU, keys[:100])
    assert index.capacity > start and index.capacity & (index.capacity - 1) == 0
    assert index.num_chunks() == 5000 and index.num_entries() == 5100
    assert all(_held(index, keys))
    assert index.holder_keys("a/1", L1) == set(keys)
    assert index.holder_keys("b/1", GPU) == set(keys[:100])
    assert not any(_held(index, rand_keys(50)))


def test_tombstones_are_reused_and_cleaned() -> None:
    index = MemoryIndex()
    cap = index.capacity
    for _ in range(20):  # 20 x 600 distinct keys pass through a 1024-row table
        keys = rand_keys(600)
        index.add("a/1", L1, keys)
        assert all(_held(index, keys))
        index.remove("a/1", L1, keys)
        assert index.num_chunks() == 0 and index.num_entries() == 0
        assert not any(_held(index, keys))
    # tombstones are rehashed away (to load <= 1/2 for the incoming batch), not grown over
    assert index.capacity <= 2 * cap


def test_probe_chains_longer_than_a_window() -> None:
    index = MemoryIndex()
    keys = _colliding(60)
    k = np.frombuffer(b"".join(keys), dtype="<u8").reshape(-1, 2)
    home = (k[:, 0] ^ (k[:, 1] >> np.uint64(1))) >> np.uint64(index._shift)
    assert len(set(home.tolist())) == 1  # one chain of 60 rows
    index.add("a/1", L1, keys[:40])
    index.add("b/1", GPU, keys[20:50])
    assert _held(index, keys) == [True] * 50 + [False] * 10
    index.remove("a/1", L1, keys[:20])  # tombstones at the start of the chain
    assert _held(index, keys) == [False] * 20 + [True] * 30 + [False] * 10
    index.add("c/1", L1, keys[50:55])  # reuses tombstones, still found past them
    assert _held(index, keys) == [False] * 20 + [True] * 35 + [False] * 5
    assert np.count_nonzero(index._state == 2) == 15  # 5 of the 20 tombstones reused
    assert index.holder_keys("c/1", L1) == set(keys[50:55])
    view = index.lookup(keys[20:50])
    assert len(view.l1) == 30 and set(view.slots.values()) == {"a/1", "b/1"}


def test_mask_words_grow_past_64_holders() -> None:
    index = MemoryIndex()
    keys = rand_keys(3)
    for h in range(130):
        index.add(f"pod{h}/1", TIERS[h % 3], keys[: 1 + h % 3])
    view = index.lookup_batch([keys])
    assert view.nwords == 4  # 130 slots -> 256 bits per tier
    words = view.words[:, 0]  # [chunk, 3 * nwords]: each tier's block moved as the words grew
    slot = {h: s for s, h in view.holders.items()}
    for h in range(130):
        s = slot[f"pod{h}/1"]
        half = (h % 3) * view.nwords
        for c in range(3):
            bit = int(words[c, half + s // 64]) >> (s % 64) & 1
            assert bit == (c < 1 + h % 3), (h, c)
    assert index.drop_holder("pod129/1") == 1 + 129 % 3
    assert index.num_entries() == sum(1 + h % 3 for h in range(129))


def test_replace_keeps_shared_rows_and_tombstones_emptied_ones() -> None:
    index = MemoryIndex()
    k = rand_keys(6)
    index.add("a/1", L1, k[:4])
    index.add("b/1", L1, k[2:3])
    index.replace("a/1", L1, k[3:6])
    assert index.holder_keys("a/1", L1) == set(k[3:6])
    assert _held(index, k) == [False, False, True, True, True, True]
    assert index.num_chunks() == 4 and index.num_entries() == 4
    assert np.count_nonzero(index._state == 2) == 2  # k[0], k[1] became tombstones


def _prefix_rows(words: bytes, nwords: int) -> bytes:
    row = 8 * len(TIERS) * nwords
    for i in range(0, len(words), row):
        if not any(words[i : i + row]):
            return words[:i]
    return words


def test_compiled_extension_is_built() -> None:
    # `pip install` (the Makefile's install step) builds it; without it the Python loops serve, and
    # the equivalence tests below would compare the Python path with itself
    assert NATIVE, "kvgrid.controller.index._probe was not built (no C compiler at install time?)"


@pytest.mark.skipif(not NATIVE, reason="the compiled extension is not built")
def test_compiled_and_python_loops_build_the_same_table() -> None:
    # The same writes through the C loops and the Python ones leave the same rows and as many
    # tombstones (reused alike), across mask-word growth past 256 holders, removals, holders
    # leaving, replaces and rehashes; the single-query lookups agree, with speculative entries too.
    rng = random.Random(7)
    pool = rand_keys(3000)
    ix = {c: MemoryIndex(native=c) for c in (True, False)}
    holders = [f"pod{h}/1" for h in range(300)]
    for i, h in enumerate(holders):  # every pod holds something: 300 slots, 8 mask words per tier
        for index in ix.values():
            index.add(h, GPU, pool[i : i + 3])
    for step in range(1500):
        op = rng.random()
        h = rng.choice(holders[: 40 + step // 5])  # holders join over time: words grow 1 -> 8
        tier = rng.choice(TIERS)
        start = rng.randrange(len(pool) - 40)
        keys = pool[start : start + rng.randint(1, 40)]
        for index in ix.values():
            if op < 0.75:
                index.add(h, tier, keys)
            elif op < 0.93:
                index.remove(h, tier, keys)
            elif op < 0.97:
                index.drop_holder(holders[int(h[3:-2]) % 20])  # the first 20 pods leave and come back
            else:
                index.replace(h, tier, keys)
    a, b = ix[True], ix[False]
    assert a.width == b.width == 512 and a.capacity == b.capacity
    # the same rows (key and masks); where they sit differs only by the rehash's placement order
    rows = [decoded(x) for x in (a, b)]
    assert len(rows[0]) == a.num_chunks() and np.array_equal(rows[0], rows[1])
    for x in (a, b):
        check_table(x)
    assert a.spilled_rows() == b.spilled_rows() > 0
    assert a.num_entries() == b.num_entries() and a.num_chunks() == b.num_chunks()
    for index in ix.values():
        index.add_speculative("pod3/1", pool[100:110], 60_000)
    queries = [pool[s : s + rng.randint(1, 60)] for s in rng.sample(range(len(pool) - 60), 200)]
    for q in queries:
        assert a.lookup_one(q) == b.lookup_one(q)
        wa, wb = a.lookup_words(q), b.lookup_words(q)
        # equal up to the first chunk nobody holds (where one may stop and the other not)
        assert _prefix_rows(wa.words, wa.nwords) == _prefix_rows(wb.words, wb.nwords)
        assert wa.holders == wb.holders and wa.nwords == wb.nwords
        ones = (1 << 64 * wa.nwords) - 1
        x, y = match_words(wa.words, wa.nwords, ones), match_words(wa.words, wa.nwords, ones, native=False)
        assert x.query(0) == y.query(0)
    # the batch gathers (compiled probe vs numpy probe and lane expansion) agree too
    for lo in range(0, 200, 25):
        assert np.array_equal(
            a.lookup_batch(queries[lo : lo + 25]).words, b.lookup_batch(queries[lo : lo + 25]).words
        )


def _both() -> list[MemoryIndex]:
    return [MemoryIndex(native=c) for c in ((True, False) if NATIVE else (False,))]


def _x(index: MemoryIndex, key: bytes) -> tuple[int, int]:
    """(state, x) of ``key``'s row."""
    i = int(index._rows(key)[0])
    return int(index._state[i]), int(index._tab[i, 2])


def test_a_fifth_holder_spills_and_the_fourth_brings_the_row_back_inline() -> None:
    for index in _both():
        k = rand_keys(2)
        for h, tier in ((7, L1), (2, GPU), (5, L2), (2, L1)):  # slots 0, 1, 2 (pod2 twice)
            index.add(f"pod{h}/1", tier, k)
        # lanes sorted by slot: pod7 (slot 0, L1), pod2 (slot 1, L1|GPU), pod5 (slot 2, L2)
        assert _x(index, k[0]) == (1, (0 << 3 | 1) | (1 << 3 | 3) << 16 | (2 << 3 | 4) << 32)
        index.add("pod9/1", GPU, k)  # slot 3: four lanes
        index.add("pod8/1", L1, k[:1])  # slot 4: a fifth holder -> side row
        assert _x(index, k[0])[0] == 3 and index.spilled_rows() == 1 and _x(index, k[1])[0] == 1
        check_table(index)
        view = index.lookup_one(k[:1])
        assert (view.l1[0], view.gpu[0], view.l2[0]) == (0b10011, 0b1010, 0b100)
        index.remove("pod2/1", L1, k)  # still five holders (pod2 keeps GPU)
        assert _x(index, k[0])[0] == 3
        index.remove("pod2/1", GPU, k)  # four: back inline, side row freed
        assert _x(index, k[0]) == (
            1,
            (0 << 3 | 1) | (2 << 3 | 4) << 16 | (3 << 3 | 2) << 32 | (4 << 3 | 1) << 48,
        )
        assert index.spilled_rows() == 0
        check_table(index)
        index.add("pod2/1", GPU, k)  # spills again, into the freed side row
        index.drop_holder("pod8/1")  # a drop brings it back too
        assert _x(index, k[0])[0] == 1 and index.spilled_rows() == 0
        check_table(index)


def test_slots_past_the_lanes_spill_even_alone() -> None:
    rows = []
    k = rand_keys(3)
    for index in _both():
        index.add("first/1", L1, k[:1])
        for h in range(8200):  # slots up to 8200: past the 13 bits of a lane
            index.add_speculative(f"pod{h}/1", k[2:], 60_000)
        index.add("pod8199/1", GPU, k[:2])  # slot 8200
        assert _x(index, k[0])[0] == 3 and _x(index, k[1])[0] == 3
        assert index.lookup_one(k[1:2]).gpu == [1 << 8200]
        check_table(index)
        index.remove("pod8199/1", GPU, k[1:2])  # its only holder: a tombstone, the side row freed
        assert int(index._rows(k[1])[0]) == -1 and index.num_chunks() == 1
        rows.append(decoded(index))
        index.remove("pod8199/1", GPU, k[:1])  # back to one holder of slot 0: inline
        assert _x(index, k[0])[0] == 1 and index.spilled_rows() == 0
        check_table(index)
    assert all(np.array_equal(r, rows[0]) for r in rows)


def test_side_rows_grow_in_the_middle_of_one_insert() -> None:
    rows = []
    keys = rand_keys(300)
    for index in _both():
        for h in range(4):
            index.add(f"pod{h}/1", L1, keys)
        index.add("pod4/1", GPU, keys)  # 300 spills in one call: side rows 0 -> 64 -> ... -> 512
        assert index.spilled_rows() == 300 and len(index._side) == 512
        check_table(index)
        assert index.holder_keys("pod4/1", GPU) == set(keys)
        index.remove("pod4/1", GPU, keys[:100])
        index.replace("pod3/1", L1, keys[200:])  # a scan demotes rows 100-199 and keeps 200-299 spilled
        assert index.spilled_rows() == 100
        check_table(index)
        rows.append(decoded(index))
    assert all(np.array_equal(r, rows[0]) for r in rows)


@pytest.mark.parametrize("native", [True, False] if NATIVE else [False])
def test_bad_keys_are_named_on_the_single_query_and_insert_paths(native: bool) -> None:
    index = MemoryIndex(native=native)
    good = rand_keys(2)
    # a 15- and a 17-byte key join to the right total length: still refused, the first one named
    for bad in ([good[0], b"x" * 15, b"y" * 17], [good[0], "not bytes", good[1]]):
        with pytest.raises(ValueError, match=r"chunk_keys\[1\]"):
            index.lookup_words(bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"chunk_keys\[1\]"):
            index.add("a/1", L1, bad)  # type: ignore[arg-type]
    assert index.num_entries() == 0


class _CountingDict(dict):  # type: ignore[type-arg]
    """A dict that counts whole-map walks (what made each reservation cost O(live reservations))."""

    walks = 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        _CountingDict.walks += 1
        return super().__iter__()

    def items(self):  # type: ignore[no-untyped-def]
        _CountingDict.walks += 1
        return super().items()

    def keys(self):  # type: ignore[no-untyped-def]
        _CountingDict.walks += 1
        return super().keys()


def test_a_reservation_costs_its_keys_not_the_live_reservations(monkeypatch: pytest.MonkeyPatch) -> None:
    idx = MemoryIndex()
    idx._spec = _CountingDict()
    for i in range(50):  # 20,000 live reserved keys on 50 pods
        idx.add_speculative(f"pod{i}/1", rand_keys(400), 60_000)
    _CountingDict.walks = 0
    new = rand_keys(8)
    idx.add_speculative("router-pick/1", new, 60_000)
    idx.drop_holder("pod3/1")  # a drop walks only its own reservations
    assert _CountingDict.walks == 0
    assert idx.lookup(new).gpu[0] != 0  # the reservation is there


def test_expired_reservations_leave_with_their_deadlines(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvgrid.controller.index.memory as memory

    clock = [1000.0]
    monkeypatch.setattr(memory.time, "monotonic", lambda: clock[0])
    idx = MemoryIndex()
    short, long_ = rand_keys(3), rand_keys(3)
    idx.add_speculative("a/1", short, 1_000)
    idx.add_speculative("b/1", long_, 60_000)
    idx.add_speculative("a/1", long_[:1], 60_000)  # a/1 refreshes one key for longer
    clock[0] += 2.0
    idx.add_speculative("c/1", rand_keys(1), 60_000)  # any reservation expires what is due
    assert set(idx._spec) == {bytes(k) for k in long_} | set(idx._spec_keys[idx._slots.by_holder["c/1"]])
    assert idx._spec_keys[idx._slots.by_holder["a/1"]] == {bytes(long_[0])}
