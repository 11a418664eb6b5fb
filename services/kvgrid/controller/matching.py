"""Prefix matching (pure functions, no storage): a batch of queries at once, or one PrefixView.

Semantics (docs/controller.md): for pod ``P`` chunk ``i`` is *available* when ``P`` holds it in GPU,
in its own L1 or in its own lower tiers (L2: disk, object store), or some other pod holds it in L1
(peer-fetchable; a peer's L2 is not: peers serve from L1 only). ``P``'s match is the longest run of
available leading chunks, and each matched chunk counts in the fastest tier that has it: GPU, then
own L1, then own L2, then peer. Because any L1 holder makes a chunk available to *every* pod, a
chunk is available to all pods when its L1 mask is non-zero, and only to its GPU and L2 holders
otherwise.

:func:`match_batch` (the service's path) does this for a whole batch with one fixed set of numpy
calls over the holder bitmasks as uint64 words ``[chunk, query, word]``: the per-pod "still
matching" mask is a running AND over chunks of the words, and per-pod counts come from unpacking
the masks to bits once and summing over chunks. Its cost hardly depends on the number of pods.
:func:`match_one` answers a single query (a router's usual request) in plain Python with no numpy
call until the result: consecutive chunks with the same holders form one run, and pods that share
their history so far share one group (a bitmask with its counts), so the work grows with the
number of runs and distinct groups, not with chunks or pods. Same answer as :func:`match_batch`
(tested). :func:`match_prefix` does one :class:`PrefixView` with Python big ints (bit-sliced
counters); it is the reference both are tested against.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import groupby, repeat

import msgspec
import numpy as np

from kvgrid.controller.index import NUM_TIERS, PrefixView

try:  # the compiled single-query matcher (index/_probe.c), where it was built
    import kvgrid.controller.index._probe as _native
except ImportError:  # no compiler at install time: match_words decodes and calls match_one
    _native = None  # type: ignore[assignment]

__all__ = [
    "BatchMatch",
    "PodPrefix",
    "PrefixMatch",
    "match_batch",
    "match_one",
    "match_prefix",
    "match_words",
]


class PodPrefix(msgspec.Struct, frozen=True):
    """Leading chunks matched on one holder slot, by the fastest tier holding each."""

    slot: int
    gpu: int
    l1: int
    peer: int
    l2: int = 0

    @property
    def total(self) -> int:
        return self.gpu + self.l1 + self.l2 + self.peer


class PrefixMatch(msgspec.Struct, frozen=True):
    """``pods``: every eligible slot holding at least one matched chunk itself, longest first.

    ``peer_fetchable``: leading chunks held in L1 by someone, i.e. the match of any eligible pod
    that is not in ``pods`` (all of it peer).
    """

    pods: list[PodPrefix]
    peer_fetchable: int


def _add(planes: list[int], x: int) -> None:
    """Add the bitset ``x`` (one bit per slot) to the bit-sliced counters ``planes``."""
    i = 0
    while x:
        if i == len(planes):
            planes.append(0)
        p = planes[i]
        planes[i] = p ^ x
        x &= p
        i += 1


def _per_slot(planes: list[int], nbytes: int) -> np.ndarray:
    """Counter value per slot from bit-planes (vector indexed by slot)."""
    if not planes:
        return np.zeros(nbytes * 8, dtype=np.int64)
    raw = b"".join(p.to_bytes(nbytes, "little") for p in planes)
    bits = np.unpackbits(
        np.frombuffer(raw, dtype=np.uint8).reshape(len(planes), nbytes), axis=1, bitorder="little"
    )
    weights = (1 << np.arange(len(planes), dtype=np.int64))[:, None]
    return (bits.astype(np.int64) * weights).sum(axis=0)


def match_prefix(view: PrefixView, eligible: int) -> PrefixMatch:
    """Match of every slot in the bitmask ``eligible`` (see the module docstring)."""
    l1s, gpus, l2s = view.l1, view.gpu, view.l2_masks()
    n = len(l1s)
    peer_fetchable = n
    for i, m in enumerate(l1s):
        if not m:
            peer_fetchable = i
            break
    owners = 0
    for a, b, c in zip(l1s, gpus, l2s, strict=True):
        owners |= a | b | c
    owners &= eligible
    if not owners:
        return PrefixMatch(pods=[], peer_fetchable=peer_fetchable)
    alive = owners
    ends: dict[int, int] = {}
    gplanes: list[int] = []
    lplanes: list[int] = []
    dplanes: list[int] = []
    for i in range(n):
        l1, g, d = l1s[i], gpus[i], l2s[i]
        if not l1:
            dead = alive & ~g & ~d
            if dead:
                while dead:
                    b = dead & -dead
                    ends[b.bit_length() - 1] = i
                    dead ^= b
                alive &= g | d
                if not alive:
                    break
        _add(gplanes, alive & g)
        _add(lplanes, alive & l1 & ~g)
        _add(dplanes, alive & d & ~l1 & ~g)
    while alive:
        b = alive & -alive
        ends[b.bit_length() - 1] = n
        alive ^= b
    nbytes = (owners.bit_length() + 7) // 8
    gc = _per_slot(gplanes, nbytes)
    lc = _per_slot(lplanes, nbytes)
    dc = _per_slot(dplanes, nbytes)
    pods = []
    for slot, end in ends.items():
        g, lo, d = int(gc[slot]), int(lc[slot]), int(dc[slot])
        if g or lo or d:
            pods.append(PodPrefix(slot=slot, gpu=g, l1=lo, peer=end - g - lo - d, l2=d))
    pods.sort(key=lambda p: (-p.total, -p.gpu, -p.l1, -p.l2, p.slot))
    return PrefixMatch(pods=pods, peer_fetchable=peer_fetchable)


class BatchMatch(msgspec.Struct, frozen=True):
    """Matches of a batch of queries, flattened into parallel int64 arrays (cheap to slice and encode).

    ``pods``: the slots listed in any answer of the batch, ascending. Query ``b``'s answer is entries
    ``offsets[b]:offsets[b + 1]`` of ``pod_index`` (index into ``pods``), ``gpu``, ``l1``, ``l2``,
    ``peer``, ordered as :attr:`PrefixMatch.pods`; ``peer_fetchable[b]`` as
    :attr:`PrefixMatch.peer_fetchable`.
    """

    pods: np.ndarray
    offsets: np.ndarray
    pod_index: np.ndarray
    gpu: np.ndarray
    l1: np.ndarray
    peer: np.ndarray
    peer_fetchable: np.ndarray
    l2: np.ndarray

    def query(self, b: int) -> PrefixMatch:
        """Query ``b``'s answer as a :class:`PrefixMatch`."""
        lo, hi = int(self.offsets[b]), int(self.offsets[b + 1])
        slots = self.pods[self.pod_index[lo:hi]].tolist()
        rows = zip(
            slots,
            self.gpu[lo:hi].tolist(),
            self.l1[lo:hi].tolist(),
            self.l2[lo:hi].tolist(),
            self.peer[lo:hi].tolist(),
            strict=True,
        )
        pods = [PodPrefix(slot=s, gpu=g, l1=lo1, peer=p, l2=d) for s, g, lo1, d, p in rows]
        return PrefixMatch(pods=pods, peer_fetchable=int(self.peer_fetchable[b]))


