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
        cands.append(
            Candidate(f"pod-{i:03d}", "", rng.choice((0, 0, 4)), rng.choice((0, 8)), rng.choice((0, 3)), load)
        )
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
