"""Fuzz every AgentService RPC of a real agent process, on both listeners: the Unix socket (the
engine API, every RPC) and loopback TCP (FetchChunks and Snapshot; the engine methods there answer
UNIMPLEMENTED by design). Every answer is OK or a named client-facing status with a message; the
agent keeps serving (a valid store + lookup every 200 messages and at the end) and its RSS stays
bounded."""

from __future__ import annotations

import grpc

from kvgrid.api.v1 import agent_pb2
from tests.agent.helpers import block_ids
from tests.fuzz import grpc_driver
from tests.fuzz.agent_cases import (
    AGENT_SERVICE,
    REQUEST,
    STREAMING,
    TCP_SERVED,
    known_bug,
    pools,
    seeds,
)
from tests.fuzz.conftest import ENGINE, L1_BYTES, MAX_MESSAGE_BYTES, Agent
from tests.fuzz.fuzzlib import Liveness, Mutator, Oracle, RawCaller, budget, log_tail, rng_for, rss_bytes

CI_MESSAGES = 1500
RSS_SLACK = 48 << 20
"""RSS growth allowed besides L1 (whose pages are first touched as chunks are written): gRPC's
buffers for a few 4 MiB messages, allocator arenas of the worker threads, lazily built caches. A
leak of 1 KiB per message would pass at the CI budget but fails ``make fuzz`` (100,000 messages)."""


def is_ticket(raw: bytes) -> bool:
    """A FetchChunks response handing out a data-plane ticket (the stream then stays open until the
    chunks went out on the data port: the fuzzer does not fetch them, so it hangs up)."""
    try:
        return bool(agent_pb2.FetchChunksResponse.FromString(raw).data_ticket)
    except Exception:
        return False


def check_agent(agent: Agent) -> None:
    """A valid request still succeeds: Health, then the engine stores and finds its chunks."""
    agent.alive()
    try:
        agent.client.health()
        agent.restore_engine()
        stored = agent.client.store(ENGINE, agent.keys, block_ids(0, len(agent.keys)))
        hits = agent.client.lookup(ENGINE, "live", agent.keys).num_hit_chunks
        agent.client.release(ENGINE, "live")
    except grpc.RpcError as e:
        raise AssertionError(
            f"the agent no longer serves a valid request: {e.code()}: {e.details()}\n"
            f"its log ends:\n{log_tail(agent.log)}"
        ) from None
    assert stored.num_stored_chunks == len(agent.keys) or stored.partial_reason, stored
    assert hits == stored.num_stored_chunks, (hits, stored)


def test_agent_grpc_fuzz(agent: Agent) -> None:
    n = budget(CI_MESSAGES)
    rng = rng_for("agent-grpc")
    mut = Mutator(rng, pools(agent))
    base = seeds(agent, rng)
    rpcs = [
        grpc_driver.Rpc(
            name,
            "server_stream" if name in STREAMING else "unary",
            base[name],
            weight=3.0 if name in ("Lookup", "Retrieve", "Store", "FetchChunks", "RegisterKVCaches") else 1.0,
            stop=is_ticket if name in STREAMING else None,
            known_bug=lambda data, name=name: known_bug(name, data),
        )
        for name in REQUEST
    ]
    assert {r.name for r in rpcs} == set(base), "a new AgentService RPC needs a seed in agent_cases.py"
    uds = grpc.insecure_channel(
        f"unix:{agent.uds_path}", options=[("grpc.max_receive_message_length", 64 << 20)]
    )
    tcp = grpc.insecure_channel(
        f"127.0.0.1:{agent.tcp_port}", options=[("grpc.max_receive_message_length", 64 << 20)]
    )
    targets = [
        grpc_driver.Target("uds", RawCaller(uds, AGENT_SERVICE)),
        grpc_driver.Target("tcp", RawCaller(tcp, AGENT_SERVICE), served=TCP_SERVED, weight_unserved=0.1),
    ]
    oracle = Oracle("agent gRPC")
    live = Liveness(lambda: check_agent(agent))
    try:
        warm = min(300, n // 5)
        grpc_driver.run(oracle, targets, rpcs, mut, warm, live, MAX_MESSAGE_BYTES)
        rss0 = rss_bytes(agent.proc.pid)
        grpc_driver.run(oracle, targets, rpcs, mut, n, live, MAX_MESSAGE_BYTES)
        check_agent(agent)
        rss1 = rss_bytes(agent.proc.pid)
    finally:
        uds.close()
        tcp.close()
    print(f"[fuzz agent gRPC] RSS {rss0 >> 20} -> {rss1 >> 20} MiB; liveness checks {live.runs + 1}")
    oracle.assert_clean()
    assert rss1 - rss0 < L1_BYTES + RSS_SLACK, (
        f"agent RSS grew {(rss1 - rss0) >> 20} MiB over {oracle.messages} messages "
        f"(bound: L1 {L1_BYTES >> 20} MiB + {RSS_SLACK >> 20} MiB)"
    )
