"""Promotion: reading chunks a Lookup found in a lower tier back into L1, off the request path.

A Lookup whose walk reaches chunks the tiers hold calls :meth:`Promoter.start`: it reserves L1
chunks for them, commits them *pending* (visible and counted as hits, ``Chunk.ready`` unset) and
queues one :class:`Promotion` on a small worker pool (``tier_promotion_workers``); the Lookup
answers at once (``tier_promotion: async``) or waits for the promotion (``sync``). The worker reads
the records in order (pipelined, ``TierChain.iter_reads``), verifies each and marks it ready; a
record that fails its checks, a store error, or a cancel fails that chunk and every one after it
(``ChunkCache.fail_pending``: they leave the index, an evict event each).

Invariants:

- Unverified bytes are never served: every reader of chunk bytes (Retrieve, peer serving) goes
  through ``ChunkCache.acquire_ready_prefix``, which waits for pending chunks and stops before a
  failed one (cause ``tier_failed``: the engine recomputes those blocks).
- Each pending chunk holds one reference for its promotion until it is finished or failed, so
  eviction never takes it nor reuses its pages while the read runs; no reference outlives the
  promotion (a failed chunk's pages are freed with its last reference).
- Cancelling (Release of the request, its engine unregistered) drops the chunks not read yet when
  nobody else references them; chunks another request pinned meanwhile are still read.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from opentelemetry import metrics, trace
from opentelemetry.metrics import Observation

from kvgrid.agent.cache import ChunkCache
from kvgrid.agent.l1 import Chunk
from kvgrid.agent.tiers.tier import TierChain

__all__ = ["Promoter", "Promotion"]

log = logging.getLogger(__name__)

# A promotion reads one to hundreds of chunks from a disk (~1-10 ms each) or an object store.
_DURATION_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass(eq=False)
class Promotion:
    """One Lookup's chunks on their way from the tiers into L1."""

    owner: tuple[str, str]
    """(instance_id, request_id) of the Lookup; request_id empty = not cancellable."""
    namespace_id: str
    layout_id: str
    chunks: list[Chunk]
    """The pending chunks this promotion committed, in key order."""
    leading: int
    """Leading keys of the Lookup's tail now in L1, pending or not (what the Lookup may count)."""
    started: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    read: int = 0
    """Chunks read and verified (the rest failed or were dropped); final once ``done`` is set."""


class Promoter:
    """Starts promotions and runs them on a worker pool. Thread-safe."""

    def __init__(
        self,
        cache: ChunkCache,
        tiers: TierChain,
        *,
        workers: int,
        meter: metrics.Meter,
        tracer: trace.Tracer,
    ) -> None:
        self.cache = cache
        self.tiers = tiers
        self.tracer = tracer
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="kvgrid-promote")
        self._lock = threading.Lock()
        self._running: dict[tuple[str, str], list[Promotion]] = {}
        self._in_flight = 0
        meter.create_observable_gauge(
            "kvgrid_agent_tier_promotions_in_flight",
            [lambda _o: [Observation(self.in_flight)]],
            unit="{promotion}",
            description="Promotions (a lookup's chunks read from a lower tier into L1) queued or running",
        )
        self.duration = meter.create_histogram(
            "kvgrid_agent_tier_promotion_duration",
            unit="s",
            description="Wall time from a lookup starting a promotion to its last chunk verified or failed",
            explicit_bucket_boundaries_advisory=_DURATION_BUCKETS_S,
        )
        self.promoted = meter.create_counter(
            "kvgrid_agent_tier_promoted_chunks",
            unit="{chunk}",
            description="Chunks promoted from a lower tier into L1, by result (ok, failed, cancelled)",
        )

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    def start(
        self,
        owner: tuple[str, str],
        keys: Sequence[bytes],
        *,
        namespace_id: str,
        layout_id: str,
        nbytes: int,
    ) -> Promotion | None:
        """Commit pending L1 chunks for the leading ``keys`` the tiers hold and queue their reads;
        None when the tiers hold none of them (or L1 has no room for the first)."""
        m = self.tiers.prefix_length(keys, layout_id, namespace_id=namespace_id)
        if not m:
            return None
        res = self.cache.reserve_store(
            keys[:m], namespace_id=namespace_id, layout_id=layout_id, nbytes=nbytes
        )
        # The leading run of entries (a reservation stops at the first chunk that does not fit).
        lead = sum(1 for pos, (i, _, _) in enumerate(res.entries) if i == pos)
        mine = list(self.cache.commit_pending(res, upto=lead)[1].values())
        if not lead:
            return None
        p = Promotion(owner, namespace_id, layout_id, mine, lead)
        if not mine:
            p.done.set()
            return p
        with self._lock:
            self._in_flight += 1
            if owner[1]:
                self._running.setdefault(owner, []).append(p)
        self._pool.submit(self._run, p)
        return p

    def cancel(self, owner: tuple[str, str]) -> int:
        """Cancel ``owner``'s promotions: chunks not read yet that nobody else references are
        dropped. Returns how many promotions were still running."""
        with self._lock:
            running = list(self._running.get(owner, ()))
        for p in running:
            p.cancelled = True
        return len(running)

    def cancel_instance(self, instance_id: str) -> int:
        with self._lock:
            owners = [o for o in self._running if o[0] == instance_id]
        return sum(self.cancel(o) for o in owners)

    def _dropped_by_cancel(self, p: Promotion, i: int) -> bool:
        return p.cancelled and self.cache.held_only_by_promotion(p.chunks[i:])

    def _run(self, p: Promotion) -> None:
        i = 0
        cancelled = False
        with self.tracer.start_as_current_span(
            "agent.tier_promote", attributes={"chunks": len(p.chunks)}
        ) as span:
            try:
                if self._dropped_by_cancel(p, 0):
                    cancelled = True
                else:
                    items = [(c.key, c.buffer.numpy()) for c in p.chunks]
                    # Closed before failing the rest: the read in flight must not outlive their pages.
                    with contextlib.closing(
                        self.tiers.iter_reads(p.namespace_id, p.layout_id, items)
                    ) as reads:
                        for checksum in reads:
                            if checksum is None:
                                break
                            self.cache.finish_pending(p.chunks[i], checksum)
                            i += 1
                            if i < len(p.chunks) and self._dropped_by_cancel(p, i):
                                cancelled = True
                                break
            except Exception:
                log.exception("promotion of %d chunks from a lower tier failed", len(p.chunks))
            finally:
                rest = p.chunks[i:]
                if rest:
                    self.cache.fail_pending(rest)
                p.read = i
                span.set_attribute("read_chunks", i)
                if i:
                    self.promoted.add(i, {"result": "ok"})
                if rest:
                    self.promoted.add(len(rest), {"result": "cancelled" if cancelled else "failed"})
                result = "ok" if not rest else ("cancelled" if cancelled else "failed")
                self.duration.record(time.perf_counter() - p.started, {"result": result})
                with self._lock:
                    self._in_flight -= 1
                    running = self._running.get(p.owner)
                    if running is not None:
                        running.remove(p)
                        if not running:
                            del self._running[p.owner]
                p.done.set()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
