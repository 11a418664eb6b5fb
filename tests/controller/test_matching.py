"""Batch matching (numpy over holder words) against the per-query big-int reference, both backends."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgrid.controller.index import ChunkIndex, IndexTier, MemoryIndex, batch_view_from_prefix_views
from kvgrid.controller.index.memory import NATIVE
from kvgrid.controller.index.redis import RedisIndex
from kvgrid.controller.matching import (
    BatchMatch,
    PodPrefix,
    match_batch,
    match_one,
    match_prefix,
    match_words,
)
from tests.controller.support import rand_keys, unique_prefix

L1, GPU, L2 = IndexTier.L1, IndexTier.GPU, IndexTier.L2
UNIVERSE = [bytes([i]) * 16 for i in range(10)]


def _reference(index: ChunkIndex, query: list[bytes], eligible: np.ndarray, max_pods: int) -> tuple:
    view = index.lookup(query)
    mask = sum(1 << int(s) for s in np.flatnonzero(eligible))
    ref = match_prefix(view, mask)
    pods = ref.pods[:max_pods] if max_pods else ref.pods
    return [(view.slots[p.slot], p.gpu, p.l1, p.peer, p.l2) for p in pods], ref.peer_fetchable


def _named(m: BatchMatch, holders: dict[int, str], b: int) -> tuple:
    q = m.query(b)
    return [(holders[p.slot], p.gpu, p.l1, p.peer, p.l2) for p in q.pods], q.peer_fetchable


@settings(max_examples=60, deadline=None)
@given(
    width=st.sampled_from([1, 4, 64]),
    holders=st.sampled_from([1, 3, 9, 70]),
    native=st.sampled_from([False, True] if NATIVE else [False]),
    data=st.data(),
)
def test_batch_matches_reference_memory(width: int, holders: int, native: bool, data: st.DataObject) -> None:
    index = MemoryIndex(width=width, native=native)
    for h in range(holders):
        for tier in (L1, GPU, L2):
            keys = data.draw(st.lists(st.sampled_from(UNIVERSE), max_size=8), label=f"h{h} {tier.name}")
            index.add(f"pod{h}/1", tier, keys)
    if data.draw(st.booleans(), label="speculative"):
        index.add_speculative(f"pod{holders - 1}/1", UNIVERSE[:3], 60_000)
    queries = data.draw(st.lists(st.lists(st.sampled_from(UNIVERSE), max_size=10), min_size=1, max_size=5))
    view = index.lookup_batch(queries)
    nslots = 64 * view.nwords
    eligible = np.array(
        data.draw(st.lists(st.booleans(), min_size=len(queries) * nslots, max_size=len(queries) * nslots)),
        dtype=bool,
    ).reshape(len(queries), nslots)
    max_pods = data.draw(st.lists(st.integers(0, 3), min_size=len(queries), max_size=len(queries)))
    m = match_batch(view.words, eligible, max_pods)
    packed = batch_view_from_prefix_views([index.lookup(q) for q in queries])  # the other backends' path
    m2 = match_batch(packed.words, eligible[:, : 64 * packed.nwords], max_pods)
    for b, q in enumerate(queries):
        want = _reference(index, q, eligible[b], max_pods[b])
        assert _named(m, view.holders, b) == want
        assert _named(m2, packed.holders, b) == want
        # the single-query path: pure-Python probe (bytes keys and packed words) and group matching
        one = index.lookup_one(q)
        words = np.frombuffer(b"".join(q), dtype="<u8").reshape(-1, 2) if q else np.zeros((0, 2), np.uint64)
        assert index.lookup_one(words) == one
        mask = sum(1 << int(s) for s in np.flatnonzero(eligible[b]))
        assert _named(match_one(one.l1, one.gpu, mask, max_pods[b], one.l2), one.holders, 0) == want
        # the compiled path (raw rows, C matcher) and its Python fallback
        wv = index.lookup_words(q)
        assert index.lookup_words(words) == wv
        for c in (True, False):
            got = match_words(wv.words, wv.nwords, mask, max_pods[b], native=c)
            assert _named(got, wv.holders, 0) == want
        assert m.pods.tolist() == sorted(set(m.pods.tolist()))


@pytest.fixture(params=["memory", "redis"])
def index(request: pytest.FixtureRequest, valkey_url: str) -> Iterator[ChunkIndex]:
    idx: ChunkIndex = (
        MemoryIndex() if request.param == "memory" else RedisIndex(valkey_url, prefix=unique_prefix())
    )
    yield idx
    if isinstance(idx, RedisIndex):
        idx.flush()
    idx.close()


def test_lookup_batch_every_backend(index: ChunkIndex) -> None:
    k = rand_keys(6)
    index.add("gpu/1", GPU, k[:2])
    index.add("l1/1", L1, k[:4])
    index.add("deep/1", GPU, k[:6])
    index.add("disk/1", L2, k[:5])
    index.add("disk/1", L1, k[1:2])  # in L1 too: counts there (the faster tier)
    index.add_speculative("spec/1", k[:1], 60_000)
    queries = [k, k[:3], [rand_keys(1)[0], *k], []]
    view = index.lookup_batch(queries)
    # rows: at least up to the first unheld chunk (backends may pad or truncate past it)
    assert view.words.shape[0] >= 6 and view.words.shape[1] == 4 and view.words.dtype == np.uint64
    eligible = np.ones((4, 64 * view.nwords), dtype=bool)
    m = match_batch(view.words, eligible)
    got = _named(m, view.holders, 0)
    assert got == (
        # own L2 continues past the peers' L1 (chunk 4: disk/1 reads it back, the others stop);
        # equal totals (4): more GPU first, so the speculative GPU chunk beats own L1
        [
            ("deep/1", 6, 0, 0, 0),
            ("disk/1", 0, 1, 0, 4),
            ("gpu/1", 2, 0, 2, 0),
            ("spec/1", 1, 0, 3, 0),
            ("l1/1", 0, 4, 0, 0),
        ],
        4,
    )
    assert _named(m, view.holders, 1)[0][0] == ("deep/1", 3, 0, 0, 0)
    assert _named(m, view.holders, 2) == ([], 0)  # first chunk held by nobody
    assert _named(m, view.holders, 3) == ([], 0)
    assert m.offsets.tolist() == [0, 5, 10, 10, 10] and len(m.pod_index) == 10
    for b, q in enumerate(queries):  # the single-query path gives the same answers on every backend
        one = index.lookup_one(q)
        every = (1 << 64 * one.nwords) - 1
        assert _named(match_one(one.l1, one.gpu, every, 0, one.l2), one.holders, 0) == _named(
            m, view.holders, b
        )
        wv = index.lookup_words(q)
        got = match_words(wv.words, wv.nwords, (1 << 64 * wv.nwords) - 1)
        assert _named(got, wv.holders, 0) == _named(m, view.holders, b)


def test_match_batch_rules() -> None:
    # Hand-made words: 3 chunks, 2 queries, slots 0..3 (words: L1, GPU, L2 per chunk).
    words = np.zeros((3, 2, 3), dtype=np.uint64)
    words[:, 0, 1] = [0b011, 0b001, 0b001]  # query 0: GPU of slot 0 (3 chunks), slot 1 (1 chunk)
    words[:, 0, 0] = [0, 0b100, 0]  # slot 2 holds chunk 1 in L1 (peers may fetch it)
    words[:, 0, 2] = [0b1000, 0b1000, 0b1001]  # slot 3 holds all 3 in L2; slot 0's L2 copy is hidden
    words[0, 1, 0] = 0b010  # query 1: one L1 chunk on slot 1
    eligible = np.ones((2, 64), dtype=bool)
    m = match_batch(words, eligible)
    # equal totals: more GPU first, then more own L1, then more own L2
    assert m.query(0).pods == [PodPrefix(0, 3, 0, 0), PodPrefix(3, 0, 0, 0, 3), PodPrefix(1, 1, 0, 1)]
    assert m.query(0).peer_fetchable == 0
    assert m.query(1).pods == [PodPrefix(1, 0, 1, 0)] and m.query(1).peer_fetchable == 1
    eligible[0, 0] = False
    assert [p.slot for p in match_batch(words, eligible, [1, 0]).query(0).pods] == [3]
    assert match_batch(words, eligible, [1, 0]).pods.tolist() == [1, 3]
    with pytest.raises(ValueError, match=r"eligible: shape \(2, 63\), expected \(2, 64\)"):
        match_batch(words, np.ones((2, 63), dtype=bool))
    with pytest.raises(ValueError, match="max_pods: 1 limits, expected one per query"):
        match_batch(words, eligible, [1])


def test_long_queries_use_wide_counters() -> None:
    index = MemoryIndex()
    keys = rand_keys(300)  # > 255 chunks: counts no longer fit a byte
    index.add("a/1", GPU, keys)
    index.add("b/1", L1, keys[:299])
    view = index.lookup_batch([keys])
    m = match_batch(view.words, np.ones((1, 64), dtype=bool))
    got = _named(m, view.holders, 0)
    assert got == ([("a/1", 300, 0, 0, 0), ("b/1", 0, 299, 0, 0)], 299)  # chunk 299: a's GPU only


@pytest.mark.parametrize("npods", [5, 40, 130])  # few distinct counts, and more than the C path's 32
@pytest.mark.parametrize("max_pods", [0, 3, 37])
def test_match_words_many_distinct_counts(npods: int, max_pods: int) -> None:
    # pod s holds chunks 0..s on GPU (s % 3 == 0), in its own L1 (1) or L2 (2): every pod a
    # different count
    nwords = max(1, -(-npods // 64))
    n = npods + 2
    rows = []
    for c in range(n):
        gpu, l1, l2 = (sum(1 << s for s in range(npods) if s % 3 == t and c <= s) for t in range(3))
        rows.append(b"".join(m.to_bytes(8 * nwords, "little") for m in (l1, gpu, l2)))
    words = b"".join(rows)
    eligible = (1 << 64 * nwords) - 1 ^ (1 << 3)  # slot 3 not eligible
    want = match_words(words, nwords, eligible, max_pods, native=False)
    got = match_words(words, nwords, eligible, max_pods)
    assert got.query(0) == want.query(0)
    assert got.pods.tolist() == want.pods.tolist() and got.pod_index.tolist() == want.pod_index.tolist()
    q = want.query(0)
    assert len(q.pods) == (min(max_pods, npods - 1) if max_pods else npods - 1)
    assert 3 not in [p.slot for p in q.pods]
