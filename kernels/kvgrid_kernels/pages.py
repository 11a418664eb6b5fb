"""Paged KV tensors seen as opaque byte pages, the kernel groups the copies run on, and the byte
layout of a chunk buffer.

The transfer kernels never interpret KV bytes. Every layer tensor of a kernel group is reduced to a
*page view*: a ``uint8`` tensor of shape ``[planes, num_blocks, page_bytes]`` whose last axis is
contiguous. A page is all bytes of one block of one plane (K or V) of one layer; ``planes`` is 2 for
layouts that keep K and V in separate planes (legacy FlashAttention ``[2, NB, BS, H, D]``) and 1
otherwise (vLLM's unified ``[B, H, N, C]`` layouts, MLA ``[NB, BS, HS]``, byte-opaque pages, and
FlashInfer ``[NB, 2, BS, H, D]``, whose K and V planes of a block are adjacent and are merged into one
page). Any layout whose pages are dense regions works: HND/NHD, cross-layer tensors (a per-layer view
into one tensor), compressed groups (``slots_per_block < tokens_per_block``: a block simply holds
fewer slots) and padded block strides.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .geometry import KernelGroupGeometry


def page_view(tensor: torch.Tensor, block_dim: int, plane_dim: int | None = None) -> torch.Tensor:
    """Return ``tensor`` as a ``uint8`` view ``[planes, num_blocks, page_bytes]`` over the same memory.

    ``block_dim`` is the axis that block ids index; ``plane_dim`` (optional) is the K/V plane axis.
    The remaining axes must cover one dense region (any order of strides, e.g. NHD or HND), else
    ``ValueError``. Planes that are adjacent in memory are merged into a single page.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"page_view expects a torch.Tensor, got {type(tensor).__name__}")
    nd = tensor.dim()
    block_dim = _axis(block_dim, nd, "block_dim")
    if plane_dim is not None:
        plane_dim = _axis(plane_dim, nd, "plane_dim")
        if plane_dim == block_dim:
            raise ValueError(f"plane_dim {plane_dim} must differ from block_dim {block_dim}")
    if tensor.size(block_dim) == 0:
        raise ValueError(f"tensor of shape {tuple(tensor.shape)} has no blocks on axis {block_dim}")
    # The axes inside a page must tile one dense region: sorted by stride, each stride equals the
    # product of the sizes below it.
    inner = sorted(
        (tensor.stride(d), tensor.size(d))
        for d in range(nd)
        if d not in (block_dim, plane_dim) and tensor.size(d) != 1
    )
    page_elems = 1
    for stride, size in inner:
        if stride != page_elems:
            raise ValueError(
                f"tensor of shape {tuple(tensor.shape)} and strides {tensor.stride()} does not hold "
                f"each (plane, block) page in one dense region (block_dim={block_dim}, "
                f"plane_dim={plane_dim}); expected stride {page_elems}, got {stride}"
            )
        page_elems *= size
    planes = tensor.size(plane_dim) if plane_dim is not None else 1
    plane_stride = tensor.stride(plane_dim) if plane_dim is not None else 0
    if planes > 1 and plane_stride == page_elems:
        page_elems *= planes  # K|V of a block are adjacent: one page
        planes, plane_stride = 1, 0
    if planes == 1:
        plane_stride = 0
    el = tensor.element_size()
    raw = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    raw.set_(tensor.untyped_storage(), 0, (tensor.untyped_storage().nbytes(),), (1,))
    return raw.as_strided(
        (planes, tensor.size(block_dim), page_elems * el),
        (plane_stride * el, tensor.stride(block_dim) * el, 1),
        tensor.storage_offset() * el,
    )


def _axis(dim: int, nd: int, name: str) -> int:
    if not -nd <= dim < nd:
        raise ValueError(f"{name}={dim} is out of range for a {nd}-D tensor")
    return dim % nd


def _check_page_view(view: torch.Tensor, where: str) -> None:
    if not isinstance(view, torch.Tensor):
        raise TypeError(f"{where}: expected a page view tensor, got {type(view).__name__}")
    if view.dtype != torch.uint8 or view.dim() != 3 or view.stride(2) != 1:
        raise ValueError(
            f"{where}: expected a uint8 page view [planes, num_blocks, page_bytes] with a contiguous "
            f"last axis, got dtype {view.dtype}, shape {tuple(view.shape)}, strides {view.stride()}"
        )


def alignment(*values: int) -> int:
    """Largest power of two <= 16 dividing every value (addresses, strides, sizes in bytes): the
    widest vector access a copy over them may use."""
    a = 16
    for v in values:
        a = math.gcd(a, int(v))
    return a


