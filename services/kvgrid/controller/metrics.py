"""OpenTelemetry metrics of the controller (``kvgrid_controller_*``): a thin wrapper over its stats.

Counters that already exist as plain numbers (events ingested, resyncs, agents...) are exported
through observable instruments read at collection time, so ingest pays nothing. The match RPCs add
their number of queries once per *call*. Per-call counts and latency of every RPC are the server
toolkit's (``kvgrid_rpc_server_*``, :mod:`kvgrid.common.rpc`); the index's gauges come from
wrapping it (:class:`kvgrid.controller.index.instrumented.InstrumentedIndex`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation

__all__ = ["ControllerMetrics", "MatchRpc", "StatsSource", "observe"]

log = logging.getLogger(__name__)

MatchRpc = str  # "MatchPrefix", "BatchMatchPrefix", "Score", "BatchScore"


class StatsSource:
    """What the observable instruments read (functions so they are evaluated at collection time)."""

    def __init__(
        self,
        *,
        agents: Callable[[], int],
        events_ingested: Callable[[], int],
        resyncs: Callable[[], int],
        rejected: Callable[[], int],
        vllm_events: Callable[[], int],
        expired_leases: Callable[[], int],
        rejected_entries: Callable[[], int] = lambda: 0,
        over_quota_pods: Callable[[], int] = lambda: 0,
        backend_losses: Callable[[], int] = lambda: 0,
        over_quota_identities: Callable[[], int] = lambda: 0,
        refused_by_cap: Callable[[], dict[str, int]] = dict,
    ) -> None:
        self.agents = agents
        self.events_ingested = events_ingested
        self.resyncs = resyncs
        self.rejected = rejected
        self.vllm_events = vllm_events
        self.expired_leases = expired_leases
        self.rejected_entries = rejected_entries
        self.over_quota_pods = over_quota_pods
        self.backend_losses = backend_losses
        self.over_quota_identities = over_quota_identities
        self.refused_by_cap = refused_by_cap


def observe(read: Callable[[], int], what: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
    """An observable-instrument callback reading ``read()``; a failed read skips the point."""

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
        for name, unit, desc, read in (
            ("kvgrid_controller_agents", "{agent}", "registered agents with a live lease", stats.agents),
            (
                "kvgrid_controller_over_quota_pods",
                "{pod}",
                "pods with index entries refused by max_entries_per_pod / max_index_entries",
                stats.over_quota_pods,
            ),
            (
                "kvgrid_controller_over_quota_identities",
                "{identity}",
                "mTLS identities with index entries refused by max_entries_per_identity",
                stats.over_quota_identities,
            ),
        ):
            meter.create_observable_gauge(name, [observe(read, name)], unit=unit, description=desc)
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
            (
                "kvgrid_controller_rejected_entries",
                "{entry}",
                "agent chunk keys not indexed because of an index-entry cap (by cap: "
                "kvgrid_controller_refused_entries)",
                stats.rejected_entries,
            ),
            (
                "kvgrid_controller_backend_losses",
                "{loss}",
                "times the index backend lost its data (every agent was resynced)",
                stats.backend_losses,
            ),
        )
        for name, unit, desc, read in counters:
            meter.create_observable_counter(name, [observe(read, name)], unit=unit, description=desc)

        def by_cap(_options: CallbackOptions) -> Iterable[Observation]:
            return [Observation(n, {"cap": cap}) for cap, n in stats.refused_by_cap().items()]

        meter.create_observable_counter(
            "kvgrid_controller_refused_entries",
            [by_cap],
            unit="{entry}",
            description="agent chunk keys not indexed, by the cap that refused them (cap: pod = "
            "max_entries_per_pod, identity = max_entries_per_identity, total = max_index_entries)",
        )
        self._attrs: dict[MatchRpc, dict[str, str]] = {}

    def answered(self, rpc: MatchRpc, queries: int) -> None:
        """One successful match RPC call answered ``queries`` queries."""
        attrs = self._attrs.get(rpc)
        if attrs is None:
            attrs = self._attrs.setdefault(rpc, {"rpc": rpc})
        self.queries.add(queries, attrs)
