"""Engine-neutral view of an engine's KV cache groups (``docs/hybrid-groups.md``).

Three levels, from the engine down to the transfer kernels:

1. *Engine group*: one paged block-id address space of the engine (vLLM
   ``KVCacheConfig.kv_cache_groups[i]``). A block id only means something inside its group.
2. *Info* (:class:`EngineGroupInfo`): the layers of one engine group that share one physical
   transfer identity. One engine group may split into several infos (e.g. a 5-D K/V cache and a
   3-D key-only cache in one group). ``list[EngineGroupInfo]`` is the registration contract; its
   order is the protocol-visible group order, and store/retrieve carry one block-id list per info.
   An empty list means a single, non-hybrid group.
3. *Kernel group* (``kvgrid.common.layer_groups``): derived by the agent from the real tensors;
   never on the wire.

The token is the unit every group shares, so all range accounting is in tokens and each group
converts with its own ``tokens_per_block`` (:func:`slice_block_ids_per_group`).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgspec
from msgspec.structs import force_setattr

from kvgrid.api.v1 import common_pb2

__all__ = [
    "EXCLUDED_ENGINE_GROUP",
    "EngineGroupInfo",
    "engine_group_ids_per_info",
    "engine_group_tokens_per_block",
    "expand_engine_block_ids",
    "from_proto",
    "get_engine_group_indices",
    "num_engine_group_infos",
    "num_engine_groups",
    "slice_block_ids_per_group",
    "to_proto",
]

# Layers that reuse another layer's KV tensor (cross-layer KV sharing) belong to no info: the
# owner's blocks already hold their KV, so moving them again would duplicate work and, if their
# block size differs, break the per-group block counts.
EXCLUDED_ENGINE_GROUP = -1


class EngineGroupInfo(msgspec.Struct, frozen=True):
    """The layers of one engine group that share one transfer identity.

    New fields are only ever appended, always with a default, so an older payload decodes to the
    defaults and an older reader ignores what it does not know.
    """

    engine_group_id: int
    """Engine block-id space this info reads block ids from (>= 0)."""
    layer_indices: tuple[int, ...] = ()
    """Registered layer indices (positions in the registration order), strictly ascending."""
    tokens_per_block: int = 0
    """Logical tokens one engine block id covers; 0 = unknown (treated as uncompressed)."""
    sw_size_tokens: int = -1
    """Sliding window in tokens; -1 = full attention."""
    extra_object_group_tag: int = 0
    """Connector-private bucket that forces a separate object group (0 = none)."""
    recurrent_state: bool = False
    """Recurrent (Mamba-like) state snapshots: only the last block of a prefix matters."""

    def __post_init__(self) -> None:
        # Lists are accepted for convenience; store a tuple so the struct stays hashable.
        if not isinstance(self.layer_indices, tuple):
            force_setattr(self, "layer_indices", tuple(self.layer_indices))
        if self.engine_group_id < 0:
            raise ValueError(
                f"engine_group_id={self.engine_group_id}: expected >= 0 "
                f"(layers excluded from transfer, id {EXCLUDED_ENGINE_GROUP}, get no info)"
            )
        prev = -1
        for layer in self.layer_indices:
            if layer <= prev:
                raise ValueError(
                    f"layer_indices={self.layer_indices}: expected non-negative, strictly ascending "
                    f"layer indices"
                )
            prev = layer
        if self.tokens_per_block < 0:
            raise ValueError(f"tokens_per_block={self.tokens_per_block}: expected >= 0 (0 = unknown)")
        if self.sw_size_tokens != -1 and self.sw_size_tokens <= 0:
            raise ValueError(
                f"sw_size_tokens={self.sw_size_tokens}: expected -1 (full attention) or a positive window"
            )
        if self.extra_object_group_tag < 0:
            raise ValueError(f"extra_object_group_tag={self.extra_object_group_tag}: expected >= 0")


def num_engine_groups(groups: Sequence[EngineGroupInfo]) -> int:
    """Number of engine block-id lists a transfer request carries (1 when ``groups`` is empty)."""
    if not groups:
        return 1
    return max(g.engine_group_id for g in groups) + 1


def num_engine_group_infos(groups: Sequence[EngineGroupInfo]) -> int:
    """Number of protocol-visible groups (infos); 1 when ``groups`` is empty."""
    return len(groups) if groups else 1


def engine_group_ids_per_info(groups: Sequence[EngineGroupInfo]) -> tuple[int, ...]:
    """Element i is the engine group whose block ids info i reads: the only bridge between
    protocol order and engine group ids. ``(0,)`` when ``groups`` is empty."""
    if not groups:
        return (0,)
    return tuple(g.engine_group_id for g in groups)


def engine_group_tokens_per_block(groups: Sequence[EngineGroupInfo]) -> list[int]:
    """``tokens_per_block`` per engine group id (index = id); 0 for ids no info covers.

    Raises ValueError if two infos of one engine group disagree (one engine group has one
    block size).
    """
    if not groups:
        return [0]
    out = [0] * num_engine_groups(groups)
    seen: set[int] = set()
    for g in groups:
        gid = g.engine_group_id
        if gid in seen and out[gid] != g.tokens_per_block:
            raise ValueError(
                f"engine group {gid}: infos disagree on tokens_per_block "
                f"({out[gid]} vs {g.tokens_per_block}); one engine group has one block size"
            )
        seen.add(gid)
        out[gid] = g.tokens_per_block
    return out


def _int_list(ids: Iterable[Any], what: str) -> list[int]:
    try:
        return [operator.index(i) for i in ids]
    except TypeError:
        raise TypeError(f"{what}: expected a sequence of ints, got {ids!r}") from None


def _is_flat(block_ids: Sequence[object]) -> bool:
    if not block_ids:
        return True
    first = block_ids[0]
    return not isinstance(first, Sequence | Iterable) or isinstance(first, str | bytes)


def expand_engine_block_ids(
    groups: Sequence[EngineGroupInfo],
    engine_block_ids: Sequence[Sequence[int]] | Sequence[int],
) -> list[list[int]]:
    """Re-index block ids from per engine group to per info (one fresh list per info).

    ``engine_block_ids[g]`` are the ids of engine group ``g`` (as vLLM hands them over, one list
    per KV cache group). A flat sequence of ints is the legacy single-group form and is accepted
    only when there is a single engine group. With ``groups`` empty the result has one list.
    """
    ids_per_info = engine_group_ids_per_info(groups)
    if _is_flat(engine_block_ids):
        if num_engine_groups(groups) != 1:
            raise ValueError(
                f"engine_block_ids is a flat list (legacy single-group form) but the infos span "
                f"{num_engine_groups(groups)} engine groups; expected one list per engine group"
            )
        flat = _int_list(engine_block_ids, "engine_block_ids")
        return [list(flat) for _ in ids_per_info]
    per_group = [
        _int_list(ids, f"engine_block_ids[{i}]")  # type: ignore[arg-type]
        for i, ids in enumerate(engine_block_ids)
    ]
    if not groups and len(per_group) != 1:
        raise ValueError(
            f"engine_block_ids has {len(per_group)} lists but no engine-group infos were registered "
            f"(single non-hybrid group); expected exactly 1 list"
        )
    out: list[list[int]] = []
    for info_idx, gid in enumerate(ids_per_info):
        if gid >= len(per_group):
            raise ValueError(
                f"info {info_idx} reads engine group {gid} but engine_block_ids has only "
                f"{len(per_group)} lists; expected one list per engine group"
            )
        out.append(list(per_group[gid]))
    return out


def get_engine_group_indices(groups: Sequence[EngineGroupInfo], num_layers: int) -> list[int]:
    """Per registered layer, the engine group id its info reads block ids from.

    Layers no info covers (cross-layer KV sharing) get :data:`EXCLUDED_ENGINE_GROUP`. With
    ``groups`` empty every layer is in engine group 0 (single non-hybrid group).
    """
    if num_layers < 0:
        raise ValueError(f"num_layers={num_layers}: expected >= 0")
    if not groups:
        return [0] * num_layers
    out = [EXCLUDED_ENGINE_GROUP] * num_layers
    owner: dict[int, int] = {}
    for info_idx, g in enumerate(groups):
        for layer in g.layer_indices:
            if not 0 <= layer < num_layers:
                raise ValueError(
                    f"info {info_idx} (engine group {g.engine_group_id}) lists layer {layer}, "
                    f"outside registered layer range [0, {num_layers})"
                )
            if layer in owner:
                raise ValueError(
                    f"layer {layer} is listed by info {owner[layer]} and info {info_idx}; "
                    f"expected each layer in at most one info"
                )
            owner[layer] = info_idx
            out[layer] = g.engine_group_id
    return out


def slice_block_ids_per_group(
    allocated: Mapping[int, Sequence[int]] | Sequence[Sequence[int]],
    group_tokens_per_block: Sequence[int],
    start_token: int,
    end_token: int,
) -> list[list[int]]:
    """Block ids covering tokens ``[start_token, end_token)``, per group.

    Group ``g`` gets ``allocated[g][start_token // tpb : end_token // tpb]`` with
    ``tpb = group_tokens_per_block[g]``: the same 256 tokens are 4 ids of a 64-token group and 1 id
    of a 256-token group. ``allocated`` is indexed like ``group_tokens_per_block`` (a mapping may
    leave out groups with nothing allocated). A group with nothing allocated slices to ``[]``.
    Raises ValueError if the range does not align with a group's ``tokens_per_block`` or a group
    has some ids but fewer than the range needs.
    """
    if start_token < 0 or end_token < start_token:
        raise ValueError(f"token range [{start_token}, {end_token}): expected 0 <= start_token <= end_token")
    if not isinstance(allocated, Mapping) and len(allocated) > len(group_tokens_per_block):
        raise ValueError(
            f"allocated has {len(allocated)} groups but group_tokens_per_block has "
            f"{len(group_tokens_per_block)}; expected one entry per group"
        )
    out: list[list[int]] = []
    for g, tpb in enumerate(group_tokens_per_block):
        if tpb <= 0:
            raise ValueError(f"group {g}: tokens_per_block={tpb}, expected > 0")
        if start_token % tpb or end_token % tpb:
            raise ValueError(
                f"group {g}: token range [{start_token}, {end_token}) does not align with "
                f"tokens_per_block={tpb}; both ends must be multiples of it"
            )
        if isinstance(allocated, Mapping):
            ids: Sequence[int] = allocated.get(g, ())
        else:
            ids = allocated[g] if g < len(allocated) else ()
        first, last = start_token // tpb, end_token // tpb
        if not ids:
            out.append([])  # nothing allocated for this group (e.g. its window holds no tokens yet)
            continue
        if last > len(ids):
            raise ValueError(
                f"group {g}: token range [{start_token}, {end_token}) needs blocks [{first}, {last}) "
                f"but only {len(ids)} block ids are allocated"
            )
        out.append(_int_list(ids[first:last], f"allocated[{g}]"))
    return out


def to_proto(infos: Iterable[EngineGroupInfo]) -> list[common_pb2.EngineGroupInfo]:
    """Lossless conversion to protobuf; ``sw_size_tokens`` -1 is left absent on the wire."""
    out = []
    for info in infos:
        msg = common_pb2.EngineGroupInfo(
            engine_group_id=info.engine_group_id,
            layer_indices=info.layer_indices,
            tokens_per_block=info.tokens_per_block,
            extra_object_group_tag=info.extra_object_group_tag,
            recurrent_state=info.recurrent_state,
        )
        if info.sw_size_tokens != -1:
            msg.sw_size_tokens = info.sw_size_tokens
        out.append(msg)
    return out


MAX_ENGINE_GROUPS = 1 << 12
"""Engine group ids a request may name (vLLM's models have a handful of KV cache groups)."""


def from_proto(msgs: Iterable[common_pb2.EngineGroupInfo]) -> list[EngineGroupInfo]:
    """Inverse of :func:`to_proto`; an absent ``sw_size_tokens`` is -1. Validates every info
    (ValueError naming the bad value)."""
    out = []
    for i, msg in enumerate(msgs):
        try:
            out.append(
                EngineGroupInfo(
                    engine_group_id=msg.engine_group_id,
                    layer_indices=tuple(msg.layer_indices),
                    tokens_per_block=msg.tokens_per_block,
                    sw_size_tokens=msg.sw_size_tokens if msg.HasField("sw_size_tokens") else -1,
                    extra_object_group_tag=msg.extra_object_group_tag,
                    recurrent_state=msg.recurrent_state,
                )
            )
        except ValueError as e:
            raise ValueError(f"engine_groups[{i}]: {e}") from None
    # Lists are sized by the largest engine group id (vLLM numbers its KV cache groups from 0, a
    # handful per model): an id past any engine's is refused, not allocated.
    for i, info in enumerate(out):
        if info.engine_group_id >= MAX_ENGINE_GROUPS:
            raise ValueError(
                f"engine_groups[{i}]: engine_group_id={info.engine_group_id}; expected < {MAX_ENGINE_GROUPS}"
            )
    return out
