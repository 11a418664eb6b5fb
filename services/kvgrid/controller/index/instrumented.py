"""Metrics for any :class:`~kvgrid.controller.index.base.ChunkIndex` by wrapping it.

:class:`InstrumentedIndex` forwards every call to the index it wraps and adds the index's
instruments (``kvgrid_controller_entries``, ``kvgrid_controller_chunks`` gauges read at collection
time, and ``kvgrid_controller_index_lookup_duration``, seconds per batch lookup), so no backend and
no caller wires metrics by hand.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import numpy as np
from opentelemetry import metrics

from kvgrid.controller.index.base import BatchView, ChunkIndex, IndexTier, MaskView, PrefixView
from kvgrid.controller.metrics import observe

__all__ = ["InstrumentedIndex"]

_LOOKUP_BUCKETS_S = (0.00002, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.25)


class InstrumentedIndex(ChunkIndex):
    """``inner`` with metrics on ``meter``; behaves exactly like ``inner``."""

    def __init__(self, inner: ChunkIndex, meter: metrics.Meter) -> None:
        self.inner = inner
        self.backend = inner.backend
        for name, unit, desc, read in (
            (
                "kvgrid_controller_entries",
                "{entry}",
                "(chunk, holder, tier) entries in the index",
                inner.num_entries,
            ),
            ("kvgrid_controller_chunks", "{chunk}", "distinct chunk keys in the index", inner.num_chunks),
        ):
            meter.create_observable_gauge(name, [observe(read, name)], unit=unit, description=desc)
        self._lookup = meter.create_histogram(
            "kvgrid_controller_index_lookup_duration",
            unit="s",
            description="Time of one index lookup (a whole batch of queries), by operation",
            explicit_bucket_boundaries_advisory=_LOOKUP_BUCKETS_S,
        )
        self._attrs = {op: {"op": op} for op in ("lookup", "lookup_one", "lookup_batch", "lookup_packed")}

    @property
    def shared(self) -> bool:
        return self.inner.shared

    def add(self, holder: str, tier: IndexTier, keys: Sequence[bytes]) -> None:
        self.inner.add(holder, tier, keys)

    def remove(self, holder: str, tier: IndexTier, keys: Sequence[bytes]) -> None:
        self.inner.remove(holder, tier, keys)

    def replace(self, holder: str, tier: IndexTier, keys: Iterable[bytes]) -> None:
        self.inner.replace(holder, tier, keys)

    def drop_holder(self, holder: str) -> int:
        return self.inner.drop_holder(holder)

    def lookup(self, keys: Sequence[bytes]) -> PrefixView:
        t0 = time.perf_counter()
        try:
            return self.inner.lookup(keys)
        finally:
            self._lookup.record(time.perf_counter() - t0, self._attrs["lookup"])

    def lookup_one(self, keys: Sequence[bytes] | np.ndarray) -> MaskView:
        t0 = time.perf_counter()
        try:
            return self.inner.lookup_one(keys)
        finally:
            self._lookup.record(time.perf_counter() - t0, self._attrs["lookup_one"])

    def lookup_batch(self, queries: Sequence[Sequence[bytes]]) -> BatchView:
        t0 = time.perf_counter()
        try:
            return self.inner.lookup_batch(queries)
        finally:
            self._lookup.record(time.perf_counter() - t0, self._attrs["lookup_batch"])

    def lookup_packed(self, keys: np.ndarray, counts: np.ndarray) -> BatchView:
        t0 = time.perf_counter()
        try:
            return self.inner.lookup_packed(keys, counts)
        finally:
            self._lookup.record(time.perf_counter() - t0, self._attrs["lookup_packed"])

    def add_speculative(self, holder: str, keys: Sequence[bytes], ttl_ms: int) -> None:
        self.inner.add_speculative(holder, keys, ttl_ms)

    def holder_keys(self, holder: str, tier: IndexTier) -> set[bytes]:
        return self.inner.holder_keys(holder, tier)

    def holder_entries(self, holder: str) -> int:
        return self.inner.holder_entries(holder)

    def holder_tier_entries(self, holder: str, tier: IndexTier) -> int:
        return self.inner.holder_tier_entries(holder, tier)

    def data_generation(self) -> str:
        return self.inner.data_generation()

    def holders(self) -> list[str]:
        return self.inner.holders()

    def num_entries(self) -> int:
        return self.inner.num_entries()

    def num_chunks(self) -> int:
        return self.inner.num_chunks()

    def close(self) -> None:
        self.inner.close()
