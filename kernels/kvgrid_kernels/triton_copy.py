"""The Triton page-copy kernel: one launch moves every page of every layer of one kernel group for any
number of chunks, between paged KV memory and chunk memory (a GPU staging buffer, GPU chunk buffers,
or pinned host chunk buffers written/read in place through unified addressing).

Addresses travel as word offsets from an ``anchor`` tensor: Triton knows the anchor is 16-byte
aligned and is told every offset is a multiple of ``ALIGN_W`` words, so loads and stores become
16-byte vector accesses whenever the geometry allows it (pointers loaded from a table would carry
no alignment and copy byte by byte).

Program ``(s, t)`` copies tile ``t`` of segment ``s``; segments run chunk-major, then layer, plane,
block, which is also the byte order of a chunk section (``ChunkLayout``).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

MAX_TILE_BYTES = 8192
NUM_WARPS = 4


@triton.jit
def _copy_pages(  # type: ignore[no-untyped-def]  # Triton reads annotations itself
    anchor,  # *word: 16-byte aligned; every address below is a word offset from it
    layer_off,  # *i64 [num_layers]: page (plane 0, block 0) of each layer
    plane_stride,  # *i64 [num_layers]
    block_stride,  # *i64 [num_layers]
    chunk_off,  # *i64 [num_chunks]: the group section of each chunk
    block_ids,  # *i64 [num_chunks * bpc]; < 0 = leave this page alone
    num_layers,
    planes,
    bpc,
    page_words,
    TO_CHUNK: tl.constexpr,
    TILE: tl.constexpr,
    ALIGN_W: tl.constexpr,
    EVEN: tl.constexpr,
):
    seg = tl.program_id(0)
    tile = tl.program_id(1)
    b = seg % bpc
    rest = seg // bpc
    p = rest % planes
    rest = rest // planes
    layer = rest % num_layers
    c = rest // num_layers
    bid = tl.load(block_ids + c * bpc + b)
    if bid >= 0:
        paged = (
            tl.load(layer_off + layer)
            + p * tl.load(plane_stride + layer)
            + bid * tl.load(block_stride + layer)
        )
        chunk = tl.load(chunk_off + c) + ((layer * planes + p) * bpc + b).to(tl.int64) * page_words
        paged = tl.multiple_of(paged, ALIGN_W)
        chunk = tl.multiple_of(chunk, ALIGN_W)
        offs = tile * TILE + tl.arange(0, TILE)
        if TO_CHUNK:
            src = anchor + paged
            dst = anchor + chunk
        else:
            src = anchor + chunk
            dst = anchor + paged
        if EVEN:
            x = tl.load(src + offs, cache_modifier=".cg")
            tl.store(dst + offs, x, cache_modifier=".cs")
        else:
            m = offs < page_words
            x = tl.load(src + offs, mask=m, cache_modifier=".cg")
            tl.store(dst + offs, x, mask=m, cache_modifier=".cs")


WORD_DTYPES = {4: torch.int32, 2: torch.int16, 1: torch.uint8}


def word_bytes_for(align: int) -> int:
    """The widest word (4, 2, 1 bytes) that divides ``align``."""
    for w in (4, 2, 1):
        if align % w == 0:
            return w
    return 1


# Compiled kernels by everything Triton specializes on (see ``_launch_key``), so a repeat launch skips
# Triton's argument binding and cache lookup (tens of us of host time per launch).
_COMPILED: dict[tuple[Any, ...], Any] = {}
_fast_launch = True


def _launch_key(
    ptrs: tuple[torch.Tensor, ...], ints: tuple[int, ...], consts: tuple[Any, ...]
) -> tuple[Any, ...]:
    # Finer than Triton's own key (pointer 16-byte alignment; ints ==1 and %16), so a cached kernel
    # is always the one Triton would pick for these arguments.
    return (
        ptrs[0].dtype,
        ptrs[0].device.index,
        *consts,
        *(t.data_ptr() % 16 == 0 for t in ptrs),
        *((v == 1, v % 16 == 0) for v in ints),
    )


def launch(
    *,
    anchor: torch.Tensor,
    layer_off: torch.Tensor,
    plane_stride: torch.Tensor,
    block_stride: torch.Tensor,
    chunk_off: torch.Tensor,
    block_ids: torch.Tensor,
    num_chunks: int,
    num_layers: int,
    planes: int,
    bpc: int,
    page_bytes: int,
    align: int,
    to_chunk: bool,
    stream: int | None = None,
) -> None:
    """Launch one copy on the current stream (``stream``: its raw handle, if the caller has it).
    ``align`` (bytes) must divide every address and stride; ``anchor``'s dtype is the word; offsets
    in the tables are in words."""
    global _fast_launch
    word = anchor.element_size()
    page_words = page_bytes // word
    tile = min(MAX_TILE_BYTES // word, triton.next_power_of_2(page_words))
    grid = (num_chunks * num_layers * planes * bpc, triton.cdiv(page_words, tile))
    ptrs = (anchor, layer_off, plane_stride, block_stride, chunk_off, block_ids)
    ints = (num_layers, planes, bpc, page_words)
    consts = (to_chunk, tile, max(1, align // word), page_words % tile == 0)
    key = _launch_key(ptrs, ints, consts)
    compiled = _COMPILED.get(key) if _fast_launch else None
    if compiled is not None:
        try:
            compiled[grid](*ptrs, *ints, *consts, stream=stream)
            return
        except Exception:  # a Triton whose launcher differs: use the regular path from now on
            _fast_launch = False
    kernel: Any = _copy_pages  # launches on the current stream: callers pass that one as ``stream``
    compiled = kernel[grid](
        *ptrs,
        *ints,
        TO_CHUNK=consts[0],
        TILE=consts[1],
        ALIGN_W=consts[2],
        EVEN=consts[3],
        num_warps=NUM_WARPS,
    )
    if _fast_launch and compiled is not None and hasattr(compiled, "__getitem__"):
        _COMPILED[key] = compiled