@dataclass(frozen=True, eq=False)
class KernelGroupPages:
    """One kernel group as the copies see it: its geometry and the same-shaped page views of its
    layers (``geometry.num_layers`` of them, ``geometry.num_blocks`` blocks each).

    The views must hold exactly ``geometry.bytes_per_block`` bytes per block (``planes *
    page_bytes``), so a chunk's bytes are ``geometry.bytes_per_chunk`` whichever side computes them.
    """

    layers: tuple[torch.Tensor, ...]
    geometry: KernelGroupGeometry
    name: str = ""

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError(f"kernel group {self.name!r} has no layers")
        first = self.layers[0]
        for i, view in enumerate(self.layers):
            _check_page_view(view, f"kernel group {self.name!r} layer {i}")
            if view.shape != first.shape or view.device != first.device:
                raise ValueError(
                    f"kernel group {self.name!r} layer {i} has page view shape {tuple(view.shape)} on "
                    f"{view.device}; expected {tuple(first.shape)} on {first.device} like layer 0"
                )
        geo = self.geometry
        planes, num_blocks, page_bytes = (int(s) for s in first.shape)
        if (len(self.layers), num_blocks, planes * page_bytes) != (
            geo.num_layers,
            geo.num_blocks,
            geo.bytes_per_block,
        ):
            raise ValueError(
                f"kernel group {self.name!r}: {len(self.layers)} page views of {num_blocks} blocks x "
                f"{planes * page_bytes} bytes; its geometry expects {geo.num_layers} x {geo.num_blocks} x "
                f"{geo.bytes_per_block} (padded or non-dense KV pages are not supported)"
            )

    @classmethod
    def from_tensors(
        cls,
        tensors: Sequence[torch.Tensor],
        *,
        block_dim: int,
        plane_dim: int | None = None,
        tokens_per_block: int,
        slots_per_block: int = 0,
        name: str = "",
    ) -> KernelGroupPages:
        """Build a group of opaque pages from per-layer tensors of one layout (see :func:`page_view`)."""
        return cls.from_views(
            tuple(page_view(t, block_dim, plane_dim) for t in tensors),
            tokens_per_block=tokens_per_block,
            slots_per_block=slots_per_block,
            name=name,
        )

    @classmethod
    def from_views(
        cls,
        views: Sequence[torch.Tensor],
        *,
        tokens_per_block: int,
        slots_per_block: int = 0,
        name: str = "",
    ) -> KernelGroupPages:
        """A group of opaque pages (:meth:`KernelGroupGeometry.of_pages`) over page views."""
        if not views:
            raise ValueError(f"kernel group {name!r} has no layers")
        _check_page_view(views[0], f"kernel group {name!r} layer 0")
        planes, num_blocks, page_bytes = (int(s) for s in views[0].shape)
        try:
            geometry = KernelGroupGeometry.of_pages(
                len(views), num_blocks, planes * page_bytes, tokens_per_block, slots_per_block
            )
        except ValueError as e:
            raise ValueError(f"kernel group {name!r}: {e}") from None
        return cls(tuple(views), geometry, name)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def planes(self) -> int:
        return int(self.layers[0].shape[0])

    @property
    def num_blocks(self) -> int:
        return self.geometry.num_blocks

    @property
    def page_bytes(self) -> int:
        return int(self.layers[0].shape[2])

    @property
    def tokens_per_block(self) -> int:
        return self.geometry.tokens_per_block

    @property
    def device(self) -> torch.device:
        return self.layers[0].device

    def page_alignment(self) -> int:
        """:func:`alignment` of every page address and stride of the group (bytes)."""
        return alignment(
            self.page_bytes,
            *(v.data_ptr() for v in self.layers),
            *(v.stride(0) for v in self.layers),
            *(v.stride(1) for v in self.layers),
        )


@dataclass(frozen=True)
class ChunkLayout:
    """Where each page of a chunk lives in a chunk buffer.

    A chunk buffer is ``bytes_per_chunk`` contiguous bytes: the kernel groups one after another (in
    plan order, no padding); inside group ``g`` (offset ``group_offsets[g]``), layer by layer (group
    layer order), plane by plane, block by block (block order of the chunk), one page each::

        offset(g, layer i, plane p, block b) = group_offsets[g]
                                               + ((i * planes_g + p) * blocks_per_chunk_g + b) * page_bytes_g

    The bytes are only meaningful to a plan of the same geometry and layout (the namespace's
    ``kv_identity`` must name them).
    """

    tokens_per_chunk: int
    group_offsets: tuple[int, ...]
    group_bytes: tuple[int, ...]
    blocks_per_chunk: tuple[int, ...]
    page_bytes: tuple[int, ...]
    planes: tuple[int, ...]
    num_layers: tuple[int, ...]

    @classmethod
    def of(cls, groups: Sequence[KernelGroupPages], tokens_per_chunk: int) -> ChunkLayout:
        if tokens_per_chunk <= 0:
            raise ValueError(f"tokens_per_chunk={tokens_per_chunk}: expected > 0")
        offsets, sizes, blocks = [], [], []
        off = 0
        for g in groups:
            try:
                blocks.append(g.geometry.blocks_per_chunk(tokens_per_chunk))
            except ValueError:
                raise ValueError(
                    f"tokens_per_chunk={tokens_per_chunk} must be a multiple of kernel group {g.name!r}'s "
                    f"tokens_per_block={g.tokens_per_block}"
                ) from None
            offsets.append(off)
            sizes.append(g.geometry.bytes_per_chunk(tokens_per_chunk))
            off += sizes[-1]
        return cls(
            tokens_per_chunk=tokens_per_chunk,
            group_offsets=tuple(offsets),
            group_bytes=tuple(sizes),
            blocks_per_chunk=tuple(blocks),
            page_bytes=tuple(g.page_bytes for g in groups),
            planes=tuple(g.planes for g in groups),
            num_layers=tuple(g.num_layers for g in groups),
        )

    @property
    def bytes_per_chunk(self) -> int:
        return sum(self.group_bytes)

    def page_offset(self, group: int, layer: int, plane: int, block: int) -> int:
        return (
            self.group_offsets[group]
            + ((layer * self.planes[group] + plane) * self.blocks_per_chunk[group] + block)
            * self.page_bytes[group]
        )

    def layer_bytes(self, group: int) -> int:
        """Bytes of one layer (all planes, all blocks) of ``group`` in a chunk."""
        return self.group_bytes[group] // self.num_layers[group]
