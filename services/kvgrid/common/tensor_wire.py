"""How a tensor's dtype and GPU are named between processes (the engine's export of its KV tensors
and the agent's opening of them, :mod:`kvgrid.engine.tensors` and :mod:`kvgrid.agent.tensors`).

Invariants: a dtype travels as its torch name without the ``torch.`` prefix (``bfloat16``), and
only the names in :data:`DTYPES` are accepted; a GPU travels as its UUID (``GPU-...``, as
nvidia-smi prints it), since ``CUDA_VISIBLE_DEVICES`` may number the devices differently in the
engine's and the agent's containers.
"""

from __future__ import annotations

import torch

__all__ = ["DTYPES", "device_index_for_uuid", "device_uuid", "dtype_from_name", "dtype_name"]

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
