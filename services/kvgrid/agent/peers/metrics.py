"""The ``kvgrid_agent_peer_*`` instruments of both sides of a peer fetch, and the counters Health
reports (:class:`PeerStats`, the same numbers).
"""

from __future__ import annotations

import threading

from opentelemetry import metrics

__all__ = ["PeerMetrics", "PeerStats"]


class PeerStats:
    """Counters for Health (the OpenTelemetry instruments carry the same numbers)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.fetched_chunks = 0
        self.fetch_failures = 0
        self.served_chunks = 0

    def add(self, *, fetched: int = 0, failures: int = 0, served: int = 0) -> None:
        with self._lock:
            self.fetched_chunks += fetched
            self.fetch_failures += failures
            self.served_chunks += served


_DURATION_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class PeerMetrics:
    """``kvgrid_agent_peer_*`` instruments."""

    def __init__(self, meter: metrics.Meter) -> None:
        self.stats = PeerStats()
        self.fetch_bytes = meter.create_counter(
            "kvgrid_agent_peer_fetch", unit="By", description="Bytes fetched from peer agents into L1"
        )
        self.fetch_chunks = meter.create_counter(
            "kvgrid_agent_peer_fetch_chunks",
            unit="{chunk}",
            description="Chunks fetched from peer agents into L1",
        )
        self.fetch_duration = meter.create_histogram(
            "kvgrid_agent_peer_fetch_duration",
            unit="s",
            description="Wall time of one Lookup's peer fetch (controller query, stream, commit), by outcome",
            explicit_bucket_boundaries_advisory=_DURATION_BUCKETS_S,
        )
        self.fetch_throughput = meter.create_histogram(
            "kvgrid_agent_peer_fetch_throughput",
            unit="GBy/s",
            description="GB/s of each peer fetch stream that moved bytes",
            explicit_bucket_boundaries_advisory=(0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 50),
        )
        self.fetch_failures = meter.create_counter(
            "kvgrid_agent_peer_fetch_failures",
            unit="{fetch}",
            description="Peer fetches that failed, by reason (controller, unavailable, deadline, "
            "layout_mismatch, protocol, checksum, error; data_plane_unreachable: a data port could not be "
            "reached and the fetch was retried over gRPC)",
        )
        self.served_bytes = meter.create_counter(
            "kvgrid_agent_peer_served", unit="By", description="Bytes streamed to peer agents"
        )
        self.served_chunks = meter.create_counter(
            "kvgrid_agent_peer_served_chunks", unit="{chunk}", description="Chunks streamed to peer agents"
        )
