"""Engine-neutral arithmetic of the connector: what to load, what to store, which blocks failed.

Pure functions over token counts, chunk counts and block-id lists, so the rules are tested
without an engine. Token ``t`` of a request lives in block ``t // tokens_per_block`` of every
engine group's block list; chunk ``c`` covers tokens ``[c * tokens_per_chunk, (c + 1) * tokens_per_chunk)``.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "NULL_BLOCK_ID",
    "failed_block_ids",
    "kv_identity",
    "loadable_chunks",
    "new_tokens_to_load",
    "storable_chunks",
]

# vLLM's block pool reserves block 0 as the shared "null" block (freed sliding-window slots point
# at it); it never holds a request's KV, so it is never reported as a failed load.
NULL_BLOCK_ID = 0


def kv_identity(
    *,
    dtype: str,
    layout: str,
    rank: int,
    world_size: int,
    tp_size: int,
    pp_size: int,
    extra: str = "",
) -> str:
    """The ``KeyNamespace.kv_identity`` text of one worker: what besides the model makes its KV bytes.

    Each worker rank holds a different shard (TP heads, PP layers), so the rank is part of it;
    ``extra`` is free text from the operator (e.g. a quantization recipe).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank}: expected 0 <= rank < world_size={world_size}")
    if tp_size * pp_size > world_size or tp_size < 1 or pp_size < 1:
        raise ValueError(
            f"tp_size={tp_size}, pp_size={pp_size}: expected positive sizes whose product is at most "
            f"world_size={world_size}"
        )
    text = f"dtype={dtype};layout={layout or 'auto'};rank={rank}/{world_size};tp={tp_size};pp={pp_size}"
    return f"{text};{extra}" if extra else text


def loadable_chunks(num_prompt_tokens: int, tokens_per_chunk: int) -> int:
    """Full chunks a load may cover: never the whole prompt, at least one token is left to compute
    (the engine needs a forward pass over the last prompt token to sample from)."""
    if tokens_per_chunk < 1:
        raise ValueError(f"tokens_per_chunk={tokens_per_chunk}: expected >= 1")
    return max(num_prompt_tokens - 1, 0) // tokens_per_chunk


def new_tokens_to_load(hit_chunks: int, tokens_per_chunk: int, num_computed_tokens: int) -> int:
    """Tokens the agent can supply beyond the engine's own ``num_computed_tokens`` (0 when none)."""
    return max(hit_chunks * tokens_per_chunk - num_computed_tokens, 0)


def storable_chunks(num_tokens_computed: int, num_prompt_tokens: int, tokens_per_chunk: int) -> int:
    """Full prompt chunks whose KV is complete once ``num_tokens_computed`` tokens are computed.

    Only prompt tokens are stored: their ids are final, while decode steps with speculative
    tokens may still roll KV back.
    """
    return min(num_tokens_computed, num_prompt_tokens) // tokens_per_chunk


def failed_block_ids(
    block_ids: Sequence[Sequence[int]],
    tokens_per_block: Sequence[int],
    *,
    start_token: int,
    end_token: int,
    skip_first_n_tokens: int = 0,
    groups: Sequence[int] | None = None,
) -> set[int]:
    """Block ids (of the given engine ``groups``; all by default) that hold tokens in
    ``[start_token, end_token)`` and were meant to be written by a load.

    Blocks wholly inside the first ``skip_first_n_tokens`` tokens are the engine's own prefix-cache
    hit (not written by the load, so not failed); the null block is never reported.
    """
    if len(tokens_per_block) != len(block_ids):
        raise ValueError(
            f"tokens_per_block has {len(tokens_per_block)} entries; expected one per block list "
            f"({len(block_ids)})"
        )
    out: set[int] = set()
    if end_token <= start_token:
        return out
    for g in range(len(block_ids)) if groups is None else groups:
        tpb = tokens_per_block[g]
        if tpb < 1:
            raise ValueError(f"tokens_per_block[{g}]={tpb}: expected >= 1")
        ids = block_ids[g]
        # A block partly inside the skipped prefix is still written by the load.
        first = max(start_token, skip_first_n_tokens) // tpb
        last = min(-(-end_token // tpb), len(ids))
        out.update(b for b in ids[first:last] if b != NULL_BLOCK_ID)
    return out
