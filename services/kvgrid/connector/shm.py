"""CPU KV caches the agent can map: allocate them in shared-memory files, and find the file again.

The agent reaches CPU KV caches by file (``kvgrid.engine.tensors.export_layer_tensor`` needs the
path). vLLM allocates its KV cache with one ``torch.zeros`` inside the connector's
``get_mem_pool_context()``; :class:`SharedMemoryAllocation` is that context for CPU engines: it
turns large CPU ``torch.zeros``/``torch.empty`` calls made inside it into tensors backed by new
files under a tmpfs (``kvgrid.engine.tensors.allocate_shared_tensor``), so stock vLLM needs no patch.

A storage created with ``torch.from_file(path, shared=True)`` is an mmap of that file; the kernel's
``/proc/self/maps`` names the file behind every mapping, so :func:`shared_memory_file` reads the
path from there rather than threading it through the engine's allocator.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from kvgrid.engine.tensors import allocate_shared_tensor

__all__ = ["SharedMemoryAllocation", "remove_stale_files", "shared_memory_file"]

FILE_PREFIX = "kvgrid-kv"
_FILE_NAME = re.compile(rf"^{FILE_PREFIX}-(\d+)-\d+$")


def remove_stale_files(directory: str | os.PathLike[str]) -> list[Path]:
    """Unlink KV cache files left by engine processes that no longer exist (a crash skips the
    engine's own cleanup); returns what was removed."""
    removed: list[Path] = []
    for path in Path(directory).glob(f"{FILE_PREFIX}-*"):
        m = _FILE_NAME.match(path.name)
        if m is None or Path(f"/proc/{m.group(1)}").exists():
            continue
        try:
            path.unlink()
            removed.append(path)
        except OSError:
            continue
    return removed


class SharedMemoryAllocation(TorchFunctionMode):
    """Inside this context, CPU ``torch.zeros``/``torch.empty`` calls of at least ``min_bytes``
    return zeroed tensors backed by new files ``{directory}/kvgrid-kv-{pid}-{n}`` (smaller or
    non-CPU allocations are untouched). ``files`` lists what was created; :meth:`remove` unlinks
    them (the mappings stay valid while tensors use them)."""

    def __init__(self, directory: str | os.PathLike[str], min_bytes: int = 1 << 20) -> None:
        super().__init__()
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise ValueError(
                f"shm_dir={str(directory)!r}: not a directory; expected a tmpfs both the engine and "
                f"the kvgrid agent can reach (e.g. /dev/shm)"
            )
        self.min_bytes = min_bytes
        self.files: list[Path] = []

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in (torch.zeros, torch.empty) and self._shareable(kwargs):
            shape = _shape(args, kwargs)
            dtype = kwargs.get("dtype") or torch.get_default_dtype()
            if shape is not None and math.prod(shape) * dtype.itemsize >= self.min_bytes:
                path = self.directory / f"{FILE_PREFIX}-{os.getpid()}-{len(self.files)}"
                tensor = allocate_shared_tensor(path, shape, dtype)
                self.files.append(path)
                return tensor.requires_grad_(bool(kwargs.get("requires_grad", False)))
        return func(*args, **kwargs)

    @staticmethod
    def _shareable(kwargs: dict[str, Any]) -> bool:
        device = kwargs.get("device")
        on_cpu = device is None or torch.device(device).type == "cpu"
        plain = kwargs.get("out") is None and kwargs.get("layout") in (None, torch.strided)
        return on_cpu and plain and not kwargs.get("pin_memory", False)

    def remove(self) -> None:
        for path in self.files:
            path.unlink(missing_ok=True)
        self.files.clear()


def _shape(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, ...] | None:
    raw = kwargs.get("size", args[0] if len(args) == 1 and not isinstance(args[0], int) else args)
    try:
        return tuple(int(s) for s in raw)
    except TypeError:
        return None


_MAPS = Path("/proc/self/maps")


def _mapping_of(address: int) -> tuple[int, int, int, str] | None:
    """(start, end, file offset, path) of the mapping that contains ``address``; later mappings
    that continue it (same file, adjacent addresses and offsets: the kernel splits one mmap into
    several entries after e.g. madvise) extend ``end``."""
    try:
        text = _MAPS.read_text()
    except OSError:
        return None
    found: tuple[int, int, int, str] | None = None
    for line in text.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) < 5:
            continue
        lo, _, hi = parts[0].partition("-")
        start, end, offset = int(lo, 16), int(hi, 16), int(parts[2], 16)
        path = parts[5].strip() if len(parts) == 6 else ""
        if found is None:
            if start <= address < end:
                found = (start, end, offset, path)
        elif start == found[1] and path == found[3] and offset == found[2] + (found[1] - found[0]):
            found = (found[0], end, found[2], path)
        else:
            break
    return found


def shared_memory_file(tensor: torch.Tensor, what: str = "tensor") -> str:
    """The file whose byte 0 is the first byte of ``tensor``'s storage, mapped shared.

    Raises ValueError (naming ``what``) when the storage is not such a mapping: anonymous memory
    (a plain ``torch.empty``), a file mapped from a non-zero offset, or a deleted file.
    """
    if tensor.device.type != "cpu":
        raise ValueError(f"{what}: on {tensor.device}; expected a CPU tensor")
    storage = tensor.untyped_storage()
    ptr, nbytes = storage.data_ptr(), storage.nbytes()
    found = _mapping_of(ptr)
    hint = (
        "expected a CPU KV cache allocated in a shared-memory file (e.g. under /dev/shm with "
        "kvgrid.engine.tensors.allocate_shared_tensor) so the kvgrid agent can map it"
    )
    if found is None or not found[3] or found[3].startswith("["):
        raise ValueError(f"{what}: its storage at 0x{ptr:x} is anonymous memory, not a file; {hint}")
    start, end, offset, path = found
    if path.endswith(" (deleted)"):
        raise ValueError(f"{what}: its storage maps {path!r}, a file that was deleted; {hint}")
    if offset + (ptr - start) != 0:
        raise ValueError(
            f"{what}: its storage starts at byte {offset + ptr - start} of {path!r}; expected byte 0"
        )
    if ptr + nbytes > end:
        raise ValueError(f"{what}: its storage of {nbytes} bytes extends past the mapping of {path!r}")
    return path
