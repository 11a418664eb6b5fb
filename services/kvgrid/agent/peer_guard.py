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
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable

import grpc

from kvgrid.common.authz import ChunkReaders, Identity
from kvgrid.common.errors import KvgridError, ResourceExhausted

__all__ = ["Deadlines", "ServingDeadlineExceeded", "StreamSlots", "TcpGuard", "caller_key"]

log = logging.getLogger(__name__)

CANCEL_GRACE_S = 0.2
"""How long after its deadline a stream that did not end by itself is cancelled (it normally ends
itself between two messages; only a send blocked on the reader's flow control waits for this)."""


class ServingDeadlineExceeded(KvgridError):
    """A stream outlived the agent's serving deadline (gRPC DEADLINE_EXCEEDED)."""

    status = "DEADLINE_EXCEEDED"


def caller_key(ident: Identity | None, context: grpc.ServicerContext | None) -> str:
    """Who a call counts against: its certificate identity (the SAN that proved it) at the caller's
    IP address (gRPC's ``ipv4:1.2.3.4`` / ``ipv6:[::1]``, without the port), so the pods sharing the
    chart's default agent certificate are still one caller each; without TLS the IP address alone;
    "" when neither is known (the Unix socket)."""
    ip = ""
    if context is not None:
        peer = context.peer() or ""
        ip = peer.rpartition(":")[0] if peer.count(":") >= 2 else peer
    if ident is not None:
        return f"{ident.uri}@{ip}" if ip else ident.uri
    return ip


class StreamSlots:
    """Counts open streams per caller; :meth:`take` refuses one over ``limit``. Thread-safe."""

    def __init__(self, limit: int, setting: str = "peer_streams_per_identity") -> None:
        if limit < 1:
            raise ValueError(f"{setting}={limit}: expected >= 1")
        self.limit = limit
        self.setting = setting
        self._lock = threading.Lock()
        self._open: dict[str, int] = {}
        self.refused = 0

    def open_streams(self, key: str) -> int:
        with self._lock:
            return self._open.get(key, 0)

    def take(self, key: str, method: str) -> Callable[[], None]:
        """A slot for ``key`` (ResourceExhausted naming the limit when it has ``limit`` open); the
        returned function gives it back (idempotent)."""
        with self._lock:
            n = self._open.get(key, 0)
            if n >= self.limit:
                self.refused += 1
                refused = True
            else:
                self._open[key] = n + 1
                refused = False
        if refused:
            raise ResourceExhausted(
                f"{method}: the caller {key!r} already has {n} streams open on this agent; the limit is "
                f"{self.limit} per caller ({self.setting}); retry when one has ended"
            )
        given = threading.Event()

        def give_back() -> None:
            if given.is_set():
                return
            with self._lock:
                if given.is_set():
                    return
                given.set()
                left = self._open[key] - 1
                if left:
                    self._open[key] = left
                else:
                    del self._open[key]

        return give_back


class Deadlines:
    """One daemon thread that cancels calls still open past their deadline. Thread-safe."""

    def __init__(self, grace_s: float = CANCEL_GRACE_S) -> None:
        self.grace_s = grace_s
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int]] = []
        self._calls: dict[int, tuple[grpc.ServicerContext, str]] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopped = False
        self.cancelled = 0

    def watch(self, context: grpc.ServicerContext, deadline: float, what: str) -> Callable[[], None]:
        """Cancel ``context`` at ``deadline`` (``time.monotonic()``) plus the grace unless the returned
        function (idempotent) was called first; ``what`` names the call in the log."""
        with self._cond:
            key = next(self._ids)
            self._calls[key] = (context, what)
            heapq.heappush(self._heap, (deadline + self.grace_s, key))
            if self._thread is None and not self._stopped:
                self._thread = threading.Thread(target=self._run, name="kvgrid-agent-deadlines", daemon=True)
                self._thread.start()
            self._cond.notify()

        def unwatch() -> None:
            with self._cond:
                self._calls.pop(key, None)

        return unwatch

    @property
    def watched(self) -> int:
        with self._cond:
            return len(self._calls)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._calls.clear()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            due: list[tuple[grpc.ServicerContext, str]] = []
            with self._cond:
                if self._stopped:
                    return
                now = time.monotonic()
                while self._heap and (self._heap[0][0] <= now or self._heap[0][1] not in self._calls):
                    _, key = heapq.heappop(self._heap)
                    call = self._calls.pop(key, None)
                    if call is not None:
                        due.append(call)
                if not due:
                    self._cond.wait(self._heap[0][0] - now if self._heap else None)
                    continue
            for context, what in due:
                self.cancelled += 1
                log.warning("%s: still open past its serving deadline; cancelled", what)
                try:
                    context.cancel()
                except Exception:  # a call that ended meanwhile
                    log.debug("cancelling %s failed", what, exc_info=True)


class TcpGuard:
    """The TCP servicer's checks: tenant (``readers``; None without TLS), streams per caller,
    serving deadline."""

    def __init__(
        self, readers: ChunkReaders | None, *, streams_per_caller: int, stream_timeout_s: float
    ) -> None:
        self.readers = readers
        self.slots = StreamSlots(streams_per_caller)
        self.deadlines = Deadlines()
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


def _nothing() -> None:
    pass
