"""Asynchronous promotion from the disk tier, in-process (``AgentCore`` with a real disk tier and
CPU KV tensors): the disk store's reads wait on a gate the test opens, so "the Lookup answered
before the read finished" is an observed order of events, not a timing. The same paths through a
real agent process are in ``test_tiers_agent.py``."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from kvgrid.agent.config import AgentConfig
from kvgrid.agent.core import AgentCore
from kvgrid.agent.tiers.base import HEADER_BYTES, BlobStore, record_name
from kvgrid.common.agent_results import RetrieveResult
from kvgrid.common.identity import PodIdentity

from .helpers import GROUPS, HINTS, NAMESPACE, block_ids, blocks_of, keys_for, make_kv
from .test_telemetry import points

PAGE = 4096


class GatedStore:
    """The disk tier's real store, whose reads wait until the test opens ``gate`` (at most 10 s,
    so a broken promotion fails the test instead of hanging it); ``reading`` is set when a read
    is waiting there."""

    def __init__(self, inner: BlobStore) -> None:
        self.inner = inner
        self.kind = inner.kind
        self.gate = threading.Event()
        self.reading = threading.Event()

    def read_into(self, name: str, header: bytearray, payload: memoryview) -> int:
        self.reading.set()
        self.gate.wait(10)
        return self.inner.read_into(name, header, payload)

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


class Setup:
    def __init__(self, tmp_path: Path, mode: str) -> None:
        self.reader = InMemoryMetricReader()
        cfg = AgentConfig(
            l1_size=256 * 1024,
            l1_page_size=PAGE,
            high_watermark=0.6,
            low_watermark=0.3,
            uds_path="",
            tcp_port=0,
            tier_disk_path=str(tmp_path / "disk"),
            tier_disk_size=1 << 20,
            tier_promotion=mode,  # type: ignore[arg-type]
            l1_shared_dir=str(tmp_path),  # engine copies: a Lookup may lease (only ready chunks)
        )
        self.core = AgentCore(
            cfg, PodIdentity(pod_uid="u"), meter=MeterProvider(metric_readers=[self.reader]).get_meter("t")
        )
        self.disk = tmp_path / "disk"
        self.tensors, _ = make_kv(tmp_path)
        self.inst = self.core.register(
            "e", engine_groups=GROUPS, tensors=self.tensors, namespace=NAMESPACE, layout_hints=HINTS
        )
        self.keys = keys_for(1, 3)
        self.want = blocks_of(self.tensors, block_ids(0, 3))
        # A goes to L1, fillers push it out onto disk (the writer finishes before the test goes on).
        assert self.core.store("e", self.keys, block_ids(0, 3)).num_stored_chunks == 3
        for f in range(8):
            self.core.store("e", keys_for(100 + f, 3), block_ids(0, 3))
        assert self.core.tiers is not None and self.core.tiers.drain()
        ns = self.inst.namespace_id
        assert not any(self.core.cache.contains(k, namespace_id=ns) for k in self.keys)
        assert all(self.core.tiers.holds(ns, k) for k in self.keys)
        tier = self.core.tiers.tiers[0]
        self.store = GatedStore(tier.store)
        tier.store = self.store  # type: ignore[assignment]
        for t in self.tensors:
            t.zero_()

    def in_l1(self) -> list[bool]:
        return [self.core.cache.contains(k, namespace_id=self.inst.namespace_id) for k in self.keys]

    def retrieve_in_thread(self, request_id: str) -> tuple[threading.Thread, list[RetrieveResult]]:
        out: list[RetrieveResult] = []
        t = threading.Thread(
            target=lambda: out.append(self.core.retrieve("e", request_id, self.keys, block_ids(16, 3)))
        )
        t.start()
        return t, out

    def no_leaks(self) -> None:
        """No pin, no promotion, and every L1 page belongs to a chunk in the index."""
        assert self.core.promoter is not None and self.core.tiers is not None
        # A promotion may have evicted a filler: its spill to disk is background work, not a leak.
        assert self.core.tiers.drain()
        s = self.core.cache.stats()
        assert (s.num_pins, s.spilling_chunks, self.core.promoter.in_flight) == (0, 0, 0)
        assert s.used_bytes == s.num_chunks * 5 * PAGE  # 19456-byte chunks take 5 pages
        assert all(c.refcount == 0 for c in self.core.cache._chunks.values())

    def wait_promotions(self) -> None:
        assert self.core.promoter is not None
        for _ in range(1000):
            if self.core.promoter.in_flight == 0:
                return
            threading.Event().wait(0.01)
        raise AssertionError("promotions still running")

    def promoted(self) -> dict[str, float]:
        return {a["result"]: v for a, v in points(self.reader).get("kvgrid_agent_tier_promoted_chunks", [])}


@pytest.fixture
def setup(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Setup]:
    s = Setup(tmp_path, getattr(request, "param", "async"))
    yield s
    s.store.gate.set()
    s.core.close()


def test_a_lookup_leases_only_chunks_whose_read_has_finished(setup: Setup) -> None:
    """Engine copies read L1 without the agent: a lease handed out while a chunk's bytes are still
    being read from disk would let the engine copy them unread. Such a Lookup keeps its pins (the
    Retrieve waits); once the reads finished, a Lookup leases the chunks and drops the pins."""
    early = setup.core.lookup("e", "r", setup.keys, lease=True)
    assert setup.store.reading.wait(5) and not setup.store.gate.is_set()
    assert (early.num_hit_chunks, early.lease_id, early.chunk_offsets) == (3, 0, [])
    assert setup.core.cache.stats().num_pins == 3 and setup.core.leased_chunks() == 0
    setup.store.gate.set()
    setup.wait_promotions()
    later = setup.core.lookup("e", "r", setup.keys, lease=True)
    assert later.num_hit_chunks == 3 and later.lease_id > 0 and len(later.chunk_offsets) == 3
    assert later.l1_file == setup.core.pool.shared_file
    assert setup.core.cache.stats().num_pins == 0 and setup.core.leased_chunks() == 3
    assert setup.core.release("e", "r", later.lease_id) == (0, 3)
    setup.no_leaks()


def test_lookup_answers_before_the_read_and_retrieve_waits_for_it(setup: Setup) -> None:
    res = setup.core.lookup("e", "r", setup.keys)
    # The Lookup has answered, and the first read is still held at the gate: it ran off the
    # request path. The chunks are in the index already (pending), pinned for "r".
    assert setup.store.reading.wait(5) and not setup.store.gate.is_set()
    assert (res.num_hit_chunks, res.miss_cause) == (3, "none")
    assert setup.in_l1() == [True, True, True]
    assert setup.core.promoter is not None and setup.core.promoter.in_flight == 1
    assert points(setup.reader)["kvgrid_agent_tier_promotions_in_flight"] == [({}, 1)]
    thread, out = setup.retrieve_in_thread("r")
    thread.join(0.5)
    assert thread.is_alive() and not out  # waits for the pending chunks (never copies them unread)
    setup.store.gate.set()
    thread.join(10)
    assert out and (out[0].num_retrieved_chunks, out[0].miss_cause) == (3, "none")
    got = blocks_of(setup.tensors, block_ids(16, 3))
    assert all(torch.equal(w, g) for w, g in zip(setup.want, got, strict=True))
    setup.wait_promotions()
    setup.no_leaks()
    assert setup.promoted() == {"ok": 3}
    seconds = {a["result"]: v for a, v in points(setup.reader)["kvgrid_agent_tier_promotion_duration"]}
    assert seconds.keys() == {"ok"} and seconds["ok"] > 0


@pytest.mark.parametrize("setup", ["sync"], indirect=True)
def test_sync_mode_reads_inside_the_lookup(setup: Setup) -> None:
    setup.store.gate.set()
    res = setup.core.lookup("e", "r", setup.keys)
    assert setup.core.promoter is not None and setup.core.promoter.in_flight == 0  # done before it answered
    assert res.num_hit_chunks == 3 and setup.promoted() == {"ok": 3}
    assert setup.core.retrieve("e", "r", setup.keys, block_ids(16, 3)).num_retrieved_chunks == 3
    got = blocks_of(setup.tensors, block_ids(16, 3))
    assert all(torch.equal(w, g) for w, g in zip(setup.want, got, strict=True))
    setup.no_leaks()


def flip_payload_bit(setup: Setup, key: bytes) -> None:
    path = setup.disk / (record_name(setup.inst.namespace_id, key) + ".kvc")
    blob = bytearray(path.read_bytes())
    blob[HEADER_BYTES + 77] ^= 0x04
    path.write_bytes(blob)


def test_a_corrupted_record_fails_its_chunk_and_the_rest(setup: Setup) -> None:
    assert setup.core.tiers is not None
    left: list[tuple[str, list[bytes], bool]] = []
    setup.core.tiers.on_l2 = lambda ns, keys, added: left.append((ns, list(keys), added))
    flip_payload_bit(setup, setup.keys[1])
    assert setup.core.lookup("e", "r", setup.keys).num_hit_chunks == 3  # counted before the read
    thread, out = setup.retrieve_in_thread("r")
    setup.store.gate.set()
    thread.join(10)
    assert out and (out[0].num_retrieved_chunks, out[0].hit_mask, out[0].miss_cause) == (
        1,
        [True, False, False],
        "tier_failed",
    )
    assert torch.equal(blocks_of(setup.tensors, block_ids(16, 1))[0], setup.want[0][:4])
    setup.wait_promotions()
    assert setup.in_l1() == [True, False, False]  # the failed ones left L1
    setup.no_leaks()
    assert setup.promoted() == {"ok": 1, "failed": 2}
    assert setup.core.tiers.tiers[0].stats().checksum_mismatches == 1
    # The refused record left the tiers: the controller is told (TIER_L2 evict, agent/events.py).
    assert [e for e in left if not e[2]] == [(setup.inst.namespace_id, [setup.keys[1]], False)]


def test_release_during_promotion_drops_the_unread_chunks_without_leaks(setup: Setup) -> None:
    assert setup.core.lookup("e", "r", setup.keys).num_hit_chunks == 3
    assert setup.store.reading.wait(5)  # chunk 0 is being read
    assert setup.core.release("e", "r") == (3, 0)
    setup.store.gate.set()
    setup.wait_promotions()
    assert setup.in_l1() == [True, False, False]  # the read in flight finished; the rest dropped
    setup.no_leaks()
    assert setup.promoted() == {"ok": 1, "cancelled": 2}


def test_a_cancelled_promotion_still_reads_what_another_request_pinned(setup: Setup) -> None:
    assert setup.core.lookup("e", "r", setup.keys).num_hit_chunks == 3
    assert setup.store.reading.wait(5)
    assert setup.core.lookup("e", "other", setup.keys).num_hit_chunks == 3  # pins the pending chunks
    setup.core.release("e", "r")
    thread, out = setup.retrieve_in_thread("other")
    setup.store.gate.set()
    thread.join(10)
    assert out and out[0].num_retrieved_chunks == 3
    got = blocks_of(setup.tensors, block_ids(16, 3))
    assert all(torch.equal(w, g) for w, g in zip(setup.want, got, strict=True))
    setup.wait_promotions()
    setup.no_leaks()
    assert setup.promoted() == {"ok": 3}


def test_a_peer_fetch_of_pending_chunks_waits_and_stops_before_a_failed_one(setup: Setup) -> None:
    """FetchChunks serving (``ChunkSender``) waits for chunks still being promoted and never
    streams one whose record was refused."""
    from kvgrid.agent.peers.sender import ChunkSender
    from kvgrid.api.v1 import agent_pb2

    flip_payload_bit(setup, setup.keys[2])
    assert setup.core.lookup("e", "r", setup.keys).num_hit_chunks == 3
    req = agent_pb2.FetchChunksRequest(
        chunk_keys=setup.keys, layout_id=setup.inst.layout_id, namespace_id=setup.inst.namespace_id
    )
    senders: list[ChunkSender] = []
    thread = threading.Thread(
        target=lambda: senders.append(ChunkSender(setup.core.cache, req, part_bytes=1 << 20, max_chunks=8))
    )
    thread.start()
    thread.join(0.5)
    assert thread.is_alive() and not senders  # waiting for the pending chunks
    setup.store.gate.set()
    thread.join(10)
    (sender,) = senders
    assert sender.num_chunks == 2  # chunk 2 was refused: not served
    msgs = list(sender)
    sent = b"".join(m.data for m in msgs)
    chunks, _ = setup.core.cache.acquire_prefix(
        setup.keys[:2], setup.inst.layout_id, namespace_id=setup.inst.namespace_id
    )
    assert sent == b"".join(c.buffer.numpy().tobytes() for c in chunks)
    setup.core.cache.release(chunks)
    setup.core.release("e", "r")
    setup.wait_promotions()
    setup.no_leaks()
