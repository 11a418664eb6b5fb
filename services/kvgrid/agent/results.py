"""Results of the agent's operations, shared by the core (in-process) and the engine-side client."""

from __future__ import annotations

import msgspec

__all__ = ["LookupResult", "RetrieveResult", "StoreResult"]


class LookupResult(msgspec.Struct, frozen=True):
    num_hit_chunks: int
    """Leading chunks held (and pinned, when a request id was given)."""
    miss_cause: str = "none"
    """Why the walk stopped: none, not_found, layout_mismatch or peer_failed."""
    num_peer_chunks: int = 0
    """Of the hits, how many this lookup fetched from a peer agent."""
    chunk_offsets: list[int] = msgspec.field(default_factory=list)
    """A lease's hit chunks: their byte offsets in the agent's shared L1 file."""
    lease_id: int = 0
    """The lease a Lookup with ``lease`` took (0: none; Retrieve the chunks instead)."""
    l1_file: str = ""
    """With a lease: the shared L1 file its offsets are in."""


class StoreResult(msgspec.Struct, frozen=True):
    num_stored_chunks: int
    """Leading chunks now held in L1 (already present ones included)."""
    num_already_present: int
    bytes_moved: int
    partial_reason: str = ""
    """Why fewer chunks than asked are held (empty when all are)."""
    store_id: int = 0
    """engine_copies, reserving: the store a second Store finishes (0: nothing to copy, final)."""
    copy_chunk_indices: list[int] = []
    """engine_copies, reserving: the chunks the engine copies (indices into the keys) ..."""
    chunk_offsets: list[int] = []
    """... and where each goes in the shared L1 file."""


class RetrieveResult(msgspec.Struct, frozen=True):
    hit_mask: list[bool]
    """One entry per requested chunk; True for the leading chunks written."""
    num_retrieved_chunks: int
    bytes_moved: int
    miss_cause: str = "none"
    chunk_offsets: list[int] = []
    """engine_copies: each retrieved chunk's byte offset in the agent's shared L1 file."""
    lease_id: int = 0
    """engine_copies: this Retrieve's lease (Release with it ends only this lease)."""
