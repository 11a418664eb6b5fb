"""The controller's state and operations, gRPC-free: msgspec types and plain Python in and out.

:class:`Controller` ties the registry (who is alive), the ingestor (agent events and resyncs), the
index (who holds what) and scoring together. The registry backend goes with the index's
(:func:`~kvgrid.controller.registry.make_registry`): with ``index_backend=redis`` every replica
shares one registry in Valkey, and the lease sweeper also refreshes this replica's view of it
(records that left through another replica are dropped here as well).

It never sees protobuf: :mod:`kvgrid.controller.wire` converts requests to the types here and
results back, :mod:`kvgrid.controller.service` serves it over gRPC. Errors the caller caused are
:mod:`kvgrid.common.errors` types naming the bad value; nothing is applied from a request that
fails validation.

Queries come in two forms: :class:`PrefixQuery` (as asked: token ids, or chunk keys, with the
namespace) is resolved into :class:`Query` (chunk keys, namespace id, sizes) once; packed batches
arrive as :class:`PackedQueries` (one key buffer for the whole batch).

Bounded state: agent admits and snapshots go through :class:`~kvgrid.controller.limits.EntryCaps`
(``max_entries_per_pod``, ``max_entries_per_identity``, ``max_index_entries``); what a cap refused is
told to the pod in its next :class:`PublishAck`. An mTLS identity registers at most
``max_pods_per_identity`` live pods (``ResourceExhausted`` beyond).

Backend data loss: a watcher reads the index's
:meth:`~kvgrid.controller.index.base.ChunkIndex.data_generation` every ``backend_check_interval_ms``;
when it changes (a Redis/Valkey restarted empty or flushed) every registered agent is resynced and
the vLLM GPU entries are rewritten, so the index is rebuilt from its sources of truth. While the
backend cannot be reached, calls that need it fail with ``Unavailable`` (UNAVAILABLE).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from kvgrid.common.errors import (
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
    check_namespace_id,
    client_input,
    is_namespace_id,
    within,
)
from kvgrid.common.hashing import CHUNK_KEY_BYTES, DEFAULT_TOKENS_PER_CHUNK, KeyNamespace, chunk_keys
from kvgrid.common.identity import PodIdentity
from kvgrid.controller.config import ControllerConfig
from kvgrid.controller.index import BatchView, ChunkIndex, IndexTier, MaskView, check_keys, make_index
from kvgrid.controller.index.base import WordsView
from kvgrid.controller.index.instrumented import InstrumentedIndex
from kvgrid.controller.ingest import AgentSnapshot, ChunkEvent, Ingestor, SnapshotFn, check_events
from kvgrid.controller.limits import NONE_REFUSED, EntryCaps, Refused
from kvgrid.controller.matching import BatchMatch, match_batch, match_words
from kvgrid.controller.metrics import ControllerMetrics, StatsSource
from kvgrid.controller.registry import (
    AgentLoad,
    AgentRecord,
    AgentRegistry,
    RegisterOutcome,
    StaleEpochError,
    UnknownPodError,
    make_registry,
)
from kvgrid.controller.scoring import Candidate, Estimate, ScoreParams, rank
from kvgrid.controller.slots import SlotTable
from kvgrid.controller.vllm_events import VllmEventSubscriber, subscriber_context

if TYPE_CHECKING:
    from kvgrid.common.telemetry import Telemetry

__all__ = [
    "AgentInfo",
    "Controller",
    "ControllerStats",
    "EventMessage",
    "HolderSnapshot",
    "Lease",
    "MatchResult",
    "PackedQueries",
    "PrefixQuery",
    "PublishAck",
    "Query",
    "Registration",
    "ScoreQuery",
    "ScoreResult",
]

log = logging.getLogger(__name__)

_NO_CANDIDATES: frozenset[str] = frozenset()
_KEY_LEN = {CHUNK_KEY_BYTES}


# --- what goes in ------------------------------------------------------------------------------
class PrefixQuery(msgspec.Struct, frozen=True):
    """One MatchPrefix query as asked: ``token_ids`` with ``namespace``, or ``chunk_keys`` with
    ``namespace`` or ``namespace_id``; neither set is an error."""

    token_ids: list[int] | None = None
    chunk_keys: list[bytes] | None = None
    namespace: KeyNamespace | None = None
    namespace_id: str = ""
    candidates: frozenset[str] = _NO_CANDIDATES
    max_pods: int = 0


class Query(msgspec.Struct, frozen=True):
    """A resolved query: the chunk keys to match and what they were computed under."""

    keys: list[bytes]
    namespace_id: str
    tokens_per_chunk: int
    num_tokens: int
    candidates: frozenset[str]
    max_pods: int


class PackedQueries(msgspec.Struct, frozen=True):
    """The packed form of a batch: ``keys`` uint64 ``[total, 2]`` (a view of the request's bytes),
    ``counts`` int64 keys per query; the rest applies to every query."""

    keys: np.ndarray
    counts: np.ndarray
    namespace_id: str
    candidates: frozenset[str]
    max_pods: int


class ScoreQuery(msgspec.Struct, frozen=True):
    match: PrefixQuery
    reserve: bool = False
    speculative_ttl_ms: int = 0
    """0: the configured ``speculative_ttl_ms``."""
    top_k: int = 0
    """0: every candidate."""


class EventMessage(msgspec.Struct, frozen=True):
    """One message of an agent's event stream; ``pod`` is required on the first only."""

    pod: PodIdentity | None
    events: list[ChunkEvent]


# --- what comes out ----------------------------------------------------------------------------
class Registration(msgspec.Struct, frozen=True):
    lease_ttl_ms: int
    snapshot_requested: bool


class Lease(msgspec.Struct, frozen=True):
    lease_ttl_ms: int
    reregister: bool
    l2_listing_requested: bool = False


class PublishAck(msgspec.Struct, frozen=True):
    acked_sequence: int
    resync_started: bool
    l2_listing_requested: bool = False
    """The agent is to send its lower tiers' listing again (:mod:`kvgrid.controller.ingest`)."""
    refused: Refused = NONE_REFUSED
    """Keys of the pod not indexed since the previous answer, by cap (:mod:`kvgrid.controller.limits`)."""


class HolderSnapshot(msgspec.Struct, frozen=True):
    pod: PodIdentity
    keys: list[bytes]
    last_sequence: int


class MatchResult(msgspec.Struct, frozen=True):
    """Every query's matches (``match``), the slots they name (``table``) and each query's size."""

    match: BatchMatch
    table: SlotTable
    num_chunks: list[int]


class ScoreResult(msgspec.Struct, frozen=True):
    num_query_chunks: int
    ranked: list[Estimate]
    """Best (lowest estimated TTFT) first."""


class AgentInfo(msgspec.Struct, frozen=True):
    pod: PodIdentity
    load: AgentLoad
    lease_remaining_ms: int
    num_chunks: int
    last_sequence: int


class ControllerStats(msgspec.Struct, frozen=True):
    num_entries: int
    num_agents: int
    events_ingested: int
    resyncs: int
    index_backend: str
    rejected_requests: int
    vllm_events_ingested: int
    vllm_replays: int
    expired_leases: int


def _no_snapshots(record: AgentRecord, timeout_s: float) -> AgentSnapshot:
    raise Unavailable(f"pod {record.pod.pod_uid!r}: this controller has no way to pull agent snapshots")


_SCORE_ENTRY_MIN_BYTES = 6
"""The fewest bytes one pod's ``PodScore`` takes in a Score answer besides its pod UID and name (the
entry's, its match's and the UID's tags and lengths; every number omitted as zero)."""


class Controller:
    """The controller's state and operations (thread-safe).

    ``snapshots`` pulls an agent's snapshot (the transport's job: :func:`kvgrid.controller.service.serve`
    passes a gRPC one); ``telemetry`` adds the ``kvgrid_controller_*`` metrics.
    """

    def __init__(
        self,
        cfg: ControllerConfig,
        index: ChunkIndex | None = None,
        telemetry: Telemetry | None = None,
        *,
        snapshots: SnapshotFn = _no_snapshots,
        registry: AgentRegistry | None = None,
    ) -> None:
        self.cfg = cfg
        index = index if index is not None else make_index(cfg)
        self.index = InstrumentedIndex(index, telemetry.meter) if telemetry is not None else index
        self.registry = registry if registry is not None else make_registry(cfg)
        self.caps = EntryCaps(
            self.index, cfg.max_entries_per_pod, cfg.max_index_entries, cfg.identity_entry_cap
        )
        # A pod-count check of an identity and the registration it allows are one step.
        self._owners_lock = threading.Lock()
        self.ingest = Ingestor(
            self.index,
            snapshots,
            snapshot_timeout_s=cfg.snapshot_timeout_ms / 1000,
            retry_s=cfg.resync_retry_ms / 1000,
            on_namespaces=self._learn_namespaces,
            max_buffered_events=cfg.max_resync_buffer_events,
            caps=self.caps,
        )
        self.params = ScoreParams.from_config(cfg)
        self.rejected = 0
        """Requests refused as invalid or stale (counted by the service)."""
        self._holders: dict[str, AgentRecord] = {}
        self._holders_lock = threading.Lock()
        # Bumped after every change of _holders or of a record's namespaces (SlotTable cache key).
        self._holders_version = 0
        self._slot_table: tuple[tuple[int, int, int], SlotTable] | None = None
        self._valid_ns_ids: set[str] = set()  # namespace ids already checked
        # eligible slots per namespace as one int, for the single-query path (per slot table)
        self._eligible_ints: tuple[SlotTable | None, dict[str, int]] = (None, {})
        self._stop = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep_loop, name="kvgrid-lease-sweeper", daemon=True)
        self._watcher = threading.Thread(target=self._watch_loop, name="kvgrid-backend-watch", daemon=True)
        self._generation: str | None = None
        self.backend_available = True
        self.backend_losses = 0
        """Times the index backend was found to have lost its data (each one resynced every agent)."""
        # one context sized to the sources (the default one holds 1,023 sockets)
        self._zmq = subscriber_context(len(cfg.vllm_sources)) if cfg.vllm_sources else None
        self.vllm = [
            VllmEventSubscriber(src, self.index, self._holder_of_uid, context=self._zmq)
            for src in cfg.vllm_sources
        ]
        self.metrics: ControllerMetrics | None = None
        if telemetry is not None:
            self.metrics = ControllerMetrics(
                telemetry.meter,
                StatsSource(
                    agents=lambda: len(self.registry.all()),
                    events_ingested=lambda: self.ingest.events_applied,
                    resyncs=lambda: self.ingest.resyncs,
                    rejected=lambda: self.rejected,
                    vllm_events=lambda: sum(s.events for s in self.vllm),
                    expired_leases=lambda: self.registry.expired_total,
                    rejected_entries=lambda: self.caps.rejected_entries,
                    over_quota_pods=lambda: len(self.caps.over_quota),
                    over_quota_identities=lambda: len(self.caps.over_quota_identities),
                    refused_by_cap=lambda: dict(self.caps.refused_by_cap),
                    backend_losses=lambda: self.backend_losses,
                ),
            )

    # --- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        try:
            self._generation = self.index.data_generation()  # the baseline later checks compare to
        except Unavailable as e:
            log.warning("%s", e)
        try:
            self.sweep()  # loads a shared registry's view now (readiness waits for it), else the sweeper
        except Unavailable as e:
            log.warning("%s", e)
        self._sweeper.start()
        self._watcher.start()
        for s in self.vllm:
            s.start()

    def stop(self) -> None:
        self._stop.set()
        for s in self.vllm:  # every one told first: each takes up to its poll interval to notice
            s.stop(wait=False)
        for s in self.vllm:
            s.stop()
        if self._zmq is not None and not any(s.running for s in self.vllm):
            self._zmq.term()  # every socket is closed (term would wait for a running subscriber's)
        self.ingest.close()
        self.index.close()
        self.registry.close()

    def _sweep_loop(self) -> None:
        while not self._stop.wait(self.cfg.sweep_interval_ms / 1000):
            try:
                self.sweep()
            except Unavailable as e:  # the readiness/backend watcher reports the outage
                log.debug("lease sweep skipped: %s", e)
            except Exception:  # keep sweeping whatever one round hit (e.g. Redis briefly down)
                log.exception("lease sweep failed")

    def _watch_loop(self) -> None:
        while not self._stop.wait(self.cfg.backend_check_interval_ms / 1000):
            try:
                self.check_backend()
            except Exception:  # keep watching whatever one round hit
                log.exception("index backend check failed")

    def check_backend(self) -> bool:
        """Check the index backend once; when it lost its data since the last check, resync every
        registered agent and rewrite the vLLM GPU entries. Returns True when a loss was found."""
        try:
            gen = self.index.data_generation()
        except Unavailable as e:
            if self.backend_available:
                log.warning("%s", e)
                self.backend_available = False
            return False
        if not self.backend_available:
            log.info("index backend %s reachable again", self.index.backend)
            self.backend_available = True
        if self._generation is None or gen == self._generation:
            self._generation = gen
            return False
        log.warning(
            "index backend %s lost its data (generation %s -> %s): resyncing every agent",
            self.index.backend,
            self._generation,
            gen,
        )
        self._generation = gen
        self.backend_losses += 1
        self.caps.reset()
        records = self.registry.all()
        if self.registry.shared:
            # The registry was in the lost data too: agents register again (heartbeats answer
            # reregister) and those registrations pull; here only the streams this replica serves.
            records = [r for r in records if self.ingest.tracks(r.holder)]
        n = self.ingest.resync_all(records)
        for s in self.vllm:
            s.rebind(force=True)
        log.info("index backend loss: %d snapshot pulls started", n)
        return True

    def sweep(self) -> list[AgentRecord]:
        """Drop lapsed leases, then refresh a shared registry's view (records that left through
        another replica are dropped here too); returns the records dropped."""
        gone = self.registry.expire()
        for rec in gone:
            log.info("lease of %s lapsed: dropping its entries", rec.holder)
            self._drop(rec)
        if self.registry.shared:  # the streams served here: every replica's ListAgents shows them
            self.registry.publish_sequences(
                {
                    r.pod.pod_uid: (r.pod.epoch, self.ingest.last_sequence(r.holder))
                    for r in self.registry.all()
                    if self.ingest.tracks(r.holder)
                }
            )
        synced = self.registry.sync()
        for rec in synced.gone:
            log.info("%s left the shared registry (through another replica): dropping it here", rec.holder)
            self._drop(rec)  # drop_holder is idempotent; it also removes what a late write left
        if gone or synced.changed:
            self._refresh_holders()
        return gone + synced.gone

    def _drop(self, rec: AgentRecord) -> None:
        # Order matters: fence every writer of this holder (event streams, resyncs, vLLM events)
        # first, so none can add entries after drop_holder and leave them behind for good.
        rec.dropped = True
        self.ingest.forget(rec.holder)
        for s in self.vllm:
            if s.source.pod_uid == rec.pod.pod_uid:
                s.rebind()
        self.index.drop_holder(rec.holder)

    def _refresh_holders(self) -> None:
        with self._holders_lock:
            self._holders = {r.holder: r for r in self.registry.all()}
            self._holders_version += 1

    def _holder_of_uid(self, pod_uid: str) -> str | None:
        rec = self.registry.get(pod_uid)
        return rec.holder if rec else None

    def _learn_namespaces(self, rec: AgentRecord, namespaces: Sequence[str]) -> None:
        good = tuple(ns for ns in namespaces if is_namespace_id(ns))
        if self.registry.learn_namespaces(rec, good):
            with self._holders_lock:
                self._holders_version += 1

    # --- registry -----------------------------------------------------------------------------
    def register(
        self, pod: PodIdentity, namespaces: Sequence[str], l1_capacity_bytes: int, *, owner: str | None = None
    ) -> Registration:
        """Register ``pod``; ``owner`` (the caller's mTLS identity) is checked and recorded in the
        same step (PermissionDenied when another identity owns the live pod, ResourceExhausted when
        it would own more than ``max_pods_per_identity``)."""
        out = self._register_owned(pod, namespaces, l1_capacity_bytes, owner)
        if out.replaced is not None:
            log.info("pod %s: epoch %d replaces %d", pod.pod_uid, pod.epoch, out.replaced.pod.epoch)
            self._drop(out.replaced)
        self._refresh_holders()
        if out.is_new:
            for s in self.vllm:
                if s.source.pod_uid == pod.pod_uid:
                    s.rebind()
            if pod.agent_address:
                self.ingest.request_resync(out.record)
        return Registration(self.cfg.lease_ttl_ms, snapshot_requested=out.is_new and bool(pod.agent_address))

    def _register_owned(
        self, pod: PodIdentity, namespaces: Sequence[str], l1_capacity_bytes: int, owner: str | None
    ) -> RegisterOutcome:
        """:meth:`AgentRegistry.register`, within ``owner``'s pod bound; the new holder's entries
        count toward ``owner``'s identity cap. Without an owner (no TLS) neither applies."""
        if owner is None:
            return self.registry.register(pod, list(namespaces), l1_capacity_bytes, owner=owner)
        with self._owners_lock:
            self._check_pod_bound(pod.pod_uid, owner)
            out = self.registry.register(pod, list(namespaces), l1_capacity_bytes, owner=owner)
            self.caps.bind(out.record.holder, owner)
            return out

    def _bind_owner(self, rec: AgentRecord, owner: str) -> None:
        """A stream of ``owner`` for a pod registered elsewhere (another replica, a registration
        that predates this stream): count it toward ``owner``'s bounds here too."""
        if self.caps.identity_of(rec.holder) == owner:
            return
        with self._owners_lock:
            self._check_pod_bound(rec.pod.pod_uid, owner)
            self.caps.bind(rec.holder, owner)

    def _check_pod_bound(self, pod_uid: str, owner: str) -> None:
        bound = self.cfg.max_pods_per_identity
        if not bound:
            return
        pods = self.caps.pods_of(owner)
        if pod_uid not in pods and len(pods) >= bound:
            raise ResourceExhausted(
                f"pod {pod_uid!r}: identity {owner!r} already has {len(pods)} live pods registered, "
                f"max_pods_per_identity={bound}; a pod counts until its lease lapses (use per-pod "
                "certificates, or raise max_pods_per_identity to the fleet size plus rollout surge)"
            )

    def heartbeat(self, pod_uid: str, epoch: int, load: AgentLoad | None) -> Lease:
        if not pod_uid:
            raise InvalidArgument("pod_uid='': expected the pod's UID")
        if load is not None and not 0.0 <= load.gpu_kv_usage <= 1.0:
            raise InvalidArgument(f"load.gpu_kv_usage={load.gpu_kv_usage}: expected a fraction in [0, 1]")
        try:
            self.registry.heartbeat(pod_uid, epoch, load)
        except UnknownPodError:
            return Lease(self.cfg.lease_ttl_ms, reregister=True)
        relist = self.ingest.take_l2_listing_request(PodIdentity(pod_uid=pod_uid, epoch=epoch).holder_id)
        return Lease(self.cfg.lease_ttl_ms, reregister=False, l2_listing_requested=relist)

    # --- ingest -------------------------------------------------------------------------------
    def publish(self, messages: Iterable[EventMessage], *, owner: str | None = None) -> Iterator[PublishAck]:
        """One agent's event stream: one pod incarnation, registered implicitly if unknown (with
        ``owner`` checked and recorded as in :meth:`register`)."""
        rec: AgentRecord | None = None
        first = True
        for msg in messages:
            if msg.pod is not None:
                pod = msg.pod
                if rec is not None and (pod.pod_uid, pod.epoch) != (rec.pod.pod_uid, rec.pod.epoch):
                    raise InvalidArgument(
                        f"pod {pod.holder_id!r}: one PublishEvents stream carries one pod incarnation "
                        f"({rec.holder!r}); open a new stream"
                    )
            elif rec is None:
                raise InvalidArgument("pod: the first PublishEvents message must carry the pod identity")
            else:
                pod = rec.pod
            current = self.registry.current(pod.pod_uid, pod.epoch)  # raises StaleEpochError
            if current is None:
                # Unknown pod or newer epoch (e.g. this controller restarted): register implicitly;
                # the snapshot pull brings the entries and the namespaces.
                out = self._register_owned(pod, (), 0, owner)
                if out.replaced is not None:
                    self._drop(out.replaced)
                self._refresh_holders()
                current = out.record
            elif rec is not None and current is not rec:
                raise StaleEpochError(f"pod {pod.holder_id!r} was re-registered while this stream was open")
            elif owner is not None and rec is None:
                self._bind_owner(current, owner)
            rec = current
            check_events(msg.events, rec.namespaces, self.cfg.max_event_keys)
            acked, resync = self.ingest.publish(rec, msg.events, new_stream=first)
            first = False
            yield PublishAck(
                acked,
                resync,
                self.ingest.take_l2_listing_request(rec.holder),
                self.caps.take_refused(rec.holder),
            )

    def snapshot_index(self, pod_uid: str, tier: IndexTier) -> HolderSnapshot:
        rec = self.registry.get(pod_uid)
        if rec is None:
            raise UnknownPodError(f"pod_uid={pod_uid!r}: no registered agent with this UID")
        keys = sorted(self.index.holder_keys(rec.holder, tier))
        return HolderSnapshot(rec.pod, keys, self.ingest.last_sequence(rec.holder))

    # --- queries ------------------------------------------------------------------------------
    def resolve(self, q: PrefixQuery) -> Query:
        """Check ``q`` against the limits and compute its chunk keys."""
        cands = q.candidates
        if "" in cands:
            raise InvalidArgument("candidate_pod_uids: contains an empty UID")
        if q.token_ids is not None:
            if q.namespace is None:
                raise InvalidArgument("namespace: required with token_ids (the key namespace of the model)")
            n = len(q.token_ids)
            if n > self.cfg.max_query_tokens:
                raise InvalidArgument(
                    f"token_ids: {n} tokens, more than max_query_tokens={self.cfg.max_query_tokens}"
                )
            ns = q.namespace
            if n // ns.tokens_per_chunk > self.cfg.max_query_chunks:
                raise InvalidArgument(
                    f"token_ids: {n // ns.tokens_per_chunk} chunks, more than max_query_chunks="
                    f"{self.cfg.max_query_chunks}"
                )
            with client_input("token_ids"):
                keys = chunk_keys(q.token_ids, ns)
            return Query(keys, ns.namespace_id(), ns.tokens_per_chunk, n, cands, q.max_pods)
        if q.chunk_keys is not None:
            keys = q.chunk_keys
            if len(keys) > self.cfg.max_query_chunks:
                raise InvalidArgument(
                    f"chunk_keys: {len(keys)} keys, more than max_query_chunks={self.cfg.max_query_chunks}"
                )
            if set(map(len, keys)) - _KEY_LEN:  # keys arrive as bytes: only lengths can be wrong
                with client_input():
                    check_keys(keys)
            if q.namespace is not None:
                ns_id, tpc = q.namespace.namespace_id(), q.namespace.tokens_per_chunk
                if q.namespace_id and q.namespace_id != ns_id:
                    raise InvalidArgument(
                        f"namespace_id={q.namespace_id!r} does not match namespace ({ns_id})"
                    )
            else:
                ns_id, tpc = q.namespace_id, DEFAULT_TOKENS_PER_CHUNK
                self._check_ns_id(ns_id, "namespace_id", "with chunk_keys")
            return Query(keys, ns_id, tpc, len(keys) * tpc, cands, q.max_pods)
        raise InvalidArgument("query: expected token_ids or chunk_keys")

    def _check_ns_id(self, ns_id: str, what: str, used_with: str) -> None:
        if ns_id not in self._valid_ns_ids:
            check_namespace_id(ns_id, what, used_with)
            if len(self._valid_ns_ids) < 4096:  # bounded: ids come from requests
                self._valid_ns_ids.add(ns_id)

    def check_batch(self, n: int, what: str = "requests") -> None:
        if n > self.cfg.max_batch:
            raise InvalidArgument(f"{what}: {n} in one batch, more than max_batch={self.cfg.max_batch}")

    def check_packed(self, p: PackedQueries) -> None:
        self.check_batch(len(p.counts), "packed_query_chunks")
        if len(p.counts) and int(p.counts.max()) > self.cfg.max_query_chunks:
            b = int(p.counts.argmax())
            raise InvalidArgument(
                f"packed_query_chunks[{b}]: {int(p.counts[b])} keys, more than max_query_chunks="
                f"{self.cfg.max_query_chunks}"
            )
        self._check_ns_id(p.namespace_id, "packed_namespace_id", "with packed_chunk_keys")
        if "" in p.candidates:
            raise InvalidArgument("packed_candidate_pod_uids: contains an empty UID")

    def slot_table(self, view: BatchView | MaskView | WordsView) -> SlotTable:
        """The :class:`SlotTable` for ``view``'s slots (cached while neither side changes)."""
        nslots = 64 * view.nwords
        version = self._holders_version  # read before _holders: a racing change only misses the cache
        # A holder without a record here is another replica's agent only when each replica keeps
        # its own registry; with a shared one it is a holder that left (entries not dropped yet).
        remote_ok = self.index.shared and not self.registry.shared
        if view.slots_version is None:
            return SlotTable(view.holders, nslots, self._holders, remote_ok)
        key = (view.slots_version, version, nslots)
        cached = self._slot_table
        if cached is not None and cached[0] == key:
            return cached[1]
        table = SlotTable(view.holders, nslots, self._holders, remote_ok)
        self._slot_table = (key, table)
        return table

    def match(self, q: PrefixQuery) -> MatchResult:
        return self.match_queries([self.resolve(q)])

    def match_batch(self, qs: Sequence[PrefixQuery]) -> MatchResult:
        self.check_batch(len(qs))
        resolved = []
        for i, q in enumerate(qs):
            with within(f"requests[{i}]"):
                resolved.append(self.resolve(q))
        return self.match_queries(resolved)

    def _eligible_int(self, table: SlotTable, namespace_id: str, candidates: frozenset[str]) -> int:
        """:meth:`SlotTable.eligible` (and candidates) as a bitmask over slots."""
        cached_table, by_ns = self._eligible_ints
        if cached_table is not table:
            by_ns = {}
            self._eligible_ints = (table, by_ns)
        mask = by_ns.get(namespace_id)
        if mask is None:
            mask = int.from_bytes(
                np.packbits(table.eligible(namespace_id), bitorder="little").tobytes(), "little"
            )
            if len(by_ns) < 4096:  # bounded: namespace ids come from requests
                by_ns[namespace_id] = mask
        if candidates:
            mask &= int.from_bytes(
                np.packbits(table.candidates(candidates), bitorder="little").tobytes(), "little"
            )
        return mask

    def match_one(
        self, keys: Sequence[bytes] | np.ndarray, namespace_id: str, candidates: frozenset[str], max_pods: int
    ) -> MatchResult:
        """One query without numpy until the result (a router's usual request): the index's mask rows
        (:meth:`ChunkIndex.lookup_words`) and :func:`match_words` (both compiled where the extension is
        built); the same answer as a batch of one."""
        view = self.index.lookup_words(keys)
        table = self.slot_table(view)
        eligible = self._eligible_int(table, namespace_id, candidates)
        m = match_words(view.words, view.nwords, eligible, max_pods)
        return MatchResult(m, table, [len(keys)])

    def match_queries(self, qs: Sequence[Query]) -> MatchResult:
        """Match resolved queries at once: one index lookup and one set of numpy calls per batch."""
        if len(qs) == 1:
            q = qs[0]
            return self.match_one(q.keys, q.namespace_id, q.candidates, q.max_pods)
        view = self.index.lookup_batch([q.keys for q in qs])
        table = self.slot_table(view)
        nslots = 64 * view.nwords
        ns0 = qs[0].namespace_id if qs else ""
        if all(q.namespace_id == ns0 and not q.candidates for q in qs):
            eligible = np.broadcast_to(table.eligible(ns0), (len(qs), nslots))
        else:
            eligible = np.empty((len(qs), nslots), dtype=bool)
            for b, q in enumerate(qs):
                row = table.eligible(q.namespace_id)
                eligible[b] = row & table.candidates(q.candidates) if q.candidates else row
        max_pods = [q.max_pods for q in qs]
        m = match_batch(view.words, eligible, max_pods if any(max_pods) else ())
        return MatchResult(m, table, [len(q.keys) for q in qs])

    def match_packed(self, p: PackedQueries) -> MatchResult:
        """:meth:`match_queries` of packed queries (one namespace, candidates and max_pods for all)."""
        self.check_packed(p)
        if len(p.counts) == 1:
            return self.match_one(p.keys, p.namespace_id, p.candidates, p.max_pods)
        view = self.index.lookup_packed(p.keys, p.counts)
        table = self.slot_table(view)
        nq = len(p.counts)
        row = table.eligible(p.namespace_id)
        if p.candidates:
            row = row & table.candidates(p.candidates)
        eligible = np.broadcast_to(row, (nq, 64 * view.nwords))
        m = match_batch(view.words, eligible, [p.max_pods] * nq if p.max_pods else ())
        return MatchResult(m, table, p.counts.tolist())

    # --- scoring ------------------------------------------------------------------------------
    def check_score(self, sq: ScoreQuery) -> None:
        """Validate the Score-only fields (the match is checked by :meth:`resolve`)."""
        if sq.speculative_ttl_ms > self.cfg.max_speculative_ttl_ms:
            raise InvalidArgument(
                f"speculative_ttl_ms={sq.speculative_ttl_ms}: expected <= "
                f"{self.cfg.max_speculative_ttl_ms} (max_speculative_ttl_ms); reservations are short-lived"
            )

    def score(self, sq: ScoreQuery) -> ScoreResult:
        self.check_score(sq)
        return self._score(sq, self.resolve(sq.match))

    def score_batch(self, sqs: Sequence[ScoreQuery]) -> list[ScoreResult]:
        """Every query is validated before any is scored (or reserves anything)."""
        self.check_batch(len(sqs))
        qs = []
        for i, sq in enumerate(sqs):
            with within(f"requests[{i}]"):
                self.check_score(sq)
            with within(f"requests[{i}].match"):
                qs.append(self.resolve(sq.match))
        self._check_answer_size(sqs, qs)
        return [self._score(sq, q) for sq, q in zip(sqs, qs, strict=True)]

    def _check_answer_size(self, sqs: Sequence[ScoreQuery], qs: Sequence[Query]) -> None:
        """ResourceExhausted, before anything is scored, when the answer cannot fit one message: a
        query lists at least every eligible agent of this replica (or its candidates), up to
        ``top_k``, so the smallest such entries give a lower bound of the answer's size."""
        holders = list(self._holders.values())
        by_namespace: dict[str, list[int]] = {}  # entry sizes, smallest first, of queries without candidates

        def entry_sizes(q: Query) -> list[int]:
            if not q.candidates and q.namespace_id in by_namespace:
                return by_namespace[q.namespace_id]
            known = {
                r.pod.pod_uid: len(r.pod.pod_uid) + len(r.pod.pod_name)
                for r in holders
                if (not q.candidates or r.pod.pod_uid in q.candidates)
                and (not r.namespaces or q.namespace_id in r.namespaces)
            }
            known.update((uid, len(uid)) for uid in q.candidates - known.keys())
            sizes = sorted(_SCORE_ENTRY_MIN_BYTES + n for n in known.values())
            if not q.candidates:
                by_namespace[q.namespace_id] = sizes
            return sizes

        least = 0
        for i, (sq, q) in enumerate(zip(sqs, qs, strict=True)):
            sizes = entry_sizes(q)
            least += sum(sizes[: sq.top_k] if sq.top_k else sizes)
            if least > self.cfg.max_message_bytes:
                raise ResourceExhausted(
                    f"BatchScore: the answer to {len(sqs)} queries would take more than "
                    f"max_message_bytes={self.cfg.max_message_bytes} bytes (already past it at "
                    f"requests[{i}], whose answer lists {len(sizes)} pods with top_k={sq.top_k}); ask for "
                    "fewer pods per query with top_k, or send fewer queries per batch"
                )

    def _score(self, sq: ScoreQuery, q: Query) -> ScoreResult:
        r = self.match_queries([q])
        table = r.table
        m = r.match.query(0)
        by_uid: dict[str, Candidate] = {}
        holder_by_uid: dict[str, str] = {}
        local: dict[str, AgentRecord] = {}  # uid -> this replica's record (None: remote or unknown)
        for p in m.pods:
            rec = table.records[p.slot]
            uid = table.uids[p.slot]
            assert uid is not None  # only eligible (answerable) slots are listed
            by_uid[uid] = Candidate(
                uid, table.names[p.slot], p.gpu, p.l1, p.peer, rec.load if rec else AgentLoad(), p.l2
            )
            holder_by_uid[uid] = table.holders[p.slot]
            if rec is not None:
                local[uid] = rec
        for rec in self._holders.values():
            uid = rec.pod.pod_uid
            if uid in by_uid or (q.candidates and uid not in q.candidates):
                continue
            if rec.namespaces and q.namespace_id not in rec.namespaces:
                continue
            by_uid[uid] = Candidate(uid, rec.pod.pod_name, 0, 0, m.peer_fetchable, rec.load)
            holder_by_uid[uid] = rec.holder
            local[uid] = rec
        for uid in q.candidates - by_uid.keys():
            by_uid[uid] = Candidate(uid, "", 0, 0, 0, AgentLoad())  # no agent known: recompute only
        ranked = rank(list(by_uid.values()), self.params, q.num_tokens, q.tokens_per_chunk)
        if sq.top_k:
            ranked = ranked[: sq.top_k]
        if sq.reserve and ranked and q.keys:
            self._reserve(ranked[0].candidate.pod_uid, holder_by_uid, local, q.keys, sq.speculative_ttl_ms)
        return ScoreResult(len(q.keys), ranked)

    def _reserve(
        self,
        uid: str,
        holder_by_uid: dict[str, str],
        local: dict[str, AgentRecord],
        keys: list[bytes],
        ttl_ms: int,
    ) -> None:
        """Speculative GPU entries for the chosen pod (cover the window before its events arrive)."""
        best = holder_by_uid.get(uid)
        if best is None:
            return
        self.index.add_speculative(best, keys, ttl_ms or self.cfg.speculative_ttl_ms)
        best_rec = local.get(uid)
        cur = self.registry.get(uid) if best_rec is not None and best_rec.dropped else None
        if best_rec is not None and best_rec.dropped and (cur is None or cur.holder != best):
            # Its lease lapsed meanwhile: the entry must not give the dead holder a slot.
            self.index.drop_holder(best)

    # --- introspection ------------------------------------------------------------------------
    def list_agents(self) -> list[AgentInfo]:
        out = []
        for rec in sorted(self.registry.all(), key=lambda r: r.pod.pod_uid):
            load = rec.load
            if not load.l1_capacity_bytes and rec.l1_capacity_bytes:
                load = msgspec.structs.replace(load, l1_capacity_bytes=rec.l1_capacity_bytes)
            out.append(
                AgentInfo(
                    pod=rec.pod,
                    load=load,
                    lease_remaining_ms=self.registry.lease_remaining_ms(rec),
                    num_chunks=self.index.holder_entries(rec.holder),
                    last_sequence=max(self.ingest.last_sequence(rec.holder), rec.last_sequence),
                )
            )
        return out

    def stats(self) -> ControllerStats:
        return ControllerStats(
            num_entries=self.index.num_entries(),
            num_agents=len(self.registry.all()),
            events_ingested=self.ingest.events_applied,
            resyncs=self.ingest.resyncs,
            index_backend=self.index.backend,
            rejected_requests=self.rejected,
            vllm_events_ingested=sum(s.events for s in self.vllm),
            vllm_replays=sum(s.replays for s in self.vllm),
            expired_leases=self.registry.expired_total,
        )
