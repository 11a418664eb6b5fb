"""OpenTelemetry metrics of the controller (``kvgrid_controller_*``): a thin wrapper over its stats.

Counters that already exist as plain numbers (events ingested, resyncs, entries, agents...) are
exported through observable instruments read at collection time, so ingest pays nothing. The match
RPCs record one counter add and one histogram point per *call* (not per query), so a batch of 32
queries costs the same few microseconds as one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation

__all__ = ["ControllerMetrics", "MatchRpc", "StatsSource"]

log = logging.getLogger(__name__)

MatchRpc = str  # "MatchPrefix", "BatchMatchPrefix", "Score", "BatchScore"

# Match latency buckets (ms): the goal is p99 <= 3 ms per call.
LATENCY_BUCKETS_MS = (0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 1000.0)


class StatsSource:
    """What the observable instruments read (functions so they are evaluated at collection time)."""

    def __init__(
        self,
        *,
        entries: Callable[[], int],
        chunks: Callable[[], int],
        agents: Callable[[], int],
        events_ingested: Callable[[], int],
        resyncs: Callable[[], int],
        rejected: Callable[[], int],
        vllm_events: Callable[[], int],
        expired_leases: Callable[[], int],
    ) -> None:
        self.entries = entries
        self.chunks = chunks
        self.agents = agents
        self.events_ingested = events_ingested
        self.resyncs = resyncs
        self.rejected = rejected
        self.vllm_events = vllm_events
        self.expired_leases = expired_leases


def _observe(read: Callable[[], int], what: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
    def callback(_options: CallbackOptions) -> Iterable[Observation]:
        try:
            return [Observation(read())]
        except Exception as e:  # e.g. Redis briefly unreachable: skip this point, keep exporting
            log.warning("metric %s unavailable: %s", what, e)
            return []

    return callback


class ControllerMetrics:
    """The controller's instruments on ``meter`` (from :func:`kvgrid.common.telemetry.setup_telemetry`)."""

    def __init__(self, meter: metrics.Meter, stats: StatsSource) -> None:
        self.queries = meter.create_counter(
            "kvgrid_controller_match_requests",
            unit="{query}",
            description="Queries answered by MatchPrefix/Score (a batch counts each of its queries)",
        )
        self.latency = meter.create_histogram(
            "kvgrid_controller_match_latency",
            unit="ms",
            description="Server time of one match RPC call (a whole batch), milliseconds",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_MS,
        )
        gauges = (
            (
                "kvgrid_controller_entries",
                "{entry}",
                "(chunk, holder, tier) entries in the index",
                stats.entries,
            ),
            ("kvgrid_controller_chunks", "{chunk}", "distinct chunk keys in the index", stats.chunks),
            ("kvgrid_controller_agents", "{agent}", "registered agents with a live lease", stats.agents),
        )
        for name, unit, desc, read in gauges:
            meter.create_observable_gauge(name, [_observe(read, name)], unit=unit, description=desc)
        counters = (
            (
                "kvgrid_controller_events_ingested",
                "{event}",
                "agent chunk events applied to the index",
                stats.events_ingested,
            ),
            ("kvgrid_controller_resyncs", "{resync}", "snapshot pulls from agents", stats.resyncs),
            (
                "kvgrid_controller_rejected_requests",
                "{request}",
                "requests rejected as invalid or stale",
                stats.rejected,
            ),
            (
                "kvgrid_controller_vllm_events_ingested",
                "{event}",
                "vLLM KV events applied (blocks stored or removed)",
                stats.vllm_events,
            ),
            (
                "kvgrid_controller_expired_leases",
                "{lease}",
                "agent leases that lapsed (entries dropped)",
                stats.expired_leases,
            ),
        )
        for name, unit, desc, read in counters:
            meter.create_observable_counter(name, [_observe(read, name)], unit=unit, description=desc)
        self._attrs: dict[MatchRpc, dict[str, str]] = {}

    def match_call(self, rpc: MatchRpc, queries: int, seconds: float) -> None:
        """One match RPC call answered ``queries`` queries in ``seconds`` (server time)."""
        attrs = self._attrs.get(rpc)
        if attrs is None:
            attrs = self._attrs.setdefault(rpc, {"rpc": rpc})
        self.queries.add(queries, attrs)
        self.latency.record(seconds * 1000.0, attrs)
