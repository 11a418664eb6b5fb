"""Index-entry caps: how many (chunk, tier) entries one pod, and the whole index, may hold.

A registrant could otherwise publish events without end and grow the controller's memory (about
60-80 B per entry) until it dies. :class:`EntryCaps` sits between agent ingest (admit events and
snapshot replaces, :mod:`kvgrid.controller.ingest`) and the index:

- an admit that would take the pod past ``max_entries_per_pod`` or the index past
  ``max_index_entries`` is applied up to the cap; the rest of its keys are *refused*: not indexed,
  counted in :attr:`EntryCaps.rejected_entries` (metric ``kvgrid_controller_rejected_entries``), and
  the pod is marked over quota (:attr:`EntryCaps.over_quota`, logged once naming the pod, the cap
  and the count). A snapshot larger than the room left is indexed up to it the same way;
- the event stream is *not* failed: its sequence numbers advance, so the agent neither resends the
  refused events nor triggers a snapshot pull per message (a loop that would cost the whole L1 each
  time); evictions are always applied, so the pod's entries fall back under the cap on their own;
- the index is then a *subset* of the agent's truth: routers may miss chunks the pod holds, they are
  never told a pod holds what it does not. Nothing cached is touched (the agent owns its L1). A pod
  leaves over-quota when a snapshot of it fits again (or it is dropped).

Invariants: caps are checked before the write, against an upper bound of the entries (exact counts
are read from the index only when the bound says the cap may be near), so concurrent ingest of
several pods never takes the index past ``max_index_entries``; a pod's own writes are serialized by
its ingest lock, so its count never passes ``max_entries_per_pod`` through agent events. GPU-tier
entries from vLLM KV events (configured sources) count toward the pod's entries but are not refused.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence

from kvgrid.controller.index import ChunkIndex, IndexTier

__all__ = ["EntryCaps"]

log = logging.getLogger(__name__)


class EntryCaps:
    """Applies admits and snapshot replaces of agents to ``index`` within the caps. Thread-safe."""

    def __init__(self, index: ChunkIndex, per_pod: int, total: int) -> None:
        self.index = index
        self.per_pod = per_pod
        self.total = total
        self._lock = threading.Lock()
        self._pod_hi: dict[str, int] = {}  # holder -> upper bound of its entries
        self._total_hi: int | None = None  # upper bound of the index's entries (incl. in flight)
        self._inflight = 0  # entries reserved but not yet written
        self.rejected_entries = 0
        """Keys refused since start (not indexed because of a cap)."""
        self.over_quota: dict[str, int] = {}
        """Holder -> entries refused while it is over quota."""

    # --- bounds (under self._lock) ------------------------------------------------------------
    def _pod_room(self, holder: str, n: int) -> int:
        hi = self._pod_hi.get(holder)
        if hi is None or hi + n > self.per_pod:
            hi = self._pod_hi[holder] = self.index.holder_entries(holder)
        return self.per_pod - hi

    def _total_room(self, n: int) -> int:
        hi = self._total_hi
        if hi is None or hi + n > self.total:
            hi = self._total_hi = self.index.num_entries() + self._inflight
        return self.total - hi

    def _reserve(self, holder: str, n: int) -> None:
        self._pod_hi[holder] = self._pod_hi.get(holder, 0) + n
        self._total_hi = (self._total_hi or 0) + n
        self._inflight += n

    def _release(self, n: int) -> None:
        if n:
            with self._lock:
                self._inflight -= n

    # --- writes -------------------------------------------------------------------------------
    def add(self, holder: str, tier: IndexTier, keys: Sequence[bytes]) -> int:
        """Index up to the room left of ``keys`` for ``holder``; returns how many were refused."""
        n = len(keys)
        with self._lock:
            pod_hi = self._pod_hi.get(holder)
            total_hi = self._total_hi
            if (
                pod_hi is not None
                and total_hi is not None
                and pod_hi + n <= self.per_pod
                and total_hi + n <= self.total
            ):  # far from both caps (the common case): reserve without reading the index
                self._pod_hi[holder] = pod_hi + n
                self._total_hi = total_hi + n
                self._inflight += n
                allowed = n
            else:
                allowed = max(0, min(n, self._pod_room(holder, n), self._total_room(n)))
                self._reserve(holder, allowed)
        try:
            if allowed:
                self.index.add(holder, tier, keys[:allowed] if allowed < n else keys)
        finally:
            self._release(allowed)
        if allowed < n:
            self._refused(holder, n - allowed)
        return n - allowed

    def replace(self, holder: str, tier: IndexTier, keys: Iterable[bytes]) -> int:
        """Make ``holder``'s ``tier`` entries ``keys``, cut to the room left; returns how many were
        refused. Reads exact counts (snapshots are rare)."""
        new = list(dict.fromkeys(keys))
        with self._lock:
            old = self.index.holder_tier_entries(holder, tier)
            other = self.index.holder_entries(holder) - old
            total_now = self.index.num_entries() + self._inflight
            allowed = max(0, min(len(new), self.per_pod - other, self.total - (total_now - old)))
            grow = max(0, allowed - old)
            self._pod_hi[holder] = other + max(allowed, old)
            self._total_hi = total_now + grow
            self._inflight += grow
        try:
            self.index.replace(holder, tier, new[:allowed] if allowed < len(new) else new)
        finally:
            self._release(grow)
        refused = len(new) - allowed
        if refused:
            self._refused(holder, refused)
        else:
            with self._lock:
                if self.over_quota.pop(holder, None) is not None:
                    log.info("pod %s: back under its index-entry cap", holder)
        return refused

    def forget(self, holder: str) -> None:
        """``holder`` was dropped (its entries are gone)."""
        with self._lock:
            self._pod_hi.pop(holder, None)
            self._total_hi = None
            self.over_quota.pop(holder, None)

    def reset(self) -> None:
        """The index lost its data: forget every bound (the next check reads exact counts)."""
        with self._lock:
            self._pod_hi.clear()
            self._total_hi = None

    def _refused(self, holder: str, n: int) -> None:
        with self._lock:
            self.rejected_entries += n
            first = holder not in self.over_quota
            self.over_quota[holder] = self.over_quota.get(holder, 0) + n
            pod_hi = self._pod_hi.get(holder, 0)
        if first:
            log.warning(
                "pod %s over quota: %d index entries refused (it holds about %d entries, "
                "max_entries_per_pod=%d; the index about %d, max_index_entries=%d); events beyond the "
                "cap are not indexed until its entries fall under it",
                holder,
                n,
                pod_hi,
                self.per_pod,
                self._total_hi or 0,
                self.total,
            )
