"""Valid AgentService requests (the seeds the fuzzers mutate) and the value pools of the agent."""

from __future__ import annotations

import random

from google.protobuf.message import Message

from kvgrid.api.v1 import agent_pb2, common_pb2
from tests.agent.helpers import NUM_BLOCKS, TOKENS_PER_CHUNK, block_ids, keys_for
from tests.fuzz.conftest import ENGINE, NS_ID, Agent
from tests.fuzz.fuzzlib import Pools

AGENT_SERVICE = "kvgrid.v1.AgentService"
HOT = ("Lookup", "Retrieve", "Store", "Release")
TCP_SERVED = frozenset({"FetchChunks", "Snapshot"})
REQUEST = {
    m.name: getattr(agent_pb2, m.input_type.name)
    for m in agent_pb2.DESCRIPTOR.services_by_name["AgentService"].methods
}
STREAMING = frozenset({"FetchChunks"})


def _blocks(first: int, n: int) -> list[common_pb2.BlockIds]:
    return [common_pb2.BlockIds(ids=ids) for ids in block_ids(first, n)]


def seeds(agent: Agent, rng: random.Random) -> dict[str, list[Message]]:
    """Valid requests per RPC, as an engine, a peer or the controller sends them."""
    keys = agent.keys
    fresh = keys_for(rng.randrange(1000, 2000), 3)
    return {
        "RegisterKVCaches": [agent.register_request],
        "UnregisterKVCaches": [agent_pb2.UnregisterKVCachesRequest(instance_id="fz")],
        "Lookup": [
            agent_pb2.LookupRequest(instance_id=ENGINE, request_id="r0", chunk_keys=keys, pin_ttl_ms=500),
            agent_pb2.LookupRequest(
                instance_id=ENGINE, request_id="r1", chunk_keys=[*keys, fresh[0]], lease=True
            ),
        ],
        "Retrieve": [
            agent_pb2.RetrieveRequest(
                instance_id=ENGINE, request_id="r0", chunk_keys=keys, block_ids=_blocks(40, len(keys))
            ),
            agent_pb2.RetrieveRequest(
                instance_id=ENGINE,
                request_id="r1",
                chunk_keys=keys[:2],
                block_ids=_blocks(40, 2),
                skip_first_n_tokens=TOKENS_PER_CHUNK,
                engine_copies=True,
            ),
        ],
        "Store": [
            agent_pb2.StoreRequest(instance_id=ENGINE, chunk_keys=fresh, block_ids=_blocks(20, len(fresh))),
            agent_pb2.StoreRequest(
                instance_id=ENGINE, chunk_keys=keys, block_ids=_blocks(0, len(keys)), skip_first_n_chunks=1
            ),
        ],
        "Release": [
            agent_pb2.ReleaseRequest(instance_id=ENGINE, request_id="r0"),
            agent_pb2.ReleaseRequest(instance_id=ENGINE, request_id="r1", lease_id=1),
        ],
        "Snapshot": [agent_pb2.SnapshotRequest()],
        "Health": [agent_pb2.HealthRequest()],
        "FetchChunks": [
            agent_pb2.FetchChunksRequest(
                chunk_keys=keys, layout_id=agent.layout_id, namespace_id=NS_ID, requester_pod_uid="uid-peer"
            ),
            agent_pb2.FetchChunksRequest(
                chunk_keys=keys, layout_id=agent.layout_id, namespace_id=NS_ID, max_part_bytes=4096
            ),
            agent_pb2.FetchChunksRequest(
                chunk_keys=keys, layout_id=agent.layout_id, namespace_id=NS_ID, data_streams=2
            ),
        ],
    }


def pools(agent: Agent) -> Pools:
    return Pools(
        strings=[
            ENGINE,
            "fz",
            "fz2",
            "r0",
            "r1",
            NS_ID,
            agent.layout_id,
            f"127.0.0.1:{agent.tcp_port}",
            str(agent.directory / "kv-2-0.bin"),
            str(agent.directory / "agent.sock"),
            str(agent.directory),
            "bfloat16",
            "float32",
            "NHD",
            "HND",
            "mla",
            "opaque",
            "flash_attn",
            "backend",
            "kv_layout",
            "num_kv_heads",
            "block_size",
        ],
        bytes_=[*agent.keys, *keys_for(99, 2)],
        ints=[NUM_BLOCKS, NUM_BLOCKS - 1, TOKENS_PER_CHUNK, agent.bytes_per_chunk, 5, 4, 2, 1, 0, -1],
    )


def known_bug(method: str, data: bytes) -> str:
    """Requests the fuzzers do not send while a bug they found is open (see test_findings.py)."""
    del method, data  # none open on the agent now
    return ""
