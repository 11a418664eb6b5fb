"""LMCache 0.5.2's transfer kernel as a reference row of ``kvgrid bench transfer`` (only when its
wheel is given: ``--lmcache-wheel``; nothing of LMCache is a dependency).

Only the compiled extension ``lmcache/c_ops*.so`` is loaded, straight from the wheel (LMCache's
Python package needs far more than this machine has; 0.5.4+ do not import under torch 2.11). The
call is LMCache's own single-op path: ``multi_layer_kv_transfer`` between the paged KV of every
layer (per-layer pointers in a device table, a token slot mapping) and one chunk object in pinned
host memory, written or read in place by the kernel (no GPU staging buffer), on the current stream.
The chunk object is laid out the LMCache way (``[2, layers, tokens, hidden]``, MLA
``[1, layers, tokens, 576]``), so its bytes are not comparable with kvgrid's chunk layout, only the
time is.
"""

from __future__ import annotations

import importlib.util
import tempfile
import zipfile
from typing import Any

import numpy as np
import torch

# bench geometry name -> (LMCache EngineKVFormat member, K/V planes in the chunk object)
FORMATS = {
    "llama3-8b-fa": ("NL_X_TWO_NB_BS_NH_HS", 2),  # [2, NB, BS, NH, HS]
    "llama3-8b-fi": ("NL_X_NB_TWO_BS_NH_HS", 2),  # FlashInfer [NB, 2, BS, NH, HS]
    "mla": ("NL_X_NB_BS_HS", 1),  # [NB, BS, HS]
}


def load_c_ops(wheel: str) -> Any:
    """Import ``lmcache.c_ops`` from the wheel file (extracted to a temporary folder)."""
    folder = tempfile.mkdtemp(prefix="kvgrid-lmcache-")
    if not zipfile.is_zipfile(wheel):
        raise ValueError(f"--lmcache-wheel {wheel!r}: not a readable wheel (zip) file; expected LMCache's")
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.startswith("lmcache/c_ops") and n.endswith(".so")]
        if not names:
            raise ValueError(f"--lmcache-wheel {wheel!r}: no lmcache/c_ops*.so inside; expected a wheel")
        path = z.extract(names[0], folder)
    spec = importlib.util.spec_from_file_location("c_ops", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class LMCacheOp:
    """One store (paged -> chunk object) or retrieve of ``tokens`` tokens at random block ids."""

    def __init__(
        self,
        ops: Any,
        geometry: str,
        layers: list[torch.Tensor],
        tokens: int,
        block_size: int,
        rng: np.random.Generator,
    ) -> None:
        fmt_name, kv = FORMATS[geometry]
        self.ops = ops
        self.fmt = getattr(ops.EngineKVFormat, fmt_name)
        self.layers = layers
        t0 = layers[0]
        if fmt_name == "NL_X_TWO_NB_BS_NH_HS":
            num_blocks, hidden = t0.shape[1], t0.shape[3] * t0.shape[4]
        elif fmt_name == "NL_X_NB_TWO_BS_NH_HS":
            num_blocks, hidden = t0.shape[0], t0.shape[3] * t0.shape[4]
        else:
            num_blocks, hidden = t0.shape[0], t0.shape[2]
        self.head_size = t0.shape[-1]
        self.block_size = block_size
        self.page_buffer_size = num_blocks * block_size
        self.ptrs = torch.tensor([t.data_ptr() for t in layers], dtype=torch.int64, device=t0.device)
        self.obj = torch.empty((kv, len(layers), tokens, hidden), dtype=t0.dtype, pin_memory=True)
        self.obj.view(torch.uint8).random_(0, 256)
        self.nbytes = self.obj.numel() * self.obj.element_size()
        blocks = rng.permutation(num_blocks)[: tokens // block_size]
        slots = (blocks[:, None] * block_size + np.arange(block_size)[None, :]).reshape(-1)
        self.slots = torch.from_numpy(slots.astype(np.int64)).to(t0.device)
        self.device = t0.device

    def __call__(self, store: bool) -> None:
        d = self.ops.TransferDirection.D2H if store else self.ops.TransferDirection.H2D
        self.ops.multi_layer_kv_transfer(
            self.obj,
            self.ptrs,
            self.slots,
            self.device,
            self.page_buffer_size,
            d,
            self.fmt,
            self.block_size,
            self.head_size,
            0,
        )
