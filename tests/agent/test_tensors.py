"""Shared-memory tensor handles: the engine side exports, the agent side maps the same bytes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvgrid.agent.tensors import SharedFileCache, open_layer_tensor
from kvgrid.engine.tensors import allocate_shared_tensor, export_layer_tensor


def test_shared_memory_round_trip_aliases_the_engine_tensor(tmp_path: Path) -> None:
    t = allocate_shared_tensor(tmp_path / "kv", (4, 2, 16, 2, 8), torch.bfloat16)
    view = t.permute(0, 1, 3, 2, 4)  # a non-contiguous view keeps its strides across the boundary
    msg = export_layer_tensor(3, view, shm_path=tmp_path / "kv")
    assert msg.WhichOneof("storage") == "shm" and msg.layer_index == 3
    agent_side = open_layer_tensor(msg, SharedFileCache([str(tmp_path)]))
    assert agent_side.shape == view.shape and agent_side.stride() == view.stride()
    view[1, 0, 1] = 3.5  # engine writes; the agent sees it, and the other way round
    assert bool((agent_side[1, 0, 1] == 3.5).all())
    agent_side[2].fill_(-1)
    assert bool((t[2] == -1).all())


def test_handles_are_checked(tmp_path: Path) -> None:
    t = allocate_shared_tensor(tmp_path / "kv", (4, 8), torch.float16)
    msg = export_layer_tensor(0, t, shm_path=tmp_path / "kv")
    with pytest.raises(ValueError, match="outside the allowed shared-memory dirs"):
        open_layer_tensor(msg, SharedFileCache(["/dev/shm"]))
    shm = SharedFileCache([str(tmp_path)])
    msg.shape[0] = 5
    with pytest.raises(ValueError, match="beyond the 32 elements"):
        open_layer_tensor(msg, shm)
    msg.shape[0], msg.dtype = 4, "complex64"
    with pytest.raises(ValueError, match="dtype 'complex64'"):
        open_layer_tensor(msg, shm)
    msg.dtype = "float16"
    msg.shm.path = str(tmp_path / "missing")
    with pytest.raises(ValueError, match="cannot open"):
        open_layer_tensor(msg, shm)
    with pytest.raises(ValueError, match="needs shm_path"):
        export_layer_tensor(0, torch.zeros(2))
