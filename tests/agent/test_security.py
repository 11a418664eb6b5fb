"""Attacks on the agent (tenant isolation, bounded resources, statuses), each against a real agent process
over real gRPC, each refused.

- Tenant isolation: a chunk another namespace stored under the same key is never served (Lookup,
  Retrieve, FetchChunks), never displaces the victim's own copy, and errors never name another
  chunk's layout; FetchChunks without a namespace is refused.
- Bounded resources: a Lookup pin cannot outlive ``--pin-ttl-max-ms``; peer streams that never read
  cannot starve the engine's Unix socket (separate thread pools); tiny FetchChunks parts are raised
  to the floor.
- Statuses: Store/Retrieve with a block-id list count other than the registered engine groups is
  INVALID_ARGUMENT naming both counts.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from kvgrid.agent.peers.sender import MIN_PART_BYTES
from kvgrid.api.v1 import agent_pb2, agent_pb2_grpc
from kvgrid.common.hashing import KeyNamespace, chunk_keys
from kvgrid.engine.client import AgentClient
from tests.agent.helpers import (
    GROUPS,
    HINTS,
    NAMESPACE,
    TOKENS_PER_CHUNK,
    AgentProc,
    block_ids,
    blocks_of,
    keys_for,
    make_kv,
    register_kv,
    start_agent,
)

# The attacker's engine: same model and layout, another tenant (cache salt), so another namespace.
ATTACKER_NS = KeyNamespace(
    model=NAMESPACE.model,
    cache_salt="attacker",
    tokens_per_chunk=TOKENS_PER_CHUNK,
    kv_identity=NAMESPACE.kv_identity,
)


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[AgentProc]:
    a = start_agent(tmp_path)
    yield a
    a.stop()


def _engines(
    agent: AgentProc, directory: Path
) -> tuple[AgentClient, list[torch.Tensor], list[torch.Tensor], str]:
    """Victim "v" (NAMESPACE) and attacker "x" (ATTACKER_NS) on one agent; returns the client, both
    engines' tensors and the (shared) layout id."""
    c = agent.client()
    victim, reg_v = register_kv(c, "v", directory, seed=1)
    attacker, paths = make_kv(directory, seed=2)
    reg_x = c.register_kv_caches(
        "x", attacker, namespace=ATTACKER_NS, engine_groups=GROUPS, shm_paths=paths, layout_hints=HINTS
    )
    assert reg_v.layout_id == reg_x.layout_id and reg_v.namespace_id != reg_x.namespace_id
    return c, victim, attacker, reg_v.layout_id


def _fetch(port: int | None, req: agent_pb2.FetchChunksRequest) -> list[agent_pb2.FetchChunksResponse]:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        return list(agent_pb2_grpc.AgentServiceStub(ch).FetchChunks(req, timeout=10))


def test_chunk_stored_by_another_namespace_is_never_served(agent: AgentProc, tmp_path: Path) -> None:
    c, victim, attacker, _ = _engines(agent, tmp_path)
    keys = keys_for(11, 3)  # the victim's prompt keys (the attacker read them from a Snapshot)
    # The attacker stores its own bytes under the victim's keys.
    assert c.store("x", keys, block_ids(0, 3)).num_stored_chunks == 3
    before = blocks_of(victim, block_ids(20, 3))

    hit = c.lookup("v", "r1", keys)
    assert (hit.num_hit_chunks, hit.miss_cause) == (0, "not_found")
    got = c.retrieve("v", "r1", keys, block_ids(20, 3))
    assert got.hit_mask == [False] * 3 and got.num_retrieved_chunks == 0
    assert all(torch.equal(a, b) for a, b in zip(blocks_of(victim, block_ids(20, 3)), before, strict=True))

    # The victim's own store is a real store (not "already present"), and it gets its own bytes back.
    stored = c.store("v", keys, block_ids(40, 3))
    assert (stored.num_stored_chunks, stored.num_already_present) == (3, 0)
    assert c.retrieve("v", "", keys, block_ids(20, 3)).num_retrieved_chunks == 3
    assert all(
        torch.equal(a, b)
        for a, b in zip(blocks_of(victim, block_ids(20, 3)), blocks_of(victim, block_ids(40, 3)), strict=True)
    )
    # ... and the attacker's chunks are still its own (nothing cached was lost or overwritten).
    assert c.retrieve("x", "", keys, block_ids(20, 3)).num_retrieved_chunks == 3
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            blocks_of(attacker, block_ids(20, 3)), blocks_of(attacker, block_ids(0, 3)), strict=True
        )
    )


def test_fetch_chunks_serves_only_the_callers_namespace(agent: AgentProc, tmp_path: Path) -> None:
    c, _, _, layout_id = _engines(agent, tmp_path)
    keys = keys_for(12, 2)
    assert c.store("v", keys, block_ids(0, 2)).num_stored_chunks == 2
    victim_ns = NAMESPACE.namespace_id()

    # No namespace used to mean "any namespace": now it is refused.
    with pytest.raises(grpc.RpcError) as err:
        _fetch(agent.tcp_port, agent_pb2.FetchChunksRequest(chunk_keys=keys, layout_id=layout_id))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "namespace_id=''" in (err.value.details() or "")

    # Another namespace sees nothing, in the right layout or a wrong one (no error naming anything).
    other = ATTACKER_NS.namespace_id()
    for layout in (layout_id, "0123456789abcdef"):
        req = agent_pb2.FetchChunksRequest(chunk_keys=keys, layout_id=layout, namespace_id=other)
        assert _fetch(agent.tcp_port, req) == []

    # The right namespace with a wrong layout: refused, without naming the layout the chunk has.
    req = agent_pb2.FetchChunksRequest(chunk_keys=keys, layout_id="0123456789abcdef", namespace_id=victim_ns)
    with pytest.raises(grpc.RpcError) as err:
        _fetch(agent.tcp_port, req)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert layout_id not in (err.value.details() or "") and "0123456789abcdef" in (err.value.details() or "")

    # The right namespace and layout get the bytes.
    req = agent_pb2.FetchChunksRequest(chunk_keys=keys, layout_id=layout_id, namespace_id=victim_ns)
    assert _fetch(agent.tcp_port, req)[0].num_chunks == 2


