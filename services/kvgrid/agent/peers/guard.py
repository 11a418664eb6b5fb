"""What the agent's TCP port lets one caller have: which tenants' chunks, how many streams, how long.

The TCP port (peers' FetchChunks, the controller's Snapshot) shares one pool of
``tcp_grpc_workers`` threads among every caller, and a server-streaming call holds its thread
while its reader does not read. :class:`TcpGuard` is consulted by the TCP servicer before a call
touches a chunk.

Invariants:

- **Tenants** (mTLS only; :class:`kvgrid.common.authz.ChunkReaders`): a FetchChunks for a
  namespace id the caller is not entitled to is PERMISSION_DENIED before any chunk is referenced
  or any data-plane ticket issued; a Snapshot lists only the namespace ids the caller may read, and
  is PERMISSION_DENIED when that is none. Nothing cached changes either way.
- **Streams per caller** (:class:`StreamSlots`): a caller -- its certificate identity at its IP
  address, or without TLS its IP address -- has at most ``peer_streams_per_identity`` FetchChunks
  streams open; one more is RESOURCE_EXHAUSTED naming the caller, the limit and the setting. The
  limit is below ``tcp_grpc_workers`` (checked at start), so one caller never holds every TCP
  thread. A stream's slot is given back exactly once, when the call ends (however it ends).
- **Serving deadline** (:class:`Deadlines`): every FetchChunks stream ends at most
  ``peer_stream_timeout_ms`` after it started, whatever deadline its caller set. A stream that is
  still sending then fails with DEADLINE_EXCEEDED; one whose thread is blocked because its reader
  stopped reading is cancelled by a watchdog thread a moment later, which frees the thread, the
  slot and the chunk references.

The slots, the caller key and the watchdog are the shared ones of :mod:`kvgrid.common.streams` (the
controller bounds its PublishEvents streams with them too); their names stay importable from here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import grpc

from kvgrid.common.authz import ChunkReaders, Identity
from kvgrid.common.streams import (
    CANCEL_GRACE_S,
    Deadlines,
    ServingDeadlineExceeded,
    StreamSlots,
    caller_key,
)
from kvgrid.common.streams import nothing as _nothing

__all__ = ["CANCEL_GRACE_S", "Deadlines", "ServingDeadlineExceeded", "StreamSlots", "TcpGuard", "caller_key"]

log = logging.getLogger(__name__)


class TcpGuard:
    """The TCP servicer's checks: tenant (``readers``; None without TLS), streams per caller,
    serving deadline."""

    def __init__(
        self, readers: ChunkReaders | None, *, streams_per_caller: int, stream_timeout_s: float
    ) -> None:
        self.readers = readers
        self.slots = StreamSlots(streams_per_caller, "peer_streams_per_identity", where="this agent")
        self.deadlines = Deadlines(name="kvgrid-agent-deadlines")
        self.stream_timeout_s = stream_timeout_s

    def check_read(self, method: str, ident: Identity | None, namespace_id: str) -> None:
        """PERMISSION_DENIED unless ``ident`` may read ``namespace_id`` (no check without TLS)."""
        if self.readers is not None and ident is not None:
            self.readers.check(method, ident, namespace_id)

    def readable(self, method: str, ident: Identity | None) -> frozenset[str] | None:
        """The namespace ids ``ident`` may list (None: all); PERMISSION_DENIED when none."""
        if self.readers is None or ident is None:
            return None
        ids = self.readers.readable(ident)
        if ids is not None and not ids:
            raise self.readers.refusal(method, ident, "any of this agent's chunks")
        return ids

    def open_stream(
        self, method: str, ident: Identity | None, context: grpc.ServicerContext | None
    ) -> tuple[float, Callable[[], None]]:
        """Admit one stream: (its serving deadline, the function that ends its bookkeeping, to call
        once when the call ends). RESOURCE_EXHAUSTED when its caller has too many open."""
        deadline = time.monotonic() + self.stream_timeout_s
        key = caller_key(ident, context)
        give_back = self.slots.take(key, method) if key else _nothing
        unwatch = (
            self.deadlines.watch(context, deadline, f"{method} from {key or 'a caller'}")
            if context is not None
            else _nothing
        )

        def end() -> None:
            unwatch()
            give_back()

        return deadline, end

    def stop(self) -> None:
        self.deadlines.stop()
