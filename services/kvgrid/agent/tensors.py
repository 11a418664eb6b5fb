"""Layer tensors across the engine/agent process boundary.

Engine side (:func:`export_layer_tensor`): describe a KV tensor as an ``agent_pb2.LayerTensor``:

- a CUDA tensor by torch's CUDA IPC triple (the storage's IPC memory handle, its ref-counter
  handle and event), plus the GPU's UUID so the agent can find the same device under its own
  device numbering (``CUDA_VISIBLE_DEVICES`` may differ between containers);
- a CPU tensor by the shared-memory file its storage lives in (the engine allocates the KV cache
  with :func:`allocate_shared_tensor`), so CI and laptops run the same pipeline without a GPU.

Agent side (:func:`open_layer_tensor`): map the handle back to a tensor that aliases the engine's
memory (no copy), checking every size and bound first (a bad handle is a ValueError naming it).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch

from kvgrid.api.v1 import agent_pb2

__all__ = [
    "DTYPES",
    "SharedFileCache",
    "allocate_shared_tensor",
    "device_index_for_uuid",
    "device_uuid",
    "dtype_from_name",
    "dtype_name",
    "export_layer_tensor",
    "open_ipc_event",
    "open_layer_tensor",
]

DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r}: expected one of {sorted(DTYPES)}") from None


def _normalize_uuid(uuid: str) -> str:
    u = uuid.strip().lower()
    return u.removeprefix("gpu-")


def device_uuid(index: int) -> str:
    """UUID of CUDA device ``index`` as nvidia-smi prints it (``GPU-...``)."""
    return "GPU-" + _normalize_uuid(str(torch.cuda.get_device_properties(index).uuid))


def device_index_for_uuid(uuid: str) -> int:
    """This process's index of the GPU with ``uuid`` (with or without the ``GPU-`` prefix)."""
    want = _normalize_uuid(uuid)
    if not want:
        raise ValueError("device_uuid='': expected the GPU's UUID (nvidia-smi -L)")
    if not torch.cuda.is_available():
        raise ValueError(f"device_uuid={uuid!r}: this agent sees no CUDA device")
    seen = []
    for i in range(torch.cuda.device_count()):
        got = _normalize_uuid(str(torch.cuda.get_device_properties(i).uuid))
        if got == want:
            return i
        seen.append("GPU-" + got)
    raise ValueError(f"device_uuid={uuid!r}: no such GPU visible to the agent (it sees {seen})")


# ---- engine side -----------------------------------------------------------------------------


def allocate_shared_tensor(
    path: str | os.PathLike[str], shape: Sequence[int], dtype: torch.dtype
) -> torch.Tensor:
    """A zeroed CPU tensor whose storage is the file ``path`` (created, usually under /dev/shm).

    The engine owns the file: it unlinks it when the KV cache goes away.
    """
    numel = 1
    for s in shape:
        numel *= int(s)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    with open(path, "wb") as f:
        f.truncate(nbytes)
    flat = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
    return flat.view(dtype).view(*shape)


def export_layer_tensor(
    layer_index: int,
    tensor: torch.Tensor,
    *,
    shm_path: str | os.PathLike[str] | None = None,
    layout_hint: str = "",
) -> agent_pb2.LayerTensor:
    """Describe ``tensor`` for the agent. CPU tensors need ``shm_path``: the file their storage
    maps (the storage must start at offset 0 of that file, as :func:`allocate_shared_tensor` does)."""
    msg = agent_pb2.LayerTensor(
        layer_index=layer_index,
        shape=list(tensor.shape),
        stride=list(tensor.stride()),
        storage_offset=int(tensor.storage_offset()),
        dtype=dtype_name(tensor.dtype),
        layout_hint=layout_hint,
    )
    storage = tensor.untyped_storage()
    if tensor.is_cuda:
        (
            _device,
            handle,
            size_bytes,
            offset_bytes,
            ref_handle,
            ref_offset,
            event_handle,
            event_sync,
        ) = storage._share_cuda_()
        msg.cuda.CopyFrom(
            agent_pb2.CudaIpcHandle(
                device_uuid=device_uuid(tensor.device.index or 0),
                handle=handle,
                storage_size_bytes=size_bytes,
                storage_offset_bytes=offset_bytes,
                ref_counter_handle=ref_handle,
                ref_counter_offset=ref_offset,
                event_handle=event_handle or b"",
                event_sync_required=bool(event_sync),
            )
        )
        return msg
    if tensor.device.type != "cpu":
        raise ValueError(f"layer {layer_index}: tensor on {tensor.device}; expected a CUDA or CPU tensor")
    if shm_path is None:
        raise ValueError(
            f"layer {layer_index}: a CPU tensor needs shm_path (allocate it with allocate_shared_tensor)"
        )
    msg.shm.CopyFrom(
        agent_pb2.SharedMemoryHandle(path=str(shm_path), size_bytes=storage.nbytes(), offset_bytes=0)
    )
    return msg


# ---- agent side ------------------------------------------------------------------------------


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
