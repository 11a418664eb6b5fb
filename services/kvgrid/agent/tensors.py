"""The engine's KV tensors opened in the agent (``RegisterKVCaches``'s ``layers`` and events).

:func:`open_layer_tensor` maps the handle the engine sent (:mod:`kvgrid.engine.tensors`: a CUDA
IPC handle, or a shared-memory file) back to a tensor that aliases the engine's memory (no copy),
checking every size and bound first (a bad handle is a ValueError naming it); shared-memory files
must lie under the allowed directories (``--shm-allowed-dirs``) and are mapped once each
(:class:`SharedFileCache`). :func:`open_ipc_event` opens the engine's interprocess CUDA events.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from kvgrid.api.v1 import agent_pb2
from kvgrid.common.tensor_wire import device_index_for_uuid, dtype_from_name

__all__ = ["SharedFileCache", "open_ipc_event", "open_layer_tensor"]


class SharedFileCache:
    """Maps each shared-memory file once (layers often share one file) and unmaps on close."""

    def __init__(self, allowed_dirs: Sequence[str] = ("/dev/shm",)) -> None:
        self.allowed_dirs = [Path(d).resolve() for d in allowed_dirs]
        self._maps: dict[str, torch.Tensor] = {}

    def open(self, path: str) -> torch.Tensor:
        """The whole file as a shared uint8 tensor."""
        real = Path(path).resolve()
        if not any(real.is_relative_to(d) for d in self.allowed_dirs):
            raise ValueError(
                f"shm.path={path!r}: outside the allowed shared-memory dirs "
                f"{[str(d) for d in self.allowed_dirs]} (agent flag --shm-allowed-dirs)"
            )
        key = str(real)
        if key in self._maps:
            return self._maps[key]
        try:
            st = real.stat()
        except OSError as e:
            raise ValueError(f"shm.path={path!r}: cannot open ({e.strerror})") from None
        if not real.is_file():
            raise ValueError(f"shm.path={path!r}: not a regular file")
        if st.st_size == 0:
            raise ValueError(f"shm.path={path!r}: file is empty")
        t = torch.from_file(key, shared=True, size=st.st_size, dtype=torch.uint8)
        self._maps[key] = t
        return t

    def close(self) -> None:
        self._maps.clear()


def _check_extent(what: str, shape: Sequence[int], stride: Sequence[int], offset: int, numel: int) -> None:
    if len(shape) != len(stride):
        raise ValueError(f"{what}: shape {list(shape)} and stride {list(stride)} differ in rank")
    if any(s < 0 for s in shape) or any(s < 0 for s in stride) or offset < 0:
        raise ValueError(
            f"{what}: negative shape/stride/storage_offset ({list(shape)}, {list(stride)}, {offset})"
        )
    if any(s == 0 for s in shape):
        return
    last = offset + sum((n - 1) * st for n, st in zip(shape, stride, strict=True))
    if last >= numel:
        raise ValueError(
            f"{what}: shape {list(shape)} stride {list(stride)} offset {offset} reaches element {last}, "
            f"beyond the {numel} elements of its storage"
        )


def open_layer_tensor(msg: agent_pb2.LayerTensor, shm: SharedFileCache) -> torch.Tensor:
    """The tensor ``msg`` describes, aliasing the engine's memory."""
    what = f"layers[{msg.layer_index}]"
    dtype = dtype_from_name(msg.dtype) if msg.dtype else None
    if dtype is None:
        raise ValueError(f"{what}: dtype is empty; expected a torch dtype name like 'bfloat16'")
    itemsize = torch.empty((), dtype=dtype).element_size()
    shape, stride, offset = list(msg.shape), list(msg.stride), int(msg.storage_offset)
    kind = msg.WhichOneof("storage")
    if kind == "shm":
        h = msg.shm
        base = shm.open(h.path)
        if h.offset_bytes % itemsize:
            raise ValueError(
                f"{what}: shm.offset_bytes={h.offset_bytes} not a multiple of {msg.dtype} size {itemsize}"
            )
        end = h.offset_bytes + h.size_bytes
        if h.size_bytes == 0 or end > base.numel():
            raise ValueError(
                f"{what}: shm range [{h.offset_bytes}, {end}) is empty or beyond the file's "
                f"{base.numel()} bytes"
            )
        if h.size_bytes % itemsize:
            raise ValueError(
                f"{what}: shm.size_bytes={h.size_bytes} not a multiple of {msg.dtype} size {itemsize}"
            )
        flat = base[h.offset_bytes : end].view(dtype)
        _check_extent(what, shape, stride, offset, flat.numel())
        return flat.as_strided(shape, stride, offset)
    if kind == "cuda":
        c = msg.cuda
        device = device_index_for_uuid(c.device_uuid)
        if c.storage_size_bytes % itemsize:
            raise ValueError(
                f"{what}: storage_size_bytes={c.storage_size_bytes} not a multiple of {itemsize}"
            )
        _check_extent(what, shape, stride, offset, c.storage_size_bytes // itemsize)
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        return rebuild_cuda_tensor(
            torch.Tensor,
            torch.Size(shape),
            tuple(stride),
            offset,
            torch.UntypedStorage,
            dtype,
            device,
            c.handle,
            c.storage_size_bytes,
            c.storage_offset_bytes,
            False,
            c.ref_counter_handle,
            c.ref_counter_offset,
            c.event_handle,
            c.event_sync_required,
        )
    raise ValueError(f"{what}: no storage handle (expected cuda or shm)")


# cudaIpcEventHandle_t is 64 opaque bytes.
_IPC_EVENT_HANDLE_BYTES = 64


def open_ipc_event(field: str, handle: bytes, tensors: Sequence[torch.Tensor]) -> torch.cuda.Event | None:
    """One of the engine's interprocess events (``RegisterKVCachesRequest.<field>``: ``fence_event``,
    ``done_event``), opened on the device of its KV tensors; None when the engine sent none."""
    if not handle:
        return None
    devices = {t.device for t in tensors}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        raise ValueError(
            f"{field} given but the layers are on {sorted(str(d) for d in devices)}; expected one "
            "CUDA device (a CPU engine needs no CUDA events)"
        )
    if len(handle) != _IPC_EVENT_HANDLE_BYTES:
        raise ValueError(
            f"{field} is {len(handle)} bytes; expected a {_IPC_EVENT_HANDLE_BYTES}-byte CUDA IPC event "
            "handle (torch.cuda.Event(interprocess=True).ipc_handle())"
        )
    try:
        return torch.cuda.Event.from_ipc_handle(next(iter(devices)), handle)
    except RuntimeError as e:
        raise ValueError(f"{field}: CUDA could not open the IPC event handle: {e}") from None
