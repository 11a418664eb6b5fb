"""Request holds: what an engine request keeps out of eviction in L1, for how long, and how it ends.

One table, by owner = (instance_id, request_id), of two kinds of hold, each a list of referenced
chunks (a reference each, so eviction skips them and their pages are never rewritten):

- the **pin** (hold id 0, at most one per owner): a Lookup's leading hits, with a TTL deadline on
  the cache's clock. It ends when the same owner pins again (:meth:`RequestHolds.pin` replaces it:
  the one re-pin path), at the request's Retrieve (:meth:`unpin`), when it becomes a lease
  (:meth:`lease_pin`), at the deadline (:meth:`expire`), at Release, or when its registration goes.
- **leases** (hold ids > 0): chunks an engine copies itself from the shared L1 file (engine
  copies): a ready pin turned into a lease at Lookup, or a Retrieve's hits. No TTL: a lease ends
  with Release naming it or the whole request (:meth:`release`), or when its registration goes
  (:meth:`end_instance`).

Every change happens under the cache's lock, so expiring pins, walking the index and taking
references are one step for an allocation that needs the pages (the cache expires due pins before
each walk and reservation).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvgrid.agent.l1 import Chunk
from kvgrid.common.agent_results import MissCause

if TYPE_CHECKING:
    from kvgrid.agent.cache import ChunkCache

__all__ = ["PIN", "Hold", "Owner", "RequestHolds"]

Owner = tuple[str, str]
"""(instance_id, request_id)."""

PIN = 0
"""Hold id of an owner's lookup pin; leases have ids from 1 up."""


@dataclass
class Hold:
    chunks: list[Chunk]
    deadline: float = math.inf
    """A pin's TTL deadline on the cache's clock; a lease has none (inf)."""


class RequestHolds:
    """The table of pins and leases over one :class:`~kvgrid.agent.cache.ChunkCache`. Thread-safe
    (the cache's lock)."""

    def __init__(self, cache: ChunkCache, clock: Callable[[], float]) -> None:
        self._cache = cache
        self._lock = cache._lock
        self._clock = clock
        self._holds: dict[Owner, dict[int, Hold]] = {}
        self._next_deadline = math.inf
        self._lease_ids = itertools.count(1)

    # ---- taking holds --------------------------------------------------------------------------

    def pin(
        self, owner: Owner, keys: Sequence[bytes], layout_id: str, ttl_s: float, *, namespace_id: str
    ) -> tuple[int, MissCause]:
        """Pin ``namespace_id``'s leading hits for ``owner`` until unpinned or ``ttl_s`` passes; a
        pin the owner held before is replaced (its references go after the new ones are taken, so
        chunks both cover stay held throughout). Returns (hits pinned, where the walk stopped)."""
        with self._lock:
            hits, cause = self._cache.acquire_prefix(keys, layout_id, namespace_id=namespace_id)
            self._drop_locked(owner, PIN)
            if hits:
                deadline = self._clock() + ttl_s
                self._holds.setdefault(owner, {})[PIN] = Hold(hits, deadline)
                self._next_deadline = min(self._next_deadline, deadline)
            return len(hits), cause

    def lease(self, owner: Owner, chunks: list[Chunk]) -> int:
        """A new lease of ``owner`` on ``chunks`` (each referenced by the caller, a reference the
        lease now owns); returns its id (a Retrieve that hit nothing gets one too)."""
        lease_id = next(self._lease_ids)
        with self._lock:
            self._holds.setdefault(owner, {})[lease_id] = Hold(chunks)
        return lease_id

    def lease_pin(self, owner: Owner) -> tuple[int, list[Chunk]] | None:
        """Turn ``owner``'s pin into a lease (no TTL, same references), in one step: (lease id,
        its chunks). None, and the pin stays, when there is no pin or one of its chunks has bytes
        still being read from a lower tier (or whose read failed)."""
        with self._lock:
            pin = self._holds.get(owner, {}).get(PIN)
            if pin is None or any(
                c.failed or (c.ready is not None and not c.ready.is_set()) for c in pin.chunks
            ):
                return None
            lease_id = next(self._lease_ids)
            holds = self._holds[owner]
            del holds[PIN]
            holds[lease_id] = Hold(pin.chunks)
            return lease_id, pin.chunks

    # ---- ending holds --------------------------------------------------------------------------

    def _drop_locked(self, owner: Owner, hold_id: int) -> int:
        holds = self._holds.get(owner)
        hold = None if holds is None else holds.pop(hold_id, None)
        if hold is None:
            return 0
        if not holds:
            del self._holds[owner]
        for c in hold.chunks:
            self._cache._deref_locked(c)
        return len(hold.chunks)

    def _drop_owner_locked(self, owner: Owner) -> tuple[int, int]:
        """Every hold of ``owner``: (pinned chunks dropped, leased chunks dropped)."""
        pins = self._drop_locked(owner, PIN)
        leased = sum(self._drop_locked(owner, i) for i in list(self._holds.get(owner, ())))
        return pins, leased

    def unpin(self, owner: Owner) -> int:
        """Drop ``owner``'s pin (its leases stay); returns how many chunks it held."""
        with self._lock:
            return self._drop_locked(owner, PIN)

    def release(self, owner: Owner, lease_id: int = 0) -> tuple[int, int]:
        """Release: with ``lease_id`` end only that lease of ``owner`` (an unknown id ends
        nothing; the pin stays), else every hold of ``owner``. Returns (pinned chunks released,
        leased chunks released)."""
        with self._lock:
            if lease_id:
                return 0, self._drop_locked(owner, lease_id)
            return self._drop_owner_locked(owner)

    def end_instance(self, instance_id: str) -> int:
        """The registration went (unregistered, replaced, its engine exited): every pin and lease of
        its requests ends. Returns the pinned chunks released."""
        with self._lock:
            owners = [o for o in self._holds if o[0] == instance_id]
            return sum(self._drop_owner_locked(o)[0] for o in owners)

    def expire_locked(self) -> int:
        """Drop pins at or past their deadline (the cache's lock held); returns the chunks they
        held."""
        now = self._clock()
        if now < self._next_deadline:
            return 0
        due = [o for o, holds in self._holds.items() if PIN in holds and holds[PIN].deadline <= now]
        n = sum(self._drop_locked(o, PIN) for o in due)
        self._next_deadline = min(
            (h.deadline for holds in self._holds.values() for h in holds.values()), default=math.inf
        )
        return n

    def expire(self) -> int:
        with self._lock:
            return self.expire_locked()

    # ---- counts --------------------------------------------------------------------------------

    def pinned_chunks(self, instance_id: str | None = None) -> int:
        """Chunks pinned (by ``instance_id``'s requests, or by anyone)."""
        with self._lock:
            return sum(
                len(holds[PIN].chunks)
                for o, holds in self._holds.items()
                if PIN in holds and (instance_id is None or o[0] == instance_id)
            )

    def leased_chunks(self) -> int:
        """Chunks leased to engines that copy themselves."""
        with self._lock:
            return sum(len(h.chunks) for holds in self._holds.values() for i, h in holds.items() if i != PIN)
