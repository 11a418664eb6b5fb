"""Find the shared-memory file a CPU tensor's storage maps, so the agent can map the same bytes.

The agent reaches CPU KV caches by file (``kvgrid.agent.tensors.export_layer_tensor`` needs the
path). A storage created with ``torch.from_file(path, shared=True)`` (what
``kvgrid.agent.tensors.allocate_shared_tensor`` does) is an mmap of that file; the kernel's
``/proc/self/maps`` names the file behind every mapping, so the path is read from there rather
than threaded through the engine's allocator.
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["shared_memory_file"]

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
        "kvgrid.agent.tensors.allocate_shared_tensor) so the kvgrid agent can map it"
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
