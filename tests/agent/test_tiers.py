"""Lower tiers in-process: one conformance suite run against both blob stores (local disk and a real
SeaweedFS S3 gateway started here), the tier chain (LRU, demotion disk -> S3), the L1 cache's spill
path, S3 retries through a real flaky TCP proxy, credentials and config validation.

The end-to-end path through a real agent process is ``test_tiers_agent.py``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvgrid.agent.cache import ChunkCache
from kvgrid.agent.config import AgentConfig
from kvgrid.agent.l1 import Chunk, L1Pool
from kvgrid.agent.tiers.base import HEADER_BYTES, BlobStore, record_name
from kvgrid.agent.tiers.disk import DiskBlobStore
from kvgrid.agent.tiers.s3 import S3BlobStore, load_credentials
from kvgrid.agent.tiers.tier import Tier, TierChain, byte_view
from kvgrid.common.checksum import chunk_checksum

from .s3_server import ACCESS_KEY, SECRET_KEY, SeaweedFS, start_seaweedfs

MiB = 1024 * 1024
NS_A, NS_B = "a" * 32, "b" * 32


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def payload(seed: int, nbytes: int = 64 * 1024) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    server = start_seaweedfs(tmp_path_factory.mktemp("seaweedfs"))
    yield server
    server.stop()


def s3_store(server: SeaweedFS, prefix: str, **kw: object) -> S3BlobStore:
    creds = load_credentials("", {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY})
    return S3BlobStore(server.host, server.bucket, prefix=prefix, credentials=creds, part_size=5 * MiB, **kw)  # type: ignore[arg-type]


@pytest.fixture(params=["disk", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BlobStore]:
    if request.param == "disk":
        s: BlobStore = DiskBlobStore(tmp_path / "tier")
    else:
        s = s3_store(request.getfixturevalue("seaweed"), prefix=f"t-{request.node.name}")
    yield s
    s.close()


def write(tier: Tier, ns: str, k: bytes, data: np.ndarray, layout: str = "L") -> None:
    for vns, vkey, _ in tier.make_room(data.nbytes):
        tier.store.delete(record_name(vns, vkey))
    tier.write(ns, k, layout, chunk_checksum(data), byte_view(data))


def raw_blob(store: BlobStore, name: str, nbytes: int) -> bytearray:
    header, body = bytearray(HEADER_BYTES), bytearray(nbytes)
    got = store.read_into(name, header, memoryview(body))
    return header + body[:got]


def overwrite(store: BlobStore, name: str, blob: bytes | bytearray) -> None:
    """Replace a blob behind the tier's back (what rot, a torn write or an attacker leaves)."""
    store.write(name, bytes(blob[:HEADER_BYTES]), memoryview(bytes(blob[HEADER_BYTES:])))


# ---- conformance: both backends ----------------------------------------------------------------


def test_round_trip_list_delete(store: BlobStore) -> None:
    tier = Tier(store, 64 * MiB)
    data = payload(1)
    write(tier, NS_A, key(1), data)
    write(tier, NS_A, key(2), payload(2))
    out = np.zeros_like(data)
    assert tier.read_into(NS_A, key(1), "L", out) == chunk_checksum(data)
    assert np.array_equal(out, data)
    assert store.list(NS_A) == sorted([record_name(NS_A, key(1)), record_name(NS_A, key(2))])
    store.delete(record_name(NS_A, key(2)))
    store.delete(record_name(NS_A, key(2)))  # absent is fine
    assert store.list(NS_A) == [record_name(NS_A, key(1))]
    s = tier.stats()
    assert (s.writes, s.reads, s.read_bytes, s.checksum_mismatches) == (2, 1, data.nbytes, 0)


def test_large_record_round_trips(store: BlobStore) -> None:
    """12 MiB + header: three parts of a multipart upload on S3 (part size 5 MiB)."""
    tier = Tier(store, 64 * MiB)
    data = payload(3, 12 * MiB)
    write(tier, NS_A, key(3), data)
    out = np.zeros_like(data)
    assert tier.read_into(NS_A, key(3), "L", out) is not None
    assert np.array_equal(out, data)


