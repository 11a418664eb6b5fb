"""The local-disk blob store: one file per record under a configured directory.

Invariants:

- A record is written to ``<name>.tmp`` with one ``writev`` of the header page and the chunk's
  bytes (large writes; the L1 view is page aligned), then renamed into place: a file under its
  final name was written completely, and a crash leaves only ``.tmp`` files. Bytes that rot
  later are caught by the tier's checksum check.
- No fsync: this is a cache. At start the directory's records are scanned (``scan``): each
  complete file is handed to the tier, which checks its header and size and indexes it again (so
  a restarted agent serves what it wrote; checksums are verified on read as always); leftover
  ``.tmp`` files (a write cut short) are removed.
- Only names of the form ``<namespace_id>/<key hex>`` (``base.record_name``) are ever opened, and
  only files ending in ``.kvc``/``.kvc.tmp`` are removed: the directory may hold other things.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

from kvgrid.agent.tiers.base import HEADER_BYTES, BlobMissing, FoundBlob

__all__ = ["DiskBlobStore"]

_SUFFIX = ".kvc"


def _io_all(op: Callable[[int, list[memoryview]], int], fd: int, bufs: list[memoryview]) -> int:
    """``os.writev``/``os.readv`` until every buffer is done (a call may move fewer bytes: signals,
    the 2 GiB per-call cap) or, reading, the file ends. Returns the bytes moved."""
    total = 0
    while bufs:
        n = op(fd, bufs)
        if n <= 0:
            if op is os.readv:
                break  # end of file: a short record
            raise OSError(f"writev moved {n} bytes after {total}")
        total += n
        while bufs and n >= len(bufs[0]):
            n -= len(bufs[0])
            bufs.pop(0)
        if bufs and n:
            bufs[0] = bufs[0][n:]
    return total


class DiskBlobStore:
    kind = "disk"

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.root = Path(directory)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(
                f"tier_disk_path={str(directory)!r}: cannot create the directory ({e})"
            ) from None
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise ValueError(f"tier_disk_path={str(directory)!r}: expected a writable directory")

    def _path(self, name: str) -> Path:
        return self.root / (name + _SUFFIX)

    def write(self, name: str, header: bytes, payload: memoryview) -> None:
        path = self._path(name)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            _io_all(os.writev, fd, [memoryview(header), payload])
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        os.replace(tmp, path)

    def read_into(self, name: str, header: bytearray, payload: memoryview) -> int:
        try:
            fd = os.open(self._path(name), os.O_RDONLY)
        except FileNotFoundError:
            raise BlobMissing(name) from None
        try:
            got = _io_all(os.readv, fd, [memoryview(header), payload])
        finally:
            os.close(fd)
        return max(0, got - HEADER_BYTES)

    def delete(self, name: str) -> None:
        self._path(name).unlink(missing_ok=True)

    def list(self, namespace_id: str) -> list[str]:
        d = self.root / namespace_id
        if not d.is_dir():
            return []
        return sorted(
            f"{namespace_id}/{p.name[: -len(_SUFFIX)]}" for p in d.iterdir() if p.name.endswith(_SUFFIX)
        )

    def scan(self) -> tuple[Sequence[FoundBlob], int]:
        """Every record file under the directory (name, header page, payload size, mtime), and
        how many leftover ``.tmp`` files (writes a crash cut short) were removed. Only
        ``<dir>/<file>.kvc`` files are reported; the tier decides which are records it can use."""
        found: list[FoundBlob] = []
        removed = 0
        for d in self.root.iterdir():
            if not d.is_dir():
                continue
            for p in d.iterdir():
                if p.name.endswith(_SUFFIX + ".tmp"):
                    p.unlink(missing_ok=True)
                    removed += 1
                    continue
                if not p.name.endswith(_SUFFIX):
                    continue
                try:
                    with open(p, "rb") as f:
                        st = os.fstat(f.fileno())
                        header = f.read(HEADER_BYTES)
                except OSError:
                    continue  # removed meanwhile, or not a file
                found.append(
                    FoundBlob(
                        f"{d.name}/{p.name[: -len(_SUFFIX)]}",
                        header,
                        max(0, st.st_size - HEADER_BYTES),
                        st.st_mtime_ns,
                    )
                )
        return found, removed

    def close(self) -> None:
        return None
