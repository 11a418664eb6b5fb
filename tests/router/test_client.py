"""kvgrid.client.PodRanker against a real controller: Score ranking, and the fallback order when the
controller is unreachable (a closed port: a real connection failure, not a mock)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from kvgrid.client import PodRanker
from kvgrid.common.hashing import KeyNamespace

NS = KeyNamespace(model="m", tokens_per_chunk=16, kv_identity="x")


def test_controller_down_falls_back_least_loaded_round_robin(
    free_port: Callable[[], int], caplog: pytest.LogCaptureFixture
) -> None:
    ranker = PodRanker(f"127.0.0.1:{free_port()}", NS, timeout_s=0.5, static_pods=["a", "b", "c"])
    try:
        with caplog.at_level(logging.WARNING, logger="kvgrid.client"):
            firsts = []
            for _ in range(3):
                r = ranker.rank(list(range(40)))
                assert r.source == "fallback" and "UNAVAILABLE" in r.error
                assert sorted(p.pod.pod_uid for p in r.pods) == ["a", "b", "c"]
                firsts.append(r.pods[0].pod.pod_uid)
        assert sorted(firsts) == ["a", "b", "c"]  # round-robin among equally loaded pods
        # One warning per outage, not one per request.
        assert sum("least-loaded/round-robin" in m for m in caplog.messages) == 1
        # Least loaded first: with requests in flight on a and b, c leads every ranking.
        with ranker.in_flight("a"), ranker.in_flight("b"), ranker.in_flight("b"):
            orders = [[p.pod.pod_uid for p in ranker.rank([1, 2]).pods] for _ in range(3)]
        assert all(o == ["c", "a", "b"] for o in orders), orders
        assert ranker.controller_error.startswith("controller UNAVAILABLE")
    finally:
        ranker.close()
