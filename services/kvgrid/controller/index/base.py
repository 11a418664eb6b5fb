"""The chunk index interface (:class:`ChunkIndex`) and the views its lookups return.

Which holder (pod incarnation) has which chunk key in which tier. Backends live one per module
beside this one (``memory.py``: :class:`~kvgrid.controller.index.memory.MemoryIndex`, embedded,
the default; ``redis.py``: :class:`~kvgrid.controller.index.redis.RedisIndex`, several controller
replicas share one Valkey/Redis); ``instrumented.py`` wraps any of them with metrics. Every backend
passes the same conformance suite (``tests/controller/test_index.py``).

The index stores facts and answers lookups; it never scores (``scoring.py`` does) and never
decides who is alive (``registry.py`` does). A *holder* is the text ``<pod_uid>/<epoch>``
(:attr:`kvgrid.common.identity.PodIdentity.holder_id`); inside a backend each live holder gets a
small integer *slot*, and a lookup returns per chunk three bitmasks over slots (L1, GPU and L2
holders, in :class:`IndexTier` order), so prefix matching (:mod:`kvgrid.controller.matching`) is a
handful of integer ops per chunk whatever the number of pods.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence

import msgspec
import numpy as np

from kvgrid.common.hashing import CHUNK_KEY_BYTES, check_chunk_keys

__all__ = [
    "NUM_TIERS",
    "BatchView",
    "ChunkIndex",
    "IndexTier",
    "MaskView",
    "PrefixView",
    "WordsView",
    "batch_view_from_prefix_views",
    "check_keys",
    "mask_rows",
]


class IndexTier(enum.IntEnum):
    """Tiers the index stores (peer-fetchable is derived at match time, never stored). The value is
    the tier's place in a chunk's mask row (L1 words, then GPU words, then L2 words)."""

    L1 = 0
    GPU = 1
    L2 = 2
    """The pod agent's lower tiers (local disk, object store): readable back into its own L1 only."""


NUM_TIERS = len(IndexTier)
"""Mask blocks per chunk row: ``NUM_TIERS * nwords`` words."""


class PrefixView(msgspec.Struct, frozen=True):
    """What the index knows about the leading chunks of one query.

    ``l1[i]`` / ``gpu[i]`` / ``l2[i]``: bitmask over slots of the holders of chunk ``i`` in that
    tier (speculative entries are folded into ``gpu``). The lists stop at the first chunk nobody
    holds: a prefix cannot continue past it. ``slots`` maps slot number -> holder id for every slot set
    in any mask.
    """

    l1: list[int]
    gpu: list[int]
    slots: dict[int, str]
    l2: list[int] | None = None
    """None: nobody holds any of the chunks in L2 (all zeros)."""

    def l2_masks(self) -> list[int]:
        return self.l2 if self.l2 is not None else [0] * len(self.l1)


class BatchView(msgspec.Struct, frozen=True):
    """What the index knows about the chunks of a batch of queries, as machine words.

    ``words[j, b]`` (uint64, shape ``[n, B, NUM_TIERS * nwords]``, ``n`` = longest query): the L1
    holder bitmask of chunk ``j`` of query ``b`` in words ``[0, nwords)`` (little-endian: slot ``s``
    is bit ``s % 64`` of word ``s // 64``), then its GPU holder bitmask (speculative entries folded
    in), then its L2 holder bitmask.
    Chunks past a query's end, or that nobody holds, are all zeros (a prefix cannot continue past
    them, so rows after the first zero row are irrelevant and may be zero too).
    ``holders``: slot -> holder id for every slot that may be set. ``slots_version``: a number that
    changes whenever the slot table does, or None when the backend cannot promise that (callers
    then must not cache anything derived from ``holders``).
    """

    words: np.ndarray
    holders: dict[int, str]
    slots_version: int | None = None

    @property
    def nwords(self) -> int:
        return int(self.words.shape[2]) // NUM_TIERS


