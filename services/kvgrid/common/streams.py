"""What one caller may hold of a server's streaming RPCs, and a watchdog that ends streams in time.

A grpcio server serves every call on a thread of one fixed pool, and a streaming call holds its
thread for as long as it is open: while its client sends nothing (the server waits for the next
request) or reads nothing (the server's send waits on HTTP/2 flow control). A caller that opens
streams and leaves them open can thus take every thread, and every other caller then waits. Both
services bound their streams with the pieces here: the agent's TCP port its FetchChunks streams
(:mod:`kvgrid.agent.peers.guard`), the controller its PublishEvents streams
(:mod:`kvgrid.controller.streams`).

- :func:`caller_key`: who a stream counts against: its certificate identity *at its IP address*.
  The chart's shared agent certificate makes every agent one identity; counting by identity alone
  would make the whole fleet one caller, whose limit one pod could use up. Without TLS the IP alone.
- :class:`StreamSlots`: at most ``limit`` open streams per key; one more is RESOURCE_EXHAUSTED
  naming the key, the limit and the setting that sets it. A slot is given back exactly once.
- :class:`Deadlines`: one daemon thread cancels calls still open at their deadline (a stream whose
  thread waits on its client never sees a deadline by itself: only a cancel frees it). A watch may
  move its own deadline (``recheck``): an idle timeout re-arms while its stream makes progress.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable

import grpc

from kvgrid.common.authz import Identity
from kvgrid.common.errors import KvgridError, ResourceExhausted

__all__ = [
    "CANCEL_GRACE_S",
    "Deadlines",
    "Recheck",
    "ServingDeadlineExceeded",
    "StreamSlots",
    "caller_key",
    "nothing",
]

log = logging.getLogger(__name__)

CANCEL_GRACE_S = 0.2
"""How long after its deadline a stream that did not end by itself is cancelled (it normally ends
itself between two messages; only a send blocked on the reader's flow control waits for this)."""


class ServingDeadlineExceeded(KvgridError):
    """A stream outlived the server's serving deadline (gRPC DEADLINE_EXCEEDED)."""

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


def nothing() -> None:
    """A give-back for a stream that holds nothing."""


class StreamSlots:
    """Counts open streams per key; :meth:`take` refuses one over ``limit``. Thread-safe.

    The refusal names ``who`` and the key (``"the caller 'spiffe://...@ipv4:10.0.0.5'"``), ``where``
    (``"this agent"``), the limit ``per`` key and ``setting``, the config field that sets it."""

    def __init__(
        self,
        limit: int,
        setting: str,
        *,
        where: str = "this server",
        who: str = "the caller",
        per: str = "caller",
    ) -> None:
        if limit < 1:
            raise ValueError(f"{setting}={limit}: expected >= 1")
        self.limit = limit
        self.setting = setting
        self.where, self.who, self.per = where, who, per
        self._lock = threading.Lock()
        self._open: dict[str, int] = {}
        self.refused = 0

    def open_streams(self, key: str) -> int:
        with self._lock:
            return self._open.get(key, 0)

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self._open.values())

    def take(self, key: str, method: str) -> Callable[[], None]:
        """A slot for ``key`` (ResourceExhausted naming the limit when it has ``limit`` open); the
        returned function gives it back (idempotent, thread-safe)."""
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
                f"{method}: {self.who} {key!r} already has {n} streams open on {self.where}; the limit is "
                f"{self.limit} per {self.per} ({self.setting}); retry when one has ended"
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


Recheck = Callable[[float], "float | str"]
"""Asked when a watch is due, with ``time.monotonic()``: a later deadline to wait for instead (the
call made progress, or is allowed to stay), or the reason to cancel it now (logged)."""


class Deadlines:
    """One daemon thread that cancels calls still open past their deadline. Thread-safe."""

    def __init__(self, grace_s: float = CANCEL_GRACE_S, name: str = "kvgrid-deadlines") -> None:
        self.grace_s = grace_s
        self.name = name
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int]] = []
        self._calls: dict[int, tuple[grpc.ServicerContext, str, Recheck | None]] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopped = False
        self.cancelled = 0

    def watch(
        self, context: grpc.ServicerContext, deadline: float, what: str, recheck: Recheck | None = None
    ) -> Callable[[], None]:
        """Cancel ``context`` at ``deadline`` (``time.monotonic()``) plus the grace unless the returned
        function (idempotent) was called first; ``what`` names the call in the log. With ``recheck``
        the deadline is only when to ask it (no grace): it tells a later one or why to cancel."""
        with self._cond:
            key = next(self._ids)
            self._calls[key] = (context, what, recheck)
            heapq.heappush(self._heap, (deadline + (self.grace_s if recheck is None else 0.0), key))
            if self._thread is None and not self._stopped:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
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
            due: list[tuple[int, grpc.ServicerContext, str, Recheck | None]] = []
            with self._cond:
                if self._stopped:
                    return
                now = time.monotonic()
                while self._heap and (self._heap[0][0] <= now or self._heap[0][1] not in self._calls):
                    _, key = heapq.heappop(self._heap)
                    call = self._calls.get(key)
                    if call is not None:
                        due.append((key, *call))
                if not due:
                    self._cond.wait(self._heap[0][0] - now if self._heap else None)
                    continue
            for key, context, what, recheck in due:
                reason = "still open past its serving deadline"
                if recheck is not None:
                    try:
                        verdict = recheck(now)
                    except Exception:  # a bug in the check must not stop the watchdog
                        log.exception("checking %s failed; it stays watched", what)
                        verdict = now + 1.0
                    if not isinstance(verdict, str):
                        with self._cond:
                            if key in self._calls:
                                heapq.heappush(self._heap, (max(verdict, now + 0.001), key))
                        continue
                    reason = verdict
                with self._cond:
                    if self._calls.pop(key, None) is None:
                        continue  # it ended meanwhile
                self.cancelled += 1
                log.warning("%s: %s; cancelled", what, reason)
                try:
                    context.cancel()
                except Exception:  # a call that ended meanwhile
                    log.debug("cancelling %s failed", what, exc_info=True)
