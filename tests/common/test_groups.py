"""kvgrid.common.groups: the engine-group view (docs/hybrid-groups.md)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from kvgrid.api.v1 import common_pb2
from kvgrid.common.groups import (
    EXCLUDED_ENGINE_GROUP,
    EngineGroupInfo,
    engine_group_ids_per_info,
    engine_group_tokens_per_block,
    expand_engine_block_ids,
    from_proto,
    get_engine_group_indices,
    num_engine_group_infos,
    num_engine_groups,
    slice_block_ids_per_group,
    to_proto,
)

# The worked example of docs/hybrid-groups.md: engine group 0 = layers [0, 2, 4], group 1 = [1, 3];
# layers 0-3 share a shape and layer 4 differs, so group 0 splits into two infos.
WORKED = [
    EngineGroupInfo(0, (0, 2), tokens_per_block=16),
    EngineGroupInfo(1, (1, 3), tokens_per_block=16),
    EngineGroupInfo(0, (4,), tokens_per_block=16),
]


def test_fields_and_defaults_match_the_contract() -> None:
    names = [f.name for f in msgspec.structs.fields(EngineGroupInfo)]
    assert names == [
        "engine_group_id",
        "layer_indices",
        "tokens_per_block",
        "sw_size_tokens",
        "extra_object_group_tag",
        "recurrent_state",
    ]
    info = EngineGroupInfo(3)
    assert info == EngineGroupInfo(3, (), 0, -1, 0, False)
    assert EXCLUDED_ENGINE_GROUP == -1


def test_frozen_and_hashable_with_list_input() -> None:
    info = EngineGroupInfo(0, [0, 2])  # type: ignore[arg-type]
    assert info.layer_indices == (0, 2)
    assert hash(info) == hash(EngineGroupInfo(0, (0, 2)))
    with pytest.raises(AttributeError):
        info.engine_group_id = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"engine_group_id": -1}, "engine_group_id=-1"),
        ({"engine_group_id": 0, "layer_indices": (2, 1)}, "layer_indices=(2, 1)"),
        ({"engine_group_id": 0, "layer_indices": (1, 1)}, "layer_indices=(1, 1)"),
        ({"engine_group_id": 0, "layer_indices": (-1,)}, "layer_indices=(-1,)"),
        ({"engine_group_id": 0, "tokens_per_block": -16}, "tokens_per_block=-16"),
        ({"engine_group_id": 0, "sw_size_tokens": 0}, "sw_size_tokens=0"),
        ({"engine_group_id": 0, "sw_size_tokens": -2}, "sw_size_tokens=-2"),
        ({"engine_group_id": 0, "extra_object_group_tag": -1}, "extra_object_group_tag=-1"),
    ],
)
def test_validation_names_the_bad_value(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        EngineGroupInfo(**kwargs)  # type: ignore[arg-type]


def test_counts_and_ids_of_worked_example() -> None:
    assert num_engine_groups(WORKED) == 2
    assert num_engine_group_infos(WORKED) == 3
    assert engine_group_ids_per_info(WORKED) == (0, 1, 0)
    assert engine_group_tokens_per_block(WORKED) == [16, 16]


def test_empty_list_is_one_non_hybrid_group() -> None:
    assert num_engine_groups([]) == 1
    assert num_engine_group_infos([]) == 1
    assert engine_group_ids_per_info([]) == (0,)
    assert expand_engine_block_ids([], [[5, 6]]) == [[5, 6]]
    assert expand_engine_block_ids([], [5, 6]) == [[5, 6]]
    assert get_engine_group_indices([], 3) == [0, 0, 0]
    with pytest.raises(ValueError, match="2 lists"):
        expand_engine_block_ids([], [[1], [2]])


def test_expand_worked_example() -> None:
    out = expand_engine_block_ids(WORKED, [[10, 11], [20, 21]])
    assert out == [[10, 11], [20, 21], [10, 11]]
    # Each info owns its list: mutating one never changes another.
    out[0].append(99)
    assert out[2] == [10, 11]


def test_expand_accepts_tuples_and_numpy_ints() -> None:
    out = expand_engine_block_ids(WORKED, ([np.int64(10), 11], (20, np.int32(21))))
    assert out == [[10, 11], [20, 21], [10, 11]]
    assert all(type(i) is int for ids in out for i in ids)


def test_expand_flat_legacy_list() -> None:
    single = [EngineGroupInfo(0, (0, 1)), EngineGroupInfo(0, (2,))]
    assert expand_engine_block_ids(single, [7, 8, 9]) == [[7, 8, 9], [7, 8, 9]]
    with pytest.raises(ValueError, match="flat list"):
        expand_engine_block_ids(WORKED, [10, 11])


def test_expand_rejects_missing_engine_group_and_non_ints() -> None:
    with pytest.raises(ValueError, match="engine group 1 but engine_block_ids has only 1"):
        expand_engine_block_ids(WORKED, [[10, 11]])
    with pytest.raises(TypeError, match=r"engine_block_ids\[1\]"):
        expand_engine_block_ids(WORKED, [[10], [1.5]])  # type: ignore[list-item]


def test_expand_tolerates_extra_untransferred_engine_group() -> None:
    # An engine group with no info (every layer excluded) still has its block-id list.
    groups = [EngineGroupInfo(0, (0,)), EngineGroupInfo(2, (1,))]
    assert expand_engine_block_ids(groups, [[1], [2], [3]]) == [[1], [3]]


def test_engine_group_indices_marks_shared_layers_excluded() -> None:
    assert get_engine_group_indices(WORKED, 5) == [0, 1, 0, 1, 0]
    # Layer 5 shares layer 0's KV (listed by no group): excluded, not moved twice.
    assert get_engine_group_indices(WORKED, 6) == [0, 1, 0, 1, 0, EXCLUDED_ENGINE_GROUP]


def test_engine_group_indices_errors() -> None:
    with pytest.raises(ValueError, match=r"layer 4, outside registered layer range \[0, 4\)"):
        get_engine_group_indices(WORKED, 4)
    dup = [EngineGroupInfo(0, (0, 1)), EngineGroupInfo(1, (1,))]
    with pytest.raises(ValueError, match="layer 1 is listed by info 0 and info 1"):
        get_engine_group_indices(dup, 2)
    with pytest.raises(ValueError, match="num_layers=-1"):
        get_engine_group_indices(WORKED, -1)


def test_tokens_per_block_must_agree_within_engine_group() -> None:
    bad = [EngineGroupInfo(0, (0,), tokens_per_block=16), EngineGroupInfo(0, (1,), tokens_per_block=32)]
    with pytest.raises(ValueError, match="engine group 0: infos disagree on tokens_per_block"):
        engine_group_tokens_per_block(bad)


def test_slice_same_tokens_different_block_sizes() -> None:
    allocated = {0: list(range(100, 108)), 1: [7, 8]}
    out = slice_block_ids_per_group(allocated, [64, 256], 0, 256)
    assert out == [[100, 101, 102, 103], [7]]
    assert [len(ids) for ids in out] == [4, 1]
    assert slice_block_ids_per_group(allocated, [64, 256], 256, 512) == [[104, 105, 106, 107], [8]]
    assert slice_block_ids_per_group([[1, 2, 3, 4], [5, 6]], [16, 32], 32, 64) == [[3, 4], [6]]
    assert slice_block_ids_per_group(allocated, [64, 256], 256, 256) == [[], []]


def test_a_group_with_nothing_allocated_slices_to_nothing() -> None:
    # A group left out of the mapping, or listed with no ids (vLLM allocated it nothing yet), gets
    # [] for any range; a group with some ids but too few is still an error.
    assert slice_block_ids_per_group({0: [1, 2]}, [16, 16], 0, 0) == [[], []]
    assert slice_block_ids_per_group({0: [1, 2]}, [16, 16], 0, 32) == [[1, 2], []]
    assert slice_block_ids_per_group([[1, 2], []], [16, 16], 16, 32) == [[2], []]
    with pytest.raises(ValueError, match=r"group 1: .* only 1 block ids are allocated"):
        slice_block_ids_per_group([[1, 2], [3]], [16, 16], 0, 32)


@pytest.mark.parametrize(
    ("start", "end", "needle"),
    [
        (0, 128, r"group 1: token range \[0, 128\) does not align with tokens_per_block=256"),
        (64, 256, r"group 1: token range \[64, 256\) does not align"),
        (0, 100, r"group 0: token range \[0, 100\) does not align with tokens_per_block=64"),
        (-64, 0, "expected 0 <= start_token <= end_token"),
        (256, 0, "expected 0 <= start_token <= end_token"),
    ],
)
def test_slice_misalignment_errors(start: int, end: int, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        slice_block_ids_per_group({0: list(range(8)), 1: [0, 1]}, [64, 256], start, end)


def test_slice_rejects_short_allocation_and_bad_block_size() -> None:
    with pytest.raises(ValueError, match=r"needs blocks \[0, 4\) but only 2"):
        slice_block_ids_per_group([[1, 2]], [64], 0, 256)
    with pytest.raises(ValueError, match="tokens_per_block=0"):
        slice_block_ids_per_group([[1, 2]], [0], 0, 0)
    with pytest.raises(ValueError, match="allocated has 2 groups"):
        slice_block_ids_per_group([[1], [2]], [16], 0, 16)


# --- wire forms -------------------------------------------------------------------------------

FULL = EngineGroupInfo(
    2, (1, 5, 9), tokens_per_block=64, sw_size_tokens=4096, extra_object_group_tag=3, recurrent_state=True
)


def test_proto_round_trip_is_lossless() -> None:
    infos = [*WORKED, FULL, EngineGroupInfo(0)]
    msgs = to_proto(infos)
    assert all(isinstance(m, common_pb2.EngineGroupInfo) for m in msgs)
    assert from_proto(msgs) == infos
    # Through bytes as well.
    wire = [m.SerializeToString() for m in msgs]
    assert from_proto(common_pb2.EngineGroupInfo.FromString(b) for b in wire) == infos


def test_proto_absent_sliding_window_is_full_attention() -> None:
    (msg,) = to_proto([WORKED[0]])
    assert not msg.HasField("sw_size_tokens")
    (msg,) = to_proto([FULL])
    assert msg.HasField("sw_size_tokens") and msg.sw_size_tokens == 4096
    # An older sender that knows only the first fields.
    old = common_pb2.EngineGroupInfo(engine_group_id=1, layer_indices=[3])
    (info,) = from_proto([common_pb2.EngineGroupInfo.FromString(old.SerializeToString())])
    assert info == EngineGroupInfo(1, (3,), 0, -1, 0, False)


def test_from_proto_validates_with_the_position() -> None:
    bad = common_pb2.EngineGroupInfo(engine_group_id=0, layer_indices=[3, 1])
    with pytest.raises(ValueError, match=r"engine_groups\[1\]: layer_indices=\(3, 1\)"):
        from_proto([to_proto(WORKED)[0], bad])


def test_msgpack_round_trip_and_missing_newer_fields() -> None:
    encoded = msgspec.msgpack.encode([*WORKED, FULL])
    assert msgspec.msgpack.decode(encoded, type=list[EngineGroupInfo]) == [*WORKED, FULL]
    # A payload from a writer that predates sw_size_tokens and everything after it.
    old = msgspec.msgpack.encode({"engine_group_id": 1, "layer_indices": [1, 3], "tokens_per_block": 16})
    info = msgspec.msgpack.decode(old, type=EngineGroupInfo)
    assert info == EngineGroupInfo(1, (1, 3), 16, -1, 0, False)
    # Unknown (newer) keys are ignored.
    newer = msgspec.msgpack.encode({"engine_group_id": 0, "tokens_per_state": 4})
    assert msgspec.msgpack.decode(newer, type=EngineGroupInfo) == EngineGroupInfo(0)


def test_msgpack_decode_validates() -> None:
    bad = msgspec.msgpack.encode({"engine_group_id": 0, "layer_indices": [2, 2]})
    with pytest.raises(msgspec.ValidationError, match="layer_indices"):
        msgspec.msgpack.decode(bad, type=EngineGroupInfo)


# --- properties ------------------------------------------------------------------------------


@st.composite
def _groups_and_ids(draw: st.DrawFn) -> tuple[list[EngineGroupInfo], list[list[int]]]:
    n_engine = draw(st.integers(1, 4))
    n_layers = draw(st.integers(0, 12))
    # Each layer: an engine group, a "shape" bucket, or excluded.
    owner = draw(
        st.lists(
            st.tuples(st.integers(-1, n_engine - 1), st.integers(0, 2)), min_size=n_layers, max_size=n_layers
        )
    )
    buckets: dict[tuple[int, int], list[int]] = {}
    for layer, (gid, shape) in enumerate(owner):
        if gid >= 0:
            buckets.setdefault((gid, shape), []).append(layer)
    infos = [EngineGroupInfo(gid, tuple(layers)) for (gid, _), layers in buckets.items()]
    infos.sort(key=lambda i: i.layer_indices[0])
    ids = draw(st.lists(st.lists(st.integers(0, 10_000), max_size=6), min_size=n_engine, max_size=n_engine))
    return infos, ids


@given(_groups_and_ids())
def test_property_expand_copies_each_info_its_engine_group(
    case: tuple[list[EngineGroupInfo], list[list[int]]],
) -> None:
    infos, ids = case
    assume(infos)  # an empty list is the single non-hybrid group, tested on its own
    out = expand_engine_block_ids(infos, ids)
    assert len(out) == num_engine_group_infos(infos)
    for info, got in zip(infos, out, strict=False):
        assert got == ids[info.engine_group_id]
    if infos:
        per_layer = get_engine_group_indices(infos, 12)
        covered = {layer for info in infos for layer in info.layer_indices}
        for layer, gid in enumerate(per_layer):
            assert (gid == EXCLUDED_ENGINE_GROUP) == (layer not in covered)


@given(
    st.lists(st.sampled_from([1, 4, 16, 32, 64, 256]), min_size=1, max_size=4),
    st.integers(0, 8),
    st.integers(0, 8),
    st.data(),
)
def test_property_slices_concatenate_and_count(tpbs: list[int], a: int, b: int, data: st.DataObject) -> None:
    unit = 256  # a multiple of every block size drawn, like a chunk
    start, end = sorted((a * unit, b * unit))
    mid = data.draw(st.integers(start // unit, end // unit)) * unit
    # Each group has at least the blocks the range needs, sometimes more.
    allocated = [
        list(range(g * 1000, g * 1000 + end // tpb + data.draw(st.integers(0, 3))))
        for g, tpb in enumerate(tpbs)
    ]
    whole = slice_block_ids_per_group(allocated, tpbs, start, end)
    left = slice_block_ids_per_group(allocated, tpbs, start, mid)
    right = slice_block_ids_per_group(allocated, tpbs, mid, end)
    for g, tpb in enumerate(tpbs):
        assert len(whole[g]) == (end - start) // tpb
        assert whole[g] == left[g] + right[g]
        assert whole[g] == allocated[g][start // tpb : end // tpb]


@given(st.sampled_from([16, 32, 64, 256]), st.integers(1, 1000), st.integers(0, 4))
def test_property_unaligned_start_always_rejected(tpb: int, offset: int, blocks: int) -> None:
    start = blocks * tpb + offset
    assume(offset % tpb != 0)
    with pytest.raises(ValueError, match="does not align"):
        slice_block_ids_per_group([list(range(100))], [tpb], start, start + (tpb - offset % tpb) + tpb)
