"""L1 pool, page allocator, eviction policy and the chunk cache (in-process, no gRPC)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgrid.agent.cache import ChunkCache, MissCause
from kvgrid.agent.eviction import LRUPolicy, make_policy
from kvgrid.agent.l1 import L1Pool, PageAllocator

PAGE = 4096


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


class Recorder:
    def __init__(self) -> None:
        self.seq = 0
        self.admitted: list[bytes] = []
        self.evicted: list[bytes] = []

    def on_admit(self, ns: str, keys: list[bytes]) -> None:
        self.seq += 1
        self.admitted += keys

    def on_evict(self, ns: str, keys: list[bytes]) -> None:
        self.seq += 1
        self.evicted += keys

    def last_sequence(self) -> int:
        return self.seq


def store(
    cache: ChunkCache, keys: list[bytes], nbytes: int = PAGE, layout: str = "L", fill: int = 1
) -> tuple:
    res = cache.reserve_store(keys, namespace_id="ns", layout_id=layout, nbytes=nbytes)
    for _, c in res.new_chunks:
        c.buffer.fill_(fill)
    held, present = cache.commit(res)
    return held, present, res.reason


def test_allocator_coalesces_and_rejects_double_free() -> None:
    a = PageAllocator(10)
    runs = [a.allocate(2) for _ in range(5)]
    assert sorted(r for r in runs if r is not None) == [0, 2, 4, 6, 8]
    assert a.allocate(1) is None
    a.free(2, 2)
    a.free(6, 2)
    assert a.largest_free_run() == 2
    a.free(4, 2)  # joins 2..8
    assert a.largest_free_run() == 6
    assert a.allocate(6) == 2
    with pytest.raises(ValueError, match="outside"):
        a.free(9, 5)
    a.free(0, 2)
    with pytest.raises(ValueError, match="double free"):
        a.free(0, 2)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 6)), max_size=80), st.integers(0, 2**32))
def test_allocator_never_overlaps(ops: list[tuple[bool, int]], seed: int) -> None:
    rng = random.Random(seed)
    a = PageAllocator(32)
    live: dict[int, int] = {}
    for is_alloc, n in ops:
        if is_alloc or not live:
            start = a.allocate(n)
            if start is not None:
                assert all(start + n <= s or s + ln <= start for s, ln in live.items())
                assert start >= 0 and start + n <= 32
                live[start] = n
        else:
            s = rng.choice(list(live))
            a.free(s, live.pop(s))
        assert a.free_pages == 32 - sum(live.values())
    for s, n in list(live.items()):
        a.free(s, n)
    assert a.allocate(32) == 0


def test_pool_is_page_aligned_and_not_pinned_without_cuda() -> None:
    pool = L1Pool(10 * PAGE + 100, page_bytes=PAGE)
    assert pool.capacity_bytes == 10 * PAGE
    assert pool.tensor.data_ptr() % PAGE == 0
    assert not pool.pinned
    got = pool.allocate(PAGE + 1)
    assert got is not None
    start, pages, view = got
    assert pages == 2 and view.numel() == PAGE + 1
    assert view.data_ptr() == pool.tensor.data_ptr() + start * PAGE
    with pytest.raises(ValueError, match="power of two"):
        L1Pool(PAGE * 4, page_bytes=3000)


def test_lru_order_and_policy_names() -> None:
    p = LRUPolicy()
    for i in range(3):
        p.on_insert(key(i))
    p.on_access(key(0))
    assert list(p.candidates()) == [key(1), key(2), key(0)]
    fifo = make_policy("FIFO")
    for i in range(3):
        fifo.on_insert(key(i))
    fifo.on_access(key(0))  # no reordering: oldest insert goes first
    fifo.on_remove(key(1))
    assert list(fifo.candidates()) == [key(0), key(2)] and len(fifo) == 2
    with pytest.raises(ValueError, match="expected one of"):
        make_policy("random")


def test_prefix_semantics_and_layout_mismatch() -> None:
    cache = ChunkCache(L1Pool(16 * PAGE, page_bytes=PAGE))
    assert store(cache, [key(0), key(1)])[:2] == (2, 0)
    assert cache.prefix_length([key(0), key(1), key(2)], "L", namespace_id="ns") == (2, MissCause.NOT_FOUND)
    assert cache.prefix_length([key(1), key(0)], "L", namespace_id="ns") == (2, MissCause.NONE)
    assert cache.prefix_length([key(5), key(0)], "L", namespace_id="ns") == (0, MissCause.NOT_FOUND)
    assert cache.prefix_length([key(0)], "other", namespace_id="ns") == (0, MissCause.LAYOUT_MISMATCH)
    # Storing again finds them present and copies nothing.
    res = cache.reserve_store([key(0), key(1), key(2)], namespace_id="ns", layout_id="L", nbytes=PAGE)
    assert [new for _, _, new in res.entries] == [False, False, True]
    assert cache.commit(res) == (3, 2)


def test_pressure_keeps_a_prefix_and_never_evicts_pinned_chunks() -> None:
    rec = Recorder()
    cache = ChunkCache(L1Pool(8 * PAGE, page_bytes=PAGE), listener=rec, high_watermark=1.0, low_watermark=1.0)
    assert store(cache, [key(i) for i in range(4)])[0] == 4
    n, _ = cache.pin(("e", "r"), [key(i) for i in range(4)], "L", ttl_s=60, namespace_id="ns")
    assert n == 4
    # 4 pinned pages + 4 free pages: a 6-chunk store keeps the first 4 and says why.
    held, present, reason = store(cache, [key(10 + i) for i in range(6)], fill=2)
    assert held == 4 and present == 0
    assert reason.startswith("l1_full: chunk 4 of 6")
    assert cache.prefix_length([key(i) for i in range(4)], "L", namespace_id="ns")[0] == 4  # pins survived
    assert rec.evicted == []
    # Unpinned, the old chunks are evictable again (LRU: they are the oldest).
    assert cache.unpin(("e", "r")) == 4
    held, _, reason = store(cache, [key(20), key(21)], fill=3)
    assert held == 2 and reason == ""
    assert set(rec.evicted) <= {key(i) for i in range(4)} and len(rec.evicted) == 2
    assert cache.stats().evictions == 2


def test_reserved_and_referenced_chunks_are_not_evicted() -> None:
    cache = ChunkCache(L1Pool(4 * PAGE, page_bytes=PAGE), high_watermark=1.0, low_watermark=1.0)
    store(cache, [key(0), key(1)])
    chunks, _ = cache.acquire_prefix([key(0)], "L", namespace_id="ns")
    res = cache.reserve_store([key(2), key(3), key(4), key(5)], namespace_id="ns", layout_id="L", nbytes=PAGE)
    # key(1) is evicted for key(4); key(0) is referenced and keys 2-4 reserved, so key(5) does not fit.
    assert len(res.new_chunks) == 3 and res.stopped_at == 3
    assert cache.contains(key(0), namespace_id="ns") and not cache.contains(key(1), namespace_id="ns")
    cache.abort(res)  # nothing of an aborted store is visible, its pages are free again
    assert not cache.contains(key(2), namespace_id="ns") and cache.pool.used_bytes == PAGE
    cache.release(chunks)
    with pytest.raises(AssertionError):
        cache.release(chunks)


def test_watermark_eviction_frees_down_to_low_watermark() -> None:
    cache = ChunkCache(L1Pool(10 * PAGE, page_bytes=PAGE), high_watermark=0.8, low_watermark=0.5)
    store(cache, [key(i) for i in range(8)])
    assert cache.stats().num_chunks == 8
    store(cache, [key(100)])
    # 8 used + 1 incoming > 80%: evict until used + incoming <= 50%.
    assert cache.pool.used_bytes <= 5 * PAGE
    assert cache.contains(key(100), namespace_id="ns") and not cache.contains(key(0), namespace_id="ns")


def test_concurrent_commit_of_one_key_keeps_the_first_copy() -> None:
    cache = ChunkCache(L1Pool(8 * PAGE, page_bytes=PAGE))
    a = cache.reserve_store([key(7)], namespace_id="ns", layout_id="L", nbytes=PAGE)
    b = cache.reserve_store([key(7)], namespace_id="ns", layout_id="L", nbytes=PAGE)
    a.new_chunks[0][1].buffer.fill_(1)
    b.new_chunks[0][1].buffer.fill_(2)
    assert cache.commit(a) == (1, 0)
    assert cache.commit(b) == (1, 1)
    chunks, _ = cache.acquire_prefix([key(7)], "L", namespace_id="ns")
    assert int(chunks[0].buffer[0]) == 1
    cache.release(chunks)
    assert cache.pool.used_bytes == PAGE


def test_pin_ttl_expires() -> None:
    now = [0.0]
    cache = ChunkCache(L1Pool(4 * PAGE, page_bytes=PAGE), clock=lambda: now[0])
    store(cache, [key(0)])
    cache.pin(("e", "r"), [key(0)], "L", ttl_s=1.0, namespace_id="ns")
    assert cache.stats().num_pins == 1
    now[0] = 0.5
    assert cache.expire_pins() == 0
    now[0] = 1.5
    assert cache.expire_pins() == 1
    assert cache.stats().num_pins == 0
    assert cache.clear() == 1


def test_snapshot_groups_keys_by_namespace_with_sequence() -> None:
    rec = Recorder()
    cache = ChunkCache(L1Pool(8 * PAGE, page_bytes=PAGE), listener=rec)
    store(cache, [key(0), key(1)])
    by_ns, seq = cache.snapshot()
    assert by_ns == {"ns": [key(0), key(1)]} and seq == 1
