"""A lower tier (a blob store with a capacity and an LRU index) and the chain of tiers below L1.

``Tier`` keeps, in memory, which (namespace, key) records its store holds, with each record's
layout, size and checksum, in LRU order. ``TierChain`` orders the tiers (fastest first: disk,
then the object store) and runs the **background writer**: chunks evicted from L1 are queued by
the cache (``submit``), hashed on one thread and written on another, off the request path; making
room in a full tier demotes its least recently used records to the next tier (or drops them from
the last). Reads back into L1 (``iter_reads``, ``read_many``) are pipelined: record i+1 is read
while record i is verified.

Invariants:

- Only the writer thread adds records or evicts them, so capacity accounting needs no
  reservation: ``used_bytes <= capacity_bytes`` after every write.
- A read (``read_into``, ``read_many``) serves bytes only when the record's header matches the
  (namespace, key) asked for, its layout and size match the index, and the payload's XXH3-128 matches the
  checksum recorded when it was written; anything else is counted as a checksum mismatch (or an
  error), the record is dropped, and the read is a miss. Nothing unverified reaches L1.
- Reads name (namespace, key) and see only records of that namespace (tenant isolation); a
  record of another layout is a miss.
- The cache decides what may be written: ``begin`` (may the writer read the chunk's L1 pages?
  False if the cache took them back) and ``end`` (the writer is done; the pages may be freed).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from kvgrid.agent.l1 import Chunk
from kvgrid.agent.tiers.base import (
    HEADER_BYTES,
    BlobMissing,
    BlobStore,
    CorruptRecord,
    FoundBlob,
    RecordHeader,
    decode_header,
    encode_header,
    parse_record_name,
    record_name,
)
from kvgrid.common.checksum import ChecksumMismatch, chunk_checksum, verify_checksum

__all__ = ["Fetched", "Tier", "TierChain", "TierEntry", "TierStats", "byte_view"]

log = logging.getLogger(__name__)


def byte_view(a: np.ndarray) -> memoryview:
    """The bytes of a contiguous array, as a flat memoryview (no copy)."""
    return a.reshape(-1).view(np.uint8).data.cast("B")


@dataclass(frozen=True)
class TierEntry:
    layout_id: str
    nbytes: int
    checksum: bytes

    @property
    def stored_bytes(self) -> int:
        return HEADER_BYTES + self.nbytes


@dataclass(eq=False)
class Fetched:
    """A record's bytes read into ``dst`` but not verified yet (``Tier.fetch`` -> ``Tier.check``)."""

    tier: Tier
    namespace_id: str
    key: bytes
    entry: TierEntry
    header: bytearray
    dst: np.ndarray
    got: int = 0
    error: Exception | None = None


@dataclass(frozen=True)
class TierStats:
    tier: str
    capacity_bytes: int
    used_bytes: int
    chunks: int
    writes: int
    written_bytes: int
    reads: int
    read_bytes: int
    evictions: int
    checksum_mismatches: int
    errors: int


