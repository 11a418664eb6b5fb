"""The controller's protobuf <-> core conversions (:mod:`kvgrid.controller.core` types).

Requests become core types here; results become responses here. Checks that only concern the
wire form (a oneof left empty, enum values, sequence order, byte lengths of packed keys, both
request forms set) raise :class:`~kvgrid.common.errors.InvalidArgument` here; limits and meaning are
the core's. Shared conversions (pod identity, key namespace) are :mod:`kvgrid.common.wire`'s.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from itertools import chain

import numpy as np

from kvgrid.api.v1 import agent_pb2, common_pb2, controller_pb2
from kvgrid.common.errors import InvalidArgument, client_input
from kvgrid.common.hashing import CHUNK_KEY_BYTES
from kvgrid.common.wire import key_namespace_from_proto, pod_identity_from_proto, pod_identity_to_proto
from kvgrid.controller.compact import compact_response, pod_ref_bytes
from kvgrid.controller.core import (
    AgentInfo,
    ControllerStats,
    EventMessage,
    HolderSnapshot,
    Lease,
    MatchResult,
    PackedQueries,
    PrefixQuery,
    PublishAck,
    Registration,
    ScoreQuery,
    ScoreResult,
)
from kvgrid.controller.index import IndexTier, check_keys
from kvgrid.controller.ingest import AgentSnapshot, ChunkEvent, EventKind
from kvgrid.controller.registry import AgentLoad
from kvgrid.controller.slots import SlotTable

__all__ = [
    "agent_snapshot_from_proto",
    "agents_to_proto",
    "batch_match_to_proto",
    "event_messages_from_proto",
    "events_from_proto",
    "is_packed",
    "lease_to_proto",
    "load_from_proto",
    "match_to_proto",
    "packed_from_proto",
    "prefix_query_from_proto",
    "publish_ack_to_proto",
    "registration_to_proto",
    "score_query_from_proto",
    "score_to_proto",
    "snapshot_to_proto",
    "stats_to_proto",
    "tier_from_proto",
]

_NO_CANDIDATES: frozenset[str] = frozenset()
_TIERS = {
    common_pb2.TIER_L1: IndexTier.L1,
    common_pb2.TIER_GPU: IndexTier.GPU,
    common_pb2.TIER_L2: IndexTier.L2,
}
_STORED_TIERS = "TIER_L1, TIER_GPU or TIER_L2"


def _tier_name(t: int) -> str:
    """``t`` as the message names it: the number, and the enum name when it has one."""
    try:
        return f"{t} ({common_pb2.Tier.Name(t)})"  # type: ignore[arg-type]
    except ValueError:
        return str(t)


_KEY_LEN = {CHUNK_KEY_BYTES}
_SNAPSHOT_TIERS = {common_pb2.TIER_UNSPECIFIED: IndexTier.L1, **_TIERS}
_PACKED_FIELDS = (
    "packed_chunk_keys",
    "packed_query_chunks",
    "packed_namespace_id",
    "packed_candidate_pod_uids",
    "packed_max_pods",
)


# --- registry and ingest -----------------------------------------------------------------------
def load_from_proto(msg: controller_pb2.AgentLoad) -> AgentLoad:
    return AgentLoad(
        running_requests=msg.running_requests,
        waiting_requests=msg.waiting_requests,
        gpu_kv_usage=msg.gpu_kv_usage,
        l1_used_bytes=msg.l1_used_bytes,
        l1_capacity_bytes=msg.l1_capacity_bytes,
    )


def load_to_proto(load: AgentLoad) -> controller_pb2.AgentLoad:
    return controller_pb2.AgentLoad(
        running_requests=load.running_requests,
        waiting_requests=load.waiting_requests,
        gpu_kv_usage=load.gpu_kv_usage,
        l1_used_bytes=load.l1_used_bytes,
        l1_capacity_bytes=load.l1_capacity_bytes,
    )


def registration_to_proto(r: Registration) -> controller_pb2.RegisterAgentResponse:
    return controller_pb2.RegisterAgentResponse(
        lease_ttl_ms=r.lease_ttl_ms, snapshot_requested=r.snapshot_requested
    )


def lease_to_proto(lease: Lease) -> controller_pb2.HeartbeatResponse:
    return controller_pb2.HeartbeatResponse(
        lease_ttl_ms=lease.lease_ttl_ms,
        reregister=lease.reregister,
        l2_listing_requested=lease.l2_listing_requested,
    )


_KINDS = {int(k): k for k in EventKind}


def events_from_proto(msgs: Sequence[controller_pb2.ChunkEvent]) -> list[ChunkEvent]:
    """Check the wire form of a whole message before anything is applied (bad input changes nothing).

    Per event only what is cheap (this is most of the controller's ingest CPU per key): key lengths
    are checked once for the whole message, and per event only when that finds a bad one (to name
    it); structs are built positionally."""
    out: list[ChunkEvent] = []
    prev = -1
    kinds, tiers, clear, unspecified = _KINDS, _TIERS, EventKind.CLEAR, common_pb2.TIER_UNSPECIFIED
    for i, e in enumerate(msgs):
        seq = e.sequence
        if seq <= prev:
            raise InvalidArgument(
                f"events[{i}].sequence={seq}: expected strictly increasing sequences (previous {prev})"
            )
        prev = seq
        kind = kinds.get(e.kind)
        if kind is None:
            raise InvalidArgument(f"events[{i}].kind={e.kind}: expected ADMIT, EVICT or CLEAR")
        t = e.tier
        tier = tiers.get(t)
        if tier is None and not (t == unspecified and kind is clear):
            raise InvalidArgument(f"events[{i}].tier={_tier_name(t)}: expected {_STORED_TIERS}")
        out.append(ChunkEvent(seq, kind, tier, tuple(e.chunk_keys), e.namespace))
    # protobuf gives bytes: only lengths can be wrong
    if set(map(len, chain.from_iterable(ev.keys for ev in out))) - _KEY_LEN:
        for i, ev in enumerate(out):
            with client_input():
                check_keys(ev.keys, f"events[{i}].chunk_keys")
    return out


def event_messages_from_proto(msgs: Iterable[controller_pb2.PublishEventsRequest]) -> Iterator[EventMessage]:
    for m in msgs:
        pod = pod_identity_from_proto(m.pod) if m.HasField("pod") else None
        yield EventMessage(pod, events_from_proto(m.events))


def publish_ack_to_proto(a: PublishAck) -> controller_pb2.PublishEventsResponse:
    resp = controller_pb2.PublishEventsResponse(
        acked_sequence=a.acked_sequence,
        resync_started=a.resync_started,
        l2_listing_requested=a.l2_listing_requested,
    )
    r = a.refused
    if r.entries:  # absent otherwise: an answer without refusals is the bytes it always was
        resp.refused_entries = r.entries
        resp.refused.pod_cap = r.pod
        resp.refused.identity_cap = r.identity
        resp.refused.total_cap = r.total
    return resp


def tier_from_proto(tier: common_pb2.Tier.ValueType) -> IndexTier:
    """SnapshotIndex's tier: unset means L1."""
    found = _SNAPSHOT_TIERS.get(tier)
    if found is None:
        raise InvalidArgument(f"tier={_tier_name(tier)}: expected {_STORED_TIERS} (unset = TIER_L1)")
    return found


def snapshot_to_proto(s: HolderSnapshot) -> controller_pb2.SnapshotIndexResponse:
    return controller_pb2.SnapshotIndexResponse(
        pod=pod_identity_to_proto(s.pod), chunk_keys=s.keys, last_sequence=s.last_sequence
    )


def agent_snapshot_from_proto(msg: agent_pb2.SnapshotResponse) -> AgentSnapshot:
    """An agent's Snapshot answer (its keys are checked by the ingestor)."""
    return AgentSnapshot(
        pod_uid=msg.pod.pod_uid,
        epoch=msg.pod.epoch,
        keys=list(msg.chunk_keys),
        last_sequence=msg.last_sequence,
        namespaces=list(msg.namespaces),
    )


# --- queries -----------------------------------------------------------------------------------
def prefix_query_from_proto(req: controller_pb2.MatchPrefixRequest) -> PrefixQuery:
    which = req.WhichOneof("query")
    cands = frozenset(req.candidate_pod_uids) if req.candidate_pod_uids else _NO_CANDIDATES
    namespace = key_namespace_from_proto(req.namespace) if req.HasField("namespace") else None
    return PrefixQuery(
        token_ids=list(req.token_ids.ids) if which == "token_ids" else None,
        chunk_keys=list(req.chunk_keys.keys) if which == "chunk_keys" else None,
        namespace=namespace,
        namespace_id=req.namespace_id,
        candidates=cands,
        max_pods=req.max_pods,
    )


def score_query_from_proto(req: controller_pb2.ScoreRequest) -> ScoreQuery:
    return ScoreQuery(
        match=prefix_query_from_proto(req.match),
        reserve=req.reserve,
        speculative_ttl_ms=req.speculative_ttl_ms,
        top_k=req.top_k,
    )


def is_packed(req: controller_pb2.BatchMatchPrefixRequest) -> bool:
    """The request uses the packed form (any ``packed_*`` field set)."""
    return bool(
        req.packed_query_chunks
        or req.packed_chunk_keys
        or req.packed_namespace_id
        or req.packed_candidate_pod_uids
        or req.packed_max_pods
    )


def packed_from_proto(req: controller_pb2.BatchMatchPrefixRequest) -> PackedQueries:
    """The packed form of ``req`` (its keys stay one buffer: no bytes object per key)."""
    if len(req.requests):
        fields = ", ".join(f for f in _PACKED_FIELDS if getattr(req, f))
        raise InvalidArgument(
            f"requests and {fields}: both set, expected either requests or the packed_* fields"
        )
    counts = np.array(list(req.packed_query_chunks), dtype=np.int64)
    raw = req.packed_chunk_keys
    total = int(counts.sum())
    if len(raw) != CHUNK_KEY_BYTES * total:
        raise InvalidArgument(
            f"packed_chunk_keys: {len(raw)} bytes, expected {CHUNK_KEY_BYTES} * sum(packed_query_chunks)"
            f" = {CHUNK_KEY_BYTES * total}"
        )
    cands = frozenset(req.packed_candidate_pod_uids) if req.packed_candidate_pod_uids else _NO_CANDIDATES
    keys = np.frombuffer(raw, dtype="<u8").reshape(total, 2)
    return PackedQueries(keys, counts, req.packed_namespace_id, cands, req.packed_max_pods)


def _readable(r: MatchResult) -> list[controller_pb2.MatchPrefixResponse]:
    """Every query of ``r`` as the readable MatchPrefixResponse (one PodMatch per listed pod)."""
    m, table = r.match, r.table
    uids, names = table.uids, table.names
    slots = m.pods[m.pod_index].tolist()
    gpu, l1, peer, l2 = m.gpu.tolist(), m.l1.tolist(), m.peer.tolist(), m.l2.tolist()
    offsets, fetchable = m.offsets.tolist(), m.peer_fetchable.tolist()
    out = []
    for b, nc in enumerate(r.num_chunks):
        resp = controller_pb2.MatchPrefixResponse(num_query_chunks=nc, peer_fetchable_chunks=fetchable[b])
        add = resp.matches.add
        for i in range(offsets[b], offsets[b + 1]):
            s = slots[i]
            add(
                pod_uid=uids[s],
                pod_name=names[s],
                gpu_chunks=gpu[i],
                l1_chunks=l1[i],
                peer_chunks=peer[i],
                l2_chunks=l2[i],
            )
        out.append(resp)
    return out


def _pod_refs(table: SlotTable) -> list[bytes]:
    """Wire bytes of each slot's PodRef (unanswerable slots are never listed), cached on the table."""
    refs = table.pod_refs
    if refs is None:
        refs = table.pod_refs = [
            pod_ref_bytes(u, n) if u is not None else b""
            for u, n in zip(table.uids, table.names, strict=True)
        ]
    return refs


def match_to_proto(r: MatchResult) -> controller_pb2.MatchPrefixResponse:
    return _readable(r)[0]


def batch_match_to_proto(r: MatchResult, compact: bool) -> controller_pb2.BatchMatchPrefixResponse:
    if compact:
        return compact_response(r.match, r.num_chunks, _pod_refs(r.table))
    return controller_pb2.BatchMatchPrefixResponse(responses=_readable(r))


def score_to_proto(r: ScoreResult) -> controller_pb2.ScoreResponse:
    resp = controller_pb2.ScoreResponse(num_query_chunks=r.num_query_chunks)
    for e in r.ranked:
        c = e.candidate
        resp.scores.add(
            match=controller_pb2.PodMatch(
                pod_uid=c.pod_uid,
                pod_name=c.pod_name,
                gpu_chunks=c.gpu,
                l1_chunks=c.l1,
                peer_chunks=c.peer,
                l2_chunks=c.l2,
            ),
            estimated_ttft_ms=e.ttft_ms,
            l1_transfer_ms=e.l1_transfer_ms,
            l2_transfer_ms=e.l2_transfer_ms,
            peer_transfer_ms=e.peer_transfer_ms,
            prefill_ms=e.prefill_ms,
            queue_ms=e.queue_ms,
        )
    return resp


# --- introspection -----------------------------------------------------------------------------
def agents_to_proto(agents: Sequence[AgentInfo]) -> controller_pb2.ListAgentsResponse:
    resp = controller_pb2.ListAgentsResponse()
    for a in agents:
        resp.agents.add(
            pod=pod_identity_to_proto(a.pod),
            load=load_to_proto(a.load),
            lease_remaining_ms=a.lease_remaining_ms,
            num_chunks=a.num_chunks,
            last_sequence=a.last_sequence,
        )
    return resp


def stats_to_proto(s: ControllerStats) -> controller_pb2.GetStatsResponse:
    return controller_pb2.GetStatsResponse(
        num_entries=s.num_entries,
        num_agents=s.num_agents,
        events_ingested=s.events_ingested,
        resyncs=s.resyncs,
        index_backend=s.index_backend,
        rejected_requests=s.rejected_requests,
        vllm_events_ingested=s.vllm_events_ingested,
        vllm_replays=s.vllm_replays,
        expired_leases=s.expired_leases,
    )