_ALL = np.uint64(0xFFFF_FFFF_FFFF_FFFF)


def match_batch(words: np.ndarray, eligible: np.ndarray, max_pods: Sequence[int] = ()) -> BatchMatch:
    """Match every query of a batch (see the module docstring).

    ``words``: uint64 ``[n, B, 3 * W]`` as :attr:`kvgrid.controller.index.BatchView.words` (L1, GPU,
    then L2 words, per chunk and query). ``eligible``: bool ``[B, 64 * W]``, the slots each query
    may list. ``max_pods``: per query, at most this many pods (0 = all); empty = all for every query.
    """
    n, nq, wt = words.shape
    nw = wt // NUM_TIERS
    ns = 64 * nw
    if eligible.shape != (nq, ns):
        raise ValueError(f"eligible: shape {eligible.shape}, expected {(nq, ns)} (queries, 64 * words)")
    if max_pods and len(max_pods) != nq:
        raise ValueError(f"max_pods: {len(max_pods)} limits, expected one per query ({nq})")
    if n == 0 or nq == 0:
        none = np.zeros(0, dtype=np.int64)
        return BatchMatch(
            none, np.zeros(nq + 1, dtype=np.int64), none, none, none, none, np.zeros(nq, np.int64), none
        )
    l1, gpu, l2 = words[:, :, :nw], words[:, :, nw : 2 * nw], words[:, :, 2 * nw :]
    # [n, B]: someone holds the chunk in L1, so every pod may fetch it
    l1_any = np.not_equal(l1[:, :, 0], 0) if nw == 1 else np.any(l1, axis=2)
    own = gpu | l2  # held by the pod itself outside L1
    # per chunk: still matching, of them GPU, own L1, own L2
    planes = np.empty((n, 4, nq, nw), dtype="<u8")
    alive = planes[:, 0]
    np.bitwise_and.accumulate(np.where(l1_any[:, :, None], _ALL, own), axis=0, out=alive)
    np.bitwise_and(alive, gpu, out=planes[:, 1])
    np.bitwise_and(alive, l1 & ~gpu, out=planes[:, 2])
    np.bitwise_and(alive, l2 & ~(l1 | gpu), out=planes[:, 3])
    peer_fetchable = np.logical_and.accumulate(l1_any, axis=0).sum(axis=0)
    bits = np.unpackbits(planes.view(np.uint8), axis=-1, bitorder="little")  # [n, 4, B, slots]
    counts = bits.sum(axis=0, dtype=np.uint8 if n < 256 else np.int64)  # [4, B, slots]
    end, g, lo, d = counts  # per (query, slot): matched chunks, of them GPU, own L1, own L2
    listed = eligible & ((g | lo | d) > 0)
    # Longest first, then more GPU, own L1, own L2, then lower slot (stable sort), unlisted last.
    if n < 256:  # one uint64 key per pod: bytes (own L2, own L1, GPU, matched, listed), descending
        key = np.zeros((nq, ns, 8), dtype=np.uint8)
        key[:, :, 0], key[:, :, 1], key[:, :, 2], key[:, :, 3], key[:, :, 4] = d, lo, g, end, listed
        order = np.argsort(~key.view("<u8")[:, :, 0], axis=1, kind="stable")
    else:
        order = np.lexsort((-d, -lo, -g, -end, ~listed), axis=-1)
    per_query = listed.sum(axis=1)
    if max_pods:
        limits = np.asarray(max_pods, dtype=np.int64)
        per_query = np.where(limits > 0, np.minimum(per_query, limits), per_query)
    keep = np.arange(ns) < per_query[:, None]
    slot = order[keep]
    flat = (order + np.arange(0, nq * ns, ns)[:, None])[keep]  # listed pods as (query, slot) indices
    egld = counts.reshape(4, nq * ns)[:, flat].astype(np.int64)  # [4, K]: matched, GPU, own L1, own L2
    used = np.zeros(ns, dtype=bool)
    used[slot] = True
    pod_index = (np.cumsum(used) - 1)[slot]
    offsets = np.zeros(nq + 1, dtype=np.int64)
    np.cumsum(per_query, out=offsets[1:])
    return BatchMatch(
        pods=np.flatnonzero(used),
        offsets=offsets,
        pod_index=pod_index,
        gpu=egld[1],
        l1=egld[2],
        peer=egld[0] - egld[1] - egld[2] - egld[3],
        peer_fetchable=peer_fetchable.astype(np.int64, copy=False),
        l2=egld[3],
    )


