"""MemoryIndex internals: the open-addressing table (growth, tombstones, long probe chains, wide masks).

The behaviour every backend shares is in test_controller_index.py; these pin what only the numpy
table can get wrong.
"""

from __future__ import annotations

import numpy as np

from kvgrid.controller.index import IndexTier, MemoryIndex
from tests.controller.support import rand_keys

L1, GPU = IndexTier.L1, IndexTier.GPU


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
    home = index._home(*index._keys_array(keys))
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
        index.add(f"pod{h}/1", GPU if h % 2 else L1, keys[: 1 + h % 3])
    view = index.lookup_batch([keys])
    assert view.nwords == 4  # 130 slots -> 256 bits per tier
    words = view.words[:, 0]  # [chunk, 2 * nwords]
    slot = {h: s for s, h in view.holders.items()}
    for h in range(130):
        s = slot[f"pod{h}/1"]
        half = view.nwords if h % 2 else 0
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