class MaskView(msgspec.Struct, frozen=True):
    """One query's holder masks as Python ints (:meth:`ChunkIndex.lookup_one`, the single-query path).

    ``l1`` / ``gpu`` / ``l2`` as in :class:`PrefixView` (stopping at the first chunk nobody holds);
    ``holders``, ``slots_version`` and ``nwords`` as in :class:`BatchView`, so the same
    slot table serves both.
    """

    l1: list[int]
    gpu: list[int]
    holders: dict[int, str]
    slots_version: int | None
    nwords: int
    l2: list[int] | None = None
    """None: all zeros (as :attr:`PrefixView.l2`)."""


class WordsView(msgspec.Struct, frozen=True):
    """One query's holder masks as raw machine words (:meth:`ChunkIndex.lookup_words`, the compiled
    single-query path): ``words`` holds per chunk ``NUM_TIERS * nwords`` little-endian uint64 (L1
    words, then GPU words, speculative entries folded in, then L2 words), as one row of
    :attr:`BatchView.words`; the rows may stop at the first chunk nobody holds (an all-zero row ends
    every prefix anyway). ``holders``,
    ``slots_version`` and ``nwords`` as in :class:`MaskView`.
    """

    words: bytes
    holders: dict[int, str]
    slots_version: int | None
    nwords: int


