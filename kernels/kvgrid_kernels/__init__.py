"""kvgrid transfer kernels: paged KV blocks <-> contiguous chunk buffers (L1), for every kernel group.

``TransferPlan`` is the one API the agent uses (CPU: torch indexing; CUDA: Triton with staging +
pipelined DMA, or zero-copy writes to pinned memory). ``kvgrid bench transfer`` measures it.
"""

from .pages import ChunkLayout, KernelGroupPages, page_view
from .plan import TransferHandle, TransferPlan, format_page_view

__all__ = [
    "ChunkLayout",
    "KernelGroupPages",
    "TransferHandle",
    "TransferPlan",
    "format_page_view",
    "page_view",
]
