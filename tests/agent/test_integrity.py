"""Chunk integrity: the checksum recorded at store, carried by FetchChunks and
verified by the fetching agent before a fetched chunk becomes visible.

The attack: a malicious peer (a real gRPC server on loopback) answers FetchChunks with chunks of
the right size but the wrong bytes. The fetching agent is a real ``kvgrid agent`` process; its
engine (this test process) asks it through ``Lookup`` with the peer named (the P/D path, no
controller needed). Nothing of the forged stream may reach L1, the Lookup answers only the local
hits, and the failure is counted. The control sends the same stream with the right checksum and
is accepted, bit for bit.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import pytest
import torch
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider

from kvgrid.agent.cache import ChunkCache
from kvgrid.agent.config import AgentConfig
from kvgrid.agent.core import AgentCore
from kvgrid.agent.l1 import L1Pool
from kvgrid.agent.peers.fetcher import PeerFetcher
from kvgrid.agent.peers.metrics import PeerMetrics
from kvgrid.agent.peers.sender import ChunkSender
from kvgrid.api.v1 import agent_pb2
from kvgrid.common.checksum import CHECKSUM_BYTES, ChecksumMismatch, chunk_checksum, verify_checksum
from kvgrid.common.identity import PodIdentity
from tests.agent.helpers import (
    GROUPS,
    HINTS,
    NAMESPACE,
    FakePeer,
    block_ids,
    fetch_once,
    keys_for,
    make_kv,
    register_kv,
    start_agent,
    wait_for,
)

NS_ID = NAMESPACE.namespace_id()


def malicious_peer(
    make: Callable[[agent_pb2.FetchChunksRequest], Iterable[agent_pb2.FetchChunksResponse]],
) -> FakePeer:
    """A peer answering every FetchChunks with ``make(request)``."""
    return FakePeer(lambda req, context: make(req))


def stream(
    payloads: list[bytes], part: int, checksums: list[bytes | None]
) -> list[agent_pb2.FetchChunksResponse]:
    """FetchChunks messages carrying ``payloads`` in parts; ``checksums[i]`` goes with chunk i's
    first part (None: none sent)."""
    out = []
    for index, (payload, checksum) in enumerate(zip(payloads, checksums, strict=True)):
        for off in range(0, len(payload), part):
            msg = agent_pb2.FetchChunksResponse(
                chunk_index=index, chunk_bytes=len(payload), offset=off, data=payload[off : off + part]
            )
            if off == 0:
                if checksum is not None:
                    msg.checksum = checksum
                if index == 0:
                    msg.num_chunks = len(payloads)
            out.append(msg)
    return out


def forged(nbytes: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size=nbytes, dtype=np.uint8).tobytes()


def flip_last_byte(payload: bytes) -> bytes:
    return payload[:-1] + bytes([payload[-1] ^ 0x01])


# ---- the attack, against a real agent process ------------------------------------------------


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("attack", ["wrong_bytes", "no_checksum", "checksum_of_other_bytes"])
def test_forged_peer_chunks_never_reach_l1_or_the_engine(tmp_path: Path, attack: str, mode: str) -> None:
    agent = start_agent(tmp_path, "--peer-fetch-mode", mode)
    peer: FakePeer | None = None
    try:
        client = agent.client()
        tensors, reg = register_kv(client, "victim", tmp_path, seed=3)
        nbytes = reg.bytes_per_chunk
        keys = keys_for(1201, 3)
        # The victim's agent holds chunk 0 itself; chunks 1 and 2 are to come from the peer.
        assert client.store("victim", keys[:1], block_ids(0, 1)).num_stored_chunks == 1

        real = [forged(nbytes, 10), forged(nbytes, 11)]
        sent = {
            # Right size, wrong content: the checksum of the real bytes travels with tampered bytes.
            "wrong_bytes": (
                [flip_last_byte(real[0]), forged(nbytes, 99)],
                [chunk_checksum(real[0]), chunk_checksum(real[1])],
            ),
            "no_checksum": (real, [None, None]),
            "checksum_of_other_bytes": (real, [chunk_checksum(real[1]), chunk_checksum(real[0])]),
        }[attack]
        answered = threading.Event()

        def answer(req: agent_pb2.FetchChunksRequest) -> Iterable[agent_pb2.FetchChunksResponse]:
            msgs = stream(sent[0], 4096, list(sent[1]))
            yield msgs[0]  # the announcement, with the first part of chunk 0
            if mode == "async":
                # The rest only once the Lookup answered, so the answer shows the chunks pending
                # (the other order: test_chunks_that_failed_before_the_lookup_answered_are_not_counted).
                answered.wait(10)
            yield from msgs[1:]

        peer = malicious_peer(answer)
        before = client.health()

        hit = client.lookup("victim", "r1", keys, peer_address=peer.address)
        answered.set()

        assert len(peer.requests) >= 1 and list(peer.requests[0].chunk_keys) == keys[1:]
        if mode == "sync":
            # Only the local hit is answered; the fetch counts as a failed peer fetch.
            assert (hit.num_hit_chunks, hit.num_peer_chunks, hit.miss_cause) == (1, 0, "peer_failed")
        else:
            # Answered once the peer said it sends 2 chunks: they are pending until verified.
            assert (hit.num_hit_chunks, hit.num_peer_chunks, hit.miss_cause) == (3, 2, "none")
        # The engine gets the local chunk only: blocks of chunks 1 and 2 are not written (an
        # asynchronous Retrieve waits for the pending chunks and stops before the failed one).
        untouched = [t.clone() for t in tensors]
        res = client.retrieve("victim", "r1", keys, block_ids(0, 3))
        assert res.hit_mask == [True, False, False]
        assert all(
            torch.equal(a.view(torch.uint8), b.view(torch.uint8))
            for a, b in zip(tensors, untouched, strict=True)
        )
        wait_for(
            "the failed fetch counted",
            lambda: client.health().peer_fetch_failures > before.peer_fetch_failures,
        )
        after = client.health()
        assert after.peer_fetched_chunks == before.peer_fetched_chunks
        # Nothing of the stream was kept: L1 holds the one local chunk, no reservation leaked.
        assert (after.num_chunks, after.l1_used_bytes) == (before.num_chunks, before.l1_used_bytes)
        assert set(client.snapshot().chunk_keys) == {keys[0]}
    finally:
        if peer is not None:
            peer.server.stop(0)
        agent.stop()


def test_chunks_that_failed_before_the_lookup_answered_are_not_counted(tmp_path: Path) -> None:
    """Asynchronous fetch, in-process: the forged stream arrives whole, and its chunks fail before
    the Lookup walks the index again (the fetch returns only once they did). The answer is the
    local hit with cause ``peer_failed``, not a hit on chunks already gone nor ``not_found``."""
    cfg = AgentConfig(l1_size=8 << 20, uds_path="", tcp_port=0, peer_fetch_mode="async")
    core = AgentCore(cfg, PodIdentity(pod_uid="u"), meter=MeterProvider().get_meter("t"))
    peer: FakePeer | None = None
    try:
        tensors, _ = make_kv(tmp_path, seed=3)
        inst = core.register(
            "victim", engine_groups=GROUPS, tensors=tensors, namespace=NAMESPACE, layout_hints=HINTS
        )
        keys = keys_for(1203, 3)
        assert core.store("victim", keys[:1], block_ids(0, 1)).num_stored_chunks == 1
        real = [forged(inst.bytes_per_chunk, 30), forged(inst.bytes_per_chunk, 31)]
        swapped: list[bytes | None] = [chunk_checksum(real[1]), chunk_checksum(real[0])]
        peer = malicious_peer(lambda req: stream(real, 4096, swapped))
        fetch = core.peers.fetch

        def fetch_then_fail(*args: object, **kwargs: object):  # type: ignore[no-untyped-def]
            got = fetch(*args, **kwargs)  # type: ignore[arg-type]
            assert got.chunks == 2 and not got.error  # pending: the answer would count them
            wait_for(
                "the pending chunks failed",
                lambda: core.cache.prefix_length(keys, inst.layout_id, namespace_id=NS_ID)[0] == 1,
            )
            return got

        core.peers.fetch = fetch_then_fail  # type: ignore[method-assign]

        hit = core.lookup("victim", "r1", keys, peer_address=peer.address)

        assert (hit.num_hit_chunks, hit.num_peer_chunks, hit.miss_cause) == (1, 0, "peer_failed")
    finally:
        if peer is not None:
            peer.server.stop(0)
        core.close()


def test_same_stream_with_the_right_checksums_is_accepted(tmp_path: Path) -> None:
    """The control: the malicious peer's stream, but each chunk with the checksum of its bytes."""
    agent = start_agent(tmp_path)
    peer: FakePeer | None = None
    try:
        client = agent.client()
        _, reg = register_kv(client, "victim", tmp_path, seed=3)
        nbytes = reg.bytes_per_chunk
        keys = keys_for(1202, 3)
        assert client.store("victim", keys[:1], block_ids(0, 1)).num_stored_chunks == 1
        payloads = [forged(nbytes, 20), forged(nbytes, 21)]
        peer = malicious_peer(lambda req: stream(payloads, 4096, [chunk_checksum(p) for p in payloads]))
        before = client.health()

        hit = client.lookup("victim", "r1", keys, peer_address=peer.address)

        assert (hit.num_hit_chunks, hit.num_peer_chunks, hit.miss_cause) == (3, 2, "none")
        # The Lookup answered at the peer's announcement (asynchronous fetch): the count follows the bytes.
        wait_for(
            "the fetched chunks counted",
            lambda: client.health().peer_fetched_chunks == before.peer_fetched_chunks + 2,
        )
        assert client.health().peer_fetch_failures == before.peer_fetch_failures
        # The fetched chunks are in L1 bit for bit, and their recorded checksums travel on.
        parts = list(client.fetch_chunks(keys, reg.layout_id, namespace_id=NS_ID, max_part_bytes=1 << 20))
        data: dict[int, bytes] = {}
        sums: dict[int, bytes] = {}
        for m in parts:
            data[m.chunk_index] = data.get(m.chunk_index, b"") + m.data
            if m.offset == 0:
                sums[m.chunk_index] = m.checksum
        assert [data[1], data[2]] == payloads
        assert [sums[1], sums[2]] == [chunk_checksum(p) for p in payloads]
        assert sums[0] == chunk_checksum(data[0])  # chunk 0 was stored by the engine here
        assert client.release("victim", "r1") == 3
    finally:
        if peer is not None:
            peer.server.stop(0)
        agent.stop()