def batch_view_from_prefix_views(views: Sequence[PrefixView]) -> BatchView:
    """Pack per-query :class:`PrefixView` masks into a :class:`BatchView` (any backend)."""
    holders: dict[int, str] = {}
    for v in views:
        holders.update(v.slots)
    nwords = max(1, -(-(max(holders, default=0) + 1) // 64))
    n = max((len(v.l1) for v in views), default=0)
    words = np.zeros((len(views), n, NUM_TIERS * nwords), dtype=np.uint64)
    for b, v in enumerate(views):
        if v.l1:
            raw = mask_rows(v.l1, v.gpu, v.l2, nwords)
            words[b, : len(v.l1)] = np.frombuffer(raw, dtype="<u8").reshape(len(v.l1), NUM_TIERS * nwords)
    return BatchView(words=np.ascontiguousarray(words.transpose(1, 0, 2)), holders=holders)


def mask_rows(l1: Sequence[int], gpu: Sequence[int], l2: Sequence[int] | None, nwords: int) -> bytes:
    """Per-chunk masks (Python ints) as raw rows of ``NUM_TIERS * nwords`` little-endian words."""
    nb = 8 * nwords
    if l2 is None:
        zero = bytes(nb)
        pairs = zip(l1, gpu, strict=True)
        return b"".join(m.to_bytes(nb, "little") + g.to_bytes(nb, "little") + zero for m, g in pairs)
    rows = zip(l1, gpu, l2, strict=True)
    return b"".join(
        m.to_bytes(nb, "little") + g.to_bytes(nb, "little") + d.to_bytes(nb, "little") for m, g, d in rows
    )


def check_keys(keys: Sequence[bytes], what: str = "chunk_keys") -> None:
    """Raise ValueError unless every key is a CHUNK_KEY_BYTES-byte chunk key."""
    check_chunk_keys(keys, what)


class ChunkIndex(ABC):
    """Chunk key -> holders, per tier. Thread-safe. Keys are 16-byte chunk keys."""

    backend: str = "abstract"
    """The backend's name, as configured (``index_backend``) and reported by GetStats."""

    @property
    def shared(self) -> bool:
        """Other controller replicas write to this index too, so a holder this replica has no
        registration for may still be live (its entries are answerable)."""
        return False

    @abstractmethod
    def add(self, holder: str, tier: IndexTier, keys: Sequence[bytes]) -> None:
        """Record that ``holder`` holds ``keys`` in ``tier`` (idempotent)."""

    @abstractmethod
    def remove(self, holder: str, tier: IndexTier, keys: Sequence[bytes]) -> None:
        """Forget ``keys`` in ``tier`` of ``holder`` (missing entries are ignored)."""

    @abstractmethod
    def replace(self, holder: str, tier: IndexTier, keys: Iterable[bytes]) -> None:
        """Make ``holder``'s entries in ``tier`` exactly ``keys``, atomically for readers."""

    @abstractmethod
    def drop_holder(self, holder: str) -> int:
        """Remove every entry (all tiers, speculative too) of ``holder``; returns entries removed."""

    @abstractmethod
    def lookup(self, keys: Sequence[bytes]) -> PrefixView:
        """Holder masks of the leading chunks of ``keys`` (see :class:`PrefixView`)."""

    def lookup_one(self, keys: Sequence[bytes] | np.ndarray) -> MaskView:
        """One query's masks for :func:`~kvgrid.controller.matching.match_one`: ``keys`` as bytes
        keys or as uint64 ``[n, 2]`` words (:meth:`lookup_packed`'s form). The default wraps
        :meth:`lookup`; backends override it with something faster.
        """
        if isinstance(keys, np.ndarray):
            raw = np.ascontiguousarray(keys, dtype="<u8").tobytes()
            keys = [raw[i : i + CHUNK_KEY_BYTES] for i in range(0, len(raw), CHUNK_KEY_BYTES)]
        v = self.lookup(keys)
        nwords = max(1, -(-(max(v.slots, default=0) + 1) // 64))
        return MaskView(l1=v.l1, gpu=v.gpu, holders=v.slots, slots_version=None, nwords=nwords, l2=v.l2)

    def lookup_words(self, keys: Sequence[bytes] | np.ndarray) -> WordsView:
        """:meth:`lookup_one` as raw words (:class:`WordsView`), for the compiled matcher. The default
        packs :meth:`lookup_one`'s ints; backends with word rows override it."""
        v = self.lookup_one(keys)
        words = mask_rows(v.l1, v.gpu, v.l2, v.nwords)
        return WordsView(words=words, holders=v.holders, slots_version=v.slots_version, nwords=v.nwords)

    def lookup_batch(self, queries: Sequence[Sequence[bytes]]) -> BatchView:
        """Holder masks of the chunks of every query as machine words (see :class:`BatchView`).

        The default packs :meth:`lookup` per query; backends override it with something faster.
        """
        return batch_view_from_prefix_views([self.lookup(q) for q in queries])

    def lookup_packed(self, keys: np.ndarray, counts: np.ndarray) -> BatchView:
        """:meth:`lookup_batch` of packed queries: ``keys`` uint64 ``[total, 2]`` (each row a key's
        two little-endian words, query after query), ``counts`` the keys of each query (int64,
        summing to ``total``). The default turns them into bytes keys; backends that can probe
        words directly override it.
        """
        raw = np.ascontiguousarray(keys, dtype="<u8").tobytes()
        kb = CHUNK_KEY_BYTES
        ends = np.cumsum(counts).tolist()
        starts = [0, *ends][:-1]
        return self.lookup_batch(
            [[raw[i * kb : (i + 1) * kb] for i in range(a, b)] for a, b in zip(starts, ends, strict=True)]
        )

    @abstractmethod
    def add_speculative(self, holder: str, keys: Sequence[bytes], ttl_ms: int) -> None:
        """Short-lived GPU-tier entries for a pod a router just chose (cover the event blind window)."""

    @abstractmethod
    def holder_keys(self, holder: str, tier: IndexTier) -> set[bytes]:
        """Every key ``holder`` holds in ``tier`` (resync checks, debugging; may be slow)."""

    @abstractmethod
    def holder_entries(self, holder: str) -> int:
        """Number of (chunk, tier) entries of ``holder``."""

    def holder_tier_entries(self, holder: str, tier: IndexTier) -> int:
        """Number of ``holder``'s entries in ``tier`` (backends override the default's full read)."""
        return len(self.holder_keys(holder, tier))

    def data_generation(self) -> str:
        """A token that changes whenever the backend lost its data (restarted empty, flushed), so
        the controller knows to rebuild the index from the agents' snapshots. Raises
        :class:`~kvgrid.common.errors.Unavailable` while the backend cannot be reached. An embedded
        index loses its data only with the process: constant."""
        return ""

    @abstractmethod
    def holders(self) -> list[str]:
        """Holders that have a slot (hold, or held, entries and were not dropped)."""

    @abstractmethod
    def num_entries(self) -> int:
        """Number of (chunk, holder, tier) entries, speculative ones excluded."""

    @abstractmethod
    def num_chunks(self) -> int:
        """Number of distinct chunk keys with at least one holder."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""