class Tier:
    """One blob store with a byte capacity and LRU order. Thread-safe."""

    def __init__(self, store: BlobStore, capacity_bytes: int) -> None:
        if capacity_bytes <= HEADER_BYTES:
            raise ValueError(f"{store.kind} tier capacity {capacity_bytes} bytes: expected > {HEADER_BYTES}")
        self.store = store
        self.name = store.kind
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._index: OrderedDict[tuple[str, bytes], TierEntry] = OrderedDict()
        self._lock = threading.Lock()
        self.writes = self.written_bytes = self.reads = self.read_bytes = 0
        self.evictions = self.checksum_mismatches = self.errors = 0

    def entry(self, namespace_id: str, key: bytes) -> TierEntry | None:
        with self._lock:
            return self._index.get((namespace_id, key))

    def fits(self, nbytes: int) -> bool:
        return HEADER_BYTES + nbytes <= self.capacity_bytes

    def make_room(self, nbytes: int) -> list[tuple[str, bytes, TierEntry]]:
        """Take least recently used records out of the index until ``nbytes`` more fit; returns
        them (the caller demotes or deletes their blobs). Writer thread only."""
        need = HEADER_BYTES + nbytes
        out = []
        with self._lock:
            while self._index and self.used_bytes + need > self.capacity_bytes:
                (ns, key), e = self._index.popitem(last=False)
                self.used_bytes -= e.stored_bytes
                self.evictions += 1
                out.append((ns, key, e))
        return out

    def write(
        self, namespace_id: str, key: bytes, layout_id: str, checksum: bytes, payload: memoryview
    ) -> None:
        """Write a record and index it (after :meth:`make_room`). Writer thread only."""
        entry = TierEntry(layout_id, len(payload), checksum)
        header = encode_header(
            RecordHeader(
                namespace_id=namespace_id,
                key=key,
                layout_id=layout_id,
                nbytes=len(payload),
                checksum=checksum,
            )
        )
        self.store.write(record_name(namespace_id, key), header, payload)
        with self._lock:
            old = self._index.pop((namespace_id, key), None)
            if old is not None:
                self.used_bytes -= old.stored_bytes
            self._index[(namespace_id, key)] = entry
            self.used_bytes += entry.stored_bytes
            self.writes += 1
            self.written_bytes += len(payload)

    def reindex(self, blobs: Sequence[FoundBlob]) -> tuple[int, int]:
        """Index the records an earlier run left in the store (at start, before the writer runs).

        A blob whose name, header or size is not what :meth:`write` makes (torn, truncated,
        misfiled, another format) is deleted; of the rest the newest are kept up to the capacity
        (oldest first in LRU order) and the older ones deleted. Payload checksums are verified when
        a record is read, as for every record. Returns (indexed, deleted)."""
        good: list[tuple[int, str, bytes, TierEntry]] = []
        bad: list[str] = []
        for b in blobs:
            try:
                ns, key = parse_record_name(b.name)
                h = decode_header(b.header, namespace_id=ns, key=key)
                if h.nbytes != b.payload_bytes:
                    raise CorruptRecord(f"{b.payload_bytes} of {h.nbytes} payload bytes (torn record)")
            except ValueError as err:  # CorruptRecord is one too
                log.warning("%s tier: discarding %s left by an earlier run: %s", self.name, b.name, err)
                bad.append(b.name)
                continue
            good.append((b.mtime_ns, ns, key, TierEntry(h.layout_id, h.nbytes, h.checksum)))
        good.sort(key=lambda g: g[0], reverse=True)  # newest first: they are kept
        kept: list[tuple[str, bytes, TierEntry]] = []
        used = 0
        for _, ns, key, e in good:
            if used + e.stored_bytes > self.capacity_bytes:
                bad.append(record_name(ns, key))
                continue
            used += e.stored_bytes
            kept.append((ns, key, e))
        with self._lock:
            for ns, key, e in reversed(kept):  # oldest first: evicted first
                old = self._index.pop((ns, key), None)
                if old is not None:
                    self.used_bytes -= old.stored_bytes
                self._index[(ns, key)] = e
                self.used_bytes += e.stored_bytes
        for name in bad:
            try:
                self.store.delete(name)
            except Exception as err:
                log.warning("%s tier: could not delete %s: %s", self.name, name, err)
        return len(kept), len(bad)

    def fetch(self, namespace_id: str, key: bytes, layout_id: str, dst: np.ndarray) -> Fetched | None:
        """Read the record's bytes into ``dst`` (uint8, the chunk's size), unverified: only
        :meth:`check` may pass them on. None when the tier does not hold it in this layout and size."""
        e = self.entry(namespace_id, key)
        if e is None or e.layout_id != layout_id or e.nbytes != dst.nbytes:
            return None
        f = Fetched(self, namespace_id, key, e, bytearray(HEADER_BYTES), dst)
        try:
            f.got = self.store.read_into(record_name(namespace_id, key), f.header, byte_view(dst))
        except Exception as err:  # checked (and counted) in check()
            f.error = err
        return f

    def check(self, f: Fetched) -> bytes | None:
        """The verified checksum of a fetched record, or None (a miss): a record that is torn,
        altered, misfiled or whose read failed is counted, dropped (and deleted), never served."""
        ns, key, e = f.namespace_id, f.key, f.entry
        name = record_name(ns, key)
        try:
            if f.error is not None:
                raise f.error
            if f.got != e.nbytes:
                raise CorruptRecord(f"{f.got} of {e.nbytes} payload bytes (torn record)")
            h = decode_header(f.header, namespace_id=ns, key=key)
            if (h.layout_id, h.nbytes, h.checksum) != (e.layout_id, e.nbytes, e.checksum):
                raise CorruptRecord("record header does not match what was written")
            verify_checksum(f.dst, e.checksum)
        except BlobMissing:
            self._drop(ns, key, e, "missing")
            return None
        except (CorruptRecord, ChecksumMismatch) as err:
            log.warning("%s tier: refused %s: %s", self.name, name, err)
            self._drop(ns, key, e, "checksum")
            return None
        except Exception as err:  # a failing store is a miss, never a failed lookup
            log.warning("%s tier: read of %s failed: %s", self.name, name, err)
            with self._lock:
                self.errors += 1
            return None
        with self._lock:
            if (ns, key) in self._index:
                self._index.move_to_end((ns, key))
            self.reads += 1
            self.read_bytes += e.nbytes
        return e.checksum

    def read_into(self, namespace_id: str, key: bytes, layout_id: str, dst: np.ndarray) -> bytes | None:
        """:meth:`fetch` then :meth:`check`: ``dst`` holds the verified record when this returns
        its checksum; None is a miss."""
        f = self.fetch(namespace_id, key, layout_id, dst)
        return None if f is None else self.check(f)

    def count(self, what: str) -> None:
        """Count a refused record (``checksum``) or a failed read (``error``)."""
        with self._lock:
            if what == "checksum":
                self.checksum_mismatches += 1
            else:
                self.errors += 1

    def _drop(self, namespace_id: str, key: bytes, e: TierEntry, why: str) -> None:
        with self._lock:
            if self._index.get((namespace_id, key)) is e:
                del self._index[(namespace_id, key)]
                self.used_bytes -= e.stored_bytes
            if why == "checksum":
                self.checksum_mismatches += 1
            else:
                self.errors += 1
        if why == "checksum":
            try:
                self.store.delete(record_name(namespace_id, key))
            except Exception as err:
                log.warning("%s tier: could not delete refused record: %s", self.name, err)

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(
                tier=self.name,
                capacity_bytes=self.capacity_bytes,
                used_bytes=self.used_bytes,
                chunks=len(self._index),
                writes=self.writes,
                written_bytes=self.written_bytes,
                reads=self.reads,
                read_bytes=self.read_bytes,
                evictions=self.evictions,
                checksum_mismatches=self.checksum_mismatches,
                errors=self.errors,
            )


