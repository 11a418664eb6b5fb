"""The L1 cache memory: one pool allocated once, a page allocator over it, and chunk objects.

The pool is a single uint8 tensor (pinned host memory when CUDA is available, so the transfer
kernels can DMA into it; plain pageable memory otherwise). Chunks are views into it: no torch
allocation happens per chunk, so the agent's memory use is fixed at start and cannot grow under
load. The allocator hands out runs of contiguous, ``align_bytes``-aligned pages.

With ``shared_dir`` the pool is a file there (``kvgrid-l1-{pid}-{random}``, mode 0600, page-locked
with ``cudaHostRegister`` when pinned) that engines map to run the transfer kernels in their own
CUDA context (agent option ``l1_shared_dir``); a chunk is then named by its byte offset in that
file. The agent holds an exclusive ``flock`` on its file while it lives: a file nobody holds locked
is a dead agent's and is removed at the next start. Names and locks do not depend on pid
namespaces: sidecars that are each pid 1 in their own container still get their own files, and an
agent restarted in place makes a new file (a new name), which is how engines see that it restarted.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = [
    "Chunk",
    "L1Pool",
    "PageAllocator",
    "SharedPoolFile",
    "allocate_pool_tensor",
    "host_register",
    "map_shared_pool",
    "remove_stale_pool_files",
]

log = logging.getLogger(__name__)

POOL_FILE_PREFIX = "kvgrid-l1-"


def host_register(t: torch.Tensor) -> bool:
    """Page-lock ``t``'s memory for this process's CUDA context (``cudaHostRegister``); False (and
    a warning) when that fails -- copies still work, from pageable memory, slower."""
    try:
        rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
        if int(rc) == 0:
            return True
        log.warning("cudaHostRegister of %d bytes returned %s; stays pageable", t.numel(), rc)
    except (RuntimeError, AttributeError) as e:
        log.warning("cudaHostRegister unavailable (%s); memory stays pageable", e)
    return False


def remove_stale_pool_files(directory: str | os.PathLike[str]) -> list[Path]:
    """Unlink shared L1 files no live agent holds locked (kill -9 skips the agent's cleanup)."""
    removed = []
    for path in Path(directory).glob(f"{POOL_FILE_PREFIX}*"):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held by a live agent: BlockingIOError
            path.unlink()
            removed.append(path)
        except OSError:
            continue
        finally:
            os.close(fd)
    return removed


class SharedPoolFile:
    """The file of a shared pool, locked (``flock``) while this process holds it open."""

    def __init__(self, directory: str, nbytes: int) -> None:
        remove_stale_pool_files(directory)
        self.path = os.path.join(directory, f"{POOL_FILE_PREFIX}{os.getpid()}-{secrets.token_hex(4)}")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.posix_fallocate(self.fd, 0, nbytes)  # committed now: no SIGBUS on a full tmpfs later
        except OSError as e:
            self.close()
            free = shutil.disk_usage(directory).free
            raise ValueError(
                f"l1_shared_dir={directory!r}: cannot allocate the {nbytes}-byte L1 file ({e.strerror}); "
                f"expected a directory (a tmpfs such as /dev/shm) with that much free, it has {free} bytes"
            ) from None

    def close(self) -> None:
        """Unlink the file and drop the lock (mappings stay valid until their tensors go)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        with contextlib.suppress(OSError):
            os.close(self.fd)


def map_shared_pool(path: str, nbytes: int) -> torch.Tensor:
    """An engine's mapping of an agent's shared L1 file (all ``nbytes`` of it), as uint8."""
    size = os.stat(path).st_size
    if size != nbytes:
        raise ValueError(f"shared L1 file {path!r} has {size} bytes; the agent announced {nbytes}")
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def allocate_pool_tensor(
    nbytes: int, *, pin: bool | None = None, shared_dir: str | None = None
) -> tuple[torch.Tensor, bool, SharedPoolFile | None]:
    """A uint8 tensor of ``nbytes``, whether it is page-locked, and its shared file (if any).

    ``pin=None`` pins exactly when CUDA is available. Large ``pin_memory=True`` allocations can fail
    on some drivers, so a failure falls back to plain memory registered with ``cudaHostRegister``,
    and then to plain memory (slower DMA, but the agent still serves).
    """
    if nbytes <= 0:
        raise ValueError(f"L1 size {nbytes} bytes: expected > 0")
    want_pin = torch.cuda.is_available() if pin is None else pin
    if shared_dir is not None:
        file = SharedPoolFile(shared_dir, nbytes)
        t = torch.from_file(file.path, shared=True, size=nbytes, dtype=torch.uint8)
        return t, want_pin and host_register(t), file
    if not want_pin:
        # Touch every page now: the memory is committed at start (no page faults mid-transfer,
        # and no out-of-memory kill later under load).
        return torch.zeros(nbytes, dtype=torch.uint8), False, None
    try:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), True, None
    except RuntimeError as e:
        log.warning("pinned allocation of %d bytes failed (%s); trying cudaHostRegister", nbytes, e)
    t = torch.empty(nbytes, dtype=torch.uint8)
    return t, host_register(t), None


class PageAllocator:
    """Runs of contiguous pages out of ``num_pages``; first an exact-size free run, else the
    smallest larger run is split. Frees coalesce with both neighbours.

    Agents usually see one chunk size, so after warm-up every request hits the exact-size bucket:
    O(1) allocate and free without fragmentation. Mixed sizes (several registered layouts) cost
    O(number of distinct free-run sizes). Not thread-safe; :class:`L1Pool` locks.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages={num_pages}: expected > 0")
        self.num_pages = num_pages
        self.free_pages = 0
        self._by_start: dict[int, int] = {}  # start -> length
        self._by_end: dict[int, int] = {}  # end (exclusive) -> start
        self._by_size: dict[int, set[int]] = {}  # length -> starts
        self._insert(0, num_pages)

    def _insert(self, start: int, length: int) -> None:
        self._by_start[start] = length
        self._by_end[start + length] = start
        self._by_size.setdefault(length, set()).add(start)
        self.free_pages += length

    def _remove(self, start: int) -> int:
        length = self._by_start.pop(start)
        del self._by_end[start + length]
        bucket = self._by_size[length]
        bucket.discard(start)
        if not bucket:
            del self._by_size[length]
        self.free_pages -= length
        return length

    def allocate(self, pages: int) -> int | None:
        """Start page of a fresh run of ``pages`` pages, or None if no free run is large enough."""
        if pages <= 0:
            raise ValueError(f"pages={pages}: expected > 0")
        bucket = self._by_size.get(pages)
        if bucket:
            start = next(iter(bucket))
            self._remove(start)
            return start
        larger = [s for s in self._by_size if s > pages]
        if not larger:
            return None
        start = next(iter(self._by_size[min(larger)]))
        length = self._remove(start)
        self._insert(start + pages, length - pages)
        return start

    def free(self, start: int, pages: int) -> None:
        if pages <= 0 or start < 0 or start + pages > self.num_pages:
            raise ValueError(f"free({start}, {pages}): outside [0, {self.num_pages})")
        if start in self._by_start or (start + pages) in self._by_end:
            raise ValueError(f"free({start}, {pages}): run overlaps a free run (double free?)")
        prev_start = self._by_end.get(start)
        if prev_start is not None:
            pages += start - prev_start
            self._remove(prev_start)
            start = prev_start
        if (start + pages) in self._by_start:
            pages += self._remove(start + pages)
        self._insert(start, pages)

    def largest_free_run(self) -> int:
        return max(self._by_size, default=0)


@dataclass(eq=False)
class Chunk:
    """One cached chunk: a run of pages in the pool holding every kernel group's bytes.

    ``refcount`` counts users that need the bytes to stay (a transfer reading them, a lookup pin);
    a chunk with ``refcount > 0`` is never evicted. ``committed`` is False while a store is still
    writing it (invisible to lookups).
    """

    key: bytes
    namespace_id: str
    layout_id: str
    start_page: int
    num_pages: int
    nbytes: int
    buffer: torch.Tensor = field(repr=False)
    refcount: int = 0
    committed: bool = False
    ready: threading.Event | None = None
    """Set once the bytes are final; None for chunks whose bytes were final when committed. A
    chunk promoted asynchronously from a lower tier is committed (visible, counted by lookups)
    before its read ends: every reader of the bytes waits for this (:meth:`wait_ready`)."""
    failed: bool = False
    """The promotion filling this chunk failed (or was cancelled): its bytes are never served; it
    left the index and its pages are freed when the last reference goes."""
    checksum: bytes = b""
    """XXH3-128 of the bytes (``kvgrid.common.checksum``): the verified one that came with the bytes
    for a peer fetch; for a store, computed the first time the chunk is served (the bytes never
    change once committed, so it is the checksum of the stored bytes, kept off the engine's store
    path). Sent with the chunk to peers, which verify it before their copy becomes visible."""

    def wait_ready(self) -> bool:
        """Wait until the bytes are final; False when they never will be (a failed promotion)."""
        if self.ready is not None:
            self.ready.wait()
        return not self.failed


class L1Pool:
    """The pool tensor plus its page allocator. ``page_bytes`` is the alignment of every chunk."""

    def __init__(
        self,
        capacity_bytes: int,
        *,
        page_bytes: int = 64 * 1024,
        pin: bool | None = None,
        shared_dir: str | None = None,
    ) -> None:
        if page_bytes <= 0 or page_bytes & (page_bytes - 1):
            raise ValueError(f"page_bytes={page_bytes}: expected a power of two")
        num_pages = capacity_bytes // page_bytes
        if num_pages <= 0:
            raise ValueError(
                f"L1 capacity {capacity_bytes} bytes is smaller than one page ({page_bytes} bytes)"
            )
        self.page_bytes = page_bytes
        self.capacity_bytes = num_pages * page_bytes
        # Over-allocate one page so the first page starts on a page boundary.
        raw, self.pinned, self._file = allocate_pool_tensor(
            self.capacity_bytes + page_bytes, pin=pin, shared_dir=shared_dir
        )
        skew = (-raw.data_ptr()) % page_bytes
        self.tensor = raw[skew : skew + self.capacity_bytes]
        self._raw = raw
        self.allocator = PageAllocator(num_pages)
        self.lock = threading.Lock()

    @property
    def shared_file(self) -> str:
        """Path of the shared file; "" for a private pool."""
        return self._file.path if self._file is not None else ""

    @property
    def file_bytes(self) -> int:
        """Size of the shared file (the whole raw allocation)."""
        return self._raw.numel()

    def file_offset(self, buffer: torch.Tensor) -> int:
        """Byte offset of a chunk buffer (a view into the pool) in the shared file."""
        return buffer.data_ptr() - self._raw.data_ptr()

    def close(self) -> None:
        """Unlink the shared file (mappings stay valid until their tensors go)."""
        if self._file is not None:
            self._file.close()

    @property
    def used_bytes(self) -> int:
        return (self.allocator.num_pages - self.allocator.free_pages) * self.page_bytes

    def pages_for(self, nbytes: int) -> int:
        return max(1, -(-nbytes // self.page_bytes))

    def allocate(self, nbytes: int) -> tuple[int, int, torch.Tensor] | None:
        """(start_page, num_pages, view of ``nbytes``) or None when no run is free."""
        pages = self.pages_for(nbytes)
        with self.lock:
            start = self.allocator.allocate(pages)
        if start is None:
            return None
        off = start * self.page_bytes
        return start, pages, self.tensor[off : off + nbytes]

    def free(self, start_page: int, num_pages: int) -> None:
        with self.lock:
            self.allocator.free(start_page, num_pages)
