"""Routing score: estimated time to first token (TTFT) per pod. Pure functions; never touches storage.

For a query of ``T`` tokens (``n`` full chunks of ``C`` tokens, ``B`` KV bytes per chunk) and a pod
whose match is ``g`` GPU + ``l`` own-L1 + ``d`` own-L2 + ``p`` peer chunks (``R = C / prefill_rate``,
one chunk's recompute)::

    copy     = min(B / l1_bw, R)                                 one chunk L1 -> GPU
    l1_ms    = (l + d + p) * copy                                L2 and peer chunks land in L1 first
    l2_ms    = d * min(B / l2_bw, R - copy)                      read from the pod's lower tier
    peer_ms  = p * min(B / peer_bw, R) + (peer_latency if p else 0)
    prefill  = (T - (g + l + d + p) * C) / prefill_rate          the unmatched tail is computed
    queue_ms = running * q_run + waiting * q_wait                reported load
    ttft     = l1_ms + l2_ms + peer_ms + prefill + queue_ms

``l2_bw`` is ``l2_disk_gbps`` or ``l2_object_store_gbps``, whichever ``l2_tier`` names (the agents'
fastest lower tier, where a recently spilled prefix is). ``min(transfer, recompute)`` per chunk: a
chunk that is slower to fetch than to recompute would be recomputed by the engine, so it never makes
a pod look worse than a miss (an L2 chunk's read and copy together cost at most ``R``). GPU chunks
cost nothing. So with the rest equal a pod ranks by where its prefix is: GPU, then L1 (a copy), then
L2 (a read and a copy), then nowhere (recompute), as long as those costs differ.
"""

from __future__ import annotations

from operator import itemgetter

import msgspec

from kvgrid.controller.config import ControllerConfig
from kvgrid.controller.registry import AgentLoad

__all__ = ["Candidate", "Estimate", "ScoreParams", "estimate", "rank"]


class ScoreParams(msgspec.Struct, frozen=True):
    bytes_per_token: int
    l1_gbps: float
    peer_gbps: float
    l2_gbps: float
    """Read rate of the agents' lower tier that ``l2_tier`` names."""
    peer_latency_ms: float
    prefill_tokens_per_s: float
    queue_ms_per_running: float
    queue_ms_per_waiting: float

    @classmethod
    def from_config(cls, cfg: ControllerConfig) -> ScoreParams:
        return cls(
            bytes_per_token=cfg.bytes_per_token,
            l1_gbps=cfg.l1_gbps,
            peer_gbps=cfg.peer_gbps,
            l2_gbps=cfg.l2_disk_gbps if cfg.l2_tier == "disk" else cfg.l2_object_store_gbps,
            peer_latency_ms=cfg.peer_latency_ms,
            prefill_tokens_per_s=cfg.prefill_tokens_per_s,
            queue_ms_per_running=cfg.queue_ms_per_running,
            queue_ms_per_waiting=cfg.queue_ms_per_waiting,
        )


class Candidate(msgspec.Struct, frozen=True):
    pod_uid: str
    pod_name: str
    gpu: int
    l1: int
    peer: int
    load: AgentLoad
    l2: int = 0


class Estimate(msgspec.Struct, frozen=True):
    candidate: Candidate
    ttft_ms: float
    l1_transfer_ms: float
    peer_transfer_ms: float
    prefill_ms: float
    queue_ms: float
    l2_transfer_ms: float = 0.0


_Costs = tuple[float, float, float, float, float, float]


def _costs(
    gpu: int,
    l1: int,
    peer: int,
    l2: int,
    running: int,
    waiting: int,
    p: ScoreParams,
    query_tokens: int,
    tokens_per_chunk: int,
) -> _Costs:
    """(ttft, l1 transfer, peer transfer, prefill, queue, l2 transfer) in ms (:class:`Estimate`'s
    order); GPU chunks cost nothing."""
    chunk_bytes = p.bytes_per_token * tokens_per_chunk
    recompute_ms = tokens_per_chunk / p.prefill_tokens_per_s * 1000.0
    l1_chunk_ms = min(chunk_bytes / (p.l1_gbps * 1e9) * 1000.0, recompute_ms)
    peer_chunk_ms = min(chunk_bytes / (p.peer_gbps * 1e9) * 1000.0, recompute_ms)
    l2_chunk_ms = min(chunk_bytes / (p.l2_gbps * 1e9) * 1000.0, recompute_ms - l1_chunk_ms)
    l1_ms = (l1 + l2 + peer) * l1_chunk_ms
    l2_ms = l2 * l2_chunk_ms
    peer_ms = peer * peer_chunk_ms + (p.peer_latency_ms if peer else 0.0)
    matched_tokens = (gpu + l1 + l2 + peer) * tokens_per_chunk
    prefill_ms = max(0, query_tokens - matched_tokens) / p.prefill_tokens_per_s * 1000.0
    queue_ms = running * p.queue_ms_per_running + waiting * p.queue_ms_per_waiting
    ttft = l1_ms + l2_ms + peer_ms + prefill_ms + queue_ms
    return ttft, l1_ms, peer_ms, prefill_ms, queue_ms, l2_ms


def estimate(c: Candidate, p: ScoreParams, query_tokens: int, tokens_per_chunk: int) -> Estimate:
    load = c.load
    costs = _costs(
        c.gpu,
        c.l1,
        c.peer,
        c.l2,
        load.running_requests,
        load.waiting_requests,
        p,
        query_tokens,
        tokens_per_chunk,
    )
    return Estimate(c, *costs)


def rank(
    candidates: list[Candidate], p: ScoreParams, query_tokens: int, tokens_per_chunk: int
) -> list[Estimate]:
    """Estimates, best (lowest TTFT) first; ties prefer more GPU chunks, then the least loaded pod
    (fewest running + waiting requests, then least GPU KV in use), then the pod UID. The load
    tie-break spreads new prefixes over idle pods: with the UID alone every request that no pod
    holds would go to the same pod while the others sit empty (``kvgrid bench routing``).

    Candidates with equal chunk counts and queue lengths share one cost computation: Score ranks
    every registered pod, and with hundreds of pods most of them hold nothing of the query
    (docs/capacity.md measured this at 1,024 pods)."""
    costs: dict[tuple[int, int, int, int, int, int], _Costs] = {}
    keyed = []
    for c in candidates:
        load = c.load
        running, waiting = load.running_requests, load.waiting_requests
        k = (c.gpu, c.l1, c.peer, c.l2, running, waiting)
        e = costs.get(k)
        if e is None:
            e = costs[k] = _costs(*k, p, query_tokens, tokens_per_chunk)
        keyed.append(((e[0], -c.gpu, running + waiting, load.gpu_kv_usage, c.pod_uid), c, e))
    keyed.sort(key=itemgetter(0))
    return [Estimate(c, *e) for _, c, e in keyed]