# ---- in-process: partial streams, counters, store-time checksums ----------------------------


def _fetcher(cache: ChunkCache, reader_metrics: PeerMetrics) -> PeerFetcher:
    cfg = AgentConfig(peer_fetch_mode="sync")  # the receive path's verdicts, inside the call
    return PeerFetcher(cache, cfg, "uid-local", reader_metrics, trace.get_tracer("t"))


def test_chunks_before_a_corrupt_one_are_kept_and_the_rest_discarded() -> None:
    """Chunk 0 intact, chunk 1 tampered, chunk 2 intact: chunk 0 is committed (a prefix), chunk 1
    never, and the stream stops there (chunk 2 is not kept either: the peer is not trusted)."""
    cache = ChunkCache(L1Pool(1 << 20, page_bytes=4096, pin=False))
    keys = keys_for(1203, 3)
    nbytes = 8192
    payloads = [forged(nbytes, 30 + i) for i in range(3)]
    sums = [chunk_checksum(p) for p in payloads]
    peer = malicious_peer(
        lambda req: stream([payloads[0], flip_last_byte(payloads[1]), payloads[2]], 3000, sums)
    )
    peer_metrics = PeerMetrics(metrics.get_meter("test_integrity"))
    fetcher = _fetcher(cache, peer_metrics)
    try:
        res = fetch_once(fetcher, peer.address, keys, nbytes, peer_uid="evil", timeout_s=5)
    finally:
        peer.server.stop(0)
    assert res.error.startswith("checksum: ") and "chunk 1 discarded" in res.error, res.error
    assert (res.chunks, res.nbytes) == (1, nbytes)
    assert peer_metrics.stats.fetch_failures == 1 and peer_metrics.stats.fetched_chunks == 1
    assert cache.prefix_length(keys, "L", namespace_id=NS_ID)[0] == 1
    (chunk,), _ = cache.acquire_prefix(keys[:1], "L", namespace_id=NS_ID)
    assert chunk.buffer.numpy().tobytes() == payloads[0] and chunk.checksum == sums[0]
    assert cache.stats().used_bytes == cache.pool.pages_for(nbytes) * cache.pool.page_bytes


