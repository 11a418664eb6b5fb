"""The agent's bridge to the transfer kernels: one :class:`ChunkMover` per registered instance.

It detects each layer's physical layout, rebuilds the kernel groups with
``KVLayerGroupsManager`` (which rejects infos that contradict the tensors), and copies between the
engine's paged KV and L1 chunk buffers (uint8 views into the pool, ``bytes_per_chunk`` each, laid
out as ``kvgrid_kernels.pages.ChunkLayout`` says).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvgrid.common.groups import EngineGroupInfo
from kvgrid.common.layer_groups import KVLayerGroupsManager
from kvgrid.common.layouts import KVFormat, detect_kv_format
from kvgrid_kernels import TransferPlan

__all__ = ["ChunkMover", "KernelGroupSummary", "build_mover", "parse_layout_hints"]

_INT_HINTS = ("num_kv_heads", "block_size", "num_blocks")


def parse_layout_hints(hint: str, hints: Mapping[str, str]) -> dict[str, object] | None:
    """Wire hints (a legacy single string and/or a string map) -> ``detect_kv_format`` hints."""
    out: dict[str, object] = {}
    if hint:
        if hint.upper() in ("NHD", "HND", "LBNHC", "BLNHC", "LBHNC", "BLHNC", "BHLNC", "LHBNC"):
            out["kv_layout"] = hint
        else:
            out["backend"] = hint
    for k, v in hints.items():
        if k in _INT_HINTS:
            try:
                out[k] = int(v)
            except ValueError:
                raise ValueError(f"layout_hints[{k!r}]={v!r}: expected a decimal integer") from None
        else:
            out[k] = v
    return out or None


@dataclass(frozen=True)
class KernelGroupSummary:
    info_index: int
    """Which per-info block-id list this kernel group reads (kernel group i <-> info i)."""
    layer_indices: tuple[int, ...]
    kv_format: str
    dtype: str
    engine_group_idx: int
    tokens_per_block: int
    slots_per_block: int
    blocks_per_chunk: int
    num_blocks: int
    bytes_per_chunk: int


class ChunkMover:
    """Copies whole chunks between one instance's KV tensors and L1 chunk buffers.

    ``ids[g][c]`` are the block ids of kernel group ``g`` for chunk ``c`` (``blocks_per_chunk``
    of them; -1 = leave that block alone).
    """

    def __init__(
        self, manager: KVLayerGroupsManager, tensors: Sequence[torch.Tensor], tokens_per_chunk: int
    ) -> None:
        self.manager = manager
        self.tokens_per_chunk = tokens_per_chunk
        self.plan = TransferPlan.from_manager(manager, list(tensors), tokens_per_chunk=tokens_per_chunk)
        # A plan serves one call at a time (it owns staging buffers and streams).
        self._lock = threading.Lock()
        self.layout = self.plan.layout
        if self.layout.bytes_per_chunk != manager.bytes_per_chunk():
            raise ValueError(
                f"kernel page views hold {self.layout.bytes_per_chunk} bytes per chunk but the kernel groups "
                f"say {manager.bytes_per_chunk()}; padded or non-dense KV pages are not supported"
            )
        self.summaries = [
            KernelGroupSummary(
                info_index=i if manager.engine_group_infos else 0,
                layer_indices=tuple(kg.layer_indices),
                kv_format=str(kg.kv_format),
                dtype=str(kg.dtype).removeprefix("torch."),
                engine_group_idx=kg.engine_group_idx,
                tokens_per_block=kg.tokens_per_block,
                slots_per_block=kg.slots_per_block,
                blocks_per_chunk=manager.blocks_per_chunk(i),
                num_blocks=kg.shape.num_blocks,
                bytes_per_chunk=manager.bytes_per_chunk(i),
            )
            for i, kg in enumerate(manager.kernel_groups)
        ]
        desc = repr(
            (
                tokens_per_chunk,
                [
                    (
                        s.kv_format,
                        s.dtype,
                        s.tokens_per_block,
                        s.slots_per_block,
                        len(s.layer_indices),
                        p.planes,
                        p.page_bytes,
                    )
                    for s, p in zip(self.summaries, self.plan.groups, strict=True)
                ],
            )
        )
        self.layout_id = hashlib.blake2b(desc.encode(), digest_size=8).hexdigest()

    @property
    def bytes_per_chunk(self) -> int:
        return self.layout.bytes_per_chunk

    def store(self, buffers: Sequence[torch.Tensor], ids: Sequence[Sequence[np.ndarray]]) -> None:
        """Gather paged blocks into ``buffers`` (one per chunk); returns when the bytes are in L1."""
        flat = [np.concatenate(per_chunk) for per_chunk in ids]
        with self._lock:
            self.plan.store(list(buffers), flat)

    def retrieve(self, buffers: Sequence[torch.Tensor], ids: Sequence[Sequence[np.ndarray]]) -> None:
        """Scatter ``buffers`` (one per chunk) into paged blocks; returns when they are written."""
        flat = [np.concatenate(per_chunk) for per_chunk in ids]
        with self._lock:
            self.plan.retrieve(list(buffers), flat)


def build_mover(
    tensors: list[torch.Tensor],
    groups: list[EngineGroupInfo],
    tokens_per_chunk: int,
    *,
    layout_hints: Sequence[Mapping[str, object] | None] | None = None,
) -> ChunkMover:
    """Detect layouts, build and validate the kernel groups; ValueError names what disagrees."""
    formats: list[KVFormat] = []
    for i, t in enumerate(tensors):
        hints = layout_hints[i] if layout_hints is not None and i < len(layout_hints) else None
        try:
            formats.append(detect_kv_format(t, hints))
        except ValueError as e:
            raise ValueError(f"layers[{i}]: {e}") from None
    devices = {str(t.device) for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"layer tensors are on several devices {sorted(devices)}; expected one")
    manager = KVLayerGroupsManager(tensors, formats, groups, tokens_per_chunk=tokens_per_chunk)
    if not manager.kernel_groups:
        raise ValueError(
            "no kernel groups: every layer is excluded; expected at least one transferable layer"
        )
    return ChunkMover(manager, tensors, tokens_per_chunk)
