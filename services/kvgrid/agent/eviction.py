"""Eviction policies for the L1 cache: an interface and LRU.

A policy only orders keys; it never decides whether a chunk *may* go. The cache skips candidates
that are in use (refcount > 0), so a policy cannot evict a chunk a transfer or a pin holds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Protocol

__all__ = ["POLICIES", "EvictionPolicy", "FIFOPolicy", "LRUPolicy", "make_policy"]


class EvictionPolicy(Protocol):
    def on_insert(self, key: bytes) -> None: ...
    def on_access(self, key: bytes) -> None: ...
    def on_remove(self, key: bytes) -> None: ...
    def candidates(self) -> Iterator[bytes]:
        """Keys in the order they should be evicted (first = evict first)."""
        ...

    def __len__(self) -> int: ...


class LRUPolicy:
    """Least recently used first; a lookup, a retrieve or a repeated store counts as a use."""

    def __init__(self) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def on_insert(self, key: bytes) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_access(self, key: bytes) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_remove(self, key: bytes) -> None:
        self._order.pop(key, None)

    def candidates(self) -> Iterator[bytes]:
        # A copy: the caller removes keys while iterating.
        return iter(list(self._order))

    def __len__(self) -> int:
        return len(self._order)


class FIFOPolicy(LRUPolicy):
    """Oldest insert first; accesses do not reorder (cheaper, worse for hot prefixes)."""

    def on_access(self, key: bytes) -> None:
        return None


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"lru": LRUPolicy, "fifo": FIFOPolicy}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name.lower()]()
    except KeyError:
        raise ValueError(f"eviction policy {name!r}: expected one of {sorted(POLICIES)}") from None