def test_the_checksum_of_stored_bytes_is_served_with_them() -> None:
    cache = ChunkCache(L1Pool(1 << 20, page_bytes=4096, pin=False))
    keys = keys_for(1204, 2)
    nbytes = 5000  # not a page multiple: the checksum covers the chunk's bytes, not its pages
    res = cache.reserve_store(keys, namespace_id=NS_ID, layout_id="L", nbytes=nbytes)
    payloads = [forged(nbytes, 40 + i) for i in range(2)]
    for (_, chunk), payload in zip(res.new_chunks, payloads, strict=True):
        assert chunk.checksum == b""
        chunk.buffer.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    assert cache.commit(res) == (2, 0)
    # The sender puts each chunk's checksum on its first part, and only there (computed then, off
    # the store path), and keeps it with the chunk.
    req = agent_pb2.FetchChunksRequest(chunk_keys=keys, layout_id="L", namespace_id=NS_ID)
    msgs = list(ChunkSender(cache, req, part_bytes=2048, max_chunks=8, min_part_bytes=1))
    firsts = [m for m in msgs if m.offset == 0]
    assert [m.checksum for m in firsts] == [chunk_checksum(p) for p in payloads]
    assert all(len(m.checksum) == CHECKSUM_BYTES for m in firsts)
    assert all(m.checksum == b"" for m in msgs if m.offset != 0)
    chunks, _ = cache.acquire_prefix(keys, "L", namespace_id=NS_ID)
    try:
        assert [c.checksum for c in chunks] == [chunk_checksum(p) for p in payloads]
    finally:
        cache.release(chunks)


