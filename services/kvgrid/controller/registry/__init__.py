"""The controller's agent registry: one interface, one backend per module.

- ``base.py``: :class:`AgentRegistry` (the interface and its rules), the record types, the errors.
- ``memory.py``: :class:`MemoryRegistry` (in-process, default; each replica its own agents).
- ``redis.py``: ``RedisRegistry`` (Valkey/Redis: one registry for every controller replica;
  imported only when configured).

:func:`make_registry` builds the backend that goes with ``index_backend``: a shared index gets a
shared registry, so every replica answers with the same agents.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvgrid.controller.registry.base import (
    AgentLoad,
    AgentRecord,
    AgentRegistry,
    RegisterOutcome,
    StaleEpochError,
    SyncResult,
    UnknownPodError,
)
from kvgrid.controller.registry.memory import MemoryRegistry, Registry

if TYPE_CHECKING:
    from kvgrid.controller.config import ControllerConfig

__all__ = [
    "BACKENDS",
    "AgentLoad",
    "AgentRecord",
    "AgentRegistry",
    "MemoryRegistry",
    "RegisterOutcome",
    "Registry",
    "StaleEpochError",
    "SyncResult",
    "UnknownPodError",
    "make_registry",
]


def _memory(cfg: ControllerConfig) -> AgentRegistry:
    return MemoryRegistry(cfg.lease_ttl_ms)


def _redis(cfg: ControllerConfig) -> AgentRegistry:
    from kvgrid.controller.registry.redis import RedisRegistry  # the redis client only when configured

    return RedisRegistry(cfg.redis_url, cfg.lease_ttl_ms, prefix=cfg.redis_prefix, cluster=cfg.redis_cluster)


BACKENDS: dict[str, Callable[[ControllerConfig], AgentRegistry]] = {"memory": _memory, "redis": _redis}
"""``index_backend`` -> factory of the registry backend that goes with it."""


def make_registry(cfg: ControllerConfig) -> AgentRegistry:
    """The registry for ``cfg.index_backend`` (ValueError for a name not in :data:`BACKENDS`)."""
    factory = BACKENDS.get(cfg.index_backend)
    if factory is None:
        raise ValueError(f"index_backend={cfg.index_backend!r}: expected one of {sorted(BACKENDS)}")
    return factory(cfg)
