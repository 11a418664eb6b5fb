"""The controller's chunk index: one interface, one backend per module, metrics by wrapping.

- ``base.py``: :class:`ChunkIndex` (the interface), :class:`IndexTier`, the lookup views.
- ``memory.py``: :class:`MemoryIndex` (embedded, default). ``redis.py``: ``RedisIndex``
  (one Valkey/Redis shared by controller replicas); ``redis_cluster.py``: ``RedisClusterIndex``
  (the same on a Valkey/Redis Cluster, ``redis_cluster: true``); both imported only when configured.
- ``instrumented.py``: :class:`InstrumentedIndex` adds the index metrics to any backend.

:func:`make_index` builds the configured backend from :data:`BACKENDS` (``index_backend`` name ->
factory); code that needs to know what kind of index it has asks the index (``shared``), never
compares backend names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvgrid.controller.index.base import (
    NUM_TIERS,
    BatchView,
    ChunkIndex,
    IndexTier,
    MaskView,
    PrefixView,
    batch_view_from_prefix_views,
    check_keys,
)
from kvgrid.controller.index.memory import MemoryIndex

if TYPE_CHECKING:
    from kvgrid.controller.config import ControllerConfig

__all__ = [
    "BACKENDS",
    "NUM_TIERS",
    "BatchView",
    "ChunkIndex",
    "IndexTier",
    "MaskView",
    "MemoryIndex",
    "PrefixView",
    "batch_view_from_prefix_views",
    "check_keys",
    "make_index",
]


def _memory(cfg: ControllerConfig) -> ChunkIndex:
    return MemoryIndex()


def _redis(cfg: ControllerConfig) -> ChunkIndex:
    if cfg.redis_cluster:
        from kvgrid.controller.index.redis_cluster import RedisClusterIndex

        return RedisClusterIndex(cfg.redis_url, prefix=cfg.redis_prefix)
    from kvgrid.controller.index.redis import RedisIndex  # the redis client only when configured

    return RedisIndex(cfg.redis_url, prefix=cfg.redis_prefix)


BACKENDS: dict[str, Callable[[ControllerConfig], ChunkIndex]] = {"memory": _memory, "redis": _redis}
"""``index_backend`` -> factory of that backend from the controller config."""


def make_index(cfg: ControllerConfig) -> ChunkIndex:
    """The index ``cfg.index_backend`` names (ValueError for a name not in :data:`BACKENDS`)."""
    factory = BACKENDS.get(cfg.index_backend)
    if factory is None:
        raise ValueError(f"index_backend={cfg.index_backend!r}: expected one of {sorted(BACKENDS)}")
    return factory(cfg)
