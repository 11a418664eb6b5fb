"""Conformance suite: every ChunkIndex backend (in-memory, Redis/Valkey) must pass all of these."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgrid.controller.index import ChunkIndex, IndexTier, MemoryIndex
from kvgrid.controller.index.redis import RedisIndex
from kvgrid.controller.matching import PodPrefix, match_prefix
from tests.controller.support import rand_keys, unique_prefix

L1, GPU, L2 = IndexTier.L1, IndexTier.GPU, IndexTier.L2


def _make(kind: str, url: str) -> ChunkIndex:
    if kind == "memory":
        return MemoryIndex()
    return RedisIndex(url, prefix=unique_prefix())


@pytest.fixture(params=["memory", "redis"])
def index(request: pytest.FixtureRequest, valkey_url: str) -> Iterator[ChunkIndex]:
    idx = _make(request.param, valkey_url)
    yield idx
    if isinstance(idx, RedisIndex):
        idx.flush()
    idx.close()


def _holders_of(idx: ChunkIndex, key: bytes) -> tuple[set[str], set[str]]:
    view = idx.lookup([key])
    if not view.l1:
        return set(), set()
    names = view.slots
    l1 = {names[s] for s in names if view.l1[0] >> s & 1}
    gpu = {names[s] for s in names if view.gpu[0] >> s & 1}
    return l1, gpu


def test_add_lookup_per_tier(index: ChunkIndex) -> None:
    k = rand_keys(4)
    index.add("a/1", L1, k)
    index.add("b/1", GPU, k[:2])
    assert _holders_of(index, k[0]) == ({"a/1"}, {"b/1"})
    assert _holders_of(index, k[3]) == ({"a/1"}, set())
    assert index.num_entries() == 6
    assert index.num_chunks() == 4
    assert index.holder_entries("a/1") == 4
    assert index.holder_keys("b/1", GPU) == set(k[:2])
    index.add("a/1", L1, k)  # idempotent
    assert index.num_entries() == 6


def _l2_holders_of(idx: ChunkIndex, key: bytes) -> set[str]:
    view = idx.lookup([key])
    if not view.l1:
        return set()
    return {view.slots[s] for s in view.slots if view.l2_masks()[0] >> s & 1}


def test_l2_is_a_stored_tier(index: ChunkIndex) -> None:
    k = rand_keys(4)
    index.add("a/1", L2, k)
    index.add("a/1", L1, k[:1])  # in L1 and L2 at once: both entries stored
    index.add("b/1", GPU, k[:2])
    assert _l2_holders_of(index, k[0]) == {"a/1"}
    assert _holders_of(index, k[0]) == ({"a/1"}, {"b/1"})
    assert _holders_of(index, k[3]) == (set(), set()) and _l2_holders_of(index, k[3]) == {"a/1"}
    assert len(index.lookup(k).l1) == 4  # an L2-only chunk continues the lookup
    assert index.num_entries() == 4 + 1 + 2 and index.num_chunks() == 4
    assert index.holder_entries("a/1") == 5 and index.holder_tier_entries("a/1", L2) == 4
    assert index.holder_keys("a/1", L2) == set(k)
    index.remove("a/1", L2, k[3:])
    assert index.lookup(k[3:]).l1 == [] and index.num_chunks() == 3
    index.replace("a/1", L2, k[1:2])
    assert index.holder_keys("a/1", L2) == {k[1]} and index.holder_keys("a/1", L1) == {k[0]}
    assert index.drop_holder("a/1") == 2
    assert _l2_holders_of(index, k[1]) == set()


def test_lookup_stops_at_first_unheld_chunk(index: ChunkIndex) -> None:
    k = rand_keys(5)
    index.add("a/1", L1, [k[0], k[1], k[3], k[4]])
    view = index.lookup(k)
    assert len(view.l1) == 2
    assert index.lookup([rand_keys(1)[0], *k]).l1 == []


def test_remove(index: ChunkIndex) -> None:
    k = rand_keys(3)
    index.add("a/1", L1, k)
    index.add("a/1", GPU, k)
    index.remove("a/1", L1, k[:2])
    index.remove("a/1", L1, k[:2])  # missing entries are ignored
    index.remove("nobody/1", L1, k)
    assert _holders_of(index, k[0]) == (set(), {"a/1"})
    assert _holders_of(index, k[2]) == ({"a/1"}, {"a/1"})
    assert index.num_entries() == 4
    index.remove("a/1", GPU, k)
    index.remove("a/1", L1, k)
    assert index.num_entries() == 0
    assert index.num_chunks() == 0


def test_replace_is_exact(index: ChunkIndex) -> None:
    k = rand_keys(6)
    index.add("a/1", L1, k[:4])
    index.add("b/1", L1, k[:4])
    index.add("a/1", GPU, k[:1])
    index.replace("a/1", L1, k[2:])
    assert index.holder_keys("a/1", L1) == set(k[2:])
    assert index.holder_keys("b/1", L1) == set(k[:4])
    assert index.holder_keys("a/1", GPU) == {k[0]}  # other tier untouched
    assert index.num_entries() == 4 + 4 + 1
    index.replace("a/1", L1, [])
    assert index.holder_keys("a/1", L1) == set()
    assert index.num_entries() == 5


def test_drop_holder_and_slot_reuse(index: ChunkIndex) -> None:
    k = rand_keys(3)
    index.add("a/1", L1, k)
    index.add("a/1", GPU, k)
    index.add("b/1", L1, k[:1])
    index.add_speculative("a/1", rand_keys(1), 60_000)
    assert index.drop_holder("a/1") == 6
    assert index.drop_holder("a/1") == 0
    assert "a/1" not in index.holders()
    assert _holders_of(index, k[0]) == ({"b/1"}, set())
    assert index.lookup(k[1:]).l1 == []
    index.add("c/1", GPU, k[2:])  # may reuse a/1's slot: must not inherit anything
    assert _holders_of(index, k[0]) == ({"b/1"}, set())
    assert _holders_of(index, k[2]) == (set(), {"c/1"})
    assert index.holder_entries("c/1") == 1


def test_speculative_entries_expire(index: ChunkIndex) -> None:
    k = rand_keys(2)
    index.add("a/1", L1, k)
    index.add_speculative("b/1", k, 1000)  # the lookup below must come within it, on a stalled CI machine too
    assert _holders_of(index, k[0]) == ({"a/1"}, {"b/1"})
    assert index.num_entries() == 2  # speculative entries are not counted
    time.sleep(1.2)
    assert _holders_of(index, k[0]) == ({"a/1"}, set())


def test_wrong_key_length_changes_nothing(index: ChunkIndex) -> None:
    k = rand_keys(2)
    index.add("a/1", L1, k)
    with pytest.raises(ValueError, match=r"chunk_keys\[1\]: got 15 bytes, expected a 16-byte"):
        index.add("a/1", GPU, [k[0], b"x" * 15])
    with pytest.raises(ValueError, match="16-byte"):
        index.replace("a/1", L1, [b"short"])
    with pytest.raises(ValueError, match="got str"):
        index.remove("a/1", L1, ["not bytes"])  # type: ignore[list-item]
    assert index.holder_keys("a/1", L1) == set(k)
    assert index.holder_keys("a/1", GPU) == set()


def test_many_holders(index: ChunkIndex) -> None:
    k = rand_keys(2)
    names = [f"pod{i}/7" for i in range(130)]  # beyond one 64-bit word of slots
    for n in names:
        index.add(n, L1, k[:1])
    index.add(names[-1], GPU, k)
    assert _holders_of(index, k[0]) == (set(names), {names[-1]})
    assert _holders_of(index, k[1]) == (set(), {names[-1]})


def test_match_tiers_and_peers(index: ChunkIndex) -> None:
    k = rand_keys(6)
    index.add("gpu/1", GPU, k[:2])  # GPU prefix, then nothing of its own
    index.add("l1/1", L1, k[:4])  # everything up to 4 in L1 -> peers can fetch 0..3
    index.add("deep/1", GPU, k[:6])
    view = index.lookup(k)
    slot = {h: s for s, h in view.slots.items()}
    everyone = sum(1 << s for s in slot.values())
    m = match_prefix(view, everyone)
    by = {view.slots[p.slot]: p for p in m.pods}
    assert by["deep/1"] == PodPrefix(slot=slot["deep/1"], gpu=6, l1=0, peer=0)
    assert by["gpu/1"] == PodPrefix(slot=slot["gpu/1"], gpu=2, l1=0, peer=2)
    assert by["l1/1"] == PodPrefix(slot=slot["l1/1"], gpu=0, l1=4, peer=0)
    assert [view.slots[p.slot] for p in m.pods] == ["deep/1", "gpu/1", "l1/1"]  # ties: more GPU first
    assert m.peer_fetchable == 4
    only = match_prefix(view, 1 << slot["gpu/1"])
    assert [p.slot for p in only.pods] == [slot["gpu/1"]]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["add", "remove", "replace", "drop"]),
            st.sampled_from(["a/1", "b/2", "c/3"]),
            st.sampled_from([L1, GPU, L2]),
            st.lists(st.integers(0, 7), max_size=6),
        ),
        max_size=25,
    )
)
def test_random_ops_match_reference_model(index: ChunkIndex, ops: list) -> None:
    universe = [bytes([i]) * 16 for i in range(8)]
    for h in index.holders():
        index.drop_holder(h)
    model: dict[tuple[str, IndexTier], set[bytes]] = {}
    for op, holder, tier, idxs in ops:
        keys = [universe[i] for i in idxs]
        cur = model.setdefault((holder, tier), set())
        if op == "add":
            index.add(holder, tier, keys)
            cur |= set(keys)
        elif op == "remove":
            index.remove(holder, tier, keys)
            cur -= set(keys)
        elif op == "replace":
            index.replace(holder, tier, keys)
            cur.clear()
            cur |= set(keys)
        else:
            index.drop_holder(holder)
            for t in IndexTier:
                model[(holder, t)] = set()
    for (holder, tier), keys in model.items():
        assert index.holder_keys(holder, tier) == keys
    assert index.num_entries() == sum(len(v) for v in model.values())
    assert index.num_chunks() == len(set().union(*model.values())) if model else True
    for key in universe:
        l1, gpu = _holders_of(index, key)
        assert l1 == {h for (h, t), v in model.items() if t is L1 and key in v}
        assert gpu == {h for (h, t), v in model.items() if t is GPU and key in v}
        assert _l2_holders_of(index, key) == {h for (h, t), v in model.items() if t is L2 and key in v}


def test_redis_replicas_share_one_index(valkey_url: str) -> None:
    prefix = unique_prefix()
    a, b = RedisIndex(valkey_url, prefix=prefix), RedisIndex(valkey_url, prefix=prefix)
    try:
        k = rand_keys(3)
        a.add("pod/1", L1, k)
        b.add("pod/2", GPU, k[:1])
        assert _holders_of(b, k[0]) == ({"pod/1"}, {"pod/2"})
        b.drop_holder("pod/1")
        assert _holders_of(a, k[0]) == (set(), {"pod/2"})
        assert a.num_entries() == b.num_entries() == 1
    finally:
        a.flush()
        a.close()
        b.close()
