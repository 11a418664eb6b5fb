"""What the Redis/Valkey back-ends (``index/redis*.py``, ``registry/redis.py``) share: the name
of the records' hash tag and the errors that mean "cannot be reached".

Invariant: every key whose name starts with :func:`registry_keys` hashes to one cluster slot (the
``{..}`` hash tag), so one Lua script may read or write any of them on a Valkey/Redis Cluster.
The agent registry lives there, and so does the cluster index's holder table: dropping a holder
checks, in the same script, that the registry has not registered that holder again.
"""

from __future__ import annotations

import redis

__all__ = ["epoch19", "registry_keys", "unavailable_errors"]

unavailable_errors: tuple[type[Exception], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.exceptions.BusyLoadingError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.ClusterError,
    redis.exceptions.SlotNotCoveredError,
    redis.exceptions.TryAgainError,
    redis.exceptions.MasterDownError,
)
"""What redis-py raises while the server or (part of) a cluster cannot serve: callers get
UNAVAILABLE, never INTERNAL."""


def registry_keys(prefix: str) -> str:
    """The start of every registry record's name: ``<prefix>{<prefix>a}:``."""
    return f"{prefix}{{{prefix}a}}:"


def epoch19(epoch: int) -> str:
    """An epoch as the registry stores it: 19 digits, zero-padded (string order = number order)."""
    return f"{epoch:019d}"
