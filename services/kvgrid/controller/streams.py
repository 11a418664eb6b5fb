"""How many PublishEvents streams a caller and a pod may hold on the controller, and when one ends.

Every open PublishEvents stream holds one of the ``grpc_workers`` threads for as long as it is
open, and a healthy agent keeps its stream open for its whole life, sending only when its cache
changes. So a stream may be quiet for hours, and the threads of streams left open by a client that
stopped sending or reading would otherwise only come back when the connection dies. The controller
(:class:`PublishStreams`, consulted by the servicer) bounds them; refusals are RESOURCE_EXHAUSTED
naming the caller, the limit and its setting, and nothing of the refused stream is applied:

- **Per caller** (``publish_streams_per_identity``): open streams of one certificate identity at one
  IP address (:func:`kvgrid.common.streams.caller_key`), without TLS of one IP address. The chart's
  shared agent certificate is one identity for the whole fleet; counted with the IP, each pod is a
  caller of its own (a pod with one agent per GPU: one caller with a stream per agent).
- **Per pod** (``publish_streams_per_pod``): open streams that named one pod UID. An agent has one;
  the bound leaves room for a reconnect while the server has not yet seen the old stream end.
- **In all** (``max_publish_streams``): below ``grpc_workers`` (checked at start), so unary calls
  (routers' MatchPrefix and Score, heartbeats, registrations) always find a thread.
- **Idle** (``publish_idle_timeout_ms``, a watchdog thread): a stream is cancelled once, for that
  long, its answer could not be sent (its client stopped reading), or no message arrived while it
  named no pod yet, a newer stream of its pod is open (the agent reconnected; this one is left
  over), or its pod's lease lapsed (the agent is gone). A quiet stream of a pod whose lease is
  renewed is kept: that is a healthy agent with nothing to report. Cancelling frees the thread and
  the slots; the client sees CANCELLED and, if it is a live agent, reconnects.

There is no fixed serving deadline for PublishEvents (unlike the agent's FetchChunks): a new stream
makes the controller pull the agent's snapshot, so ending healthy streams on a clock would cost a
resync per agent per period.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable

import grpc

from kvgrid.common.authz import Identity
from kvgrid.common.errors import ResourceExhausted
from kvgrid.common.streams import Deadlines, StreamSlots, caller_key, nothing

__all__ = ["PublishStream", "PublishStreams"]

log = logging.getLogger(__name__)

WHERE = "this controller"


class PublishStream:
    """One open PublishEvents stream's bookkeeping (its thread calls the methods; :meth:`end` may
    come from any thread, once or more)."""

    def __init__(self, owner: PublishStreams, sid: int, key: str, give_back: Callable[[], None]) -> None:
        self._owner = owner
        self.id = sid
        self.key = key
        self.pod: str | None = None
        self.since = time.monotonic()
        """When it last made progress (a message arrived, an answer went out)."""
        self.answering = False
        """True while an answer waits to be sent (the client's reading is what it waits for)."""
        self._give_back = [give_back]
        self._unwatch: Callable[[], None] = nothing
        self._lock = threading.Lock()
        self._ended = False

    def received(self) -> None:
        """A request message arrived."""
        self.since = time.monotonic()

    def answer(self) -> None:
        """An answer is about to be handed to gRPC (it returns once the answer is sent)."""
        self.since = time.monotonic()
        self.answering = True

    def answered(self) -> None:
        self.answering = False
        self.since = time.monotonic()

    def name_pod(self, pod_uid: str, method: str) -> None:
        """The stream is for ``pod_uid`` (its first message named it): take the pod's slot
        (RESOURCE_EXHAUSTED past ``publish_streams_per_pod``); it is the pod's newest stream now."""
        if self.pod is not None:
            return
        give = self._owner.pods.take(pod_uid, method)
        with self._lock:
            if self._ended:
                give()
                return
            self._give_back.append(give)
            self.pod = pod_uid
        self._owner._newest_of(pod_uid, self.id)

    def end(self) -> None:
        """The call ended: give its slots back and stop watching it (idempotent)."""
        with self._lock:
            if self._ended:
                return
            self._ended = True
            gives, self._give_back = self._give_back, []
        self._unwatch()
        for give in gives:
            give()
        self._owner._ended(self)


class PublishStreams:
    """The controller's PublishEvents limits (module docstring). ``pod_live(pod_uid)``: whether the
    pod has a live registration (its lease renewed)."""

    def __init__(
        self,
        *,
        per_caller: int,
        per_pod: int,
        total: int,
        idle_timeout_s: float,
        pod_live: Callable[[str], bool],
    ) -> None:
        self.callers = StreamSlots(per_caller, "publish_streams_per_identity", where=WHERE)
        self.pods = StreamSlots(per_pod, "publish_streams_per_pod", where=WHERE, who="pod", per="pod")
        if total < 1:
            raise ValueError(f"max_publish_streams={total}: expected >= 1")
        self.total = total
        self.idle_timeout_s = idle_timeout_s
        self.pod_live = pod_live
        self.deadlines = Deadlines(name="kvgrid-controller-streams")
        self._lock = threading.Lock()
        self._open = 0
        self._ids = itertools.count(1)
        self._newest: dict[str, int] = {}
        self.refused_total = 0

    @property
    def open_streams(self) -> int:
        with self._lock:
            return self._open

    @property
    def cancelled(self) -> int:
        """Streams the idle watchdog ended."""
        return self.deadlines.cancelled

    def open(
        self, method: str, ident: Identity | None, context: grpc.ServicerContext | None
    ) -> PublishStream:
        """Admit one stream (RESOURCE_EXHAUSTED past the caller's or the total bound) and watch it."""
        key = caller_key(ident, context)
        give = self.callers.take(key, method) if key else nothing
        with self._lock:
            if self._open >= self.total:
                self.refused_total += 1
                n = self._open
                refused = True
            else:
                self._open += 1
                refused = False
        if refused:
            give()
            raise ResourceExhausted(
                f"{method}: {n} streams are open on {WHERE}; the limit is {self.total} in all "
                f"(max_publish_streams, below grpc_workers so other calls keep threads); retry later"
            )
        stream = PublishStream(self, next(self._ids), key, give)
        if context is not None:
            what = f"{method} from {key or 'a caller'}"
            stream._unwatch = self.deadlines.watch(
                context,
                stream.since + self.idle_timeout_s,
                what,
                recheck=lambda now: self._recheck(stream, now),
            )
        return stream

    def _newest_of(self, pod_uid: str, sid: int) -> None:
        with self._lock:
            if sid > self._newest.get(pod_uid, 0):
                self._newest[pod_uid] = sid

    def _ended(self, stream: PublishStream) -> None:
        with self._lock:
            self._open -= 1
            if stream.pod is not None and self._newest.get(stream.pod) == stream.id:
                del self._newest[stream.pod]

    def _recheck(self, s: PublishStream, now: float) -> float | str:
        """When to look at ``s`` again, or why it is cancelled now."""
        idle = self.idle_timeout_s
        due = s.since + idle
        if now < due:
            return due
        setting = f"{idle:g} s (publish_idle_timeout_ms)"
        if s.answering:
            return f"its client has read no answer for {setting}"
        if s.pod is None:
            return f"it named no pod for {setting}"
        with self._lock:
            newest = self._newest.get(s.pod)
        if newest is not None and newest != s.id:
            return f"a newer stream of pod {s.pod!r} is open and this one sent nothing for {setting}"
        if not self.pod_live(s.pod):
            return f"pod {s.pod!r} is not registered (lease lapsed) and the stream sent nothing for {setting}"
        return now + idle  # a quiet stream of a live pod: a healthy agent with nothing to report

    def stop(self) -> None:
        self.deadlines.stop()
