"""kvgrid transfer kernels: paged KV blocks <-> contiguous chunk buffers (L1), for every kernel group.

``TransferPlan`` is the one API the agent uses (CPU: torch indexing; CUDA: Triton with staging +
pipelined DMA, or zero-copy writes to pinned memory) over ``KernelGroupPages`` (a
``KernelGroupGeometry`` and the page views of its layers). ``kvgrid bench transfer`` measures it.
This distribution imports nothing of kvgrid.
"""

from .geometry import KernelGroupGeometry
from .pages import ChunkLayout, KernelGroupPages, alignment, page_view
from .plan import TransferHandle, TransferPlan

__all__ = [
    "ChunkLayout",
    "KernelGroupGeometry",
    "KernelGroupPages",
    "TransferHandle",
    "TransferPlan",
    "alignment",
    "page_view",
]
