"""Page gather/scatter with plain torch indexing: the correctness reference, the CPU path, and the
baseline the GPU kernels are measured against.

Works on any device. When a chunk section is not on the KV device (pinned host chunks, CUDA KV) the
copy goes through a temporary buffer on the KV device and one ``copy_`` per chunk.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .pages import KernelGroupPages


def gather_group(
    group: KernelGroupPages,
    sections: Sequence[torch.Tensor],
    ids_per_chunk: Sequence[np.ndarray],
    tokens_per_chunk: int,
) -> None:
    """Copy the blocks ``ids_per_chunk[c]`` of every layer of ``group`` into ``sections[c]``.

    ``sections[c]`` is the group's byte section of chunk ``c`` (see ``ChunkLayout``). Negative ids
    are skipped: their pages in the section are left as they were.
    """
    dev = group.device
    bpc = group.geometry.blocks_per_chunk(tokens_per_chunk)
    for sec, ids in zip(sections, ids_per_chunk, strict=True):
        pos = np.flatnonzero(ids >= 0)
        if pos.size == 0:
            continue
        full = pos.size == bpc
        target = sec if sec.device == dev else torch.empty(sec.numel(), dtype=torch.uint8, device=dev)
        if target is not sec and not full:
            target.copy_(sec)  # keep the skipped pages' bytes
        pages = target.view(group.num_layers, group.planes, bpc, group.page_bytes)
        src_ids = torch.from_numpy(ids[pos]).to(dev)
        pos_t = torch.from_numpy(pos).to(dev)
        for i, layer in enumerate(group.layers):
            for p in range(group.planes):
                if full:
                    torch.index_select(layer[p], 0, src_ids, out=pages[i, p])
                else:
                    pages[i, p].index_copy_(0, pos_t, layer[p].index_select(0, src_ids))
        if target is not sec:
            sec.copy_(target, non_blocking=True)


def scatter_group(
    group: KernelGroupPages,
    sections: Sequence[torch.Tensor],
    ids_per_chunk: Sequence[np.ndarray],
    tokens_per_chunk: int,
) -> None:
    """Copy ``sections[c]`` into blocks ``ids_per_chunk[c]`` of every layer; negative ids are skipped."""
    dev = group.device
    bpc = group.geometry.blocks_per_chunk(tokens_per_chunk)
    for sec, ids in zip(sections, ids_per_chunk, strict=True):
        pos = np.flatnonzero(ids >= 0)
        if pos.size == 0:
            continue
        source = sec if sec.device == dev else sec.to(dev, non_blocking=True)
        pages = source.view(group.num_layers, group.planes, bpc, group.page_bytes)
        dst_ids = torch.from_numpy(ids[pos]).to(dev)
        full = pos.size == bpc
        pos_t = None if full else torch.from_numpy(pos).to(dev)
        for i, layer in enumerate(group.layers):
            for p in range(group.planes):
                rows = pages[i, p] if pos_t is None else pages[i, p].index_select(0, pos_t)
                layer[p].index_copy_(0, dst_ids, rows)
