"""The agent's OpenTelemetry instruments (names ``kvgrid_agent_*``).

Gauges are observed from the cache when a reader collects, so they cost nothing per request.
Naming follows the OpenTelemetry conventions: no unit in an instrument's name, the unit in ``unit``
(``By``, ``s``, ``{chunk}``...); the Prometheus exporter appends it (``kvgrid_agent_l1_used`` in
``By`` is scraped as ``kvgrid_agent_l1_used_bytes``, counters get ``_total``). docs/telemetry.md
lists every metric.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation

from kvgrid.agent.cache import CacheStats

__all__ = ["AgentMetrics"]

# Transfers take from ~10 µs (one small chunk, CPU) to seconds (hundreds of chunks over PCIe).
_LATENCY_BUCKETS_S = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class AgentMetrics:
    def __init__(
        self, meter: metrics.Meter, stats: Callable[[], CacheStats], instances: Callable[[], int]
    ) -> None:
        self._stats = stats

        def gauge(fn: Callable[[CacheStats], float]) -> Callable[[CallbackOptions], Iterable[Observation]]:
            return lambda _opts: [Observation(fn(self._stats()))]

        meter.create_observable_gauge(
            "kvgrid_agent_l1_used",
            [gauge(lambda s: s.used_bytes)],
            unit="By",
            description="L1 bytes in use",
        )
        meter.create_observable_gauge(
            "kvgrid_agent_l1_capacity",
            [gauge(lambda s: s.capacity_bytes)],
            unit="By",
            description="L1 pool size",
        )
        meter.create_observable_gauge(
            "kvgrid_agent_l1_chunks",
            [gauge(lambda s: s.num_chunks)],
            unit="{chunk}",
            description="Chunks held in L1",
        )
        meter.create_observable_gauge(
            "kvgrid_agent_l1_pinned_chunks",
            [gauge(lambda s: s.num_pins)],
            unit="{pin}",
            description="Chunk pins held by lookups",
        )
        meter.create_observable_counter(
            "kvgrid_agent_evictions",
            [gauge(lambda s: s.evictions)],
            unit="{chunk}",
            description="Chunks evicted from L1",
        )
        meter.create_observable_counter(
            "kvgrid_agent_evicted",
            [gauge(lambda s: s.evicted_bytes)],
            unit="By",
            description="Bytes evicted",
        )
        meter.create_observable_gauge(
            "kvgrid_agent_instances",
            [lambda _opts: [Observation(instances())]],
            unit="{instance}",
            description="Registered engine instances",
        )
        self.lookup_chunks = meter.create_counter(
            "kvgrid_agent_lookup_chunks",
            unit="{chunk}",
            description="Chunks asked for by lookups, by result (hit, or miss with its cause)",
        )
        self.retrieve_chunks = meter.create_counter(
            "kvgrid_agent_retrieve_chunks",
            unit="{chunk}",
            description="Chunks asked for by retrieves, by result (hit, or miss with its cause)",
        )
        self.stored_chunks = meter.create_counter(
            "kvgrid_agent_store_chunks",
            unit="{chunk}",
            description="Chunks in store requests, by result (stored, present, skipped, dropped)",
        )
        self.bytes_moved = meter.create_counter(
            "kvgrid_agent_transfer",
            unit="By",
            description="Bytes copied, by direction (store, retrieve)",
        )
        self.latency = meter.create_histogram(
            "kvgrid_agent_transfer_duration",
            unit="s",
            description="Wall time of the copy part of a store or retrieve, by direction",
            explicit_bucket_boundaries_advisory=_LATENCY_BUCKETS_S,
        )
        self.throughput = meter.create_histogram(
            "kvgrid_agent_transfer_throughput",
            unit="GBy/s",
            description="GB/s of each store or retrieve copy, by direction",
            explicit_bucket_boundaries_advisory=(0.5, 1, 2, 5, 10, 20, 30, 40, 50, 60, 80, 100),
        )
