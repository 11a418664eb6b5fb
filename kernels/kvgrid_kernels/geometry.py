"""The geometry of one kernel group, and the one place that says how many blocks, slots and bytes a
chunk of it takes.

A *kernel group* is a set of layers whose paged KV buffers have the same shape and dtype and read
block ids from the same engine block-id space, so one launch (and one block-id list) moves them
all. :class:`KernelGroupGeometry` describes it; kvgrid's ``KVLayerGroupInfo`` (built from the
engine's real tensors) and the kernels' ``KernelGroupPages`` (the page views the copies run on)
both hold one, so chunk sizes are computed here and nowhere else.

Invariants, checked on construction: every size is positive; ``kv_size`` is 1 or 2;
``tokens_per_block`` (logical tokens one block id covers) is a multiple of ``block_size`` (physical
slots per block): a slot holds a whole number of tokens, the *compression*. Compression never
changes the bytes of a block, only how many blocks a chunk spans.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["KernelGroupGeometry"]


@dataclass(frozen=True)
class KernelGroupGeometry:
    """Shape of one kernel group's paged buffers (every layer alike) and its chunk arithmetic."""

    kv_size: int
    """2 for separate K and V planes, else 1."""
    num_layers: int
    num_blocks: int
    block_size: int
    """Physical slots per block, read from the tensor (``slots_per_block``)."""
    num_heads: int
    head_size: int
    """Elements per head per slot (content C for fused K|V, page elements for opaque pages)."""
    dtype: torch.dtype
    """Element type (the size alone cannot tell bfloat16 from float16)."""
    tokens_per_block: int = 0
    """Logical tokens per block id (from the engine); 0 = ``block_size`` (no compression)."""
    block_stride: int = 0
    """Elements between block b and b+1 of one layer (the same for every layer of the group);
    0 = unknown (e.g. a shape spec), read it as tight."""

    def __post_init__(self) -> None:
        if self.tokens_per_block == 0:
            object.__setattr__(self, "tokens_per_block", self.block_size)
        sizes = {
            "num_layers": self.num_layers,
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "num_heads": self.num_heads,
            "head_size": self.head_size,
            "tokens_per_block": self.tokens_per_block,
        }
        bad = {k: v for k, v in sizes.items() if v <= 0}
        if bad:
            raise ValueError(f"kernel group geometry {bad}: expected every size > 0")
        if self.kv_size not in (1, 2):
            raise ValueError(f"kv_size={self.kv_size}: expected 1 (one plane) or 2 (K and V)")
        if self.tokens_per_block % self.block_size:
            raise ValueError(
                f"tokens_per_block={self.tokens_per_block} must be a multiple of "
                f"slots_per_block={self.block_size} (whole tokens per slot)"
            )

    @classmethod
    def of_pages(
        cls,
        num_layers: int,
        num_blocks: int,
        bytes_per_block: int,
        tokens_per_block: int,
        slots_per_block: int = 0,
    ) -> KernelGroupGeometry:
        """Geometry of byte pages with no KV structure: ``slots_per_block`` (0 = ``tokens_per_block``)
        slots of ``bytes_per_block / slots`` uint8 elements each, one plane, one head."""
        slots = slots_per_block or tokens_per_block
        if slots <= 0 or bytes_per_block % slots:
            raise ValueError(
                f"bytes_per_block={bytes_per_block}: expected a multiple of slots_per_block={slots} > 0"
            )
        return cls(
            kv_size=1,
            num_layers=num_layers,
            num_blocks=num_blocks,
            block_size=slots,
            num_heads=1,
            head_size=bytes_per_block // slots,
            dtype=torch.uint8,
            tokens_per_block=tokens_per_block,
        )

    @property
    def element_size(self) -> int:
        """Bytes per element."""
        return self.dtype.itemsize

    @property
    def slots_per_block(self) -> int:
        return self.block_size

    @property
    def compression(self) -> int:
        """Logical tokens packed in one slot: ``tokens_per_block // slots_per_block`` (1 = none)."""
        return self.tokens_per_block // self.block_size

    @property
    def bytes_per_block(self) -> int:
        """Payload bytes of one block of one layer (K and V together)."""
        return self.kv_size * self.block_size * self.num_heads * self.head_size * self.element_size

    def blocks_per_chunk(self, num_tokens: int) -> int:
        """Block ids covering ``num_tokens`` tokens; ValueError unless a whole number of blocks."""
        if num_tokens < 0 or num_tokens % self.tokens_per_block:
            raise ValueError(
                f"num_tokens={num_tokens}: expected a non-negative multiple of tokens_per_block="
                f"{self.tokens_per_block}"
            )
        return num_tokens // self.tokens_per_block

    def slots_per_chunk(self, num_tokens: int) -> int:
        """Physical slots holding ``num_tokens`` tokens; ValueError unless a whole number of slots."""
        if num_tokens < 0 or (num_tokens * self.block_size) % self.tokens_per_block:
            raise ValueError(
                f"num_tokens={num_tokens}: expected a non-negative multiple of the compression "
                f"{self.tokens_per_block}/{self.block_size} tokens per slot"
            )
        return num_tokens * self.block_size // self.tokens_per_block

    def bytes_per_chunk(self, tokens_per_chunk: int) -> int:
        """Payload bytes of one chunk of ``tokens_per_chunk`` tokens over every layer of the group."""
        return self.num_layers * self.blocks_per_chunk(tokens_per_chunk) * self.bytes_per_block
