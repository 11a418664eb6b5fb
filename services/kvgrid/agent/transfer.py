"""The agent's bridge to the transfer kernels: one :class:`ChunkMover` per registered instance.

It detects each layer's physical layout, rebuilds the kernel groups with
``KVLayerGroupsManager`` (which rejects infos that contradict the tensors), hands the kernels each
group's geometry with the page views of its layers (``kernel_group_pages``), and copies between the
engine's paged KV and L1 chunk buffers (uint8 views into the pool, ``bytes_per_chunk`` each, laid
out as ``kvgrid_kernels.pages.ChunkLayout`` says).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from kvgrid.common.errors import InvalidArgument, client_input
from kvgrid.common.groups import EngineGroupInfo, expand_engine_block_ids, num_engine_groups
from kvgrid.common.layer_groups import KVLayerGroupsManager
from kvgrid.common.layouts import KVFormat, block_view, detect_kv_format
from kvgrid.common.tensor_wire import dtype_name
from kvgrid_kernels import KernelGroupPages, TransferHandle, TransferPlan, page_view

__all__ = [
    "ChunkMover",
    "DoneSignal",
    "build_mover",
    "chunk_block_ids",
    "format_page_view",
    "kernel_group_pages",
    "parse_layout_hints",
]

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


def format_page_view(tensor: torch.Tensor, kv_format: KVFormat) -> torch.Tensor:
    """Page view (``kvgrid_kernels.page_view``) of a layer tensor in ``kv_format``.

    Whole blocks are one page when they are dense (FlashInfer, unified NHD/HND, MLA, opaque pages);
    FlashAttention's separate K/V planes become 2 planes; head-major blocks become one plane per head.
    """
    view = block_view(tensor, kv_format)  # [NB, kv_size, X, Y, Z], X..Z in physical order
    errors = []
    for plane_dim in (None, 1, 2):
        try:
            return page_view(view, 0, plane_dim)
        except ValueError as e:
            errors.append(str(e))
    raise ValueError(f"layer tensor in format {kv_format} has no dense pages: {errors[-1]}")


def kernel_group_pages(
    manager: KVLayerGroupsManager, kv_caches: Sequence[torch.Tensor] | Mapping[str, torch.Tensor]
) -> list[KernelGroupPages]:
    """The kernels' view of every kernel group of ``manager``, built over the same registered layer
    tensors (a list, or a name -> tensor mapping in registration order). Each group keeps the
    manager's geometry, so plan and manager agree on every chunk size by construction."""
    tensors = list(kv_caches.values()) if isinstance(kv_caches, Mapping) else list(kv_caches)
    groups = []
    for i, info in enumerate(manager.kernel_groups):
        if info.kv_format is None:
            raise ValueError(f"kernel group {i} has no kv_format: expected a manager built from tensors")
        views = tuple(format_page_view(tensors[layer], info.kv_format) for layer in info.layer_indices)
        groups.append(
            KernelGroupPages(
                views, info.shape, name=f"kernel group {i} (engine group {info.engine_group_idx})"
            )
        )
    return groups


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
        self.plan = TransferPlan(kernel_group_pages(manager, tensors), tokens_per_chunk)
        # A plan serves one call at a time (it owns staging buffers and streams).
        self._lock = threading.Lock()
        self.layout = self.plan.layout
        desc = repr(
            (
                tokens_per_chunk,
                [
                    (
                        str(kg.kv_format),
                        dtype_name(kg.dtype),
                        kg.tokens_per_block,
                        kg.slots_per_block,
                        kg.num_layers,
                        p.planes,
                        p.page_bytes,
                    )
                    for kg, p in zip(manager.kernel_groups, self.plan.groups, strict=True)
                ],
            )
        )
        self.layout_id = hashlib.blake2b(desc.encode(), digest_size=8).hexdigest()

    @property
    def bytes_per_chunk(self) -> int:
        return self.layout.bytes_per_chunk

    def store(
        self,
        buffers: Sequence[torch.Tensor],
        ids: Sequence[Sequence[np.ndarray]],
        *,
        wait_event: torch.cuda.Event | None = None,
    ) -> None:
        """Gather paged blocks into ``buffers`` (one per chunk); returns when the bytes are in L1.
        ``wait_event``: the engine's fence -- the copy starts on the GPU once the engine's stream
        has passed it (the host waits here only for the copy itself)."""
        flat = [np.concatenate(per_chunk) for per_chunk in ids]
        with self._lock:
            self.plan.store_async(list(buffers), flat, wait_event=wait_event).wait()

    def retrieve(
        self,
        buffers: Sequence[torch.Tensor],
        ids: Sequence[Sequence[np.ndarray]],
        *,
        wait_event: torch.cuda.Event | None = None,
    ) -> None:
        """Scatter ``buffers`` (one per chunk) into paged blocks; returns when they are written
        (after ``wait_event``, as in :meth:`store`)."""
        self.retrieve_async(buffers, ids, wait_event=wait_event).wait()

    def retrieve_async(
        self,
        buffers: Sequence[torch.Tensor],
        ids: Sequence[Sequence[np.ndarray]],
        *,
        wait_event: torch.cuda.Event | None = None,
    ) -> TransferHandle:
        """Queue the scatter and return at once; the handle completes with it. ``buffers`` must
        stay valid (referenced) until then. The plan queues calls in order on its own streams."""
        flat = [np.concatenate(per_chunk) for per_chunk in ids]
        with self._lock:
            return self.plan.retrieve_async(list(buffers), flat, wait_event=wait_event)


