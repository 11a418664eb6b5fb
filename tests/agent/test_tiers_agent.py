"""The lower tiers through a real agent process (gRPC on its Unix socket, shared-memory KV): a prefix
goes L1 -> disk -> (evicted from disk) -> a real SeaweedFS S3 server -> back into L1 on a Lookup,
and Retrieve writes it into the engine's blocks bit for bit; a corrupted object is refused."""

from __future__ import annotations

import io
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from minio import Minio

from kvgrid.agent.tiers.base import HEADER_BYTES, record_name

from .helpers import NAMESPACE, block_ids, blocks_of, keys_for, register_kv, start_agent
from .s3_server import ACCESS_KEY, SECRET_KEY, SeaweedFS, start_seaweedfs

PREFIX = "agent-e2e"


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    server = start_seaweedfs(tmp_path_factory.mktemp("seaweedfs"))
    yield server
    server.stop()


def wait_for(cond: object, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_prefix_goes_l1_disk_s3_and_back_bit_for_bit(tmp_path: Path, seaweed: SeaweedFS) -> None:
    secret = tmp_path / "s3-secret"  # what a mounted Kubernetes Secret looks like
    secret.mkdir()
    (secret / "access_key_id").write_text(ACCESS_KEY)
    (secret / "secret_access_key").write_text(SECRET_KEY)
    disk = tmp_path / "disk-tier"
    ns = NAMESPACE.namespace_id()
    s3 = Minio(seaweed.host, access_key=ACCESS_KEY, secret_key=SECRET_KEY, secure=False)

    def on_disk(keys: list[bytes]) -> list[bool]:
        return [(disk / (record_name(ns, k) + ".kvc")).exists() for k in keys]

    def on_s3(keys: list[bytes]) -> list[bool]:
        names = {
            o.object_name for o in s3.list_objects(seaweed.bucket, prefix=f"{PREFIX}/{ns}/", recursive=True)
        }
        return [f"{PREFIX}/{record_name(ns, k)}" in names for k in keys]

    # L1 of 320 KiB (16 chunks of 20 KiB), eviction from 60% down to 30% (the headroom lets the
    # writer catch up); a disk tier of 4 records; S3 below it.
    agent = start_agent(
        tmp_path,
        "--high-watermark", "0.6", "--low-watermark", "0.3",
        "--tier-disk-path", str(disk), "--tier-disk-size", str(4 * (HEADER_BYTES + 20 * 1024)),
        "--tier-s3-endpoint", seaweed.endpoint, "--tier-s3-bucket", seaweed.bucket,
        "--tier-s3-prefix", PREFIX, "--tier-s3-credentials-dir", str(secret),
        l1_size="320KiB",
    )  # fmt: skip
    try:
        c = agent.client()
        tensors, reg = register_kv(c, "e", tmp_path, seed=3)
        assert HEADER_BYTES + reg.bytes_per_chunk <= HEADER_BYTES + 20 * 1024
        a = keys_for(1, 4)
        src = block_ids(0, 4)
        want = blocks_of(tensors, src)
        assert c.store("e", a, src).num_stored_chunks == 4

        def in_l1(keys: list[bytes]) -> list[bool]:
            held = set(c.snapshot().chunk_keys)
            return [k in held for k in keys]

        # Fillers push A out of L1 onto disk, then out of disk into S3.
        for f in range(40):
            assert c.store("e", keys_for(100 + f, 4), src).num_stored_chunks == 4
            if f == 2:
                # L1 spills only to disk, so a chunk on S3 went through it; on a loaded machine the
                # writer may have demoted A again (the fillers' spills fill the 4-record disk)
                # before a poll saw it there (CI once timed out waiting for "A on disk").
                wait_for(
                    lambda: all(d or s for d, s in zip(on_disk(a), on_s3(a), strict=True)),
                    "A written to the disk tier (or already demoted from it to S3)",
                )
                assert not any(in_l1(a))
            if all(on_s3(a)) and not any(on_disk(a)):
                break
            # The writer has written this filler's spills before the next store (no L1 pages wait
            # for it: 5 pages of 4 KiB per chunk), so 40 fillers are a count, not a time budget.
            wait_for(
                lambda: (h := c.health()).l1_used_bytes == h.num_chunks * 5 * 4096,
                "the tier writer caught up",
            )
        assert all(on_s3(a)) and not any(on_disk(a)) and not any(in_l1(a))

        # Back into L1 on a Lookup (counted as hits), then into other blocks of the engine.
        dst = block_ids(16, 4)
        for t in tensors:
            t.zero_()
        res = c.lookup("e", "r1", a)
        assert (res.num_hit_chunks, res.num_peer_chunks, res.miss_cause) == (4, 0, "none")
        assert all(in_l1(a))
        assert c.retrieve("e", "r1", a, dst).num_retrieved_chunks == 4
        got = blocks_of(tensors, dst)
        assert all(torch.equal(w, g) for w, g in zip(want, got, strict=True))

        # A corrupted object is refused: push A out of L1 again (S3 still holds it: no rewrite),
        # flip one payload bit of chunk 2's object, and the lookup stops before it.
        for f in range(40):
            c.store("e", keys_for(200 + f, 4), src)
            if not any(in_l1(a)):
                break
        assert not any(in_l1(a))
        obj = f"{PREFIX}/{record_name(ns, a[2])}"
        resp = s3.get_object(seaweed.bucket, obj)
        blob = bytearray(resp.read())
        resp.close()
        resp.release_conn()
        blob[HEADER_BYTES + 100] ^= 0x10
        s3.put_object(seaweed.bucket, obj, io.BytesIO(bytes(blob)), len(blob))
        # The Lookup answers before the reads (asynchronous promotion: all four count); the
        # Retrieve waits for them and stops before the refused chunk, which the engine recomputes.
        res = c.lookup("e", "r2", a)
        assert (res.num_hit_chunks, res.miss_cause) == (4, "none")
        r = c.retrieve("e", "r2", a, dst)
        assert (r.num_retrieved_chunks, r.hit_mask, r.miss_cause) == (
            2,
            [True, True, False, False],
            "tier_failed",
        )
        assert in_l1(a) == [True, True, False, False]  # chunks 2 and 3 left L1 (evict events)
        assert not on_s3([a[2]])[0]  # the refused object was deleted, never tried again
        assert c.health().num_pinned_chunks == 0  # the retrieve dropped r2's pins, failed ones too
    finally:
        agent.stop()


def test_agent_refuses_to_start_with_wrong_s3_credentials(tmp_path: Path, seaweed: SeaweedFS) -> None:
    secret = tmp_path / "s3-secret"
    secret.mkdir()
    (secret / "access_key_id").write_text(ACCESS_KEY)
    (secret / "secret_access_key").write_text("not-the-secret")
    with pytest.raises(RuntimeError, match="exited with 2"):
        start_agent(
            tmp_path,
            "--tier-s3-endpoint", seaweed.endpoint, "--tier-s3-bucket", seaweed.bucket,
            "--tier-s3-credentials-dir", str(secret), "--tier-s3-max-retries", "0",
        )  # fmt: skip


def test_disk_tier_survives_kill_9_and_restart(tmp_path: Path) -> None:
    """Chunks written to the disk tier serve again after the agent is killed (SIGKILL: no clean
    shutdown) and restarted on the same directory; a torn record left behind is discarded."""
    disk = tmp_path / "disk-tier"
    ns = NAMESPACE.namespace_id()
    flags = ("--high-watermark", "0.6", "--low-watermark", "0.3", "--tier-disk-path", str(disk))
    agent = start_agent(tmp_path, *flags, l1_size="320KiB")
    try:
        c = agent.client()
        tensors, _ = register_kv(c, "e", tmp_path, seed=5)
        a = keys_for(11, 4)
        src = block_ids(0, 4)
        want = blocks_of(tensors, src)
        assert c.store("e", a, src).num_stored_chunks == 4
        for f in range(40):  # fillers push A out of L1 onto disk
            c.store("e", keys_for(300 + f, 4), src)
            if all((disk / (record_name(ns, k) + ".kvc")).exists() for k in a):
                break
            time.sleep(0.05)
        assert all((disk / (record_name(ns, k) + ".kvc")).exists() for k in a)
    finally:
        agent.proc.kill()
        agent.proc.wait()
    # A record the crash cut short (a rename that happened before the bytes hit the file).
    torn_key = keys_for(99, 1)[0]
    torn = disk / (record_name(ns, torn_key) + ".kvc")
    torn.write_bytes((disk / (record_name(ns, a[0]) + ".kvc")).read_bytes()[: HEADER_BYTES + 10])

    agent = start_agent(tmp_path, *flags, l1_size="320KiB")
    try:
        c = agent.client()
        tensors, _ = register_kv(c, "e", tmp_path, seed=6)  # another engine process's tensors
        for t in tensors:
            t.zero_()
        assert not torn.exists()
        res = c.lookup("e", "r1", a)
        assert (res.num_hit_chunks, res.miss_cause) == (4, "none")
        dst = block_ids(16, 4)
        assert c.retrieve("e", "r1", a, dst).num_retrieved_chunks == 4
        got = blocks_of(tensors, dst)
        assert all(torch.equal(w, g) for w, g in zip(want, got, strict=True))
        assert c.lookup("e", "", [torn_key]).num_hit_chunks == 0
    finally:
        agent.stop()


def test_release_while_promoting_leaks_no_pin_or_page_in_a_real_agent(tmp_path: Path) -> None:
    """Lookups that start promotions from the disk tier and are released at once (the engine
    cancelled the request), over and over: afterwards no pin is held and every L1 page belongs to a
    chunk in the index; a Lookup + Retrieve still loads the right bytes."""
    disk = tmp_path / "disk-tier"
    ns = NAMESPACE.namespace_id()
    agent = start_agent(
        tmp_path,
        "--high-watermark", "0.6", "--low-watermark", "0.3", "--tier-disk-path", str(disk),
        l1_size="640KiB",
    )  # fmt: skip
    try:
        c = agent.client()
        tensors, reg = register_kv(c, "e", tmp_path, seed=7)
        a = keys_for(21, 8)
        src = block_ids(0, 8)
        want = blocks_of(tensors, src)
        assert c.store("e", a, src).num_stored_chunks == 8
        for f in range(40):  # fillers push A out of L1 onto disk
            c.store("e", keys_for(400 + f, 8), src)
            if all((disk / (record_name(ns, k) + ".kvc")).exists() for k in a):
                break
            time.sleep(0.05)

        def in_l1() -> int:
            return len(set(a) & set(c.snapshot().chunk_keys))

        wait_for(lambda: in_l1() == 0, "A out of L1")
        for i in range(10):
            assert c.lookup("e", f"r{i}", a).num_hit_chunks == 8
            c.release("e", f"r{i}")  # the promotion may still be reading: it drops what is unread
            for f in range(3):  # push what came back out again
                c.store("e", keys_for(500 + 3 * i + f, 8), src)

        def settled() -> bool:
            h = c.health()
            return h.num_pinned_chunks == 0 and h.l1_used_bytes == h.num_chunks * 5 * 4096

        # 19456-byte chunks take 5 pages of 4 KiB; pages waiting for the tier writer settle too.
        wait_for(settled, "no pins and no pages outside the index")
        for t in tensors:
            t.zero_()
        assert c.lookup("e", "last", a).num_hit_chunks == 8
        dst = block_ids(16, 8)
        assert c.retrieve("e", "last", a, dst).num_retrieved_chunks == 8
        got = blocks_of(tensors, dst)
        assert all(torch.equal(w, g) for w, g in zip(want, got, strict=True))
        assert reg.bytes_per_chunk == 19456
    finally:
        agent.stop()
