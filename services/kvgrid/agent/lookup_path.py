"""The agent's Lookup: the leading chunks available to a request, held here, brought back from a
lower tier, or fetched from a peer, in that order; pinned for the request (the request holds
table, ``kvgrid.agent.holds``) or, with engine copies, leased to it. Part of
:class:`~kvgrid.agent.core.AgentCore`.

Local hits stay pinned or referenced while chunks come back from a tier or a peer: a promotion's
or a fetch's reservations may evict, and must not evict the prefix they extend. After chunks came
back the walk runs again (:meth:`LookupPath._walk_again`): a request re-pins through the holds
table, which replaces its pin; a lookup without a request only counts.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.metrics import Counter

from kvgrid.agent.cache import ChunkCache, MissCause
from kvgrid.agent.config import AgentConfig
from kvgrid.agent.holds import Owner, RequestHolds
from kvgrid.agent.instances import EngineInstance, TransferTotals
from kvgrid.agent.l1 import Chunk, L1Pool
from kvgrid.agent.metrics import AgentMetrics
from kvgrid.agent.peers.fetcher import PeerFetcher
from kvgrid.agent.promotion import Promoter, Promotion
from kvgrid.agent.tiers.tier import TierChain
from kvgrid.common.agent_results import LookupResult
from kvgrid.common.errors import client_input
from kvgrid.common.hashing import check_chunk_keys
from kvgrid.common.rpc import after_reply
from kvgrid.common.tracing import local_span

__all__ = ["LookupPath"]


class LookupPath:
    """Lookup, its tier promotion and peer fetch, and the lease a Lookup may take."""

    config: AgentConfig
    pool: L1Pool
    cache: ChunkCache
    holds: RequestHolds
    tiers: TierChain | None
    promoter: Promoter | None
    peers: PeerFetcher
    tracer: trace.Tracer
    metrics: AgentMetrics
    totals: TransferTotals
    _totals_lock: threading.Lock

    if TYPE_CHECKING:

        def instance(self, instance_id: str) -> EngineInstance: ...
        def _offsets(self, chunks: Sequence[Chunk]) -> list[int]: ...
        def _count_hits(
            self,
            counter: Counter,
            asked: int,
            hits: int,
            cause: MissCause,
            peer: int = 0,
            tier: int = 0,
        ) -> None: ...

    def lookup(
        self,
        instance_id: str,
        request_id: str,
        keys: Sequence[bytes],
        pin_ttl_ms: int = 0,
        *,
        peer_address: str = "",
        lease: bool = False,
    ) -> LookupResult:
        """Leading chunks available: held here, then fetched from a peer -- the one at
        ``peer_address`` when the engine names it (P/D: its producer's agent), else (peer fetch on)
        the holder the controller names. With ``request_id`` they stay pinned until
        Retrieve/Release or the TTL. A failing peer never fails the lookup: it answers what it has,
        with cause ``peer_failed`` (also when an asynchronous fetch's chunks failed before the
        answer). ``lease`` (engine copies, shared L1): lease the hits to the request instead of
        pinning them when all their bytes are here already, so the engine copies without a
        Retrieve (:meth:`_lease_ready`)."""
        inst = self.instance(instance_id)
        with client_input():
            keys = check_chunk_keys(keys)
        # Clamped: a pin only protects chunks from eviction until Retrieve; no client may hold L1 longer.
        ttl = min(pin_ttl_ms or self.config.pin_ttl_ms, self.config.pin_ttl_max_ms) / 1000.0
        owner = (instance_id, request_id)
        with local_span(
            self.tracer, "agent.lookup", {"instance_id": instance_id, "chunks": len(keys)}
        ) as span:
            held: list[Chunk] = []
            if request_id:
                n, cause = self.holds.pin(owner, keys, inst.layout_id, ttl, namespace_id=inst.namespace_id)
            else:
                held, cause = self.cache.acquire_prefix(keys, inst.layout_id, namespace_id=inst.namespace_id)
                n = len(held)
            local = n
            tier = 0
            try:
                if (
                    cause == MissCause.NOT_FOUND
                    and self.tiers is not None
                    and self._from_tiers(inst, keys[n:], owner)
                ):
                    n, cause = self._walk_again(inst, owner, keys, ttl)
                tier = n - local
                if cause == MissCause.NOT_FOUND and (peer_address or self.config.peer_fetch_enabled):
                    n, cause = self._from_peer(inst, owner, keys, ttl, n, peer_address)
            finally:
                if held:
                    self.cache.release(held)
            peer = max(0, n - local - tier)
            span.set_attribute("hit_chunks", n)
            span.set_attribute("tier_chunks", tier)
            span.set_attribute("peer_chunks", peer)
            offsets, lease_id = (
                self._lease_ready(owner) if lease and request_id and n and self.pool.shared_file else ([], 0)
            )
        after_reply(self._count_hits, self.metrics.lookup_chunks, len(keys), n, cause, peer, tier)
        return LookupResult(
            num_hit_chunks=n,
            miss_cause=cause,
            num_peer_chunks=peer,
            chunk_offsets=offsets,
            lease_id=lease_id,
            l1_file=self.pool.shared_file if lease_id else "",
        )

    def _walk_again(
        self, inst: EngineInstance, owner: Owner, keys: Sequence[bytes], ttl: float
    ) -> tuple[int, MissCause]:
        """The walk after chunks came back: a request pins again (its pin replaced, the same TTL),
        a lookup without one counts the leading hits."""
        if owner[1]:
            return self.holds.pin(owner, keys, inst.layout_id, ttl, namespace_id=inst.namespace_id)
        return self.cache.prefix_length(keys, inst.layout_id, namespace_id=inst.namespace_id)

    def _from_peer(
        self, inst: EngineInstance, owner: Owner, keys: Sequence[bytes], ttl: float, n: int, peer_address: str
    ) -> tuple[int, MissCause]:
        """Fetch the keys after the ``n`` leading ones from a peer and walk again: (leading chunks
        available, cause)."""
        walked, cause = n, MissCause.NOT_FOUND
        fetched = self.peers.fetch(
            keys[n:],
            namespace_id=inst.namespace_id,
            layout_id=inst.layout_id,
            bytes_per_chunk=inst.bytes_per_chunk,
            peer_address=peer_address,
        )
        if fetched.chunks:
            n, cause = self._walk_again(inst, owner, keys, ttl)
        # An asynchronous fetch's pending chunks may have failed already (a forged stream arrives
        # whole at once): fewer than fetched are there, and the peer is why.
        if n < len(keys) and (fetched.error or n < walked + fetched.chunks):
            cause = MissCause.PEER_FAILED
        return n, cause

    def _lease_ready(self, owner: Owner) -> tuple[list[int], int]:
        """Turn the pin this Lookup took into a lease of ``owner`` when each chunk's bytes are
        final in L1: (their offsets, the lease id). Else ([], 0) and the pin stays: a chunk still
        being read from a lower tier (or whose read failed) is served by a Retrieve, which waits."""
        leased = self.holds.lease_pin(owner)
        if leased is None:
            return [], 0
        lease_id, chunks = leased
        with self._totals_lock:  # no Retrieve follows: the engine copies these itself
            self.totals.retrieved_chunks += len(chunks)
        return self._offsets(chunks), lease_id

    def _from_tiers(self, inst: EngineInstance, keys: Sequence[bytes], owner: Owner) -> int:
        """Bring the leading ``keys`` back into L1: those still waiting for the tier writer (no
        I/O), then those the tiers hold (a promotion; waited for in ``sync`` mode). Returns how many
        leading keys are now in L1, pending or not."""
        back = self.cache.rescue_spilling(keys, inst.layout_id, namespace_id=inst.namespace_id)
        promotion = self._promote(inst, keys[back:], owner)
        return back + (promotion.leading if promotion is not None else 0)

    def _promote(self, inst: EngineInstance, keys: Sequence[bytes], owner: Owner) -> Promotion | None:
        assert self.promoter is not None
        promotion = self.promoter.start(
            owner,
            keys,
            namespace_id=inst.namespace_id,
            layout_id=inst.layout_id,
            nbytes=inst.bytes_per_chunk,
        )
        if promotion is not None and self.config.tier_promotion == "sync":
            promotion.done.wait()  # failed chunks left the index: the re-pin does not count them
        return promotion
