"""Admit/evict events from the agent to the controller.

:class:`EventLog` is the cache's listener: it numbers every admit/evict (one sequence number per
event, strictly increasing within this agent's epoch) and keeps events until the controller
acknowledges them. :class:`EventPublisher` is a thread that registers the agent with the
controller, streams the log over ``PublishEvents``, renews the lease with ``Heartbeat`` and, on any
failure, reconnects with exponential backoff (with jitter), resending what was not acknowledged.
With TLS files configured every connection is mTLS, made with the files as they are at connect
time (a rotated certificate is picked up by the next reconnect).

The log carries L1 admits/evicts (the cache's listener calls) and TIER_L2 admits/evicts of the
lower tiers (:meth:`EventLog.on_l2`; :meth:`EventLog.attach_lower_tiers` wires it to the tier
chain and lists what the chain already holds), numbered in one sequence. The agent's ``Snapshot``
lists L1 only, so after a resync the controller asks (``l2_listing_requested`` in an ack or a
heartbeat answer) for the L2 listing again: :meth:`EventLog.relist_l2` appends a TIER_L2 CLEAR and
the chain's keys as TIER_L2 admits, under the log's lock, so an admit or evict the chain makes
meanwhile lands either in the listing or after it (the chain changes its index before it tells).

If more than ``max_buffer`` events pile up (controller unreachable for long) the oldest are dropped;
the controller then sees a gap in the sequence numbers and pulls a snapshot from the agent's
``Snapshot`` RPC, which is the recovery path for every inconsistency (the agent is the source of
truth for its pod).

Entries the controller refused: admits past one of its index-entry caps (per pod, per identity,
total) are acknowledged but not indexed, and the ack says how many (``refused_entries``, by cap in
``refused``). They are never resent (the controller would refuse them again, and a resend would
not be ordered after later evicts): the chunks stay cached here and routers miss them until a later
snapshot fits. The publisher counts them (:attr:`EventPublisher.refused_entries`, metric
``kvgrid_agent_controller_refused_entries`` by cap) and logs a warning at most every
:data:`REFUSED_LOG_INTERVAL_S`.

Connection state (``EventPublisher.state``, exported as ``kvgrid_agent_controller_connection_state``):
``disconnected`` (no session: before the first attempt, or backing off after a failure) ->
``registering`` (channel open, RegisterAgent in flight) -> ``connected`` (registered, event stream
and heartbeats running) -> back to ``disconnected`` on any failure. Each session after the first
counts as one reconnect (``kvgrid_agent_controller_reconnects``).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation

from kvgrid.api.v1 import common_pb2, controller_pb2, controller_pb2_grpc
from kvgrid.common.identity import PodIdentity
from kvgrid.common.tls import CONTROLLER_SERVER_NAME, ClientTls, make_channel
from kvgrid.common.wire import pod_identity_to_proto

if TYPE_CHECKING:
    from kvgrid.agent.tiers.tier import TierChain

__all__ = [
    "CONNECTION_STATES",
    "L2_LISTING_EVENT_KEYS",
    "MESSAGE_KEYS",
    "AgentLoadFn",
    "EventLog",
    "EventPublisher",
    "LoggedEvent",
]

log = logging.getLogger(__name__)

L2_LISTING_EVENT_KEYS = 4096
"""Keys per TIER_L2 admit of a listing (one PublishEvents message stays far below the controller's
``max_event_keys``)."""

MESSAGE_KEYS = 65_536
"""Most chunk keys in one PublishEvents message the agent sends (the controller's ``max_event_keys``
defaults to 1,048,576)."""

CONNECTION_STATES = ("disconnected", "registering", "connected")

REFUSED_CAPS = ("pod", "identity", "total")
"""The controller's index-entry caps, as ``PublishEventsResponse.refused`` names them."""

REFUSED_LOG_INTERVAL_S = 60.0
"""Most one warning per this many seconds about entries the controller refused."""


@dataclass(frozen=True)
class LoggedEvent:
    sequence: int
    kind: int  # controller_pb2.EventKind
    namespace_id: str
    keys: tuple[bytes, ...]
    tier: int = common_pb2.TIER_L1  # common_pb2.Tier

    def to_proto(self) -> controller_pb2.ChunkEvent:
        return controller_pb2.ChunkEvent(
            sequence=self.sequence,
            kind=self.kind,  # type: ignore[arg-type]
            tier=self.tier,  # type: ignore[arg-type]
            chunk_keys=list(self.keys),
            namespace=self.namespace_id,
        )


