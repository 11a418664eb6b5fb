"""The engine's KV tensors described for its agent (``RegisterKVCaches``'s ``layers``).

:func:`export_layer_tensor` describes a KV tensor as an ``agent_pb2.LayerTensor``:

- a CUDA tensor by torch's CUDA IPC triple (the storage's IPC memory handle, its ref-counter
  handle and event), plus the GPU's UUID so the agent can find the same device under its own
  device numbering (``CUDA_VISIBLE_DEVICES`` may differ between containers);
- a CPU tensor by the shared-memory file its storage lives in (the engine allocates the KV cache
  with :func:`allocate_shared_tensor`), so CI and laptops run the same pipeline without a GPU.

The agent maps them back (:mod:`kvgrid.agent.tensors`), checking every size and bound first.
Invariant: a CPU tensor's storage starts at offset 0 of its file; the engine owns the file.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from kvgrid.api.v1 import agent_pb2
from kvgrid.common.tensor_wire import device_uuid, dtype_name

__all__ = ["allocate_shared_tensor", "export_layer_tensor"]


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
