"""``kvgrid_agent_tier_*`` instruments, one series per tier (attribute ``tier``: disk, s3).

Observed from the tiers' counters when a reader collects, so they cost nothing per request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation

from kvgrid.agent.tiers.tier import TierChain, TierStats

__all__ = ["TierMetrics"]


class TierMetrics:
    def __init__(self, meter: metrics.Meter, chain: TierChain, dropped_spills: Callable[[], int]) -> None:
        self.chain = chain

        def per_tier(fn: Callable[[TierStats], float]) -> Callable[[CallbackOptions], Iterable[Observation]]:
            return lambda _opts: [Observation(fn(s), {"tier": s.tier}) for s in chain.stats()]

        def gauge(name: str, fn: Callable[[TierStats], float], description: str, unit: str = "") -> None:
            meter.create_observable_gauge(name, [per_tier(fn)], unit=unit, description=description)

        def counter(name: str, fn: Callable[[TierStats], float], description: str, unit: str = "") -> None:
            meter.create_observable_counter(name, [per_tier(fn)], unit=unit, description=description)

        gauge("kvgrid_agent_tier_used_bytes", lambda s: s.used_bytes, "Bytes held in a lower tier", "By")
        gauge(
            "kvgrid_agent_tier_capacity_bytes", lambda s: s.capacity_bytes, "Capacity of a lower tier", "By"
        )
        gauge("kvgrid_agent_tier_chunks", lambda s: s.chunks, "Chunks held in a lower tier")
        counter(
            "kvgrid_agent_tier_writes", lambda s: s.writes, "Chunks written to a tier (spills and demotions)"
        )
        counter("kvgrid_agent_tier_written_bytes", lambda s: s.written_bytes, "Bytes written to a tier", "By")
        counter("kvgrid_agent_tier_reads", lambda s: s.reads, "Verified chunk reads from a tier into L1")
        counter(
            "kvgrid_agent_tier_read_bytes", lambda s: s.read_bytes, "Bytes read from a tier into L1", "By"
        )
        counter("kvgrid_agent_tier_evictions", lambda s: s.evictions, "Chunks evicted from a tier (LRU)")
        counter(
            "kvgrid_agent_tier_checksum_mismatches",
            lambda s: s.checksum_mismatches,
            "Tier records refused: torn, altered or misfiled (never served)",
        )
        counter("kvgrid_agent_tier_errors", lambda s: s.errors, "Tier reads that failed or found no record")
        meter.create_observable_counter(
            "kvgrid_agent_tier_write_failures",
            [lambda _o: [Observation(chain.write_failures)]],
            description="Spills from L1 the tier writer could not write (store failing after retries)",
        )
        meter.create_observable_counter(
            "kvgrid_agent_tier_s3_retries",
            [lambda _o: [Observation(sum(getattr(t.store, "retries", 0) for t in chain.tiers))]],
            description="Object-store requests retried after a transport error, 5xx or throttling",
        )
        meter.create_observable_counter(
            "kvgrid_agent_tier_dropped_spills",
            [lambda _o: [Observation(dropped_spills())]],
            description="Chunks evicted from L1 and never written to a tier (L1 needed their pages first)",
        )