_BYTE_SLOTS: list[list[list[int]]] = []


def _byte_slots(byte_index: int) -> list[list[int]]:
    """Per byte value, the slots its set bits stand for in byte ``byte_index`` of a bitmask (lists
    grow on demand: 256 entries per 8 slots), so a group of pods expands at C speed."""
    while len(_BYTE_SLOTS) <= byte_index:
        base = 8 * len(_BYTE_SLOTS)
        _BYTE_SLOTS.append([[base + b for b in range(8) if v >> b & 1] for v in range(256)])
    return _BYTE_SLOTS[byte_index]


def match_one(
    l1s: Sequence[int],
    gpus: Sequence[int],
    eligible: int,
    max_pods: int = 0,
    l2s: Sequence[int] | None = None,
) -> BatchMatch:
    """One query's match (as :func:`match_batch` of a batch of one) from per-chunk holder bitmasks.

    ``l1s[i]`` / ``gpus[i]`` / ``l2s[i]``: the L1 / GPU / L2 holder bitmasks of chunk ``i`` (Python
    ints, as :attr:`PrefixView.l1` / ``.gpu`` / ``.l2``; they may stop at the first chunk nobody
    holds; ``l2s`` None = all zeros). ``eligible``: bitmask of the slots that may be listed. Pods
    are grouped by identical counts so far: a run of chunks with the same masks splits each group at
    most four ways (GPU, own L1, own L2, neither), and groups with equal counts merge again, so a
    query costs runs x groups big-int operations. Runs are found at C speed (``groupby``) and the
    answer is one numpy array built from a Python list (numpy's per-call cost, not the arithmetic,
    was most of a single query's match).
    """
    n = len(l1s)
    try:
        peer_fetchable = l1s.index(0) if isinstance(l1s, list) else list(l1s).index(0)
    except ValueError:
        peer_fetchable = n
    masks = zip(l1s, gpus, repeat(0, n) if l2s is None else l2s, strict=False)
    runs = [(l1, g, d, len(list(grp))) for (l1, g, d), grp in groupby(masks)]
    owners = 0
    for l1, g, d, _ in runs:
        owners |= l1 | g | d
    owners &= eligible
    Counts = tuple[int, int, int]  # (gpu, own L1, own L2)
    alive: dict[Counts, int] = {(0, 0, 0): owners} if owners else {}
    ended: dict[tuple[int, int, int, int], int] = {}  # (matched, gpu, own L1, own L2) -> pods that stopped
    i = 0
    for l1, g, d, run in runs:
        if not alive:
            break
        nxt: dict[Counts, int] = {}
        for (gc, lc, dc), pods in alive.items():
            own_d = pods & d & ~g & ~l1
            if not l1:  # available only to its GPU and L2 holders: the others stop before this run
                dead = pods & ~g & ~own_d
                if dead:
                    ended[(i, gc, lc, dc)] = ended.get((i, gc, lc, dc), 0) | dead
                parts: tuple[tuple[Counts, int], ...] = (
                    ((gc + run, lc, dc), pods & g),
                    ((gc, lc, dc + run), own_d),
                )
            else:  # some L1 holds it: every pod continues, counting its own tier
                own_l1 = pods & l1 & ~g
                parts = (
                    ((gc + run, lc, dc), pods & g),
                    ((gc, lc + run, dc), own_l1),
                    ((gc, lc, dc + run), own_d),
                    ((gc, lc, dc), pods & ~g & ~own_l1 & ~own_d),
                )
            for key, m in parts:
                if m:
                    nxt[key] = nxt.get(key, 0) | m
        alive = nxt
        i += run
    for (gc, lc, dc), pods in alive.items():
        ended[(i, gc, lc, dc)] = ended.get((i, gc, lc, dc), 0) | pods
    # Longest first, then more GPU, own L1, own L2, then lower slot; pods with nothing of their own
    # are not listed.
    slots: list[int] = []
    gpu: list[int] = []
    l1c: list[int] = []
    l2c: list[int] = []
    peer: list[int] = []
    for (end, gc, lc, dc), pods in sorted(ended.items(), reverse=True):
        if not (gc or lc or dc):
            continue
        raw = pods.to_bytes((pods.bit_length() + 7) // 8, "little")
        for byte_index, byte in enumerate(raw):
            if byte:
                slots += _byte_slots(byte_index)[byte]
        k = len(slots) - len(gpu)
        gpu += [gc] * k
        l1c += [lc] * k
        l2c += [dc] * k
        peer += [end - gc - lc - dc] * k
    if max_pods and len(slots) > max_pods:
        del slots[max_pods:], gpu[max_pods:], l1c[max_pods:], l2c[max_pods:], peer[max_pods:]
    # one array, sliced: pods ascending, each listed slot's index into them, the counts, then
    # offsets and peer_fetchable
    k = len(slots)
    pods_sorted = sorted(slots)
    if pods_sorted == slots:  # one group, or groups in slot order: the index is the position
        pod_index: list[int] | range = range(k)
    else:
        rank = {s: r for r, s in enumerate(pods_sorted)}
        pod_index = [rank[s] for s in slots]
    return _from_flat(
        np.array([*pods_sorted, *pod_index, *gpu, *l1c, *l2c, *peer, 0, k, peer_fetchable], dtype=np.int64)
    )


def _from_flat(flat: np.ndarray) -> BatchMatch:
    """A batch-of-one :class:`BatchMatch` from ``[pods, pod_index, gpu, l1, l2, peer]`` (k each) then
    ``[0, k, peer_fetchable]`` in one int64 array (views, no copies)."""
    k = (len(flat) - 3) // 6
    return BatchMatch(
        pods=flat[:k],
        offsets=flat[6 * k : 6 * k + 2],
        pod_index=flat[k : 2 * k],
        gpu=flat[2 * k : 3 * k],
        l1=flat[3 * k : 4 * k],
        peer=flat[5 * k : 6 * k],
        peer_fetchable=flat[6 * k + 2 :],
        l2=flat[4 * k : 5 * k],
    )


def match_words(
    words: bytes, nwords: int, eligible: int, max_pods: int = 0, native: bool = True
) -> BatchMatch:
    """:func:`match_one` of raw mask rows (:class:`~kvgrid.controller.index.base.WordsView`'s
    ``words``: per chunk ``nwords`` L1, ``nwords`` GPU then ``nwords`` L2 little-endian uint64). In C
    where the extension is built (``native=False`` forces the Python path; the answers are equal,
    tested)."""
    elig = (eligible & ((1 << 64 * nwords) - 1)).to_bytes(8 * nwords, "little")
    if native and _native is not None:
        return _from_flat(np.frombuffer(_native.match_words(words, nwords, elig, max_pods), dtype=np.int64))
    nb = 8 * nwords
    rb = NUM_TIERS * nb
    l1s = [int.from_bytes(words[i : i + nb], "little") for i in range(0, len(words), rb)]
    gpus = [int.from_bytes(words[i + nb : i + 2 * nb], "little") for i in range(0, len(words), rb)]
    l2s = [int.from_bytes(words[i + 2 * nb : i + rb], "little") for i in range(0, len(words), rb)]
    return match_one(l1s, gpus, eligible, max_pods, l2s)