class EventLog:
    """Numbers events and buffers them until acknowledged. Thread-safe.

    With ``buffer=False`` (no controller configured) events are only counted, so snapshots still
    carry a meaningful ``last_sequence``.
    """

    def __init__(self, max_buffer: int = 100_000, *, buffer: bool = True) -> None:
        self._cond = threading.Condition()
        self._seq = 0
        self._acked = 0
        self._events: deque[LoggedEvent] = deque()
        self._max = max_buffer
        self._buffer = buffer
        self.dropped = 0
        self._l2_listing: Callable[[], dict[str, list[bytes]]] | None = None
        self.l2_listings = 0
        """L2 listings appended (at start and on the controller's request)."""

    def _append(
        self, kind: int, namespace_id: str, keys: Sequence[bytes], tier: int = common_pb2.TIER_L1
    ) -> None:
        with self._cond:
            self._seq += 1
            if not self._buffer:
                return
            self._events.append(LoggedEvent(self._seq, kind, namespace_id, tuple(keys), tier))
            while len(self._events) > self._max:
                self._events.popleft()
                self.dropped += 1
            self._cond.notify_all()

    def on_admit(self, namespace_id: str, keys: Sequence[bytes]) -> None:
        self._append(controller_pb2.EVENT_KIND_ADMIT, namespace_id, keys)

    def on_evict(self, namespace_id: str, keys: Sequence[bytes]) -> None:
        self._append(controller_pb2.EVENT_KIND_EVICT, namespace_id, keys)

    def on_l2(self, namespace_id: str, keys: Sequence[bytes], held: bool) -> None:
        """The lower tiers (``TierChain.on_l2``) took ``keys`` in (``held``) or let them go: a
        TIER_L2 admit or evict."""
        kind = controller_pb2.EVENT_KIND_ADMIT if held else controller_pb2.EVENT_KIND_EVICT
        self._append(kind, namespace_id, keys, common_pb2.TIER_L2)

    def attach_lower_tiers(self, chain: TierChain) -> None:
        """Publish ``chain``'s changes as TIER_L2 events from now on, after listing what it holds
        already (records an earlier run left on disk)."""
        with self._cond:
            chain.on_l2 = self.on_l2
            self._l2_listing = chain.l2_keys
            self.relist_l2()

    def relist_l2(self) -> None:
        """Append the lower tiers' listing: a TIER_L2 CLEAR, then TIER_L2 admits of every key
        (events of at most ``L2_LISTING_EVENT_KEYS`` keys). Nothing without attached tiers."""
        with self._cond:
            if self._l2_listing is None:
                return
            self._append(controller_pb2.EVENT_KIND_CLEAR, "", (), common_pb2.TIER_L2)
            n = L2_LISTING_EVENT_KEYS
            for ns, keys in sorted(self._l2_listing().items()):
                for i in range(0, len(keys), n):
                    self._append(controller_pb2.EVENT_KIND_ADMIT, ns, keys[i : i + n], common_pb2.TIER_L2)
            self.l2_listings += 1

    def last_sequence(self) -> int:
        with self._cond:
            return self._seq

    @property
    def acked(self) -> int:
        with self._cond:
            return self._acked

    def ack(self, sequence: int) -> None:
        """Forget events up to ``sequence`` (the controller applied them)."""
        with self._cond:
            self._acked = max(self._acked, min(sequence, self._seq))
            while self._events and self._events[0].sequence <= self._acked:
                self._events.popleft()

    def pending(self) -> int:
        with self._cond:
            return len(self._events)

    def wait_after(
        self, sequence: int, timeout: float, max_events: int = 512, max_keys: int = MESSAGE_KEYS
    ) -> list[LoggedEvent]:
        """Events with a sequence above ``sequence`` (waits up to ``timeout`` for the first), at
        most ``max_events`` of them and, past the first, at most ``max_keys`` keys in all (one
        message stays under the controller's ``max_event_keys`` even during an L2 listing)."""
        with self._cond:
            if not (self._events and self._events[-1].sequence > sequence):
                self._cond.wait(timeout)
            out: list[LoggedEvent] = []
            keys = 0
            for ev in self._events:
                if ev.sequence > sequence:
                    keys += len(ev.keys)
                    if out and keys > max_keys:
                        break
                    out.append(ev)
                    if len(out) >= max_events:
                        break
            return out

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()


