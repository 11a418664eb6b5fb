"""Index-entry caps: how many (chunk, tier) entries one pod, one identity and the whole index may hold.

A registrant could otherwise publish events without end and grow the controller's memory (about
60-80 B per entry) until it dies, or fill the index so that nobody else's chunks are indexed.
:class:`EntryCaps` sits between agent ingest (admit events and snapshot replaces,
:mod:`kvgrid.controller.ingest`) and the index, with three caps:

- ``per_pod`` (``max_entries_per_pod``): the entries of one pod incarnation (holder);
- ``per_identity`` (``max_entries_per_identity``): the entries of every holder bound to one caller
  identity (:meth:`EntryCaps.bind`: the mTLS identity that registered the pod; holders bound to
  none, i.e. without TLS, have no identity cap). Smaller than ``total`` by default, so one identity
  cannot fill the index for the others;
- ``total`` (``max_index_entries``): the whole index.

An admit that would take its pod, identity or the index past a cap is applied up to the cap; the rest
of its keys are *refused*: not indexed, counted in :attr:`EntryCaps.rejected_entries` (metric
``kvgrid_controller_rejected_entries``) and per cap (:attr:`EntryCaps.refused_by_cap`), kept for the
pod's next PublishEvents answer (:meth:`EntryCaps.take_refused`, so the agent is told), and the pod
(and identity) are marked over quota (:attr:`EntryCaps.over_quota`, :attr:`EntryCaps.over_quota_identities`,
logged once naming the pod, the cap and the count). A snapshot larger than the room left is indexed
up to it the same way. Which cap refused: the one with the least room (pod, then identity, then
total on ties).

- the event stream is *not* failed: its sequence numbers advance, so the agent neither resends the
  refused events nor triggers a snapshot pull per message (a loop that would cost the whole L1 each
  time); evictions are always applied, so the pod's entries fall back under the cap on their own;
- the index is then a *subset* of the agent's truth: routers may miss chunks the pod holds, they are
  never told a pod holds what it does not. Nothing cached is touched (the agent owns its L1). A pod
  (and its identity) leaves over-quota when a snapshot of it fits again (or it is dropped).

Invariants: caps are checked before the write, against upper bounds of the entries (exact counts
are read from the index only when a bound says the cap may be near), and what is reserved but not
yet written counts, so concurrent ingest of several pods never takes the index past ``total`` nor an
identity past ``per_identity``; a pod's own writes are serialized by its ingest lock, so its count
never passes ``per_pod`` through agent events. GPU-tier entries from vLLM KV events (configured
sources) count toward the pod's entries but are not refused. Identities are this replica's view:
holders are bound by the registrations and streams this controller serves.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence

import msgspec

from kvgrid.controller.index import ChunkIndex, IndexTier

__all__ = ["CAPS", "EntryCaps", "Refused"]

log = logging.getLogger(__name__)

IDENTITY_RECOUNT_S = 0.1
"""While an identity is at its cap, its exact count (one index read per pod it has) is read at most
this often; in between its upper bound decides (never more entries than the cap, at worst keys
refused that evictions of the last 0.1 s made room for)."""

CAPS = ("pod", "identity", "total")
"""The caps, in the order a tie is attributed (narrowest first)."""

_SETTING = {
    "pod": "max_entries_per_pod",
    "identity": "max_entries_per_identity",
    "total": "max_index_entries",
}


class Refused(msgspec.Struct, frozen=True):
    """Keys not indexed, by the cap that refused them."""

    pod: int = 0
    identity: int = 0
    total: int = 0

    @property
    def entries(self) -> int:
        return self.pod + self.identity + self.total


NONE_REFUSED = Refused()


class EntryCaps:
    """Applies admits and snapshot replaces of agents to ``index`` within the caps. Thread-safe.

    ``per_identity`` 0: no identity cap."""

    def __init__(self, index: ChunkIndex, per_pod: int, total: int, per_identity: int = 0) -> None:
        self.index = index
        self.per_pod = per_pod
        self.total = total
        self.per_identity = per_identity
        self._lock = threading.Lock()
        self._pod_hi: dict[str, int] = {}  # holder -> upper bound of its entries
        self._total_hi: int | None = None  # upper bound of the index's entries (incl. in flight)
        self._inflight = 0  # entries reserved but not yet written
        self._identity_of: dict[str, str] = {}  # holder -> identity it is bound to
        self._holders_of: dict[str, set[str]] = {}  # identity -> its holders
        self._ident_hi: dict[str, int] = {}  # identity -> upper bound of its entries (incl. in flight)
        self._ident_inflight: dict[str, int] = {}
        self._ident_read_at: dict[str, float] = {}  # identity -> when its exact count was read
        self._pending: dict[str, list[int]] = {}  # holder -> refused since its last answer, per cap
        self.rejected_entries = 0
        """Keys refused since start (not indexed because of a cap)."""
        self.refused_by_cap: dict[str, int] = dict.fromkeys(CAPS, 0)
        """Keys refused since start, by the cap that refused them."""
        self.over_quota: dict[str, int] = {}
        """Holder -> entries refused while it is over quota."""
        self.over_quota_identities: dict[str, int] = {}
        """Identity -> entries refused by its identity cap while it is over quota."""

    # --- identities ---------------------------------------------------------------------------
    def bind(self, holder: str, identity: str) -> None:
        """``holder`` was registered by ``identity`` (its entries count toward that identity's cap)."""
        with self._lock:
            if self._identity_of.get(holder) == identity:
                return
            self._unbind_locked(holder)
            self._identity_of[holder] = identity
            self._holders_of.setdefault(identity, set()).add(holder)
            self._ident_hi.pop(identity, None)  # read exact counts at the next check

    def identity_of(self, holder: str) -> str | None:
        return self._identity_of.get(holder)

    def pods_of(self, identity: str) -> set[str]:
        """Pod UIDs of the live holders bound to ``identity``."""
        with self._lock:
            return {h.rpartition("/")[0] for h in self._holders_of.get(identity, ())}

    def _unbind_locked(self, holder: str) -> None:
        ident = self._identity_of.pop(holder, None)
        if ident is None:
            return
        holders = self._holders_of.get(ident)
        if holders is not None:
            holders.discard(holder)
            if not holders:
                del self._holders_of[ident]
                self._ident_inflight.pop(ident, None)
                self._ident_read_at.pop(ident, None)
                self.over_quota_identities.pop(ident, None)
        self._ident_hi.pop(ident, None)

    # --- bounds (under self._lock) ------------------------------------------------------------
    def _pod_room(self, holder: str, n: int) -> int:
        hi = self._pod_hi.get(holder)
        if hi is None or hi + n > self.per_pod:
            hi = self._pod_hi[holder] = self.index.holder_entries(holder)
        return self.per_pod - hi

    def _ident_room(self, ident: str | None, n: int) -> int:
        if ident is None or not self.per_identity:
            return n
        hi = self._ident_hi.get(ident)
        now = time.monotonic()
        if hi is None or (
            hi + n > self.per_identity and now - self._ident_read_at.get(ident, 0.0) >= IDENTITY_RECOUNT_S
        ):
            exact = sum(self.index.holder_entries(h) for h in self._holders_of.get(ident, ()))
            hi = self._ident_hi[ident] = exact + self._ident_inflight.get(ident, 0)
            self._ident_read_at[ident] = now
        return self.per_identity - hi

    def _total_room(self, n: int) -> int:
        hi = self._total_hi
        if hi is None or hi + n > self.total:
            hi = self._total_hi = self.index.num_entries() + self._inflight
        return self.total - hi

    def _reserve(self, holder: str, ident: str | None, n: int) -> None:
        self._pod_hi[holder] = self._pod_hi.get(holder, 0) + n
        self._total_hi = (self._total_hi or 0) + n
        self._inflight += n
        if ident is not None:
            self._ident_hi[ident] = self._ident_hi.get(ident, 0) + n
            self._ident_inflight[ident] = self._ident_inflight.get(ident, 0) + n

    def _release(self, ident: str | None, n: int) -> None:
        if n:
            with self._lock:
                self._inflight -= n
                if ident is not None and ident in self._ident_inflight:
                    self._ident_inflight[ident] = max(0, self._ident_inflight[ident] - n)

    @staticmethod
    def _binding(rooms: tuple[int, int, int]) -> str:
        """The cap with the least room (pod, identity, total on ties)."""
        return CAPS[rooms.index(min(rooms))]

    # --- writes -------------------------------------------------------------------------------
    def add(self, holder: str, tier: IndexTier, keys: Sequence[bytes]) -> int:
        """Index up to the room left of ``keys`` for ``holder``; returns how many were refused."""
        n = len(keys)
        cap = ""
        with self._lock:
            ident = self._identity_of.get(holder) if self.per_identity else None
            pod_hi = self._pod_hi.get(holder)
            total_hi = self._total_hi
            ident_hi = self._ident_hi.get(ident) if ident is not None else 0
            if (
                pod_hi is not None
                and total_hi is not None
                and ident_hi is not None
                and pod_hi + n <= self.per_pod
                and total_hi + n <= self.total
                and (ident is None or ident_hi + n <= self.per_identity)
            ):  # far from every cap (the common case): reserve without reading the index
                allowed = n
            else:
                rooms = (self._pod_room(holder, n), self._ident_room(ident, n), self._total_room(n))
                allowed = max(0, min(n, *rooms))
                if allowed < n:
                    cap = self._binding(rooms)
            self._reserve(holder, ident, allowed)
        try:
            if allowed:
                self.index.add(holder, tier, keys[:allowed] if allowed < n else keys)
        finally:
            self._release(ident, allowed)
        if allowed < n:
            self._refused(holder, ident, cap, n - allowed)
        return n - allowed

    def replace(self, holder: str, tier: IndexTier, keys: Iterable[bytes]) -> int:
        """Make ``holder``'s ``tier`` entries ``keys``, cut to the room left; returns how many were
        refused. Reads exact counts (snapshots are rare)."""
        new = list(dict.fromkeys(keys))
        cap = ""
        with self._lock:
            ident = self._identity_of.get(holder) if self.per_identity else None
            old = self.index.holder_tier_entries(holder, tier)
            other = self.index.holder_entries(holder) - old
            total_now = self.index.num_entries() + self._inflight
            rooms = [self.per_pod - other, len(new), self.total - (total_now - old)]
            ident_now = 0
            if ident is not None:
                ident_now = sum(self.index.holder_entries(h) for h in self._holders_of.get(ident, ()))
                ident_now += self._ident_inflight.get(ident, 0)
                rooms[1] = self.per_identity - (ident_now - old)
            allowed = max(0, min(len(new), *rooms))
            if allowed < len(new):
                cap = self._binding((rooms[0], rooms[1], rooms[2]))
            grow = max(0, allowed - old)
            self._pod_hi[holder] = other + max(allowed, old)
            self._total_hi = total_now + grow
            self._inflight += grow
            if ident is not None:
                self._ident_hi[ident] = ident_now + grow
                self._ident_inflight[ident] = self._ident_inflight.get(ident, 0) + grow
        try:
            self.index.replace(holder, tier, new[:allowed] if allowed < len(new) else new)
        finally:
            self._release(ident, grow)
        refused = len(new) - allowed
        if refused:
            self._refused(holder, ident, cap, refused)
        else:
            with self._lock:
                if self.over_quota.pop(holder, None) is not None:
                    log.info("pod %s: back under its index-entry caps", holder)
                if ident is not None and self.over_quota_identities.pop(ident, None) is not None:
                    log.info("identity %s: back under max_entries_per_identity", ident)
        return refused

    def take_refused(self, holder: str) -> Refused:
        """Keys of ``holder`` refused since the last call (for its next PublishEvents answer)."""
        if holder not in self._pending:
            return NONE_REFUSED
        with self._lock:
            counts = self._pending.pop(holder, None)
        return NONE_REFUSED if counts is None else Refused(*counts)

    def forget(self, holder: str) -> None:
        """``holder`` was dropped (its entries are gone)."""
        with self._lock:
            self._pod_hi.pop(holder, None)
            self._total_hi = None
            self.over_quota.pop(holder, None)
            self._pending.pop(holder, None)
            self._unbind_locked(holder)

    def reset(self) -> None:
        """The index lost its data: forget every bound (the next check reads exact counts)."""
        with self._lock:
            self._pod_hi.clear()
            self._total_hi = None
            self._ident_hi.clear()

    def _refused(self, holder: str, ident: str | None, cap: str, n: int) -> None:
        with self._lock:
            self.rejected_entries += n
            self.refused_by_cap[cap] += n
            pending = self._pending.setdefault(holder, [0, 0, 0])
            pending[CAPS.index(cap)] += n
            first = holder not in self.over_quota
            self.over_quota[holder] = self.over_quota.get(holder, 0) + n
            first_ident = False
            if cap == "identity" and ident is not None:
                first_ident = ident not in self.over_quota_identities
                self.over_quota_identities[ident] = self.over_quota_identities.get(ident, 0) + n
            pod_hi = self._pod_hi.get(holder, 0)
            ident_hi = self._ident_hi.get(ident, 0) if ident is not None else 0
            pods = len(self._holders_of.get(ident, ())) if ident is not None else 0
        if first_ident:
            log.warning(
                "identity %s over quota: %d index entries of pod %s refused (its %d pods hold about %d "
                "entries, max_entries_per_identity=%d); its pods' new chunks are not indexed until "
                "their entries fall under it",
                ident,
                n,
                holder,
                pods,
                ident_hi,
                self.per_identity,
            )
        if first:
            log.warning(
                "pod %s over quota: %d index entries refused by %s (it holds about %d entries, "
                "max_entries_per_pod=%d; %s; the index about %d, max_index_entries=%d); events beyond "
                "the cap are not indexed until its entries fall under it",
                holder,
                n,
                _SETTING[cap],
                pod_hi,
                self.per_pod,
                f"identity {ident} about {ident_hi}, max_entries_per_identity={self.per_identity}"
                if ident is not None
                else "no identity cap",
                self._total_hi or 0,
                self.total,
            )
