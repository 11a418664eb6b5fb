"""Speculative entries of mixed TTLs, on every backend (in-memory, Valkey, Valkey Cluster).

``add_speculative(holder, keys, ttl_ms)`` makes each (key, holder) entry count as a GPU holder
until its own deadline, whatever other calls' TTLs are (``ScoreRequest.speculative_ttl_ms`` is per
request, so TTLs mix). Two bugs of the Redis backends, found by ``test_index_stateful.py``'s review:
the expiry of the shared ``s:<key>`` hash and of a holder's ``sp:`` key set was reset by every call,
so a later, shorter TTL cut a longer entry of another holder, and the holder's key set expired
before its longer entries, so ``drop_holder`` left them behind (in RedisIndex the next holder on
the freed slot inherited them). Plus: a RedisIndex lookup stops at the first chunk whose every bit
is of a slot without owner (a holder dropped between the lookup's reads), as at one nobody holds.

Timing: the short TTL is 200 ms and the long one 10 s; the tests wait explicitly (polling up to
5 s) until the short entry is gone and at least 1 s has passed since it was made, then check the
long one is still there (the only assumption: the test's steps take less than 9 s).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvgrid.controller.index import ChunkIndex, IndexTier, MemoryIndex
from kvgrid.controller.index.redis import RedisIndex
from kvgrid.controller.index.redis_cluster import HID_LEN, RedisClusterIndex
from tests.controller.support import rand_keys, unique_prefix
from tests.controller.valkey_cluster import ValkeyCluster

SHORT_MS = 200
LONG_MS = 10_000
SETTLE_S = 1.0
"""Checks run at least this long after the short entry was made (5x its TTL)."""
POLL_S = 5.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ValkeyCluster]:
    c = ValkeyCluster(Path(tmp_path_factory.mktemp("vkc")), primaries=3)
    yield c
    c.stop()


def _make(kind: str, request: pytest.FixtureRequest) -> ChunkIndex:
    if kind == "memory":
        return MemoryIndex()
    if kind == "redis":
        return RedisIndex(request.getfixturevalue("valkey_url"), prefix=unique_prefix())
    return RedisClusterIndex(request.getfixturevalue("cluster").url, prefix=unique_prefix())


@pytest.fixture(params=["memory", "redis", "redis-cluster"])
def index(request: pytest.FixtureRequest) -> Iterator[ChunkIndex]:
    idx = _make(request.param, request)
    yield idx
    if isinstance(idx, RedisIndex | RedisClusterIndex):
        idx.flush()
    idx.close()


@pytest.fixture(params=["redis", "redis-cluster"])
def redis_index(request: pytest.FixtureRequest) -> Iterator[RedisIndex | RedisClusterIndex]:
    idx = _make(request.param, request)
    assert isinstance(idx, RedisIndex | RedisClusterIndex)
    yield idx
    idx.flush()
    idx.close()


def _gpu_holders(idx: ChunkIndex, key: bytes) -> set[str]:
    view = idx.lookup([key])
    if not view.gpu:
        return set()
    return {h for s, h in view.slots.items() if view.gpu[0] >> s & 1}


def _settle(made_at: float, gone: Callable[[], bool], what: str) -> None:
    """Wait until ``gone()`` (polling up to POLL_S) and SETTLE_S has passed since ``made_at``."""
    deadline = time.monotonic() + POLL_S
    while not gone():
        assert time.monotonic() < deadline, f"{what}: still there after {POLL_S} s"
        time.sleep(0.05)
    time.sleep(max(0.0, made_at + SETTLE_S - time.monotonic()))


def _spec_hash(idx: ChunkIndex, key: bytes) -> dict[bytes, bytes] | None:
    """The raw ``s:<key>`` hash of a Redis backend (None for the in-memory one)."""
    if isinstance(idx, RedisIndex | RedisClusterIndex):
        return dict(idx._r.hgetall(idx._pb + b"s:" + key))
    return None


def test_drop_removes_long_speculative_entries_after_a_shorter_one(index: ChunkIndex) -> None:
    k1, k2, k3 = rand_keys(3)
    made_at = time.monotonic()
    index.add_speculative("a/1", [k1], LONG_MS)
    index.add_speculative("a/1", [k2], SHORT_MS)  # later and shorter: must not shorten k1's life
    _settle(made_at, lambda: not _gpu_holders(index, k2), "a/1's 200 ms entry")
    assert _gpu_holders(index, k1) == {"a/1"}  # its own 10 s deadline is still ahead
    index.drop_holder("a/1")
    assert _gpu_holders(index, k1) == set()
    index.add("b/1", IndexTier.L1, [k3])  # RedisIndex gives b/1 the freed slot
    assert index.holders() == ["b/1"]
    view = index.lookup([k1])
    assert (view.l1, view.gpu) == ([], [])  # nobody holds k1: b/1 inherited nothing
    assert _spec_hash(index, k1) in (None, {})  # nothing of a/1 left behind in Valkey either


def test_shorter_ttl_of_another_holder_keeps_a_longer_entry(index: ChunkIndex) -> None:
    (k,) = rand_keys(1)
    made_at = time.monotonic()
    index.add_speculative("c/1", [k], LONG_MS)
    index.add_speculative("d/1", [k], SHORT_MS)
    assert _gpu_holders(index, k) == {"c/1", "d/1"}
    _settle(made_at, lambda: "d/1" not in _gpu_holders(index, k), "d/1's 200 ms entry")
    assert _gpu_holders(index, k) == {"c/1"}


def test_longer_ttl_of_another_holder_outlives_a_shorter_entry(index: ChunkIndex) -> None:
    (k,) = rand_keys(1)
    made_at = time.monotonic()
    index.add_speculative("c/1", [k], SHORT_MS)
    index.add_speculative("d/1", [k], LONG_MS)
    _settle(made_at, lambda: "c/1" not in _gpu_holders(index, k), "c/1's 200 ms entry")
    assert _gpu_holders(index, k) == {"d/1"}


def test_an_entry_lives_until_its_latest_deadline(index: ChunkIndex) -> None:
    # Per (key, holder) the latest call sets the deadline, shorter or not (unchanged semantics).
    k1, k2 = rand_keys(2)
    made_at = time.monotonic()
    index.add_speculative("e/1", [k1, k2], LONG_MS)
    index.add_speculative("e/1", [k2], SHORT_MS)
    _settle(made_at, lambda: not _gpu_holders(index, k2), "e/1's re-made 200 ms entry")
    assert _gpu_holders(index, k1) == {"e/1"}


def _unown(idx: RedisIndex | RedisClusterIndex, holder: str) -> None:
    """Take ``holder``'s slot out of the owner table only: what a lookup whose chunk reads came
    before a concurrent drop and whose owner-table read came after sees."""
    if isinstance(idx, RedisIndex):
        slot = idx._slot(holder)
        assert slot is not None
        assert idx._r.hdel(idx._pb + b"owner", slot) == 1
    else:
        owners = {bytes(e)[HID_LEN:].decode(): s for s, e in idx._r.hgetall(idx._table[1]).items()}
        assert idx._r.hdel(idx._table[1], owners[holder]) == 1


def test_lookup_stops_at_a_chunk_held_only_by_a_slot_without_owner(
    redis_index: RedisIndex | RedisClusterIndex,
) -> None:
    k1, k2, k3 = rand_keys(3)
    redis_index.add("a/1", IndexTier.L1, [k1, k2, k3])
    redis_index.add("b/1", IndexTier.GPU, [k1, k3])
    redis_index.add_speculative("a/1", [k2], LONG_MS)
    _unown(redis_index, "a/1")
    view = redis_index.lookup([k1, k2, k3])
    assert len(view.l1) == len(view.gpu) == 1  # k2 is held by nobody with a slot: the prefix ends
    assert view.l1 == [0] and view.slots == {s: "b/1" for s in view.slots}
    assert [{view.slots[s] for s in view.slots if m >> s & 1} for m in view.gpu] == [{"b/1"}]
