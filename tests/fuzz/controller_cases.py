"""Valid ControllerService requests (the seeds the fuzzers mutate), PublishEvents sequences and
the controller's value pools."""

from __future__ import annotations

import random

from google.protobuf.message import Message

from kvgrid.api.v1 import common_pb2, controller_pb2
from tests.agent.helpers import NAMESPACE
from tests.fuzz.fuzzlib import Pools
from tests.fuzz.grpc_driver import Rpc

CONTROLLER_SERVICE = "kvgrid.v1.ControllerService"
NS_ID = NAMESPACE.namespace_id()
PODS = ("fz-pod-0", "fz-pod-1", "fz-pod-2")
"""Pods the fuzzer registers and publishes for (never the liveness pod)."""
KEYS = [bytes([i]) * 16 for i in range(1, 9)]


def _pod(uid: str, address: str, epoch: int = 1) -> common_pb2.PodIdentity:
    return common_pb2.PodIdentity(
        pod_uid=uid,
        pod_name=f"name-{uid}",
        namespace="ns",
        node_name="node",
        epoch=epoch,
        agent_address=address,
    )


def _match(rng: random.Random | None = None) -> controller_pb2.MatchPrefixRequest:
    return controller_pb2.MatchPrefixRequest(
        chunk_keys=common_pb2.ChunkKeys(keys=KEYS[:4]), namespace_id=NS_ID, max_pods=4
    )


def _match_tokens() -> controller_pb2.MatchPrefixRequest:
    ns = common_pb2.KeyNamespace(
        model=NAMESPACE.model, tokens_per_chunk=NAMESPACE.tokens_per_chunk, kv_identity=NAMESPACE.kv_identity
    )
    return controller_pb2.MatchPrefixRequest(
        token_ids=common_pb2.TokenIds(ids=list(range(3 * NAMESPACE.tokens_per_chunk))),
        namespace=ns,
        candidate_pod_uids=list(PODS[:2]),
    )


def rpcs(snapshot_address: str, live_uid: str) -> list[Rpc]:
    """Every ControllerService RPC with its seeds (PublishEvents: a sequence generator)."""

    def events(rng: random.Random) -> list[Message]:
        uid = rng.choice(PODS)
        epoch = rng.choice((1, 1, 2))
        out: list[Message] = [controller_pb2.PublishEventsRequest(pod=_pod(uid, snapshot_address, epoch))]
        seq = rng.choice((1, 1, 5))
        for _ in range(rng.randint(1, 5)):
            kind = rng.choice((controller_pb2.EVENT_KIND_ADMIT, controller_pb2.EVENT_KIND_EVICT))
            ev = controller_pb2.ChunkEvent(
                sequence=seq,
                kind=kind,
                tier=rng.choice((common_pb2.TIER_L1, common_pb2.TIER_L2)),
                chunk_keys=[*rng.sample(KEYS, rng.randint(1, 4)), rng.randbytes(16)],
                namespace=NS_ID,
            )
            seq += 1
            out.append(controller_pb2.PublishEventsRequest(events=[ev]))
        if rng.random() < 0.2:
            out.append(
                controller_pb2.PublishEventsRequest(
                    events=[controller_pb2.ChunkEvent(sequence=seq, kind=controller_pb2.EVENT_KIND_CLEAR)]
                )
            )
        return out

    pod = _pod(PODS[0], snapshot_address)
    return [
        Rpc(
            "RegisterAgent",
            "unary",
            [
                controller_pb2.RegisterAgentRequest(pod=pod, namespaces=[NS_ID], l1_capacity_bytes=8 << 20),
                controller_pb2.RegisterAgentRequest(
                    pod=_pod(PODS[1], snapshot_address, 2), namespaces=[NS_ID]
                ),
            ],
            weight=2,
        ),
        Rpc(
            "Heartbeat",
            "unary",
            [
                controller_pb2.HeartbeatRequest(
                    pod_uid=PODS[0],
                    epoch=1,
                    load=controller_pb2.AgentLoad(
                        running_requests=2, waiting_requests=1, gpu_kv_usage=0.5, l1_used_bytes=1 << 20
                    ),
                )
            ],
        ),
        Rpc("PublishEvents", "bidi", sequence=events, weight=3),
        Rpc(
            "SnapshotIndex",
            "unary",
            [
                controller_pb2.SnapshotIndexRequest(pod_uid=live_uid, tier=common_pb2.TIER_L1),
                controller_pb2.SnapshotIndexRequest(pod_uid=PODS[0], tier=common_pb2.TIER_L2),
            ],
        ),
        Rpc("MatchPrefix", "unary", [_match(), _match_tokens()], weight=3),
        Rpc(
            "BatchMatchPrefix",
            "unary",
            [
                controller_pb2.BatchMatchPrefixRequest(requests=[_match(), _match_tokens()]),
                controller_pb2.BatchMatchPrefixRequest(requests=[_match()], compact=True),
                controller_pb2.BatchMatchPrefixRequest(
                    packed_chunk_keys=b"".join(KEYS[:5]),
                    packed_query_chunks=[2, 3],
                    packed_namespace_id=NS_ID,
                    packed_candidate_pod_uids=[PODS[0]],
                    packed_max_pods=2,
                    compact=True,
                ),
            ],
            weight=3,
        ),
        Rpc(
            "Score",
            "unary",
            [
                controller_pb2.ScoreRequest(match=_match(), top_k=2),
                controller_pb2.ScoreRequest(match=_match_tokens(), reserve=True, speculative_ttl_ms=500),
            ],
            weight=3,
        ),
        Rpc(
            "BatchScore",
            "unary",
            [
                controller_pb2.BatchScoreRequest(
                    requests=[
                        controller_pb2.ScoreRequest(match=_match()),
                        controller_pb2.ScoreRequest(match=_match_tokens()),
                    ]
                )
            ],
            weight=2,
        ),
        Rpc("ListAgents", "unary", [controller_pb2.ListAgentsRequest()], weight=0.5),
        Rpc("GetStats", "unary", [controller_pb2.GetStatsRequest()], weight=0.5),
    ]


def pools(snapshot_address: str) -> Pools:
    return Pools(
        strings=[*PODS, NS_ID, snapshot_address, "name-fz", "node", NAMESPACE.model, NAMESPACE.kv_identity],
        bytes_=[*KEYS, b"".join(KEYS[:3])],
        ints=[1, 2, 3, 4, 5, NAMESPACE.tokens_per_chunk, 4096, 4097, 1 << 20],
    )