def test_verify_checksum() -> None:
    data = forged(1 << 16, 50)
    verify_checksum(data, chunk_checksum(data))
    verify_checksum(np.frombuffer(data, dtype=np.uint8), chunk_checksum(data))
    with pytest.raises(ChecksumMismatch, match="xxh3-128"):
        verify_checksum(flip_last_byte(data), chunk_checksum(data))
    for bad in (b"", chunk_checksum(data)[:8], chunk_checksum(data) + b"\0"):
        with pytest.raises(ChecksumMismatch, match="16-byte"):
            verify_checksum(data, bad)


def test_bench_checksum_command(capsys: pytest.CaptureFixture[str]) -> None:
    from kvgrid import cli

    args = ["bench", "checksum", "--sizes-kib", "64,256", "--min-bytes", "1048576", "--repeat", "2"]
    assert cli.main([*args, "--store-chunks", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [row["size_kib"] for row in report["rows"]] == [64, 256]
    for row in report["rows"]:
        assert row["copy_gb_per_s"] > 0
        assert set(row["results"]) == {"xxh3_128", "blake2b_128", "crc32"}
        assert all(r["gb_per_s"] > 0 and r["ratio_to_copy"] > 0 for r in row["results"].values())
    store = report["store_path"]
    assert store["chunks"] == 2 and store["chunk_bytes"] == 256 * 1024
    assert store["checksum_ms_per_chunk"] > 0 and store["copy_ms_per_chunk"] > 0  # each timed on its own
    assert cli.main([*args, "--store-path", "false"]) == 0
    out = capsys.readouterr().out
    assert "xxh3_128" in out and "ratio" in out and "store path" not in out