def test_corrupted_record_is_refused_and_counted(store: BlobStore) -> None:
    tier = Tier(store, 64 * MiB)
    data = payload(4)
    write(tier, NS_A, key(4), data)
    name = record_name(NS_A, key(4))
    blob = raw_blob(store, name, data.nbytes)
    blob[HEADER_BYTES + 1000] ^= 0x01  # one bit of the payload
    overwrite(store, name, blob)
    out = np.zeros_like(data)
    assert tier.read_into(NS_A, key(4), "L", out) is None
    s = tier.stats()
    assert s.checksum_mismatches == 1 and s.chunks == 0 and s.reads == 0
    assert store.list(NS_A) == []  # the refused record is gone, never tried again


def test_torn_record_is_refused(store: BlobStore) -> None:
    tier = Tier(store, 64 * MiB)
    data = payload(5)
    write(tier, NS_A, key(5), data)
    name = record_name(NS_A, key(5))
    overwrite(store, name, raw_blob(store, name, data.nbytes)[: HEADER_BYTES + data.nbytes // 2])
    assert tier.read_into(NS_A, key(5), "L", np.zeros_like(data)) is None
    assert tier.stats().checksum_mismatches == 1


def test_namespaces_are_isolated(store: BlobStore) -> None:
    """A tenant never reads another's record: not by asking (the index is per namespace), and not
    when another namespace's record is planted under its name (the header names its owner)."""
    tier = Tier(store, 64 * MiB)
    secret = payload(6)
    write(tier, NS_A, key(6), secret)
    out = np.zeros_like(secret)
    assert tier.read_into(NS_B, key(6), "L", out) is None
    assert not out.any()
    mine = payload(7)
    write(tier, NS_B, key(6), mine)
    # Plant A's record under B's name: same size, a valid checksum of its own bytes.
    overwrite(store, record_name(NS_B, key(6)), raw_blob(store, record_name(NS_A, key(6)), secret.nbytes))
    # Refused (``out`` is scratch the caller discards: the agent reads into a reserved, invisible
    # L1 chunk and aborts it).
    assert tier.read_into(NS_B, key(6), "L", out) is None
    assert tier.stats().checksum_mismatches == 1
    assert tier.read_into(NS_A, key(6), "L", out) is not None and np.array_equal(out, secret)


def test_layout_and_size_mismatch_are_misses(store: BlobStore) -> None:
    tier = Tier(store, 64 * MiB)
    data = payload(8)
    write(tier, NS_A, key(8), data, layout="L1")
    assert tier.read_into(NS_A, key(8), "L2", np.zeros_like(data)) is None
    assert tier.read_into(NS_A, key(8), "L1", np.zeros(data.nbytes // 2, np.uint8)) is None
    assert tier.stats().checksum_mismatches == 0  # a miss, not a corruption


def test_lru_capacity(store: BlobStore) -> None:
    n = 64 * 1024
    tier = Tier(store, 3 * (HEADER_BYTES + n))
    for i in range(3):
        write(tier, NS_A, key(i), payload(i, n))
    assert tier.read_into(NS_A, key(0), "L", np.zeros(n, np.uint8)) is not None  # key 0 is now recent
    write(tier, NS_A, key(3), payload(3, n))
    s = tier.stats()
    assert s.chunks == 3 and s.evictions == 1 and s.used_bytes <= s.capacity_bytes
    assert tier.entry(NS_A, key(1)) is None and tier.entry(NS_A, key(0)) is not None
    assert record_name(NS_A, key(1)) not in store.list(NS_A)


# ---- the chain: disk -> S3 ---------------------------------------------------------------------


def chunk_of(data: np.ndarray, k: bytes, ns: str = NS_A) -> Chunk:
    return Chunk(k, ns, "L", 0, 1, data.nbytes, torch.from_numpy(data.copy()))


def test_chain_demotes_lru_from_disk_to_s3_and_reads_back(tmp_path: Path, seaweed: SeaweedFS) -> None:
    n = 256 * 1024
    disk = Tier(DiskBlobStore(tmp_path / "disk"), 2 * (HEADER_BYTES + n))
    s3 = Tier(s3_store(seaweed, prefix="chain"), 64 * MiB)
    chain = TierChain([disk, s3])
    try:
        datas = [payload(10 + i, n) for i in range(4)]
        for i, d in enumerate(datas):
            chain.submit(chunk_of(d, key(i)))
        assert chain.drain()
        # Disk holds the two newest; the two oldest went to S3, verified on the way.
        assert [disk.entry(NS_A, key(i)) is not None for i in range(4)] == [False, False, True, True]
        assert [s3.entry(NS_A, key(i)) is not None for i in range(4)] == [True, True, False, False]
        assert sorted(s3.store.list(NS_A)) == [record_name(NS_A, key(0)), record_name(NS_A, key(1))]
        assert chain.prefix_length([key(i) for i in range(5)], "L", namespace_id=NS_A) == 4
        assert chain.prefix_length([key(0)], "L", namespace_id=NS_B) == 0
        for i, d in enumerate(datas):
            out = np.zeros(n, np.uint8)
            assert chain.read_into(NS_A, key(i), "L", out) == chunk_checksum(d)
            assert np.array_equal(out, d)
        assert disk.stats().evictions == 2 and s3.stats().writes == 2
    finally:
        chain.close()


# ---- the L1 cache's spill path -----------------------------------------------------------------

PAGE = 4096


def fill_store(cache: ChunkCache, keys: list[bytes], fill: int) -> int:
    res = cache.reserve_store(keys, namespace_id=NS_A, layout_id="L", nbytes=PAGE)
    for _, c in res.new_chunks:
        c.buffer.fill_(fill)
    return cache.commit(res)[0]


def make_spilling_cache(tmp_path: Path, pages: int = 16) -> tuple[ChunkCache, TierChain]:
    chain = TierChain([Tier(DiskBlobStore(tmp_path / "disk"), 64 * MiB)])
    cache = ChunkCache(
        L1Pool(pages * PAGE, page_bytes=PAGE), high_watermark=0.75, low_watermark=0.5, spill=chain
    )
    chain.begin, chain.end = cache.begin_spill, cache.end_spill
    return cache, chain


def test_evicted_chunks_are_written_to_disk_and_pages_freed(tmp_path: Path) -> None:
    cache, chain = make_spilling_cache(tmp_path)
    try:
        assert fill_store(cache, [key(i) for i in range(8)], fill=1) == 8
        n, _ = cache.pin(("e", "r"), [key(0), key(1)], "L", ttl_s=60, namespace_id=NS_A)
        assert n == 2
        # 14 chunks > the 12-page high watermark: eviction brings L1 (minus pages waiting for
        # the writer) to the low watermark, LRU first, skipping the pinned keys 0 and 1.
        assert fill_store(cache, [key(100 + i) for i in range(6)], fill=2) == 6
        assert chain.drain()
        s = cache.stats()
        assert (s.spilling_chunks, s.dropped_spills, s.num_chunks) == (0, 0, 8)
        assert s.used_bytes == 8 * PAGE  # the writer freed the spilled pages
        assert {k for k in range(8) if chain.holds(NS_A, key(k))} == {2, 3, 4, 5, 6, 7}
        assert cache.contains(key(0), namespace_id=NS_A) and cache.contains(key(1), namespace_id=NS_A)
        out = np.zeros(PAGE, np.uint8)
        assert chain.read_into(NS_A, key(3), "L", out) is not None and (out == 1).all()
        # Evicted again while a tier holds it: freed at once, not written twice.
        writes = chain.tiers[0].stats().writes
        assert cache.clear() == 6 and chain.drain() and chain.tiers[0].stats().writes == writes
    finally:
        chain.close()


def test_allocation_never_waits_for_the_writer(tmp_path: Path) -> None:
    """With the writer stalled, a store still gets its pages: queued spills are given up."""
    cache, chain = make_spilling_cache(tmp_path, pages=8)
    gate = threading.Event()
    begin = chain.begin
    chain.begin = lambda c: gate.wait(30) and begin(c)
    try:
        fill_store(cache, [key(i) for i in range(8)], fill=1)
        assert fill_store(cache, [key(100 + i) for i in range(6)], fill=2) == 6
        s = cache.stats()
        assert s.dropped_spills > 0 and s.spilling_chunks + s.num_chunks <= 8
        assert s.allocation_failures == 0
    finally:
        gate.set()
        assert chain.drain()
        chain.close()
    assert cache.stats().spilling_chunks == 0 and cache.pool.used_bytes == cache.stats().num_chunks * PAGE


def test_a_chunk_waiting_for_the_writer_is_rescued_without_io(tmp_path: Path) -> None:
    cache, chain = make_spilling_cache(tmp_path, pages=8)
    gate = threading.Event()
    begin = chain.begin
    chain.begin = lambda c: gate.wait(30) and begin(c)
    try:
        fill_store(cache, [key(i) for i in range(6)], fill=1)
        fill_store(cache, [key(100)], fill=2)  # over the high watermark: keys 0.. go to the writer
        waiting = cache.stats().spilling_chunks
        assert waiting > 0 and not cache.contains(key(0), namespace_id=NS_A)
        assert cache.rescue_spilling([key(0), key(1)], "L", namespace_id=NS_B) == 0  # not B's
        assert cache.rescue_spilling([key(0), key(1)], "other-layout", namespace_id=NS_A) == 0
        assert cache.rescue_spilling([key(0), key(1)], "L", namespace_id=NS_A) == 2
        chunks, _ = cache.acquire_prefix([key(0), key(1)], "L", namespace_id=NS_A)
        assert len(chunks) == 2 and all((c.buffer == 1).all() for c in chunks)
        cache.release(chunks)
    finally:
        gate.set()
        assert chain.drain()
        chain.close()
    # The writer skipped or finished the rescued chunks without freeing their pages.
    s = cache.stats()
    assert s.spilling_chunks == 0 and cache.pool.used_bytes == s.num_chunks * PAGE
    assert cache.contains(key(0), namespace_id=NS_A) and cache.contains(key(1), namespace_id=NS_A)


@pytest.mark.parametrize("evicted_by", ["clear", "store"])
def test_pages_a_spill_write_reads_are_never_reused(tmp_path: Path, evicted_by: str) -> None:
    """A chunk rescued while its spill write is in flight, then evicted again (freed by ``clear``,
    or queued again and given up under allocation pressure), keeps its pages until that write
    ends: the record on disk holds the chunk's bytes and its checksum, never a later store's."""
    cache, chain = make_spilling_cache(tmp_path, pages=8)
    writing, write_gate, others = threading.Event(), threading.Event(), threading.Event()
    begun: list[Chunk] = []
    begin, disk = chain.begin, chain.tiers[0].store
    write = disk.write

    def begin_only_key0(c: Chunk) -> bool:  # every other spill waits, unstarted (droppable)
        if c.key != key(0) and not others.wait(30):
            return False
        started = begin(c)
        if started and c.key == key(0):
            begun.append(c)
        return started

    def held_write(name: str, header: bytes, data: memoryview) -> None:
        if name == record_name(NS_A, key(0)):
            writing.set()  # hashed already: the checksum is of the chunk's bytes
            assert write_gate.wait(30)
        write(name, header, data)

    chain.begin = begin_only_key0
    disk.write = held_write  # type: ignore[method-assign]
    try:
        fill_store(cache, [key(i) for i in range(6)], fill=1)
        fill_store(cache, [key(100)], fill=2)  # over the high watermark: keys 0.. go to the writer
        assert writing.wait(30), "the write of key 0 never started"
        (c0,) = begun
        assert cache.rescue_spilling([key(0)], "L", namespace_id=NS_A) == 1
        if evicted_by == "clear":
            assert cache.clear() >= 1 and not cache.contains(key(0), namespace_id=NS_A)
        # New stores take every page they can get (evicting, spilling and giving up spills).
        for i in range(12):
            fill_store(cache, [key(200 + i)], fill=3)
        assert not cache.contains(key(0), namespace_id=NS_A)
        assert (c0.buffer.numpy() == 1).all(), "the pages the writer is reading were reused"
    finally:
        write_gate.set()
        others.set()
        assert chain.drain()
        chain.close()
    out = np.zeros(PAGE, np.uint8)
    assert chain.read_into(NS_A, key(0), "L", out) is not None and (out == 1).all()
    assert chain.tiers[0].stats().checksum_mismatches == 0
    s = cache.stats()
    assert s.spilling_chunks == 0 and cache.pool.used_bytes == s.num_chunks * PAGE


# ---- S3 specifics ------------------------------------------------------------------------------


class FlakyProxy:
    """A real TCP proxy in front of the S3 server that closes the first ``fail`` connections at once
    (a server restarting, a load balancer dropping): the client must retry."""

    def __init__(self, target: str, fail: int) -> None:
        host, _, port = target.partition(":")
        self.target = (host, int(port))
        self.fail = fail
        self.accepted = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            if self.accepted <= self.fail:
                conn.close()
                continue
            up = socket.create_connection(self.target)
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(1 << 16):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.sock.close()


def test_s3_retries_with_backoff_through_dropped_connections(seaweed: SeaweedFS) -> None:
    proxy = FlakyProxy(seaweed.host, fail=2)
    try:
        creds = load_credentials("", {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY})
        store = S3BlobStore(
            f"127.0.0.1:{proxy.port}", seaweed.bucket, prefix="retry", credentials=creds, backoff_s=0.01
        )
        assert store.retries == 2  # bucket check: two dropped connections, then through
        tier = Tier(store, 64 * MiB)
        data = payload(20)
        write(tier, NS_A, key(20), data)
        out = np.zeros_like(data)
        assert tier.read_into(NS_A, key(20), "L", out) is not None and np.array_equal(out, data)
        proxy.fail = proxy.accepted + 10  # now every connection drops: give up after max_retries
        store.client._http.clear()
        with pytest.raises(Exception):  # noqa: B017 -- the transport error itself
            store.write(record_name(NS_A, key(21)), bytes(HEADER_BYTES), byte_view(data))
        assert store.retries == 2 + store.max_retries
    finally:
        proxy.close()


def test_s3_large_records_go_up_in_parts(seaweed: SeaweedFS) -> None:
    store = s3_store(seaweed, prefix="multipart")  # part size 5 MiB
    tier = Tier(store, 64 * MiB)
    write(tier, NS_A, key(40), payload(40, 12 * MiB))
    write(tier, NS_A, key(41), payload(41, 1 * MiB))
    etag = store.client.stat_object(seaweed.bucket, f"multipart/{record_name(NS_A, key(40))}").etag
    small = store.client.stat_object(seaweed.bucket, f"multipart/{record_name(NS_A, key(41))}").etag
    assert etag is not None and etag.endswith("-3")  # a multipart upload's ETag: <md5 of md5s>-<parts>
    assert small is not None and "-" not in small


def test_s3_wrong_credentials_fail_at_start(seaweed: SeaweedFS) -> None:
    creds = load_credentials("", {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": "wrong"})
    with pytest.raises(ValueError, match=r"cannot check the bucket: .*(SignatureDoesNotMatch|AccessDenied)"):
        S3BlobStore(seaweed.host, seaweed.bucket, prefix="x", credentials=creds, max_retries=0)


def test_s3_missing_bucket_is_named(seaweed: SeaweedFS) -> None:
    creds = load_credentials("", {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY})
    with pytest.raises(ValueError, match="tier_s3_bucket='no-such-bucket': no such bucket"):
        S3BlobStore(seaweed.host, "no-such-bucket", prefix="x", credentials=creds)


def test_credentials_from_a_mounted_secret_or_env(tmp_path: Path) -> None:
    (tmp_path / "access_key_id").write_text("AK\n")
    (tmp_path / "secret_access_key").write_text("SK\n")
    c = load_credentials(str(tmp_path), {})
    assert (c.access_key, c.secret_key) == ("AK", "SK") and "SK" not in repr(c)
    (tmp_path / "secret_access_key").unlink()
    with pytest.raises(ValueError, match=r"tier_s3_credentials_dir=.*expected a file named one of"):
        load_credentials(str(tmp_path), {})
    c = load_credentials("", {"AWS_ACCESS_KEY_ID": "A", "AWS_SECRET_ACCESS_KEY": "S"})
    assert (c.access_key, c.secret_key, c.source) == ("A", "S", "environment")
    with pytest.raises(ValueError, match="no credentials"):
        load_credentials("", {})


# ---- config ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tier_s3_endpoint": "http://h:1"}, "expected both set"),
        ({"tier_s3_bucket": "b"}, "expected both set"),
        ({"tier_s3_endpoint": "h:1", "tier_s3_bucket": "b"}, "tier_s3_endpoint='h:1': expected http://"),
        (
            {"tier_s3_endpoint": "http://h:1", "tier_s3_bucket": "b", "tier_s3_part_size": MiB},
            "tier_s3_part_size=1048576: expected >= 5MiB",
        ),
        ({"tier_disk_path": "/x", "tier_disk_size": 1000}, "tier_disk_size=1000: expected >= 64KiB"),
    ],
)
def test_config_validation(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AgentConfig(**fields)  # type: ignore[arg-type]


def test_tiers_are_off_by_default(tmp_path: Path) -> None:
    from kvgrid.agent.tiers.build import build_tier_chain

    assert build_tier_chain(AgentConfig()) is None
    chain = build_tier_chain(AgentConfig(tier_disk_path=str(tmp_path / "d"), tier_disk_size=MiB))
    assert chain is not None and [t.name for t in chain.tiers] == ["disk"]
    chain.close()


def test_disk_records_of_an_earlier_run_are_indexed_again(tmp_path: Path) -> None:
    """A restarted agent's disk tier serves what the last run wrote: complete records are indexed
    (newest kept up to the capacity, LRU order by age), torn / misfiled / foreign files removed."""
    d = tmp_path / "d"
    rec = HEADER_BYTES + 64 * 1024
    old_tier = Tier(DiskBlobStore(d), 64 * MiB)
    for i in range(5):
        write(old_tier, NS_A, key(i), payload(i))
    write(old_tier, NS_B, key(9), payload(9), layout="L2")
    for i, name in enumerate([record_name(NS_A, key(i)) for i in range(5)] + [record_name(NS_B, key(9))]):
        os.utime(d / (name + ".kvc"), ns=(10**18 + i * 10**9, 10**18 + i * 10**9))  # key 0 oldest
    torn = d / (record_name(NS_A, key(3)) + ".kvc")
    torn.write_bytes(torn.read_bytes()[: HEADER_BYTES + 100])  # cut short by a crash
    misfiled = d / (record_name(NS_A, key(7)) + ".kvc")
    misfiled.write_bytes((d / (record_name(NS_A, key(4)) + ".kvc")).read_bytes())  # another key's record
    (d / NS_A / ("ab" * 16 + ".kvc.tmp")).write_bytes(b"half a write")
    (d / NS_A / "notes.kvc").write_bytes(b"not a record name")
    (d / "keep.txt").write_text("not ours")

    # Room for four records: of the five good ones the oldest (key 0) goes.
    chain = TierChain([Tier(DiskBlobStore(d), 4 * rec)])
    try:
        assert chain.reindex() == 4
        tier = chain.tiers[0]
        s = tier.stats()
        assert (s.chunks, s.used_bytes) == (4, 4 * rec)
        assert {(ns, k) for ns, k in tier._index} == {(NS_A, key(i)) for i in (1, 2, 4)} | {(NS_B, key(9))}
        assert sorted(p.name for p in (d / NS_A).iterdir()) == sorted(
            record_name(NS_A, key(i)).split("/")[1] + ".kvc" for i in (1, 2, 4)
        )
        assert (d / "keep.txt").exists()
        for i in (1, 2, 4):
            out = np.zeros(64 * 1024, np.uint8)
            assert tier.read_into(NS_A, key(i), "L", out) is not None and np.array_equal(out, payload(i))
        assert chain.prefix_length([key(9)], "L2", namespace_id=NS_B) == 1
        assert chain.prefix_length([key(9)], "L", namespace_id=NS_B) == 0  # the layout is checked
        # LRU order survives the restart: the next write evicts the oldest kept record (key 1).
        write(tier, NS_A, key(20), payload(20))
        evicted = tier.make_room(64 * 1024)
        assert [(ns, k) for ns, k, _ in evicted] == [(NS_A, key(1))]
    finally:
        chain.close()


# ---- metrics -----------------------------------------------------------------------------------


def test_metrics_per_tier(tmp_path: Path) -> None:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from kvgrid.agent.tiers.metrics import TierMetrics

    reader = InMemoryMetricReader()
    chain = TierChain([Tier(DiskBlobStore(tmp_path / "disk"), 64 * MiB)])
    try:
        TierMetrics(MeterProvider(metric_readers=[reader]).get_meter("t"), chain, lambda: 3)
        data = payload(30)
        chain.submit(chunk_of(data, key(30)))
        assert chain.drain()
        name = record_name(NS_A, key(30))
        blob = raw_blob(chain.tiers[0].store, name, data.nbytes)
        blob[-1] ^= 0xFF
        overwrite(chain.tiers[0].store, name, blob)
        assert chain.read_into(NS_A, key(30), "L", np.zeros_like(data)) is None
        got: dict[tuple[str, str], float] = {}
        md = reader.get_metrics_data()
        assert md is not None
        for rm in md.resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    for p in m.data.data_points:
                        got[(m.name, str(p.attributes.get("tier", "")))] = p.value  # type: ignore[union-attr]
        assert got[("kvgrid_agent_tier_writes", "disk")] == 1
        assert got[("kvgrid_agent_tier_written_bytes", "disk")] == data.nbytes
        assert got[("kvgrid_agent_tier_checksum_mismatches", "disk")] == 1
        assert got[("kvgrid_agent_tier_chunks", "disk")] == 0  # the refused record was dropped
        assert got[("kvgrid_agent_tier_capacity_bytes", "disk")] == 64 * MiB
        assert got[("kvgrid_agent_tier_dropped_spills", "")] == 3
    finally:
        chain.close()


def test_bench_tier_reports_both_figures_and_the_ratios(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "kvgrid.cli", "bench", "tier", "--dir", str(tmp_path), "--chunks", "2",
         "--chunk-size", "1MiB", "--iters", "1", "--json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for way in ("write", "read"):
        assert out[f"raw_{way}_gbps"] > 0 and out[f"tier_{way}_gbps"] > 0
        assert out[f"{way}_ratio"] == pytest.approx(
            out[f"tier_{way}_gbps"] / out[f"raw_{way}_gbps"], rel=0.01
        )
    assert list(tmp_path.iterdir()) == []  # the scratch directory is removed
    bad = subprocess.run(
        [sys.executable, "-m", "kvgrid.cli", "bench", "tier", "--dir", str(tmp_path / "nope")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and "expected an existing directory" in bad.stderr