def test_tiny_fetch_parts_are_raised_to_the_floor(agent: AgentProc, tmp_path: Path) -> None:
    c = agent.client()
    _, reg = register_kv(c, "e", tmp_path, seed=3)
    keys = keys_for(13, 2)
    assert c.store("e", keys, block_ids(0, 2)).num_stored_chunks == 2
    req = agent_pb2.FetchChunksRequest(
        chunk_keys=keys, layout_id=reg.layout_id, namespace_id=reg.namespace_id, max_part_bytes=1
    )
    parts = _fetch(agent.tcp_port, req)
    size = min(reg.bytes_per_chunk, MIN_PART_BYTES)
    assert {len(m.data) for m in parts} == {size}, "max_part_bytes=1 must not mean one byte per message"
    assert len(parts) == 2 * -(-reg.bytes_per_chunk // size)


def test_lookup_pin_ttl_is_capped(tmp_path: Path) -> None:
    a = start_agent(
        tmp_path, "--pin-ttl-ms", "500", "--pin-ttl-max-ms", "1000", "--peer-fetch", "off", l1_size="256KiB"
    )
    try:
        c = a.client()
        register_kv(c, "e", tmp_path, seed=4)
        first, second = keys_for(14, 8), keys_for(15, 8)
        held = c.store("e", first, block_ids(0, 8)).num_stored_chunks
        assert held >= 4
        # One client pins everything it can for 2^32-1 ms (49 days).
        assert c.lookup("e", "hog", first[:held], pin_ttl_ms=2**32 - 1).num_hit_chunks == held
        assert c.store("e", second, block_ids(32, 8)).partial_reason.startswith("l1_full")
        time.sleep(1.5)  # past the cap
        res = c.store("e", second, block_ids(32, 8))
        assert res.partial_reason == "" and res.num_stored_chunks == 8, res
        assert c.release("e", "hog") == 0  # the pin is gone
    finally:
        a.stop()


def test_unread_peer_streams_do_not_starve_the_engine_socket(tmp_path: Path) -> None:
    a = start_agent(tmp_path)  # default pools: 16 threads per listener (one shared pool of 16 before)
    channels: list[grpc.Channel] = []
    try:
        c = a.client()
        _, reg = register_kv(c, "e", tmp_path, seed=5)
        keys = keys_for(16, 16)
        assert c.store("e", keys, block_ids(0, 16)).num_stored_chunks == 16
        # 20 streams that never read, each on its own connection without BDP probing, so HTTP/2's
        # 64 KiB window stops each sender mid-stream and it holds its thread.
        req = agent_pb2.FetchChunksRequest(
            chunk_keys=keys, layout_id=reg.layout_id, namespace_id=reg.namespace_id, max_part_bytes=1
        )
        streams = []
        for _ in range(20):
            ch = grpc.insecure_channel(f"127.0.0.1:{a.tcp_port}", options=[("grpc.http2.bdp_probe", 0)])
            channels.append(ch)
            streams.append(agent_pb2_grpc.AgentServiceStub(ch).FetchChunks(req, timeout=60))
        time.sleep(1.0)  # let the agent take them up
        with AgentClient(a.uds_path, timeout_s=5) as engine:
            t0 = time.monotonic()
            assert engine.health().num_chunks == 16
            res = engine.store("e", keys_for(17, 2), block_ids(0, 2))
            assert res.num_stored_chunks == 2
            assert time.monotonic() - t0 < 5
        for s in streams:
            s.cancel()
    finally:
        for ch in channels:
            ch.close()
        a.stop()


@pytest.mark.parametrize("lists", [1, 3])
def test_block_id_list_count_must_match_engine_groups(agent: AgentProc, tmp_path: Path, lists: int) -> None:
    c = agent.client()
    tensors, _ = register_kv(c, "e", tmp_path, seed=6)  # 2 engine groups
    keys = keys_for(18, 1)
    ids = block_ids(0, 1)
    ids = ids[:1] if lists == 1 else [*ids, list(range(8))]
    before = [t.clone() for t in tensors]
    for call in (lambda: c.store("e", keys, ids), lambda: c.retrieve("e", "", keys, ids)):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"block_ids has {lists} lists" in (err.value.details() or "")
        assert "registered 2 engine groups" in (err.value.details() or "")
    assert c.lookup("e", "", keys).num_hit_chunks == 0  # nothing was stored
    assert all(torch.equal(a, b) for a, b in zip(tensors, before, strict=True))
    assert c.health().num_chunks == 0


def test_snapshot_still_lists_every_namespace(agent: AgentProc, tmp_path: Path) -> None:
    """Snapshot's content is unchanged (the controller's resync needs every key); who may call it is
    the caller's mTLS identity (the controller only, docs/security.md), not checked here."""
    c, _, _, _ = _engines(agent, tmp_path)
    assert c.store("v", keys_for(19, 1), block_ids(0, 1)).num_stored_chunks == 1
    assert (
        c.store("x", chunk_keys([1] * TOKENS_PER_CHUNK, ATTACKER_NS), block_ids(0, 1)).num_stored_chunks == 1
    )
    snap = c.snapshot()
    assert {g.namespace for g in snap.by_namespace} == {NAMESPACE.namespace_id(), ATTACKER_NS.namespace_id()}