AgentLoadFn = Callable[[], controller_pb2.AgentLoad]


class EventPublisher:
    """Keeps a connection to the controller: register, stream events, heartbeat, reconnect."""

    def __init__(
        self,
        controller_address: str,
        log_: EventLog,
        pod: PodIdentity,
        *,
        namespaces: Callable[[], list[str]],
        l1_capacity_bytes: int,
        load: AgentLoadFn,
        flush_interval_s: float = 0.1,
        heartbeat_interval_s: float = 2.0,
        initial_backoff_s: float = 0.2,
        max_backoff_s: float = 10.0,
        tls: ClientTls | None = None,
        meter: metrics.Meter | None = None,
    ) -> None:
        """``tls``: mTLS to the controller (credentials re-read per connection, so a rotated
        certificate is used from the next reconnect on); None = plaintext. ``meter``: export the
        connection state and reconnects."""
        self.address = controller_address
        self.tls = tls
        self.log = log_
        self.pod = pod
        self._namespaces = namespaces
        self._capacity = l1_capacity_bytes
        self._load = load
        self._flush = flush_interval_s
        self._heartbeat = heartbeat_interval_s
        self._backoff0 = initial_backoff_s
        self._backoff_max = max_backoff_s
        self._stop = threading.Event()
        self._reconnect = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvgrid-agent-events", daemon=True)
        self.connected = threading.Event()
        self.connects = 0
        self.resyncs_requested = 0
        self.state = "disconnected"
        self.reconnects = 0
        self._sessions = 0
        self.refused_entries: dict[str, int] = dict.fromkeys(REFUSED_CAPS, 0)
        """Chunk keys the controller acknowledged but did not index, by the cap that refused them."""
        self._refused_unlogged: dict[str, int] = dict.fromkeys(REFUSED_CAPS, 0)
        self._refused_logged_at: float | None = None
        if meter is not None:
            self._instruments(meter)

    def _instruments(self, meter: metrics.Meter) -> None:
        def states(_opts: CallbackOptions) -> list[Observation]:
            current = self.state
            return [Observation(int(st == current), {"state": st}) for st in CONNECTION_STATES]

        meter.create_observable_gauge(
            "kvgrid_agent_controller_connection_state",
            [states],
            unit="1",
            description="1 for the agent's current connection state to the controller "
            "(disconnected, registering, connected), 0 for the others",
        )
        meter.create_observable_counter(
            "kvgrid_agent_controller_reconnects",
            [lambda _opts: [Observation(self.reconnects)]],
            unit="{reconnect}",
            description="Sessions with the controller started after an earlier one ended or failed",
        )
        meter.create_observable_counter(
            "kvgrid_agent_controller_refused_entries",
            [lambda _opts: [Observation(n, {"cap": cap}) for cap, n in self.refused_entries.items()]],
            unit="{entry}",
            description="Chunk keys the controller acknowledged but did not index because an index-entry "
            "cap was reached (cap: pod, identity, total); routers do not see these chunks",
        )

    def _note_refused(self, ack: controller_pb2.PublishEventsResponse) -> None:
        """Count the keys an ack says were refused; warn at most every REFUSED_LOG_INTERVAL_S."""
        r = ack.refused
        counts = {"pod": r.pod_cap, "identity": r.identity_cap, "total": r.total_cap}
        if not any(counts.values()):  # a controller that sends only the total
            counts["total"] = ack.refused_entries
        for cap, n in counts.items():
            self.refused_entries[cap] += n
            self._refused_unlogged[cap] += n
        now = time.monotonic()
        if self._refused_logged_at is not None and now - self._refused_logged_at < REFUSED_LOG_INTERVAL_S:
            return
        self._refused_logged_at = now
        pending = ", ".join(f"{n} by its {cap} cap" for cap, n in self._refused_unlogged.items() if n)
        self._refused_unlogged = dict.fromkeys(REFUSED_CAPS, 0)
        log.warning(
            "controller %s did not index chunk keys of pod %s: %s (controller settings "
            "max_entries_per_pod / max_entries_per_identity / max_index_entries); the chunks stay "
            "cached but routers will not see them until a later snapshot fits",
            self.address,
            self.pod.holder_id,
            pending,
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._reconnect.set()
        self.log.wake()
        self._thread.join(timeout)

    def reregister(self) -> None:
        """Register again (e.g. the set of namespaces changed)."""
        self._reconnect.set()
        self.log.wake()

    def _run(self) -> None:
        backoff = self._backoff0
        while not self._stop.is_set():
            try:
                self._session()
                backoff = self._backoff0
            except grpc.RpcError as e:
                code = e.code() if isinstance(e, grpc.Call) else None
                log.warning("controller %s: %s; reconnecting in %.1fs", self.address, code or e, backoff)
            except Exception:
                log.exception(
                    "controller %s: event publisher failed; reconnecting in %.1fs", self.address, backoff
                )
            finally:
                self.connected.clear()
                self.state = "disconnected"
            if self._stop.is_set():
                break
            # Full jitter keeps a fleet of agents from reconnecting in lockstep after an outage.
            self._stop.wait(random.uniform(0.5, 1.0) * backoff)
            backoff = min(backoff * 2, self._backoff_max)

    def _session(self) -> None:
        self._reconnect.clear()
        pod_pb = pod_identity_to_proto(self.pod)
        self._sessions += 1
        if self._sessions > 1:
            self.reconnects += 1
        self.state = "registering"
        with make_channel(self.address, self.tls, CONTROLLER_SERVER_NAME) as channel:
            stub = controller_pb2_grpc.ControllerServiceStub(channel)
            resp = stub.RegisterAgent(
                controller_pb2.RegisterAgentRequest(
                    pod=pod_pb, namespaces=self._namespaces(), l1_capacity_bytes=self._capacity
                ),
                timeout=10,
            )
            self.connects += 1
            if resp.snapshot_requested:
                self.resyncs_requested += 1
            log.info(
                "registered with controller %s (epoch %d, lease %d ms)",
                self.address,
                self.pod.epoch,
                resp.lease_ttl_ms,
            )
            self.state = "connected"
            self.connected.set()
            call = stub.PublishEvents(self._requests(pod_pb))
            hb = threading.Thread(target=self._heartbeats, args=(stub, call), daemon=True)
            hb.start()
            try:
                for ack in call:
                    self.log.ack(ack.acked_sequence)
                    if ack.resync_started:
                        self.resyncs_requested += 1
                    if ack.l2_listing_requested:
                        self.log.relist_l2()
                    if ack.refused_entries:
                        self._note_refused(ack)
            except grpc.RpcError as e:
                if not (self._reconnect.is_set() and e.code() == grpc.StatusCode.CANCELLED):
                    raise
            finally:
                self._reconnect.set()
                call.cancel()
                hb.join(timeout=5)

    def _requests(self, pod_pb: common_pb2.PodIdentity) -> Iterator[controller_pb2.PublishEventsRequest]:
        # Resend everything not acknowledged: the controller ignores sequences it already applied.
        sent = self.log.acked
        first = True
        while not self._reconnect.is_set():
            batch = self.log.wait_after(sent, self._flush)
            if self._reconnect.is_set():
                return
            if batch or first:
                # The first message announces the stream even with nothing to send.
                yield controller_pb2.PublishEventsRequest(pod=pod_pb, events=[e.to_proto() for e in batch])
                first = False
                if batch:
                    sent = batch[-1].sequence

    def _heartbeats(self, stub: controller_pb2_grpc.ControllerServiceStub, call: grpc.Future) -> None:
        while not self._reconnect.wait(self._heartbeat):
            try:
                resp = stub.Heartbeat(
                    controller_pb2.HeartbeatRequest(
                        pod_uid=self.pod.pod_uid, epoch=self.pod.epoch, load=self._load()
                    ),
                    timeout=max(self._heartbeat, 1.0),
                )
            except grpc.RpcError as e:
                log.warning(
                    "heartbeat to %s failed: %s", self.address, e.code() if isinstance(e, grpc.Call) else e
                )
                self._reconnect.set()
                break
            if resp.l2_listing_requested:
                self.log.relist_l2()
            if resp.reregister:
                log.info("controller %s asked this agent to register again", self.address)
                self._reconnect.set()
                break
        call.cancel()
        self.log.wake()
