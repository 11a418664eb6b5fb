"""What the Redis/Valkey back-ends (``index/redis*.py``, ``registry/redis.py``) share: the name
of the records' hash tag, the errors that mean "cannot be reached" and the decorator that turns
them into :class:`~kvgrid.common.errors.Unavailable`.

Invariant: every key whose name starts with :func:`registry_keys` hashes to one cluster slot (the
``{..}`` hash tag), so one Lua script may read or write any of them on a Valkey/Redis Cluster.
The agent registry lives there, and so does the cluster index's holder table: dropping a holder
checks, in the same script, that the registry has not registered that holder again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import redis

from kvgrid.common.errors import Unavailable

__all__ = ["epoch19", "reachable", "registry_keys", "unavailable_errors"]

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

_F = TypeVar("_F", bound=Callable[..., Any])


def reachable(what: str, server: str) -> Callable[[_F], _F]:
    """Decorator of a backend's methods (the backend has ``url``): :data:`unavailable_errors` become
    :class:`Unavailable` naming ``what`` (``"agent registry"``), ``server`` (``"Redis/Valkey"``)
    and the URL."""

    def decorate(fn: _F) -> _F:
        @functools.wraps(fn)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return fn(self, *args, **kwargs)
            except unavailable_errors as e:
                raise Unavailable(
                    f"{what} unavailable: {server} at {self.url} cannot be reached ({e}); retry later"
                ) from None

        return wrapper  # type: ignore[return-value]

    return decorate


def registry_keys(prefix: str) -> str:
    """The start of every registry record's name: ``<prefix>{<prefix>a}:``."""
    return f"{prefix}{{{prefix}a}}:"


def epoch19(epoch: int) -> str:
    """An epoch as the registry stores it: 19 digits, zero-padded (string order = number order)."""
    return f"{epoch:019d}"
