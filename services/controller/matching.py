"""Prefix matching over a :class:`~kvgrid.controller.index.PrefixView` (pure functions, no storage).

Semantics (docs/controller.md): for pod ``P`` chunk ``i`` is *available* when ``P`` holds it in GPU
or in its own L1, or some other pod holds it in L1 (peer-fetchable). ``P``'s match is the longest
run of available leading chunks, and each matched chunk counts in the fastest tier that has it:
GPU, then own L1, then peer. Because any L1 holder makes a chunk available to *every* pod, a chunk
is available to all pods when its L1 mask is non-zero, and only to its GPU holders otherwise; the
whole computation is a few big-int operations per chunk, with per-pod tier counts kept as
bit-sliced counters (one bit-plane per binary digit, every pod counted at once).
"""

from __future__ import annotations

import msgspec
import numpy as np
from kvgrid.controller.index import PrefixView

__all__ = ["PodPrefix", "PrefixMatch", "match_prefix"]


class PodPrefix(msgspec.Struct, frozen=True):
    """Leading chunks matched on one holder slot, by the fastest tier holding each."""

    slot: int
    gpu: int
    l1: int
    peer: int

    @property
    def total(self) -> int:
        return self.gpu + self.l1 + self.peer


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
    l1s, gpus = view.l1, view.gpu
    n = len(l1s)
    peer_fetchable = n
    for i, m in enumerate(l1s):
        if not m:
            peer_fetchable = i
            break
    owners = 0
    for a, b in zip(l1s, gpus, strict=True):
        owners |= a | b
    owners &= eligible
    if not owners:
        return PrefixMatch(pods=[], peer_fetchable=peer_fetchable)
    alive = owners
    ends: dict[int, int] = {}
    gplanes: list[int] = []
    lplanes: list[int] = []
    for i in range(n):
        l1, g = l1s[i], gpus[i]
        if not l1:
            dead = alive & ~g
            if dead:
                while dead:
                    b = dead & -dead
                    ends[b.bit_length() - 1] = i
                    dead ^= b
                alive &= g
                if not alive:
                    break
        _add(gplanes, alive & g)
        _add(lplanes, alive & l1 & ~g)
    while alive:
        b = alive & -alive
        ends[b.bit_length() - 1] = n
        alive ^= b
    nbytes = (owners.bit_length() + 7) // 8
    gc = _per_slot(gplanes, nbytes)
    lc = _per_slot(lplanes, nbytes)
    pods = []
    for slot, end in ends.items():
        g, lo = int(gc[slot]), int(lc[slot])
        if g or lo:
            pods.append(PodPrefix(slot=slot, gpu=g, l1=lo, peer=end - g - lo))
    pods.sort(key=lambda p: (-p.total, -p.gpu, -p.l1, p.slot))
    return PrefixMatch(pods=pods, peer_fetchable=peer_fetchable)