class DoneSignal:
    """The engine's ``done_event``, recorded by the agent once a Retrieve's copies landed, on a
    stream of its own (the engine's stream waits for the event on the GPU; nobody's host does)."""

    def __init__(self, event: torch.cuda.Event, device: torch.device) -> None:
        self.event = event
        self.stream = torch.cuda.Stream(device=device)
        self._lock = threading.Lock()

    def after(self, handle: TransferHandle | None) -> None:
        """Record the event once ``handle`` completed (at once when there was nothing to move).
        Calls are ordered: a record made later covers every earlier one."""
        with self._lock:
            if handle is not None:
                handle.wait_stream(self.stream)
            self.event.record(self.stream)


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


def chunk_block_ids(
    mover: ChunkMover,
    groups: Sequence[EngineGroupInfo],
    block_ids: Sequence[Sequence[int]],
    chunks: range,
    skip_first_n_tokens: int = 0,
    *,
    allow_holes: bool = False,
    who: str = "the engine",
) -> list[list[np.ndarray]]:
    """Per kernel group, per chunk in ``chunks``: the block ids ``mover``'s copy uses (the agent's
    check of a request, and an engine copying itself over the agent's shared L1).

    ``block_ids`` holds one list per engine group (covering the request from token 0). Blocks
    that lie wholly inside the first ``skip_first_n_tokens`` tokens become -1 (not copied).
    With ``allow_holes`` (retrieve) an id of -1 is a hole: the engine keeps no block there (a
    sliding-window group outside its window), so nothing is written there; a store must name
    every block it gathers.
    """
    if groups:
        n_groups = num_engine_groups(groups)
        if len(block_ids) != n_groups:
            raise InvalidArgument(
                f"block_ids has {len(block_ids)} lists; {who} registered "
                f"{n_groups} engine groups: expected one list per engine group"
            )
        with client_input():
            per_info = expand_engine_block_ids(groups, [list(b) for b in block_ids])
    else:
        if len(block_ids) != 1:
            raise InvalidArgument(
                f"block_ids has {len(block_ids)} lists; {who} registered a "
                f"single non-hybrid group, so expected exactly 1"
            )
        per_info = [list(block_ids[0])]
    out: list[list[np.ndarray]] = []
    manager = mover.manager
    for k, kg in enumerate(manager.kernel_groups):
        info = manager.info_index(k)
        ids = np.asarray(per_info[info], dtype=np.int64)
        bpc = manager.blocks_per_chunk(k)
        need = chunks.stop * bpc
        if len(ids) < need:
            raise InvalidArgument(
                f"block_ids for info {info} (engine group {kg.engine_group_idx}) has "
                f"{len(ids)} ids; "
                f"{chunks.stop} chunks of {mover.tokens_per_chunk} tokens need {need} "
                f"({bpc} per chunk at {kg.tokens_per_block} tokens per block)"
            )
        used = ids[chunks.start * bpc : need]
        num_blocks = kg.shape.num_blocks
        bad = (used < (-1 if allow_holes else 0)) | (used >= num_blocks)
        if bad.any():
            j = int(np.argmax(bad))
            raise InvalidArgument(
                f"block_ids for info {info} (engine group {kg.engine_group_idx}): id "
                f"{int(used[j])} at position {chunks.start * bpc + j} is outside "
                f"[0, {num_blocks}) (the layer tensors' num_blocks)"
                + ("; -1 marks a hole" if allow_holes else "")
            )
        # One [chunks, bpc] array (a copy: the skip below writes it); its rows are the chunks.
        rows = ids[chunks.start * bpc : chunks.stop * bpc].reshape(len(chunks), bpc).copy()
        if skip_first_n_tokens:
            first_token = (
                np.arange(chunks.start, chunks.stop)[:, None] * mover.tokens_per_chunk
                + np.arange(bpc)[None, :] * kg.tokens_per_block
            )
            rows[first_token + kg.tokens_per_block <= skip_first_n_tokens] = -1
        if allow_holes:  # a retrieve writes each block once (the kernel plan refuses repeats too)
            written = rows[rows >= 0]
            values, counts = np.unique(written, return_counts=True)
            if (counts > 1).any():
                raise InvalidArgument(
                    f"block_ids for info {info} (engine group {kg.engine_group_idx}) repeats block id "
                    f"{int(values[np.argmax(counts > 1)])}: a retrieve writes each block once; expected "
                    f"distinct ids"
                )
        out.append(list(rows))
    return out
