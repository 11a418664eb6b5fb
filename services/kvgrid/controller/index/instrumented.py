"""Metrics for any :class:`~kvgrid.controller.index.base.ChunkIndex` by wrapping it.

:class:`InstrumentedIndex` forwards every call to the index it wraps and adds the index's
instruments, so no backend and no caller wires metrics by hand:

- ``kvgrid_controller_entries``, ``kvgrid_controller_chunks``: gauges read at collection time;
- ``kvgrid_controller_index_lookup_duration{op,backend}``: seconds per lookup (a whole batch);
- ``kvgrid_controller_index_update_duration{op,backend}``: seconds per write or maintenance call
  (add, remove, replace, drop_holder, add_speculative, data_generation), the Redis/Valkey round
  trips of the data path;
- ``kvgrid_controller_index_errors{op,backend,error}``: calls of any operation that raised, by
  exception type (``Unavailable`` when Redis/Valkey cannot be reached). The exception still
  propagates unchanged: the wrapper only observes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import numpy as np
from opentelemetry import metrics

from kvgrid.controller.index.base import BatchView, ChunkIndex, IndexTier, MaskView, PrefixView, WordsView
from kvgrid.controller.metrics import observe

__all__ = ["InstrumentedIndex"]

_LOOKUP_BUCKETS_S = (0.00002, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.25)
# A Redis round trip is ~100 µs on a LAN; a snapshot replace of a large pod takes seconds.
_UPDATE_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 0.5, 2.5, 10.0)
_OPS = (
    "lookup", "lookup_one", "lookup_batch", "lookup_packed", "add", "remove", "replace", "drop_holder",
    "add_speculative", "data_generation", "holder_keys", "holder_entries", "holder_tier_entries",
    "holders", "num_entries", "num_chunks",
)  # fmt: skip
_T = TypeVar("_T")


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
            description="Time of one index lookup (a whole batch of queries), by operation and backend",
            explicit_bucket_boundaries_advisory=_LOOKUP_BUCKETS_S,
        )
        self._update = meter.create_histogram(
            "kvgrid_controller_index_update_duration",
            unit="s",
            description="Time of one index write or maintenance call, by operation and backend",
            explicit_bucket_boundaries_advisory=_UPDATE_BUCKETS_S,
        )
        self._errors = meter.create_counter(
            "kvgrid_controller_index_errors",
            unit="{call}",
            description="Index calls that raised, by operation, backend and exception type",
        )
        self._attrs = {op: {"op": op, "backend": self.backend} for op in _OPS}

    def _failed(self, op: str, e: BaseException) -> None:
        self._errors.add(1, {"op": op, "backend": self.backend, "error": type(e).__name__})

    def _timed(self, op: str, fn: Callable[..., _T], *args: Any) -> _T:
        t0 = time.perf_counter()
        try:
            return fn(*args)
        except Exception as e:
            self._failed(op, e)
            raise
        finally:
            self._update.record(time.perf_counter() - t0, self._attrs[op])

    def _counted(self, op: str, fn: Callable[..., _T], *args: Any) -> _T:
        try:
            return fn(*args)
        except Exception as e:
            self._failed(op, e)
            raise

    @property
    def shared(self) -> bool:
        return self.inner.shared

    def add(self, holder: str, tier: IndexTier, keys: Sequence[bytes]) -> None:
        self._timed("add", self.inner.add, holder, tier, keys)

    def remove(self, holder: str, tier: IndexTier, keys: Sequence[bytes]) -> None:
        self._timed("remove", self.inner.remove, holder, tier, keys)

    def replace(self, holder: str, tier: IndexTier, keys: Iterable[bytes]) -> None:
        self._timed("replace", self.inner.replace, holder, tier, keys)

    def drop_holder(self, holder: str) -> int:
        return self._timed("drop_holder", self.inner.drop_holder, holder)

    def lookup(self, keys: Sequence[bytes]) -> PrefixView:
        t0 = time.perf_counter()
        try:
            return self.inner.lookup(keys)
        except Exception as e:
            self._failed("lookup", e)
            raise
        finally:
            self._lookup.record(time.perf_counter() - t0, self._attrs["lookup"])

    def lookup_one(self, keys: Sequence[bytes] | np.ndarray) -> MaskView:
        t0 = time.perf_counter()
        try:
            return self.inner.lookup_one(keys)
        except Exception as e:
            self._failed("lookup_one", e)
            raise
        finally:
            self._lookup.record(time.perf_counter() - t0, self._attrs["lookup_one"])

    def lookup_words(self, keys: Sequence[bytes] | np.ndarray) -> WordsView:
        t0 = time.perf_counter()  # recorded as op "lookup_one": the same single-query lookup
        try:
            return self.inner.lookup_words(keys)
        except Exception as e:
            self._failed("lookup_one", e)
            raise
        finally:
            self._lookup.record(time.perf_counter() - t0, self._attrs["lookup_one"])

    def lookup_batch(self, queries: Sequence[Sequence[bytes]]) -> BatchView:
        t0 = time.perf_counter()
        try:
            return self.inner.lookup_batch(queries)
        except Exception as e:
            self._failed("lookup_batch", e)
            raise
        finally:
            self._lookup.record(time.perf_counter() - t0, self._attrs["lookup_batch"])

    def lookup_packed(self, keys: np.ndarray, counts: np.ndarray) -> BatchView:
        t0 = time.perf_counter()
        try:
            return self.inner.lookup_packed(keys, counts)
        except Exception as e:
            self._failed("lookup_packed", e)
            raise
        finally:
            self._lookup.record(time.perf_counter() - t0, self._attrs["lookup_packed"])

    def add_speculative(self, holder: str, keys: Sequence[bytes], ttl_ms: int) -> None:
        self._timed("add_speculative", self.inner.add_speculative, holder, keys, ttl_ms)

    def holder_keys(self, holder: str, tier: IndexTier) -> set[bytes]:
        return self._counted("holder_keys", self.inner.holder_keys, holder, tier)

    def holder_entries(self, holder: str) -> int:
        return self._counted("holder_entries", self.inner.holder_entries, holder)

    def holder_tier_entries(self, holder: str, tier: IndexTier) -> int:
        return self._counted("holder_tier_entries", self.inner.holder_tier_entries, holder, tier)

    def data_generation(self) -> str:
        return self._timed("data_generation", self.inner.data_generation)

    def holders(self) -> list[str]:
        return self._counted("holders", self.inner.holders)

    def num_entries(self) -> int:
        return self._counted("num_entries", self.inner.num_entries)

    def num_chunks(self) -> int:
        return self._counted("num_chunks", self.inner.num_chunks)

    def close(self) -> None:
        self.inner.close()