class TierChain:
    """The tiers below L1, fastest first, and the background writer that fills them."""

    def __init__(self, tiers: Sequence[Tier]) -> None:
        if not tiers:
            raise ValueError("a tier chain needs at least one tier")
        self.tiers = list(tiers)
        self.begin: Callable[[Chunk], bool] = lambda _c: True
        self.end: Callable[[Chunk], None] = lambda _c: None
        self.dropped = 0
        """Chunks evicted from L1 whose write was given up (L1 needed the pages first)."""
        self.write_failures = 0
        self.on_l2: Callable[[str, Sequence[bytes], bool], None] | None = None
        """Told when a chunk enters the chain (True: the writer wrote it from L1) or leaves it (False:
        dropped from the last tier or its demotion failed, by the writer; refused by every tier on a
        read); a demotion within the chain is no change. The agent publishes these as TIER_L2
        events. A read back into L1 leaves the record where it is, so a chunk may be in L1 and L2 at
        once."""
        self._queue: queue.SimpleQueue[Chunk | None] = queue.SimpleQueue()
        self._write_queue: queue.SimpleQueue[tuple[Chunk, bytes] | None] = queue.SimpleQueue()
        self._pending = 0
        self._idle = threading.Condition()
        self._scratch: dict[int, np.ndarray] = {}
        # Two stages: checksums (hashing holds the GIL) overlap writes (the syscalls release it).
        self._threads = [
            threading.Thread(target=self._hash_run, name="kvgrid-tier-hash", daemon=True),
            threading.Thread(target=self._write_run, name="kvgrid-tier-writer", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        self._reader = ThreadPoolExecutor(2, thread_name_prefix="kvgrid-tier-read")

    # ---- reads (request path) ------------------------------------------------------------

    def holds(self, namespace_id: str, key: bytes) -> bool:
        return any(t.entry(namespace_id, key) is not None for t in self.tiers)

    def prefix_length(self, keys: Sequence[bytes], layout_id: str, *, namespace_id: str) -> int:
        """Leading ``keys`` some tier holds in ``namespace_id`` and ``layout_id`` (no I/O)."""
        n = 0
        for key in keys:
            if not any(
                (e := t.entry(namespace_id, key)) is not None and e.layout_id == layout_id for t in self.tiers
            ):
                break
            n += 1
        return n

    def read_into(self, namespace_id: str, key: bytes, layout_id: str, dst: np.ndarray) -> bytes | None:
        """Fill ``dst`` from the fastest tier that serves the record verified; its checksum, or
        None (a miss)."""
        for t in self.tiers:
            checksum = t.read_into(namespace_id, key, layout_id, dst)
            if checksum is not None:
                return checksum
        return None

    def _fetch(self, namespace_id: str, key: bytes, layout_id: str, dst: np.ndarray) -> Fetched | None:
        for t in self.tiers:
            f = t.fetch(namespace_id, key, layout_id, dst)
            if f is not None:
                return f
        return None

    def iter_reads(
        self, namespace_id: str, layout_id: str, items: Sequence[tuple[bytes, np.ndarray]]
    ) -> Generator[bytes | None, None, None]:
        """Read ``(key, dst)`` records in order, verified, yielding each one's checksum; a None (a
        miss, or a record refused by every tier) is the last item. Pipelined: record i+1 is read
        (I/O, no GIL) while record i is verified (hashing, on the consumer's thread). Closing the
        generator early waits for the read in flight: no read lands in a buffer the caller is about
        to free."""
        if not items:
            return
        nxt = self._reader.submit(self._fetch, namespace_id, items[0][0], layout_id, items[0][1])
        try:
            for i, (key, dst) in enumerate(items):
                f = nxt.result()
                if i + 1 < len(items):
                    k2, d2 = items[i + 1]
                    nxt = self._reader.submit(self._fetch, namespace_id, k2, layout_id, d2)
                checksum = None if f is None else f.tier.check(f)
                if checksum is None and f is not None:
                    # Refused by the faster tier (and dropped there): a slower one may hold it.
                    checksum = self.read_into(namespace_id, key, layout_id, dst)
                    if checksum is None and self.on_l2 is not None and not self.holds(namespace_id, key):
                        self.on_l2(namespace_id, [key], False)  # refused everywhere: it left the chain
                yield checksum
                if checksum is None:
                    return
        finally:
            nxt.result()  # never leave a read into a buffer the caller is about to free

    def read_many(
        self, namespace_id: str, layout_id: str, items: Sequence[tuple[bytes, np.ndarray]]
    ) -> list[bytes]:
        """The checksums of the leading ``(key, dst)`` records read back verified (:meth:`iter_reads`;
        stops at the first miss)."""
        out: list[bytes] = []
        with contextlib.closing(self.iter_reads(namespace_id, layout_id, items)) as reads:
            for checksum in reads:
                if checksum is None:
                    break
                out.append(checksum)
        return out

    # ---- writes (background) -------------------------------------------------------------

    def submit(self, chunk: Chunk) -> None:
        """Queue an L1 chunk for writing (called under the cache lock: only a queue put)."""
        with self._idle:
            self._pending += 1
        self._queue.put(chunk)

    def drain(self, timeout_s: float = 60.0) -> bool:
        """Wait until every submitted chunk is written (or given up); False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout_s)

    def _done(self) -> None:
        with self._idle:
            self._pending -= 1
            self._idle.notify_all()

    def _hash_run(self) -> None:
        while True:
            chunk = self._queue.get()
            if chunk is None:
                self._write_queue.put(None)
                return
            try:
                started = self.begin(chunk)
            except Exception as e:
                started = False
                log.warning("tier writer: begin of chunk %s failed: %s", chunk.key.hex(), e)
            if not started:
                self._done()
                continue
            try:
                # The bytes are final: L1 keeps the pages until ``end``.
                checksum = chunk.checksum or chunk_checksum(chunk.buffer.numpy())
            except Exception as e:
                self.write_failures += 1
                log.warning("tier writer: checksum of chunk %s failed: %s", chunk.key.hex(), e)
                self.end(chunk)
                self._done()
                continue
            self._write_queue.put((chunk, checksum))

    def _write_run(self) -> None:
        while True:
            job = self._write_queue.get()
            if job is None:
                return
            chunk, checksum = job
            try:
                data = byte_view(chunk.buffer.numpy())
                held = self.holds(chunk.namespace_id, chunk.key)
                self._put(0, chunk.namespace_id, chunk.key, chunk.layout_id, checksum, data)
                if self.on_l2 is not None and not held and self.holds(chunk.namespace_id, chunk.key):
                    self.on_l2(chunk.namespace_id, [chunk.key], True)
            except Exception as e:
                self.write_failures += 1
                log.warning("tier write of chunk %s failed: %s", chunk.key.hex(), e)
            finally:
                try:
                    self.end(chunk)
                finally:
                    self._done()

    def _put(
        self, level: int, ns: str, key: bytes, layout_id: str, checksum: bytes, payload: memoryview
    ) -> None:
        while level < len(self.tiers) and not self.tiers[level].fits(len(payload)):
            level += 1  # larger than this tier: the next one
        if level == len(self.tiers):
            return
        tier = self.tiers[level]
        for vns, vkey, ventry in tier.make_room(len(payload)):
            self._demote(level, vns, vkey, ventry)
        tier.write(ns, key, layout_id, checksum, payload)

    def _demote(self, level: int, ns: str, key: bytes, entry: TierEntry) -> None:
        """Move a record evicted from tier ``level`` to the next tier (verified), or drop it."""
        tier = self.tiers[level]
        name = record_name(ns, key)
        try:
            if level + 1 < len(self.tiers):
                buf = self._scratch.get(level)
                if buf is None or buf.nbytes != entry.nbytes:
                    buf = self._scratch[level] = np.empty(entry.nbytes, dtype=np.uint8)
                header = bytearray(HEADER_BYTES)
                got = tier.store.read_into(name, header, byte_view(buf))
                h = decode_header(header, namespace_id=ns, key=key)
                if got != entry.nbytes or h.checksum != entry.checksum:
                    raise CorruptRecord(f"{name}: torn or altered record")
                verify_checksum(buf, entry.checksum)
                self._put(level + 1, ns, key, entry.layout_id, entry.checksum, byte_view(buf))
        except (CorruptRecord, ChecksumMismatch) as e:
            tier.count("checksum")
            log.warning("%s tier: not demoting %s: %s", tier.name, name, e)
        except Exception as e:
            tier.count("error")
            log.warning("%s tier: demoting %s failed: %s", tier.name, name, e)
        finally:
            try:
                tier.store.delete(name)
            except Exception as e:
                log.warning("%s tier: delete of %s failed: %s", tier.name, name, e)
            if self.on_l2 is not None and not self.holds(ns, key):
                self.on_l2(ns, [key], False)

    def l2_keys(self) -> dict[str, list[bytes]]:
        """Namespace -> the keys some tier holds (the agent's L2 listing)."""
        out: dict[str, set[bytes]] = {}
        for t in self.tiers:
            with t._lock:
                held = list(t._index)
            for ns, key in held:
                out.setdefault(ns, set()).add(key)
        return {ns: sorted(keys) for ns, keys in out.items()}

    def reindex(self) -> int:
        """Index again the records an earlier run left in tiers whose store can list them (the disk
        tier's directory; see :meth:`Tier.reindex`). Call once at start, before any chunk is
        spilled. Returns how many records were indexed."""
        total = 0
        for t in self.tiers:
            scan = getattr(t.store, "scan", None)
            if scan is None:
                continue
            found, torn = scan()
            indexed, discarded = t.reindex(found)
            total += indexed
            if found or torn:
                log.info(
                    "%s tier: %d records of an earlier run indexed again, %d discarded (torn, "
                    "unreadable or over the capacity)",
                    t.name,
                    indexed,
                    discarded + torn,
                )
        return total

    def stats(self) -> list[TierStats]:
        return [t.stats() for t in self.tiers]

    def close(self) -> None:
        self._queue.put(None)
        for thread in self._threads:
            thread.join(timeout=30)
        self._reader.shutdown(wait=True)
        for t in self.tiers:
            t.store.close()
