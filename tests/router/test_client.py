"""kvgrid.client.PodRanker against a real controller: Score over mTLS with a router certificate, and
the fallback order when the controller is unreachable (a closed port or a refused handshake: real
failures, not mocks)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from kvgrid.client import PodRanker
from kvgrid.common.hashing import KeyNamespace
from kvgrid.controller.config import ControllerConfig
from kvgrid.controller.service import serve
from tests.security.conftest import Pki, tls_flags

NS = KeyNamespace(model="m", tokens_per_chunk=16, kv_identity="x")


def test_controller_down_falls_back_least_loaded_round_robin(
    free_port: Callable[[], int], caplog: pytest.LogCaptureFixture
) -> None:
    ranker = PodRanker(
        f"127.0.0.1:{free_port()}", NS, timeout_s=0.5, static_pods=["a", "b", "c"], retry_s=600
    )
    try:
        with caplog.at_level(logging.WARNING, logger="kvgrid.client"):
            firsts = []
            for _ in range(3):
                r = ranker.rank(list(range(40)))
                assert r.source == "fallback" and "UNAVAILABLE" in r.error
                # The pod list's ListAgents failed first: Score is not asked within retry_s.
                assert r.error.endswith("(asked again within 600 s)"), r.error
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


def test_ranker_calls_score_over_mtls_with_a_router_certificate(tmp_path: Path) -> None:
    pki = Pki(tmp_path)
    server = serve(ControllerConfig(listen="127.0.0.1:0", lease_ttl_ms=60_000, **tls_flags(pki.controller())))
    rankers: list[PodRanker] = []
    try:
        rankers.append(
            PodRanker(server.address, NS, timeout_s=5, static_pods=["a"], **tls_flags(pki.router()))
        )
        r = rankers[0].rank(list(range(40)))
        assert (r.source, r.error, r.num_query_chunks) == ("score", "", 2)  # 40 tokens = 2 chunks of 16
        # Without a certificate the controller refuses the handshake: the fallback, with the reason.
        rankers.append(PodRanker(server.address, NS, timeout_s=2, static_pods=["a"]))
        r = rankers[1].rank(list(range(40)))
        assert r.source == "fallback" and r.error.startswith("controller UNAVAILABLE")
        assert [p.pod.pod_uid for p in r.pods] == ["a"]
    finally:
        for ranker in rankers:
            ranker.close()
        server.stop()
