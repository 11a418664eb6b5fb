"""Agent event ingest: sequence checking, and snapshot resync when the stream cannot be trusted.

Per pod incarnation (holder) the ingestor keeps the last applied sequence. Events are applied in
order; a duplicate (sequence <= last) is skipped; a gap, a new stream (reconnect) or an unknown
incarnation starts a *resync*: a background pull of ``AgentService.Snapshot`` from the agent.
While it runs, arriving events are buffered; when the snapshot lands, the holder's L1 entries (and
its L2 entries, when the snapshot lists them) are replaced by the snapshot, one atomic index
operation per tier, and the buffered events with sequence >
``snapshot.last_sequence`` are applied in order. After that the index equals the agent's truth
(or, for a pod over its index-entry cap, a subset of it: :mod:`kvgrid.controller.limits`).

A snapshot that does not list L2 keys (``AgentService.Snapshot`` lists L1 only) leaves the L2
entries as they are and asks the agent, through the next PublishEvents ack or Heartbeat answer
(:meth:`Ingestor.take_l2_listing_request`), to send its L2 listing again: a TIER_L2 CLEAR and
TIER_L2 ADMITs, sequenced after the snapshot, so the L2 entries catch up with the agent's truth.

Admits and snapshot replaces go through :class:`~kvgrid.controller.limits.EntryCaps` when one is
given; :meth:`Ingestor.resync_all` forces a fresh pull of every pod (the index lost its data).

Pulls run on a small pool of threads. A pull that failed is tried again ``retry_s`` later, queued
behind the pulls waiting by then; it holds no thread while it waits. (Waiting on a pool thread let
the pods whose pulls keep failing -- an agent registered with an address nothing answers on, which
any agent identity can do -- hold every thread for as long as their leases were renewed, and no
other pod was ever pulled: its events stayed buffered, unapplied.)
"""

from __future__ import annotations

import enum
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import msgspec

from kvgrid.common.errors import InvalidArgument, KvgridError
from kvgrid.controller.index import ChunkIndex, IndexTier, check_keys
from kvgrid.controller.limits import EntryCaps
from kvgrid.controller.registry import AgentRecord, UnknownPodError

__all__ = ["AgentSnapshot", "ChunkEvent", "EventKind", "Ingestor", "SnapshotFn", "check_events"]

log = logging.getLogger(__name__)


class EventKind(enum.IntEnum):
    """The wire's ``EventKind`` values (``EVENT_KIND_*``; tests/common/test_wire.py keeps them equal)."""

    ADMIT = 1
    EVICT = 2
    CLEAR = 3


class ChunkEvent(msgspec.Struct, frozen=True):
    sequence: int
    kind: EventKind
    tier: IndexTier | None
    """None only for CLEAR without a tier (every tier)."""
    keys: tuple[bytes, ...]
    namespace: str = ""
    """The namespace id the agent named for the keys ("" = not named)."""


def check_events(events: Sequence[ChunkEvent], namespaces: Sequence[str], max_keys: int) -> None:
    """What the wire form cannot check: each event's namespace is one the pod registered (when it
    named any), and one message carries at most ``max_keys`` keys. Raises before anything is applied.

    TIER_L2 events are exempt from the namespace check: a pod's lower tiers keep records of engines
    that left and of earlier runs (their namespaces are not registered any more, and refusing them
    would refuse the whole stream for good); their entries are answered only for namespaces the pod
    is registered in, like every entry."""
    total = 0
    for i, e in enumerate(events):
        if e.namespace and namespaces and e.namespace not in namespaces and e.tier is not IndexTier.L2:
            raise InvalidArgument(
                f"events[{i}].namespace={e.namespace!r}: not one of the pod's registered namespaces"
            )
        total += len(e.keys)
        if total > max_keys:
            raise InvalidArgument(f"message carries more than max_event_keys={max_keys} chunk keys")


class AgentSnapshot(msgspec.Struct, frozen=True):
    """An agent's answer to a snapshot pull (``AgentService.Snapshot``): its L1 keys as of
    ``last_sequence`` and the namespaces it serves."""

    pod_uid: str
    epoch: int
    keys: list[bytes]
    last_sequence: int
    namespaces: list[str] = []
    l2_keys: list[bytes] | None = None
    """Its lower tiers' keys as of ``last_sequence``; None: the snapshot does not list them (the
    holder's L2 entries are left as they are; TIER_L2 events keep them current)."""


