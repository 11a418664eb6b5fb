"""Results of the agent's Lookup, Retrieve and Store, shared by the agent's core (which returns them
in process) and the engine's client (:mod:`kvgrid.engine.client`, which rebuilds them from the wire).

Invariant: :class:`MissCause`'s values are the wire's ``miss_cause`` text and the metric label; a
cause this version does not know reads as ``not_found``.
"""

from __future__ import annotations

import enum

import msgspec

__all__ = ["LookupResult", "MissCause", "RetrieveResult", "StoreResult"]


class MissCause(enum.StrEnum):
    """Why a prefix walk stopped (also the metric label and the wire's ``miss_cause`` text)."""

    NONE = "none"
    NOT_FOUND = "not_found"
    LAYOUT_MISMATCH = "layout_mismatch"
    PEER_FAILED = "peer_failed"
    """A peer fetch of the next chunks failed (Lookup only; the hits are still valid)."""
    TIER_FAILED = "tier_failed"
    """The next chunk was being read back from a lower tier and that read failed (refused record,
    store error) or was cancelled: its bytes were never served (Retrieve, peer serving)."""

    @classmethod
    def from_wire(cls, text: str) -> MissCause:
        """The cause a response names ("" is none); one this version does not know (a newer
        agent's) reads as not_found: the walk stopped there either way."""
        try:
            return cls(text or "none")
        except ValueError:
            return cls.NOT_FOUND


class LookupResult(msgspec.Struct, frozen=True):
    num_hit_chunks: int
    """Leading chunks held (and pinned, when a request id was given)."""
    miss_cause: MissCause = MissCause.NONE
    """Why the walk stopped."""
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
    miss_cause: MissCause = MissCause.NONE
    """Why the leading chunks written stopped there."""
    chunk_offsets: list[int] = []
    """engine_copies: each retrieved chunk's byte offset in the agent's shared L1 file."""
    lease_id: int = 0
    """engine_copies: this Retrieve's lease (Release with it ends only this lease)."""
