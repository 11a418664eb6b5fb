"""vLLM KV events (real vLLM classes and ZmqEventPublisher) -> GPU-tier entries with kvgrid chunk keys."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import grpc
import msgspec
import pytest

from kvgrid.api.v1 import common_pb2, controller_pb2, controller_pb2_grpc
from kvgrid.common.hashing import KeyNamespace, chunk_keys
from kvgrid.controller.config import ControllerConfig, VllmEventSource
from kvgrid.controller.index import IndexTier
from kvgrid.controller.service import serve
from kvgrid.controller.vllm_events import (
    BlockMapper,
    Removed,
    Stored,
    decode_batch,
)
from tests.controller.support import FakeAgent, wait_until

kv_events = pytest.importorskip("vllm.distributed.kv_events")

NS = KeyNamespace(model="tiny-model", tokens_per_chunk=16)
BS = 4  # engine block size: 4 blocks per chunk


@pytest.mark.parametrize("block_size", [3, 5, 16])
@pytest.mark.parametrize("blocks_per_event", [1, 2, 7])
def test_block_mapper_keys_equal_chunk_keys_for_any_block_size_and_event_split(
    block_size: int, blocks_per_event: int
) -> None:
    # Block boundaries that do not line up with chunk boundaries, one run per event, each event's
    # parent the last block of the one before: every chunk is keyed as over the whole prompt.
    n_blocks = 40
    tokens = list(range(1000, 1000 + block_size * n_blocks))
    m = BlockMapper(NS)
    got: list[bytes] = []
    parent = None
    for first in range(0, n_blocks, blocks_per_event):
        hashes = tuple(range(first + 1, min(first + blocks_per_event, n_blocks) + 1))
        run = tokens[first * block_size : (first + len(hashes)) * block_size]
        result = m.stored(Stored(hashes, parent, tuple(run), block_size, "GPU"))
        assert result is not None
        got += result[1]
        parent = hashes[-1]
    assert got == chunk_keys(tokens, NS)
    assert len(got) == len(tokens) // NS.tokens_per_chunk


def test_block_mapper_refuses_a_bad_token_id_without_changing_state() -> None:
    m = BlockMapper(NS)
    m.stored(Stored((1,), None, tuple(range(BS)), BS, "GPU"))
    with pytest.raises(ValueError, match=r"token_ids\[5\] = -1"):
        m.stored(Stored((2, 3), 1, (4, 5, 6, 7, 8, -1, 10, 11), BS, "GPU"))
    assert set(m.blocks) == {1}
    # The parent's state is intact: the good continuation still keys the first chunk.
    tokens = list(range(16))
    result = m.stored(Stored((2, 3, 4), 1, tuple(tokens[BS:]), BS, "GPU"))
    assert result == (IndexTier.GPU, chunk_keys(tokens, NS))


def test_block_mapper_chains_runs_and_evicts_the_completing_block() -> None:
    tokens = list(range(16 * 4))
    want = chunk_keys(tokens, NS)
    m = BlockMapper(NS)
    hashes = list(range(1, 17))
    # Two runs with a parent link that splits a chunk in the middle (blocks 0-5, then 6-15).
    tier, got = m.stored(Stored(tuple(hashes[:6]), None, tuple(tokens[:24]), BS, "GPU"))  # type: ignore[misc]
    assert got == want[:1]
    tier, got = m.stored(Stored(tuple(hashes[6:]), hashes[5], tuple(tokens[24:]), BS, None))  # type: ignore[misc]
    assert got == want[1:]
    # Removing a block that completes no chunk evicts nothing; the completing block evicts its chunk.
    assert m.removed(Removed((hashes[4],), "GPU")) == (tier, [])
    assert m.removed(Removed((hashes[7],), "GPU")) == (tier, [want[1]])
    # Unknown parent: counted, nothing keyed.
    assert m.stored(Stored((99,), 12345, (1, 2, 3, 4), BS, "GPU")) is None
    assert m.unknown_parents == 1


def _ids(tokens: list[int]) -> controller_pb2.MatchPrefixRequest:
    return controller_pb2.MatchPrefixRequest(
        token_ids=common_pb2.TokenIds(ids=tokens),
        namespace=common_pb2.KeyNamespace(model="tiny-model", tokens_per_chunk=16),
    )


def test_real_vllm_publisher_both_forms_replay_and_medium(free_port: Callable[[], int]) -> None:
    pub_port, replay_port = free_port(), free_port()
    pub = kv_events.ZmqEventPublisher(
        data_parallel_rank=0,
        endpoint=f"tcp://*:{pub_port}",
        replay_endpoint=f"tcp://*:{replay_port}",
        topic="kv@pod-v@tiny",
    )
    tokens = list(range(500, 500 + 16 * 6))
    keys = chunk_keys(tokens, NS)
    h = [10_000 + i for i in range(24)]  # one engine block hash per 4 tokens

    def stored(lo: int, hi: int, medium: str = "GPU") -> kv_events.BlockStored:
        return kv_events.BlockStored(
            block_hashes=h[lo:hi],
            parent_block_hash=h[lo - 1] if lo else None,
            token_ids=tokens[lo * BS : hi * BS],
            block_size=BS,
            lora_id=None,
            medium=medium,
            lora_name=None,
        )

    # Published before the controller subscribes: only the replay socket can deliver it.
    pub.publish(kv_events.KVEventBatch(ts=time.time(), events=[stored(0, 8)]))
    time.sleep(0.2)
    srv = serve(
        ControllerConfig(
            listen="127.0.0.1:0",
            sweep_interval_ms=50,
            vllm_sources=[
                VllmEventSource(
                    pod_uid="pod-v",
                    endpoint=f"tcp://127.0.0.1:{pub_port}",
                    replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
                    namespace=NS,
                )
            ],
        )
    )
    ch = grpc.insecure_channel(srv.address)
    stub = controller_pb2_grpc.ControllerServiceStub(ch)
    agent = FakeAgent(srv.address, "pod-v", namespace_id=NS.namespace_id())

    def gpu() -> int:
        m = stub.MatchPrefix(_ids(tokens))
        return sum(p.gpu_chunks for p in m.matches if p.pod_uid == "pod-v")

    def l1() -> int:
        m = stub.MatchPrefix(_ids(tokens))
        return sum(p.l1_chunks for p in m.matches if p.pod_uid == "pod-v")

    try:
        wait_until(lambda: gpu() == 2, what="replayed BlockStored (2 chunks)")
        # Positional (pre-0.26) form, carried by the same real publisher.
        positional = ["BlockStored", h[8:16], h[7], tokens[32:64], BS, None, "GPU", None]
        # The first live batch may go before the controller's subscription reached the publisher
        # (ZeroMQ's slow joiner; no later batch would reveal the gap): published again until it
        # lands. Storing the same blocks again changes nothing.
        for _ in range(30):
            pub.publish(kv_events.KVEventBatch(ts=time.time(), events=[positional]))
            try:
                wait_until(lambda: gpu() == 4, timeout=1.0, what="positional BlockStored")
                break
            except AssertionError:
                continue
        assert gpu() == 4, "positional BlockStored never arrived"
        pub.publish(kv_events.KVEventBatch(ts=time.time(), events=[stored(16, 24)]))
        wait_until(lambda: gpu() == 6, what="tagged BlockStored")
        # The block completing chunk 2 (block 11) goes: the GPU prefix stops at 2.
        pub.publish(
            kv_events.KVEventBatch(
                ts=time.time(), events=[kv_events.BlockRemoved(block_hashes=[h[11]], medium="GPU")]
            )
        )
        wait_until(lambda: gpu() == 2, what="BlockRemoved")
        snap = stub.SnapshotIndex(
            controller_pb2.SnapshotIndexRequest(pod_uid="pod-v", tier=common_pb2.TIER_GPU)
        )
        assert set(snap.chunk_keys) == set(keys) - {keys[2]}
        # medium CPU -> the L1 tier (tokens-free offload event of known blocks).
        pub.publish(
            kv_events.KVEventBatch(
                ts=time.time(),
                events=[
                    kv_events.BlockStored(
                        block_hashes=h[0:8],
                        parent_block_hash=None,
                        token_ids=[],
                        block_size=BS,
                        lora_id=None,
                        medium="CPU",
                        lora_name=None,
                    )
                ],
            )
        )

        def l1_keys() -> set[bytes]:
            return set(stub.SnapshotIndex(controller_pb2.SnapshotIndexRequest(pod_uid="pod-v")).chunk_keys)

        wait_until(lambda: l1_keys() == {keys[0], keys[1]}, what="CPU medium -> L1")
        assert (gpu(), l1()) == (2, 0)  # a chunk counts in its fastest tier
        pub.publish(kv_events.KVEventBatch(ts=time.time(), events=[kv_events.AllBlocksCleared()]))
        wait_until(lambda: gpu() == 0, what="AllBlocksCleared")
        st = stub.GetStats(controller_pb2.GetStatsRequest())
        assert st.vllm_replays >= 1 and st.vllm_events_ingested >= 6
    finally:
        agent.close()
        ch.close()
        srv.stop()
        pub.shutdown()


def test_decode_rejects_garbage() -> None:
    with pytest.raises(ValueError, match="not msgpack"):
        decode_batch(b"\xc1")
    with pytest.raises(ValueError, match=r"expected \[ts, events, dp_rank\]"):
        decode_batch(msgspec.msgpack.encode({"a": 1}))
    assert decode_batch(msgspec.msgpack.encode([1.0, [{"type": "SomethingNew"}], 0])) == []