class _PodState:
    def __init__(self, record: AgentRecord) -> None:
        self.record = record
        self.lock = threading.Lock()
        self.last_applied = 0
        self.synced = False
        self.resyncing = False
        self.buffer: list[ChunkEvent] = []
        # Events were dropped from a full buffer: the snapshot being pulled may predate them.
        self.overflowed = False
        self.generation = 0
        # A snapshot without L2 keys was installed: the agent is asked to list its L2 again.
        self.l2_listing_wanted = False


SnapshotFn = Callable[[AgentRecord, float], AgentSnapshot]
"""Pull a snapshot from the record's agent within the timeout; raises :class:`KvgridError`
(e.g. ``Unavailable``) or ValueError when it cannot."""


class Ingestor:
    """Applies agent events to the index; owns resyncs. Thread-safe."""

    def __init__(
        self,
        index: ChunkIndex,
        snapshot: SnapshotFn,
        *,
        snapshot_timeout_s: float = 5.0,
        retry_s: float = 0.5,
        on_namespaces: Callable[[AgentRecord, Sequence[str]], None] | None = None,
        max_buffered_events: int = 100_000,
        caps: EntryCaps | None = None,
    ) -> None:
        self.index = index
        self.caps = caps
        self._max_buffered = max_buffered_events
        self._snapshot = snapshot
        self._timeout = snapshot_timeout_s
        self._retry = retry_s
        self._on_namespaces = on_namespaces
        self._pods: dict[str, _PodState] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvgrid-resync")
        self._closed = threading.Event()
        # Pulls to retry: (when, order, state, generation), started by one timer thread.
        self._later: list[tuple[float, int, _PodState, int]] = []
        self._later_cond = threading.Condition()
        self._later_ids = itertools.count()
        self._timer: threading.Thread | None = None
        self.events_applied = 0
        self.resyncs = 0

    def _state(self, record: AgentRecord) -> _PodState:
        with self._lock:
            st = self._pods.get(record.holder)
            if st is None or (st.record.dropped and st.record is not record):
                # A re-registration of a dropped incarnation starts from scratch.
                st = self._pods[record.holder] = _PodState(record)
            return st

    def forget(self, holder: str) -> None:
        with self._lock:
            st = self._pods.pop(holder, None)
        if st is not None:
            with st.lock:
                st.generation += 1  # an in-flight pull for it is discarded
                st.buffer.clear()
        if self.caps is not None:
            self.caps.forget(holder)

    def last_sequence(self, holder: str) -> int:
        st = self._pods.get(holder)
        return st.last_applied if st else 0

    def tracks(self, holder: str) -> bool:
        """True when this ingestor has state for ``holder`` (its stream or a pull went through here)."""
        return holder in self._pods

    def take_l2_listing_request(self, holder: str) -> bool:
        """True once after a snapshot without L2 keys was installed for ``holder`` (the agent is
        to send its lower tiers' listing as new events)."""
        st = self._pods.get(holder)
        if st is None or not st.l2_listing_wanted:
            return False
        with st.lock:
            wanted, st.l2_listing_wanted = st.l2_listing_wanted, False
        return wanted

    def is_synced(self, holder: str) -> bool:
        st = self._pods.get(holder)
        return bool(st and st.synced and not st.resyncing)

    # --- events -------------------------------------------------------------------------------
    def request_resync(self, record: AgentRecord) -> bool:
        """Start a pull unless one is running; returns True if one is (now) in flight."""
        st = self._state(record)
        with st.lock:
            return self._start_resync_locked(st)

    def resync_all(self, records: Sequence[AgentRecord]) -> int:
        """Pull a new snapshot of every record's agent now, superseding pulls in flight (their
        snapshot may have been written before the index lost its data); returns pulls started."""
        started = 0
        for rec in records:
            if rec.dropped or not rec.pod.agent_address:
                continue
            st = self._state(rec)
            with st.lock:
                st.synced = False
                st.resyncing = False  # a pull in flight sees the generation change and gives up
                self._start_resync_locked(st)
                started += 1
        return started

    def _start_resync_locked(self, st: _PodState) -> bool:
        if not st.resyncing and not self._closed.is_set():
            st.resyncing = True
            st.generation += 1
            self._pool.submit(self._resync, st, st.generation)
        return True

    def publish(
        self, record: AgentRecord, events: Sequence[ChunkEvent], new_stream: bool
    ) -> tuple[int, bool]:
        """Apply (or buffer) events; returns (acked sequence, resync started/running)."""
        st = self._state(record)
        with st.lock:
            if record.dropped:  # lease lapsed or replaced while this stream was open
                raise UnknownPodError(
                    f"pod {record.holder!r}: no longer registered (lease lapsed?); register again"
                )
            if new_stream or not st.synced:
                self._start_resync_locked(st)
            if st.resyncing:
                self._buffer_locked(st, events)
                return st.last_applied, True
            # Consecutive admits of one tier are applied as one index write (one lock, one probe
            # loop): the per-call cost is most of an event of a few keys.
            applied = st.last_applied
            run_tier: IndexTier | None = None
            run: list[bytes] = []
            try:
                for i, e in enumerate(events):
                    if e.sequence <= applied:
                        continue
                    if e.sequence != applied + 1:
                        log.info(
                            "pod %s: sequence gap (expected %d, got %d): resync",
                            record.holder,
                            applied + 1,
                            e.sequence,
                        )
                        self._admit(record.holder, run_tier, run)
                        run = []
                        st.last_applied = applied
                        self._buffer_locked(st, events[i:])
                        self._start_resync_locked(st)
                        return st.last_applied, True
                    if e.kind is EventKind.ADMIT and e.keys:
                        if run and e.tier is not run_tier:
                            self._admit(record.holder, run_tier, run)
                            run = []
                        run_tier = e.tier
                        run += e.keys
                        self.events_applied += len(e.keys)
                    else:
                        self._admit(record.holder, run_tier, run)
                        run = []
                        self._apply(record.holder, e)
                    applied = e.sequence
                self._admit(record.holder, run_tier, run)
            except BaseException:
                # nothing of the failed run counts as applied: the agent resends or resyncs
                self.events_applied -= len(run)
                raise
            st.last_applied = applied
            return st.last_applied, False

    def _admit(self, holder: str, tier: IndexTier | None, keys: list[bytes]) -> None:
        """Index one run of admitted keys (counted by the caller)."""
        if keys:
            assert tier is not None
            if self.caps is not None:
                self.caps.add(holder, tier, keys)
            else:
                self.index.add(holder, tier, keys)

    def _buffer_locked(self, st: _PodState, events: Sequence[ChunkEvent]) -> None:
        """Keep events for after the snapshot, within a bound. Past it they are dropped and the
        pull is repeated once it lands: a snapshot that starts after the drop covers them."""
        st.buffer.extend(events)
        if len(st.buffer) > self._max_buffered:
            log.warning(
                "pod %s: %d events buffered while resyncing (max %d): dropped; pulling a newer snapshot",
                st.record.holder,
                len(st.buffer),
                self._max_buffered,
            )
            st.buffer.clear()
            st.overflowed = True

    def _apply(self, holder: str, e: ChunkEvent) -> None:
        if e.kind is EventKind.ADMIT:
            assert e.tier is not None
            if self.caps is not None:
                self.caps.add(holder, e.tier, e.keys)
            else:
                self.index.add(holder, e.tier, e.keys)
        elif e.kind is EventKind.EVICT:
            assert e.tier is not None
            self.index.remove(holder, e.tier, e.keys)
        else:
            for tier in (e.tier,) if e.tier is not None else tuple(IndexTier):
                self.index.replace(holder, tier, ())
        self.events_applied += len(e.keys) or 1

    # --- resync -------------------------------------------------------------------------------
    def _resync(self, st: _PodState, generation: int) -> None:
        rec = st.record
        while not self._closed.is_set():
            try:
                snap = self._snapshot(rec, self._timeout)
                if snap.pod_uid != rec.pod.pod_uid or snap.epoch != rec.pod.epoch:
                    raise ValueError(
                        f"agent at {rec.pod.agent_address} is {snap.pod_uid}/{snap.epoch}, "
                        f"expected {rec.holder}"
                    )
                check_keys(snap.keys, "snapshot.chunk_keys")
                if snap.l2_keys is not None:
                    check_keys(snap.l2_keys, "snapshot.l2_chunk_keys")
            except (KvgridError, ValueError) as exc:
                log.warning("snapshot pull from %s failed: %s", rec.holder, exc)
                self._retry_later(st, generation)
                return
            with st.lock:
                if st.generation != generation or rec.dropped:
                    return  # superseded (forgotten pod, newer pull)
                if st.overflowed:
                    st.overflowed = False
                    continue  # this snapshot may predate the dropped events: pull again
                if self._on_namespaces is not None and snap.namespaces:
                    self._on_namespaces(rec, list(snap.namespaces))
                pending = sorted(st.buffer, key=lambda e: e.sequence)
                st.buffer.clear()
                try:
                    done = self._install_locked(st, snap, pending)
                except KvgridError as exc:  # the index is unreachable (e.g. Redis down): pull again
                    log.warning("resync of %s: snapshot not applied: %s", rec.holder, exc)
                    st.buffer[:0] = pending  # nothing is lost: a newer snapshot skips what it covers
                    done = None
                if done:
                    return
                if done is False:
                    generation = st.generation
                    continue
            self._retry_later(st, generation)
            return

    def _retry_later(self, st: _PodState, generation: int) -> None:
        """Pull ``st`` again in ``retry_s`` unless superseded by then (no thread waits meanwhile)."""
        with self._later_cond:
            if self._closed.is_set():
                return
            heapq.heappush(
                self._later, (time.monotonic() + self._retry, next(self._later_ids), st, generation)
            )
            if self._timer is None:
                self._timer = threading.Thread(
                    target=self._timer_loop, name="kvgrid-resync-retry", daemon=True
                )
                self._timer.start()
            self._later_cond.notify()

    def _timer_loop(self) -> None:
        while True:
            due: list[tuple[_PodState, int]] = []
            with self._later_cond:
                if self._closed.is_set():
                    return
                now = time.monotonic()
                while self._later and self._later[0][0] <= now:
                    _, _, st, generation = heapq.heappop(self._later)
                    due.append((st, generation))
                if not due:
                    self._later_cond.wait(self._later[0][0] - now if self._later else None)
                    continue
            for st, generation in due:
                with st.lock:
                    if st.generation != generation or st.record.dropped:
                        continue  # superseded (a newer pull, a forgotten pod)
                try:
                    self._pool.submit(self._resync, st, generation)
                except RuntimeError:  # the pool shut down
                    return

    def _install_locked(self, st: _PodState, snap: AgentSnapshot, pending: list[ChunkEvent]) -> bool:
        """Replace the pod's L1 (and listed L2) entries by ``snap`` and apply the buffered events
        after it. True when the pod is in sync; False on a gap inside the buffer (a new pull is
        needed)."""
        rec = st.record
        tiers = [(IndexTier.L1, snap.keys)]
        if snap.l2_keys is not None:
            tiers.append((IndexTier.L2, snap.l2_keys))
        else:  # L2 events up to last_sequence may be lost: the agent lists its L2 again after it
            st.l2_listing_wanted = True
        for tier, keys in tiers:
            if self.caps is not None:
                self.caps.replace(rec.holder, tier, keys)
            else:
                self.index.replace(rec.holder, tier, keys)
        last = snap.last_sequence
        for j, e in enumerate(pending):
            if e.sequence <= last:
                continue
            if e.sequence != last + 1:
                # A gap inside the buffered events: what we have is still older truth.
                st.buffer.extend(pending[j:])
                st.last_applied = last
                st.generation += 1
                return False
            self._apply(rec.holder, e)
            last = e.sequence
        st.last_applied = last
        st.synced = True
        st.resyncing = False
        self.resyncs += 1
        return True

    def close(self) -> None:
        self._closed.set()
        with self._later_cond:
            self._later.clear()
            self._later_cond.notify()
        self._pool.shutdown(wait=False, cancel_futures=True)
