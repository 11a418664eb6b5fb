"""Score's ranking (``controller/scoring.py``): the shared-cost ranking equals ranking every
candidate's own estimate, with the documented tie-breaks, on candidates built to collide."""

from __future__ import annotations

import random

import pytest

from kvgrid.controller.registry import AgentLoad
from kvgrid.controller.scoring import Candidate, ScoreParams, estimate, rank

PARAMS = ScoreParams(
    bytes_per_token=131_072,
    l1_gbps=45.0,
    peer_gbps=0.9,
    peer_latency_ms=1.0,
    l2_gbps=4.8,
    prefill_tokens_per_s=10_000.0,
    queue_ms_per_running=2.0,
    queue_ms_per_waiting=300.0,
)


def _reference(cands: list[Candidate], tokens: int, per_chunk: int) -> list[tuple[str, float]]:
    ests = [estimate(c, PARAMS, tokens, per_chunk) for c in cands]
    ests.sort(
        key=lambda e: (
            e.ttft_ms,
            -e.candidate.gpu,
            e.candidate.load.running_requests + e.candidate.load.waiting_requests,
            e.candidate.load.gpu_kv_usage,
            e.candidate.pod_uid,
        )
    )
    return [(e.candidate.pod_uid, e.ttft_ms) for e in ests]


@pytest.mark.parametrize("seed", range(5))
def test_rank_equals_each_candidates_own_estimate(seed: int) -> None:
    rng = random.Random(seed)
    cands = []
    for i in range(300):  # few distinct values: most candidates share counts and loads
        load = AgentLoad(
            running_requests=rng.choice((0, 1, 5)),
            waiting_requests=rng.choice((0, 0, 2)),
            gpu_kv_usage=rng.choice((0.0, 0.5)),
        )
        gpu, l1, peer, l2 = (
            rng.choice((0, 0, 4)),
            rng.choice((0, 8)),
            rng.choice((0, 3)),
            rng.choice((0, 0, 5)),
        )
        cands.append(Candidate(f"pod-{i:03d}", "", gpu, l1, peer, load, l2))
    rng.shuffle(cands)
    got = rank(cands, PARAMS, 53 * 512, 512)
    assert [(e.candidate.pod_uid, e.ttft_ms) for e in got] == _reference(cands, 53 * 512, 512)
    for e in got:  # each estimate's parts are its own candidate's
        assert e == estimate(e.candidate, PARAMS, 53 * 512, 512)


def test_a_queue_outweighs_a_hit_it_cannot_pay_for() -> None:
    holder = Candidate("a", "", 0, 10, 0, AgentLoad(waiting_requests=3))  # 900 ms queue, 10 chunks
    idle = Candidate("b", "", 0, 0, 0, AgentLoad())
    tokens = 10 * 512
    assert [e.candidate.pod_uid for e in rank([holder, idle], PARAMS, tokens, 512)] == ["b", "a"]
    short = Candidate("a", "", 0, 10, 0, AgentLoad(waiting_requests=1))  # 300 ms < 512 ms prefill
    assert [e.candidate.pod_uid for e in rank([short, idle], PARAMS, tokens, 512)] == ["a", "b"]


@pytest.mark.parametrize("l2_gbps", [4.8, 20.0])  # the disk default; a read as fast as the L1 copy
def test_l1_before_l2_before_recompute(l2_gbps: float) -> None:
    params = ScoreParams(**{**{f: getattr(PARAMS, f) for f in PARAMS.__struct_fields__}, "l2_gbps": l2_gbps})
    tokens = 10 * 512
    pods = [
        Candidate("cold", "", 0, 0, 0, AgentLoad()),
        Candidate("disk", "", 0, 0, 0, AgentLoad(), 10),
        Candidate("l1", "", 0, 10, 0, AgentLoad()),
    ]
    ranked = rank(pods, params, tokens, 512)
    assert [e.candidate.pod_uid for e in ranked] == ["l1", "disk", "cold"]
    by = {e.candidate.pod_uid: e for e in ranked}
    assert by["l1"].ttft_ms < by["disk"].ttft_ms < by["cold"].ttft_ms
    # the L2 chunks' read is its own part; their L1 -> GPU copy is the L1 part's, as for L1 chunks
    assert by["disk"].l1_transfer_ms == pytest.approx(by["l1"].l1_transfer_ms)
    chunk = PARAMS.bytes_per_token * 512
    assert by["disk"].l2_transfer_ms == pytest.approx(10 * chunk / (l2_gbps * 1e9) * 1000)
    assert by["l1"].l2_transfer_ms == 0
    assert by["disk"].prefill_ms == 0 and by["cold"].prefill_ms == pytest.approx(10 * 512 / 10_000 * 1000)


def test_an_l2_read_slower_than_recompute_costs_a_recompute() -> None:
    # 64 MiB chunks from a 0.5 GB/s object store: 134 ms a chunk to read, 51.2 ms to recompute
    params = ScoreParams(**{**{f: getattr(PARAMS, f) for f in PARAMS.__struct_fields__}, "l2_gbps": 0.5})
    cold, slow = Candidate("cold", "", 0, 0, 0, AgentLoad()), Candidate("slow", "", 0, 0, 0, AgentLoad(), 10)
    by = {e.candidate.pod_uid: e for e in rank([cold, slow], params, 10 * 512, 512)}
    assert by["slow"].ttft_ms == pytest.approx(by["cold"].ttft_ms)  # never worse than a miss
    assert by["slow"].l1_transfer_ms + by["slow"].l2_transfer_ms == pytest.approx(by["cold"].prefill_ms)
