"""Fuzz the agent's hot path (``{uds}.hot``, agent/hotpath.py) of a real agent process: mutated
requests of Lookup/Retrieve/Store/Release in valid frames, mutated frame headers and lengths,
one-way frames, partial and slow writes, pipelined frames and garbage (see
:mod:`tests.fuzz.hot_driver`). Every reply is OK or a named status with text, framing errors end
in such a reply and a close, nothing hangs, a valid Lookup still answers (every 200 frames and at
the end) and the agent's RSS stays bounded."""

from __future__ import annotations

from kvgrid.api.v1 import agent_pb2
from tests.fuzz.agent_cases import known_bug, pools, seeds
from tests.fuzz.conftest import ENGINE, MAX_MESSAGE_BYTES, Agent
from tests.fuzz.fuzzlib import Liveness, Mutator, Oracle, budget, rng_for, rss_bytes
from tests.fuzz.hot_driver import HOT, HotFuzzer, hot_liveness

CI_MESSAGES = 2000
RSS_SLACK = 32 << 20
"""RSS growth allowed: a thread (and its stack pages) per open connection, allocator arenas, the
L1 pages a fuzzed Store first touches (L1 is 16 MiB). A per-frame leak of 1 KiB fails at 100,000."""


def test_hotpath_fuzz(agent: Agent) -> None:
    n = budget(CI_MESSAGES)
    rng = rng_for("agent-hotpath")
    agent.restore_engine()
    base = {m: s for m, s in seeds(agent, rng).items() if m in HOT}
    lookup = agent_pb2.LookupRequest(instance_id=ENGINE, request_id="hot-live", chunk_keys=agent.keys)
    oracle = Oracle("agent hot path")
    fuzzer = HotFuzzer(
        agent.hot_path, oracle, Mutator(rng, pools(agent)), base, lookup, MAX_MESSAGE_BYTES, known_bug
    )
    live = Liveness(hot_liveness(agent.hot_path, lookup, agent.alive))
    fuzzer.run(min(300, n // 5), live)
    rss0 = rss_bytes(agent.proc.pid)
    fuzzer.run(n, live)
    live.check()
    rss1 = rss_bytes(agent.proc.pid)
    print(f"[fuzz agent hot path] RSS {rss0 >> 20} -> {rss1 >> 20} MiB; liveness checks {live.runs + 1}")
    oracle.assert_clean()
    assert rss1 - rss0 < (16 << 20) + RSS_SLACK, (
        f"agent RSS grew {(rss1 - rss0) >> 20} MiB over {oracle.messages} hot-path frames"
    )
