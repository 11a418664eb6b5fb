"""ControllerService: registry + ingest + index + scoring behind gRPC (with health and reflection).

:class:`Controller` holds the logic and is usable without gRPC; :class:`ControllerServicer` maps it
onto the protobuf API and turns errors into status codes (ValueError/TypeError ->
INVALID_ARGUMENT, stale epoch -> FAILED_PRECONDITION, unknown pod -> NOT_FOUND) with the message
naming the bad value. Nothing is applied from a request that fails validation.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import msgspec
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvgrid.api.v1 import common_pb2, controller_pb2, controller_pb2_grpc
from kvgrid.common.hashing import CHUNK_KEY_BYTES, DEFAULT_TOKENS_PER_CHUNK, chunk_keys
from kvgrid.common.wire import key_namespace_from_proto, pod_identity_from_proto, pod_identity_to_proto
from kvgrid.controller.compact import compact_response, pod_ref_bytes
from kvgrid.controller.config import ControllerConfig
from kvgrid.controller.index import BatchView, ChunkIndex, IndexTier, MemoryIndex, check_keys
from kvgrid.controller.ingest import Ingestor, events_from_proto, grpc_snapshot
from kvgrid.controller.matching import BatchMatch, match_batch
from kvgrid.controller.metrics import ControllerMetrics, StatsSource
from kvgrid.controller.registry import (
    AgentLoad,
    AgentRecord,
    Registry,
    StaleEpochError,
    UnknownPodError,
)
from kvgrid.controller.scoring import Candidate, ScoreParams, rank
from kvgrid.controller.vllm_events import VllmEventSubscriber

if TYPE_CHECKING:
    from kvgrid.common.telemetry import Telemetry

__all__ = ["Controller", "ControllerServicer", "PackedQueries", "Query", "make_index", "serve"]

log = logging.getLogger(__name__)

SERVICE_NAME = controller_pb2.DESCRIPTOR.services_by_name["ControllerService"].full_name


def make_index(cfg: ControllerConfig) -> ChunkIndex:
    if cfg.index_backend == "redis":
        from kvgrid.controller.index_redis import RedisIndex

        return RedisIndex(cfg.redis_url, prefix=cfg.redis_prefix)
    return MemoryIndex()


class Query(msgspec.Struct, frozen=True):
    keys: list[bytes]
    namespace_id: str
    tokens_per_chunk: int
    num_tokens: int
    candidates: frozenset[str]
    max_pods: int


class PackedQueries(msgspec.Struct, frozen=True):
    """The packed form of BatchMatchPrefixRequest: ``keys`` uint64 ``[total, 2]`` (a view of the
    request's bytes), ``counts`` int64 keys per query; the rest applies to every query."""

    keys: np.ndarray
    counts: np.ndarray
    namespace_id: str
    candidates: frozenset[str]
    max_pods: int


_PACKED_FIELDS = (
    "packed_chunk_keys",
    "packed_query_chunks",
    "packed_namespace_id",
    "packed_candidate_pod_uids",
    "packed_max_pods",
)
_NO_CANDIDATES: frozenset[str] = frozenset()
_KEY_LEN = {CHUNK_KEY_BYTES}


def _is_hex_id(s: str) -> bool:
    return len(s) == 32 and not s.strip("0123456789abcdef")


class SlotTable:
    """Per index slot: who answers for it (pod UID, name, record, holder) and, per namespace, whether
    it is eligible. Derived from the registry and the index's slot table only, so it is built once
    per (slot table version, registry version) and shared by every query until either changes.
    """

    def __init__(
        self, holders: dict[int, str], nslots: int, records: dict[str, AgentRecord], remote_ok: bool
    ) -> None:
        self.uids: list[str | None] = [None] * nslots  # None: not answerable
        self.names: list[str] = [""] * nslots
        self.records: list[AgentRecord | None] = [None] * nslots
        self.holders: list[str] = [""] * nslots
        for slot, holder in holders.items():
            if slot >= nslots:
                continue
            rec = records.get(holder)
            if rec is None:
                # Another controller replica's agent (shared index): no namespace/load known here.
                if not remote_ok:
                    continue
                self.uids[slot] = holder.rpartition("/")[0]
            else:
                self.uids[slot] = rec.pod.pod_uid
                self.names[slot] = rec.pod.pod_name
                self.records[slot] = rec
            self.holders[slot] = holder
        self._by_namespace: dict[str, np.ndarray] = {}
        # Wire bytes of each slot's PodRef (compact answers' pod table); unanswerable slots are never listed.
        self.pod_refs: list[bytes] = [
            pod_ref_bytes(u, n) if u is not None else b"" for u, n in zip(self.uids, self.names, strict=True)
        ]

    def eligible(self, namespace_id: str) -> np.ndarray:
        """bool per slot: answerable and serving ``namespace_id`` (agents that named none serve all)."""
        row = self._by_namespace.get(namespace_id)
        if row is None:
            row = np.array(
                [
                    uid is not None and (rec is None or not rec.namespaces or namespace_id in rec.namespaces)
                    for uid, rec in zip(self.uids, self.records, strict=True)
                ],
                dtype=bool,
            )
            if len(self._by_namespace) < 4096:  # bounded: namespace ids come from requests
                self._by_namespace[namespace_id] = row
        return row

    def candidates(self, uids: frozenset[str]) -> np.ndarray:
        """bool per slot: its pod UID is one of ``uids``."""
        return np.array([u is not None and u in uids for u in self.uids], dtype=bool)


class Controller:
    """The controller's state and operations (thread-safe)."""

    def __init__(
        self, cfg: ControllerConfig, index: ChunkIndex | None = None, telemetry: Telemetry | None = None
    ) -> None:
        self.cfg = cfg
        self.index = index if index is not None else make_index(cfg)
        self.registry = Registry(cfg.lease_ttl_ms)
        self._channels: dict[str, grpc.Channel] = {}
        self._channels_lock = threading.Lock()
        self.ingest = Ingestor(
            self.index,
            grpc_snapshot(self._channels, self._channels_lock),
            snapshot_timeout_s=cfg.snapshot_timeout_ms / 1000,
            retry_s=cfg.resync_retry_ms / 1000,
            on_namespaces=self._learn_namespaces,
            max_buffered_events=cfg.max_resync_buffer_events,
        )
        self.params = ScoreParams.from_config(cfg)
        self.rejected = 0
        self._holders: dict[str, AgentRecord] = {}
        self._holders_lock = threading.Lock()
        # Bumped after every change of _holders or of a record's namespaces (SlotTable cache key).
        self._holders_version = 0
        self._slot_table: tuple[tuple[int, int, int], SlotTable] | None = None
        self._valid_ns_ids: set[str] = set()  # namespace ids already checked (hex, 32 chars)
        self._stop = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep_loop, name="kvgrid-lease-sweeper", daemon=True)
        self.vllm = [VllmEventSubscriber(src, self.index, self._holder_of_uid) for src in cfg.vllm_sources]
        self.metrics: ControllerMetrics | None = None
        if telemetry is not None:
            self.metrics = ControllerMetrics(
                telemetry.meter,
                StatsSource(
                    entries=self.index.num_entries,
                    chunks=self.index.num_chunks,
                    agents=lambda: len(self.registry.all()),
                    events_ingested=lambda: self.ingest.events_applied,
                    resyncs=lambda: self.ingest.resyncs,
                    rejected=lambda: self.rejected,
                    vllm_events=lambda: sum(s.events for s in self.vllm),
                    expired_leases=lambda: self.registry.expired_total,
                ),
            )

    # --- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        self._sweeper.start()
        for s in self.vllm:
            s.start()

    def stop(self) -> None:
        self._stop.set()
        for s in self.vllm:
            s.stop()
        self.ingest.close()
        with self._channels_lock:
            for ch in self._channels.values():
                ch.close()
        self.index.close()

    def _sweep_loop(self) -> None:
        while not self._stop.wait(self.cfg.sweep_interval_ms / 1000):
            try:
                self.sweep()
            except Exception:  # keep sweeping whatever one round hit (e.g. Redis briefly down)
                log.exception("lease sweep failed")

    def sweep(self) -> list[AgentRecord]:
        gone = self.registry.expire()
        for rec in gone:
            log.info("lease of %s lapsed: dropping its entries", rec.holder)
            self._drop(rec)
        if gone:
            self._refresh_holders()
        return gone

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
        good = tuple(ns for ns in namespaces if _is_hex_id(ns))
        if good and set(good) != set(rec.namespaces):
            rec.namespaces = tuple(dict.fromkeys((*rec.namespaces, *good)))
            with self._holders_lock:
                self._holders_version += 1

    # --- registry -----------------------------------------------------------------------------
    def register(self, req: controller_pb2.RegisterAgentRequest) -> controller_pb2.RegisterAgentResponse:
        pod = pod_identity_from_proto(req.pod)
        out = self.registry.register(pod, list(req.namespaces), req.l1_capacity_bytes)
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
        return controller_pb2.RegisterAgentResponse(
            lease_ttl_ms=self.cfg.lease_ttl_ms, snapshot_requested=out.is_new and bool(pod.agent_address)
        )

    def heartbeat(self, req: controller_pb2.HeartbeatRequest) -> controller_pb2.HeartbeatResponse:
        if not req.pod_uid:
            raise ValueError("pod_uid='': expected the pod's UID")
        load = None
        if req.HasField("load"):
            ld = req.load
            if not 0.0 <= ld.gpu_kv_usage <= 1.0:
                raise ValueError(f"load.gpu_kv_usage={ld.gpu_kv_usage}: expected a fraction in [0, 1]")
            load = AgentLoad(
                running_requests=ld.running_requests,
                waiting_requests=ld.waiting_requests,
                gpu_kv_usage=ld.gpu_kv_usage,
                l1_used_bytes=ld.l1_used_bytes,
                l1_capacity_bytes=ld.l1_capacity_bytes,
            )
        try:
            self.registry.heartbeat(req.pod_uid, req.epoch, load)
        except UnknownPodError:
            return controller_pb2.HeartbeatResponse(lease_ttl_ms=self.cfg.lease_ttl_ms, reregister=True)
        return controller_pb2.HeartbeatResponse(lease_ttl_ms=self.cfg.lease_ttl_ms, reregister=False)

    # --- ingest -------------------------------------------------------------------------------
    def publish(
        self, requests: Iterator[controller_pb2.PublishEventsRequest]
    ) -> Iterator[controller_pb2.PublishEventsResponse]:
        rec: AgentRecord | None = None
        first = True
        for req in requests:
            if req.HasField("pod"):
                pod = pod_identity_from_proto(req.pod)
                if rec is not None and (pod.pod_uid, pod.epoch) != (rec.pod.pod_uid, rec.pod.epoch):
                    raise ValueError(
                        f"pod {pod.holder_id!r}: one PublishEvents stream carries one pod incarnation "
                        f"({rec.holder!r}); open a new stream"
                    )
            elif rec is None:
                raise ValueError("pod: the first PublishEvents message must carry the pod identity")
            else:
                pod = rec.pod
            current = self.registry.current(pod.pod_uid, pod.epoch)  # raises StaleEpochError
            if current is None:
                # Unknown pod or newer epoch (e.g. this controller restarted): register implicitly;
                # the snapshot pull brings the entries and the namespaces.
                out = self.registry.register(pod, (), 0)
                if out.replaced is not None:
                    self._drop(out.replaced)
                self._refresh_holders()
                current = out.record
            elif rec is not None and current is not rec:
                raise StaleEpochError(f"pod {pod.holder_id!r} was re-registered while this stream was open")
            rec = current
            events = events_from_proto(req.events, rec.namespaces, self.cfg.max_event_keys)
            acked, resync = self.ingest.publish(rec, events, new_stream=first)
            first = False
            yield controller_pb2.PublishEventsResponse(acked_sequence=acked, resync_started=resync)

    def snapshot_index(
        self, req: controller_pb2.SnapshotIndexRequest
    ) -> controller_pb2.SnapshotIndexResponse:
        rec = self.registry.get(req.pod_uid)
        if rec is None:
            raise UnknownPodError(f"pod_uid={req.pod_uid!r}: no registered agent with this UID")
        tiers = {
            common_pb2.TIER_UNSPECIFIED: IndexTier.L1,
            common_pb2.TIER_L1: IndexTier.L1,
            common_pb2.TIER_GPU: IndexTier.GPU,
        }
        if req.tier not in tiers:
            raise ValueError(f"tier={req.tier}: expected TIER_L1 or TIER_GPU")
        keys = sorted(self.index.holder_keys(rec.holder, tiers[req.tier]))
        return controller_pb2.SnapshotIndexResponse(
            pod=pod_identity_to_proto(rec.pod),
            chunk_keys=keys,
            last_sequence=self.ingest.last_sequence(rec.holder),
        )

    # --- queries ------------------------------------------------------------------------------
    def parse_query(self, req: controller_pb2.MatchPrefixRequest) -> Query:
        which = req.WhichOneof("query")
        cands = frozenset(req.candidate_pod_uids) if req.candidate_pod_uids else _NO_CANDIDATES
        if "" in cands:
            raise ValueError("candidate_pod_uids: contains an empty UID")
        if which == "token_ids":
            if not req.HasField("namespace"):
                raise ValueError("namespace: required with token_ids (the key namespace of the model)")
            n = len(req.token_ids.ids)
            if n > self.cfg.max_query_tokens:
                raise ValueError(
                    f"token_ids: {n} tokens, more than max_query_tokens={self.cfg.max_query_tokens}"
                )
            ns = key_namespace_from_proto(req.namespace)
            if n // ns.tokens_per_chunk > self.cfg.max_query_chunks:
                raise ValueError(
                    f"token_ids: {n // ns.tokens_per_chunk} chunks, more than max_query_chunks="
                    f"{self.cfg.max_query_chunks}"
                )
            keys = chunk_keys(list(req.token_ids.ids), ns)
            return Query(keys, ns.namespace_id(), ns.tokens_per_chunk, n, cands, req.max_pods)
        if which == "chunk_keys":
            keys = list(req.chunk_keys.keys)
            if len(keys) > self.cfg.max_query_chunks:
                raise ValueError(
                    f"chunk_keys: {len(keys)} keys, more than max_query_chunks={self.cfg.max_query_chunks}"
                )
            if set(map(len, keys)) - _KEY_LEN:  # protobuf gives bytes: only lengths can be wrong
                check_keys(keys)
            if req.HasField("namespace"):
                ns = key_namespace_from_proto(req.namespace)
                ns_id, tpc = ns.namespace_id(), ns.tokens_per_chunk
                if req.namespace_id and req.namespace_id != ns_id:
                    raise ValueError(f"namespace_id={req.namespace_id!r} does not match namespace ({ns_id})")
            else:
                ns_id, tpc = req.namespace_id, DEFAULT_TOKENS_PER_CHUNK
                self._check_ns_id(ns_id, "namespace_id", "chunk_keys")
            return Query(keys, ns_id, tpc, len(keys) * tpc, cands, req.max_pods)
        raise ValueError("query: expected token_ids or chunk_keys")

    def _check_ns_id(self, ns_id: str, what: str, used_with: str) -> None:
        if ns_id not in self._valid_ns_ids:
            if not _is_hex_id(ns_id):
                raise ValueError(
                    f"{what}={ns_id!r:.60}: expected the 32-char hex namespace id with {used_with}"
                )
            if len(self._valid_ns_ids) < 4096:  # bounded: ids come from requests
                self._valid_ns_ids.add(ns_id)

    def parse_packed(self, req: controller_pb2.BatchMatchPrefixRequest) -> PackedQueries:
        """The packed form of ``req`` (its keys stay one buffer: no bytes object per key)."""
        if len(req.requests):
            raise ValueError(
                f"requests and {', '.join(_packed_fields_set(req))}: both set, expected either requests "
                "or the packed_* fields"
            )
        counts = np.array(list(req.packed_query_chunks), dtype=np.int64)
        self.check_batch(len(counts), "packed_query_chunks")
        if len(counts) and int(counts.max()) > self.cfg.max_query_chunks:
            b = int(counts.argmax())
            raise ValueError(
                f"packed_query_chunks[{b}]: {int(counts[b])} keys, more than max_query_chunks="
                f"{self.cfg.max_query_chunks}"
            )
        raw = req.packed_chunk_keys
        total = int(counts.sum())
        if len(raw) != CHUNK_KEY_BYTES * total:
            raise ValueError(
                f"packed_chunk_keys: {len(raw)} bytes, expected {CHUNK_KEY_BYTES} * sum(packed_query_chunks)"
                f" = {CHUNK_KEY_BYTES * total}"
            )
        self._check_ns_id(req.packed_namespace_id, "packed_namespace_id", "packed_chunk_keys")
        cands = frozenset(req.packed_candidate_pod_uids) if req.packed_candidate_pod_uids else _NO_CANDIDATES
        if "" in cands:
            raise ValueError("packed_candidate_pod_uids: contains an empty UID")
        keys = np.frombuffer(raw, dtype="<u8").reshape(total, 2)
        return PackedQueries(keys, counts, req.packed_namespace_id, cands, req.packed_max_pods)

    def slot_table(self, view: BatchView) -> SlotTable:
        """The :class:`SlotTable` for ``view``'s slots (cached while neither side changes)."""
        nslots = 64 * view.nwords
        version = self._holders_version  # read before _holders: a racing change only misses the cache
        remote_ok = self.index.backend != "memory"
        if view.slots_version is None:
            return SlotTable(view.holders, nslots, self._holders, remote_ok)
        key = (view.slots_version, version, nslots)
        cached = self._slot_table
        if cached is not None and cached[0] == key:
            return cached[1]
        table = SlotTable(view.holders, nslots, self._holders, remote_ok)
        self._slot_table = (key, table)
        return table

    def match_batch(self, qs: Sequence[Query]) -> tuple[BatchMatch, SlotTable]:
        """Match every query at once: one index lookup and one set of numpy calls per batch."""
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
        return match_batch(view.words, eligible, max_pods if any(max_pods) else ()), table

    def match_packed(self, p: PackedQueries) -> tuple[BatchMatch, SlotTable]:
        """:meth:`match_batch` of packed queries (one namespace, candidates and max_pods for all)."""
        view = self.index.lookup_packed(p.keys, p.counts)
        table = self.slot_table(view)
        nq = len(p.counts)
        row = table.eligible(p.namespace_id)
        if p.candidates:
            row = row & table.candidates(p.candidates)
        eligible = np.broadcast_to(row, (nq, 64 * view.nwords))
        return match_batch(view.words, eligible, [p.max_pods] * nq if p.max_pods else ()), table

    def packed_match_response(
        self, p: PackedQueries, compact: bool = False
    ) -> controller_pb2.BatchMatchPrefixResponse:
        m, table = self.match_packed(p)
        num_chunks = p.counts.tolist()
        if compact:
            return compact_response(m, num_chunks, table.pod_refs)
        return controller_pb2.BatchMatchPrefixResponse(responses=_readable(m, table, num_chunks))

    def match_response(self, q: Query) -> controller_pb2.MatchPrefixResponse:
        m, table = self.match_batch([q])
        return _readable(m, table, [len(q.keys)])[0]

    def batch_match_response(
        self, qs: Sequence[Query], compact: bool = False
    ) -> controller_pb2.BatchMatchPrefixResponse:
        m, table = self.match_batch(qs)
        num_chunks = [len(q.keys) for q in qs]
        if compact:
            return compact_response(m, num_chunks, table.pod_refs)
        return controller_pb2.BatchMatchPrefixResponse(responses=_readable(m, table, num_chunks))

    def check_score(self, req: controller_pb2.ScoreRequest) -> None:
        """Validate the Score-only fields (the match is checked by :meth:`parse_query`)."""
        if req.speculative_ttl_ms > self.cfg.max_speculative_ttl_ms:
            raise ValueError(
                f"speculative_ttl_ms={req.speculative_ttl_ms}: expected <= "
                f"{self.cfg.max_speculative_ttl_ms} (max_speculative_ttl_ms); reservations are short-lived"
            )

    def score(self, req: controller_pb2.ScoreRequest) -> controller_pb2.ScoreResponse:
        self.check_score(req)
        q = self.parse_query(req.match)
        bm, table = self.match_batch([q])
        m = bm.query(0)
        by_uid: dict[str, Candidate] = {}
        holder_by_uid: dict[str, str] = {}
        local: dict[str, AgentRecord] = {}  # uid -> this replica's record (None: remote or unknown)
        for p in m.pods:
            rec = table.records[p.slot]
            uid = table.uids[p.slot]
            assert uid is not None  # only eligible (answerable) slots are listed
            by_uid[uid] = Candidate(
                uid, table.names[p.slot], p.gpu, p.l1, p.peer, rec.load if rec else AgentLoad()
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
        if req.top_k:
            ranked = ranked[: req.top_k]
        if req.reserve and ranked and q.keys:
            best_uid = ranked[0].candidate.pod_uid
            best = holder_by_uid.get(best_uid)
            if best is not None:
                ttl = req.speculative_ttl_ms or self.cfg.speculative_ttl_ms
                self.index.add_speculative(best, q.keys, ttl)
                best_rec = local.get(best_uid)
                cur = self.registry.get(best_uid) if best_rec is not None and best_rec.dropped else None
                if best_rec is not None and best_rec.dropped and (cur is None or cur.holder != best):
                    # Its lease lapsed meanwhile: the entry must not give the dead holder a slot.
                    self.index.drop_holder(best)
        resp = controller_pb2.ScoreResponse(num_query_chunks=len(q.keys))
        for e in ranked:
            c = e.candidate
            resp.scores.add(
                match=controller_pb2.PodMatch(
                    pod_uid=c.pod_uid,
                    pod_name=c.pod_name,
                    gpu_chunks=c.gpu,
                    l1_chunks=c.l1,
                    peer_chunks=c.peer,
                ),
                estimated_ttft_ms=e.ttft_ms,
                l1_transfer_ms=e.l1_transfer_ms,
                peer_transfer_ms=e.peer_transfer_ms,
                prefill_ms=e.prefill_ms,
                queue_ms=e.queue_ms,
            )
        return resp

    def check_batch(self, n: int, what: str = "requests") -> None:
        if n > self.cfg.max_batch:
            raise ValueError(f"{what}: {n} in one batch, more than max_batch={self.cfg.max_batch}")

    def list_agents(self) -> controller_pb2.ListAgentsResponse:
        resp = controller_pb2.ListAgentsResponse()
        for rec in sorted(self.registry.all(), key=lambda r: r.pod.pod_uid):
            ld = rec.load
            resp.agents.add(
                pod=pod_identity_to_proto(rec.pod),
                load=controller_pb2.AgentLoad(
                    running_requests=ld.running_requests,
                    waiting_requests=ld.waiting_requests,
                    gpu_kv_usage=ld.gpu_kv_usage,
                    l1_used_bytes=ld.l1_used_bytes,
                    l1_capacity_bytes=ld.l1_capacity_bytes or rec.l1_capacity_bytes,
                ),
                lease_remaining_ms=self.registry.lease_remaining_ms(rec),
                num_chunks=self.index.holder_entries(rec.holder),
                last_sequence=self.ingest.last_sequence(rec.holder),
            )
        return resp

    def stats(self) -> controller_pb2.GetStatsResponse:
        return controller_pb2.GetStatsResponse(
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


def _readable(
    m: BatchMatch, table: SlotTable, num_chunks: Sequence[int]
) -> list[controller_pb2.MatchPrefixResponse]:
    """Every query of ``m`` as the readable MatchPrefixResponse (one PodMatch per listed pod)."""
    uids, names = table.uids, table.names
    slots = m.pods[m.pod_index].tolist()
    gpu, l1, peer = m.gpu.tolist(), m.l1.tolist(), m.peer.tolist()
    offsets, fetchable = m.offsets.tolist(), m.peer_fetchable.tolist()
    out = []
    for b, nc in enumerate(num_chunks):
        resp = controller_pb2.MatchPrefixResponse(num_query_chunks=nc, peer_fetchable_chunks=fetchable[b])
        add = resp.matches.add
        for i in range(offsets[b], offsets[b + 1]):
            s = slots[i]
            add(pod_uid=uids[s], pod_name=names[s], gpu_chunks=gpu[i], l1_chunks=l1[i], peer_chunks=peer[i])
        out.append(resp)
    return out


F = TypeVar("F", bound=Callable[..., Any])


def _is_packed(req: controller_pb2.BatchMatchPrefixRequest) -> bool:
    return bool(
        req.packed_query_chunks
        or req.packed_chunk_keys
        or req.packed_namespace_id
        or req.packed_candidate_pod_uids
        or req.packed_max_pods
    )


def _packed_fields_set(req: controller_pb2.BatchMatchPrefixRequest) -> list[str]:
    return [f for f in _PACKED_FIELDS if getattr(req, f)]


def _status(ctl: Controller, context: grpc.ServicerContext, exc: BaseException) -> None:
    if isinstance(exc, ValueError | TypeError):
        code = grpc.StatusCode.INVALID_ARGUMENT
    elif isinstance(exc, StaleEpochError):
        code = grpc.StatusCode.FAILED_PRECONDITION
    elif isinstance(exc, UnknownPodError):
        code = grpc.StatusCode.NOT_FOUND
    else:
        log.exception("internal error")
        context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        return
    ctl.rejected += 1
    context.abort(code, str(exc))


def _unary(fn: F) -> F:
    @functools.wraps(fn)
    def wrapper(self: ControllerServicer, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return fn(self, request, context)
        except Exception as exc:  # mapped to a status; abort raises
            _status(self.ctl, context, exc)

    return wrapper  # type: ignore[return-value]


class ControllerServicer(controller_pb2_grpc.ControllerServiceServicer):
    def __init__(self, ctl: Controller) -> None:
        self.ctl = ctl

    @_unary
    def RegisterAgent(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self.ctl.register(request)

    @_unary
    def Heartbeat(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self.ctl.heartbeat(request)

    def PublishEvents(self, request_iterator: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            yield from self.ctl.publish(request_iterator)
        except grpc.RpcError as exc:
            # The agent went away (stopped, killed, network): a normal end of the stream; it
            # resyncs when it comes back.
            log.info("event stream ended by the agent: %s", exc.code() if hasattr(exc, "code") else exc)
        except Exception as exc:
            _status(self.ctl, context, exc)

    @_unary
    def SnapshotIndex(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self.ctl.snapshot_index(request)

    def _timed(self, rpc: str, queries: int, t0: float) -> None:
        if self.ctl.metrics is not None:
            self.ctl.metrics.match_call(rpc, queries, time.perf_counter() - t0)

    @_unary
    def MatchPrefix(self, request: Any, context: grpc.ServicerContext) -> Any:
        t0 = time.perf_counter()
        resp = self.ctl.match_response(self.ctl.parse_query(request))
        self._timed("MatchPrefix", 1, t0)
        return resp

    @_unary
    def BatchMatchPrefix(self, request: Any, context: grpc.ServicerContext) -> Any:
        t0 = time.perf_counter()
        if _is_packed(request):
            p = self.ctl.parse_packed(request)
            resp = self.ctl.packed_match_response(p, compact=request.compact)
            self._timed("BatchMatchPrefix", len(p.counts), t0)
            return resp
        self.ctl.check_batch(len(request.requests))
        qs = []
        parse = self.ctl.parse_query
        for i, r in enumerate(request.requests):
            try:
                qs.append(parse(r))
            except (ValueError, TypeError) as e:
                raise ValueError(f"requests[{i}]: {e}") from None
        resp = self.ctl.batch_match_response(qs, compact=request.compact)
        self._timed("BatchMatchPrefix", len(qs), t0)
        return resp

    @_unary
    def Score(self, request: Any, context: grpc.ServicerContext) -> Any:
        t0 = time.perf_counter()
        resp = self.ctl.score(request)
        self._timed("Score", 1, t0)
        return resp

    @_unary
    def BatchScore(self, request: Any, context: grpc.ServicerContext) -> Any:
        t0 = time.perf_counter()
        self.ctl.check_batch(len(request.requests))
        for i, r in enumerate(request.requests):
            try:
                self.ctl.check_score(r)
            except ValueError as e:
                raise ValueError(f"requests[{i}]: {e}") from None
            try:
                self.ctl.parse_query(r.match)
            except (ValueError, TypeError) as e:
                raise ValueError(f"requests[{i}].match: {e}") from None
        resp = controller_pb2.BatchScoreResponse(responses=[self.ctl.score(r) for r in request.requests])
        self._timed("BatchScore", len(request.requests), t0)
        return resp

    @_unary
    def ListAgents(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self.ctl.list_agents()

    @_unary
    def GetStats(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self.ctl.stats()


class Server(msgspec.Struct):
    """A running controller: ``address`` is host:port actually bound."""

    controller: Controller
    grpc_server: Any
    address: str

    def stop(self, grace: float | None = 0.5) -> None:
        self.grpc_server.stop(grace).wait()
        self.controller.stop()


def serve(
    cfg: ControllerConfig, index: ChunkIndex | None = None, telemetry: Telemetry | None = None
) -> Server:
    """Start the controller and its gRPC server (health + reflection); returns once listening.

    With ``telemetry`` (from :func:`kvgrid.common.telemetry.setup_telemetry`) the controller
    records its ``kvgrid_controller_*`` metrics on ``telemetry.meter``.
    """
    ctl = Controller(cfg, index, telemetry)
    opts = [
        ("grpc.max_receive_message_length", cfg.max_message_bytes),
        ("grpc.max_send_message_length", cfg.max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]
    server = grpc.server(ThreadPoolExecutor(max_workers=cfg.grpc_workers), options=opts)
    controller_pb2_grpc.add_ControllerServiceServicer_to_server(ControllerServicer(ctl), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    port = server.add_insecure_port(cfg.listen)
    if port == 0:
        raise ValueError(f"listen={cfg.listen!r}: could not bind")
    ctl.start()
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    host = cfg.listen.rpartition(":")[0]
    return Server(controller=ctl, grpc_server=server, address=f"{host}:{port}")
