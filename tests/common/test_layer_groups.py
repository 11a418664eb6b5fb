"""kvgrid.common.layer_groups: kernel groups from real tensors, validated against infos
(docs/hybrid-groups.md)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgrid.common.groups import EXCLUDED_ENGINE_GROUP, EngineGroupInfo, expand_engine_block_ids
from kvgrid.common.layer_groups import (
    DTYPES,
    KernelGroupIdentity,
    KVLayerGroupInfo,
    KVLayerGroupsManager,
    format_kvcache_shape_spec,
    group_layers_by_identity,
    parse_kvcache_shape_spec,
)
from kvgrid.common.layouts import KVFormat, detect_kv_format, empty_kv_cache
from kvgrid_kernels import KernelGroupGeometry

NB = 8
FI = KVFormat.FLASHINFER_NHD


def attn(
    bs: int = 16, nh: int = 2, hs: int = 8, dtype: torch.dtype = torch.float16, nb: int = NB
) -> torch.Tensor:
    return empty_kv_cache(FI, nb, bs, nh, hs, dtype)


def mla(bs: int = 16, c: int = 32, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    return empty_kv_cache(KVFormat.MLA, NB, bs, 1, c, dtype)


def detect_all(caches: list[torch.Tensor]) -> list[KVFormat]:
    return [detect_kv_format(t, {"kv_layout": "NHD"}) for t in caches]


# The worked example of docs/hybrid-groups.md: engine group 0 = layers [0, 2, 4], group 1 = [1, 3]; layers 0-3
# share a shape, layer 4 (a key-only MLA-like cache) differs.
WORKED_INFOS = [
    EngineGroupInfo(0, (0, 2), tokens_per_block=16),
    EngineGroupInfo(1, (1, 3), tokens_per_block=16),
    EngineGroupInfo(0, (4,), tokens_per_block=16),
]


def worked_caches() -> list[torch.Tensor]:
    return [attn(), attn(), attn(), attn(), mla()]


# ------------------------------------------------------------------ group_layers_by_identity


def test_worked_example_through_the_manager() -> None:
    caches = worked_caches()
    m = KVLayerGroupsManager(caches, detect_all(caches), WORKED_INFOS)
    assert [g.layer_indices for g in m.kernel_groups] == [(0, 2), (1, 3), (4,)]
    assert [g.engine_group_idx for g in m.kernel_groups] == [0, 1, 0]
    assert [g.kv_format for g in m.kernel_groups] == [FI, FI, KVFormat.MLA]
    assert m.kernel_groups[0].shape == KernelGroupGeometry(
        2, 2, NB, 16, 2, 8, torch.float16, tokens_per_block=16, block_stride=2 * 16 * 2 * 8
    )
    assert m.kernel_groups[2].shape == KernelGroupGeometry(
        1, 1, NB, 16, 1, 32, torch.float16, tokens_per_block=16, block_stride=16 * 32
    )
    # block ids arrive per info, i.e. per kernel group: info 0 and info 2 share engine group 0's ids
    per_group = expand_engine_block_ids(WORKED_INFOS, [[10, 11], [20, 21]])
    assert per_group == [[10, 11], [20, 21], [10, 11]]
    assert [per_group[k] for k, g in enumerate(m.kernel_groups) if g.engine_group_idx == 0] == [[10, 11]] * 2
    assert [m.info_index(k) for k in range(m.num_kernel_groups)] == [0, 1, 2]
    # Without infos every kernel group (here two, by layout) reads the engine's one block-id list.
    bare = KVLayerGroupsManager(caches, detect_all(caches))
    assert [bare.info_index(k) for k in range(bare.num_kernel_groups)] == [0, 0]


def test_grouping_is_ordered_by_first_layer_and_deterministic() -> None:
    caches = worked_caches()
    fmts = detect_all(caches)
    out = group_layers_by_identity(caches, fmts, [0, 1, 0, 1, 0])
    assert [layers for _, layers in out] == [[0, 2], [1, 3], [4]]
    assert out[0][0] == KernelGroupIdentity(2, 2, 8, 16, 0, torch.float16, FI)
    assert out[2][0] == KernelGroupIdentity(1, 1, 32, 16, 0, torch.float16, KVFormat.MLA)
    assert group_layers_by_identity(caches, fmts, [0, 1, 0, 1, 0]) == out
    # a mapping works the same (registration order = value order)
    named = {f"model.layers.{i}.attn": t for i, t in enumerate(caches)}
    assert group_layers_by_identity(named, fmts, [0, 1, 0, 1, 0]) == out
    # without engine group indices every layer is in engine group 0
    assert [layers for _, layers in group_layers_by_identity(caches, fmts)] == [[0, 1, 2, 3], [4]]


def test_identity_separates_dtype_format_and_engine_group() -> None:
    caches = [
        attn(dtype=torch.float16),
        attn(dtype=torch.bfloat16),  # same bytes per element, different kernel template
        empty_kv_cache(KVFormat.FLASHINFER_HND, NB, 16, 2, 8),  # same geometry, other layout
        attn(dtype=torch.float16),
    ]
    fmts = [FI, FI, KVFormat.FLASHINFER_HND, FI]
    assert [layers for _, layers in group_layers_by_identity(caches, fmts)] == [[0, 3], [1], [2]]
    assert [layers for _, layers in group_layers_by_identity(caches, fmts, [0, 0, 0, 1])] == [
        [0],
        [1],
        [2],
        [3],
    ]


def test_nhd_and_hnd_with_nh_equal_bs_split_into_two_groups() -> None:
    nhd = empty_kv_cache(FI, NB, 16, 16, 8)
    hnd = empty_kv_cache(KVFormat.FLASHINFER_HND, NB, 16, 16, 8)
    fmts = [detect_kv_format(nhd, {"kv_layout": "NHD"}), detect_kv_format(hnd, {"kv_layout": "HND"})]
    out = group_layers_by_identity([nhd, hnd], fmts)
    assert len(out) == 2 and out[0][0][:4] == out[1][0][:4]


def test_excluded_layers_are_skipped() -> None:
    caches = worked_caches()
    caches.append(caches[1])  # layer 5 shares layer 1's KV (cross-layer sharing)
    fmts = detect_all(caches)
    out = group_layers_by_identity(caches, fmts, [0, 1, 0, 1, 0, EXCLUDED_ENGINE_GROUP])
    assert [layers for _, layers in out] == [[0, 2], [1, 3], [4]]
    # the manager tags it from the infos: no info lists layer 5
    m = KVLayerGroupsManager(caches, fmts, WORKED_INFOS)
    assert m.engine_group_indices == [0, 1, 0, 1, 0, EXCLUDED_ENGINE_GROUP]
    assert all(5 not in g.layer_indices for g in m.kernel_groups)


def test_group_layers_argument_errors() -> None:
    caches = worked_caches()
    with pytest.raises(ValueError, match="kv_formats has 4 entries but kv_caches has 5"):
        group_layers_by_identity(caches, detect_all(caches)[:4])
    with pytest.raises(ValueError, match="per_layer_engine_group_idx has 2 entries"):
        group_layers_by_identity(caches, detect_all(caches), [0, 1])
    with pytest.raises(ValueError, match="layer 1: engine group index -2"):
        group_layers_by_identity(caches, detect_all(caches), [0, -2, 0, 0, 0])
    with pytest.raises(ValueError, match=r"layer 4: .*cannot have format"):
        group_layers_by_identity(caches, [FI] * 5)


# ------------------------------------------------------------------------ 5-D + 3-D, one group


def test_5d_and_3d_layouts_in_one_engine_group_become_two_kernel_groups() -> None:
    """A UniformTypeKVCacheSpecs-like engine group: K/V caches and a key-only indexer cache."""
    caches = [attn(), mla(c=132, dtype=torch.uint8), attn(), mla(c=132, dtype=torch.uint8)]
    fmts = detect_all(caches)
    assert fmts == [FI, KVFormat.MLA, FI, KVFormat.MLA]
    one_info = [EngineGroupInfo(0, (0, 1, 2, 3), tokens_per_block=16)]
    with pytest.raises(ValueError, match="1 engine group infos but the tensors form 2 kernel groups"):
        KVLayerGroupsManager(caches, fmts, one_info)
    infos = [EngineGroupInfo(0, (0, 2), tokens_per_block=16), EngineGroupInfo(0, (1, 3), tokens_per_block=16)]
    m = KVLayerGroupsManager(caches, fmts, infos)
    assert [(g.layer_indices, g.engine_group_idx, g.shape.kv_size) for g in m.kernel_groups] == [
        ((0, 2), 0, 2),
        ((1, 3), 0, 1),
    ]
    assert m.kernel_groups[1].dtype == torch.uint8 and m.kernel_groups[1].shape.element_size == 1


# ------------------------------------------------------------------------------ validations


def test_info_layers_must_equal_kernel_group_layers() -> None:
    caches = worked_caches()
    swapped = [EngineGroupInfo(0, (0, 4)), EngineGroupInfo(1, (1, 3)), EngineGroupInfo(0, (2,))]
    with pytest.raises(
        ValueError, match=r"info 0 covers layers \[0, 4\].*kernel group 0 has layers \[0, 2\]"
    ):
        KVLayerGroupsManager(caches, detect_all(caches), swapped)
    reordered = [WORKED_INFOS[1], WORKED_INFOS[0], WORKED_INFOS[2]]  # order is the protocol order
    with pytest.raises(ValueError, match="info 0 covers layers"):
        KVLayerGroupsManager(caches, detect_all(caches), reordered)


def test_info_count_must_equal_kernel_group_count() -> None:
    caches = worked_caches()
    merged = [EngineGroupInfo(0, (0, 2, 4), 16), EngineGroupInfo(1, (1, 3), 16)]  # layer 4 differs
    with pytest.raises(ValueError, match="2 engine group infos but the tensors form 3 kernel groups"):
        KVLayerGroupsManager(caches, detect_all(caches), merged)
    # an info set that leaves a layer out excludes it (cross-layer sharing): not a count error
    assert len(KVLayerGroupsManager(caches, detect_all(caches), WORKED_INFOS[:2]).kernel_groups) == 2
    with pytest.raises(ValueError, match="1 engine group infos but the tensors form 0 kernel groups"):
        KVLayerGroupsManager([], [], [EngineGroupInfo(0, ())])


def test_info_layers_out_of_range_or_listed_twice() -> None:
    caches = worked_caches()
    with pytest.raises(ValueError, match="outside registered layer range"):
        KVLayerGroupsManager(caches, detect_all(caches), [*WORKED_INFOS[:2], EngineGroupInfo(0, (7,), 16)])
    with pytest.raises(ValueError, match="listed by info"):
        KVLayerGroupsManager(caches, detect_all(caches), [*WORKED_INFOS[:2], EngineGroupInfo(0, (2, 4), 16)])


def test_infos_of_one_engine_group_agree_on_tokens_per_block() -> None:
    caches = worked_caches()
    infos = [*WORKED_INFOS[:2], EngineGroupInfo(0, (4,), tokens_per_block=32)]
    with pytest.raises(ValueError, match="disagree on tokens_per_block"):
        KVLayerGroupsManager(caches, detect_all(caches), infos)


def test_tokens_per_block_must_be_a_multiple_of_slots_per_block() -> None:
    caches = [mla(bs=16)]
    with pytest.raises(ValueError, match="tokens_per_block=24 must be a multiple of slots_per_block=16"):
        KVLayerGroupsManager(caches, detect_all(caches), [EngineGroupInfo(0, (0,), tokens_per_block=24)])


def test_chunk_must_be_a_multiple_of_tokens_per_block() -> None:
    caches = [attn(bs=16)]
    with pytest.raises(ValueError, match=r"tokens_per_chunk=200 must be a multiple of .*tokens_per_block=16"):
        KVLayerGroupsManager(caches, detect_all(caches), tokens_per_chunk=200)
    with pytest.raises(ValueError, match=r"tokens_per_chunk=256 must be .*tokens_per_block=512"):
        KVLayerGroupsManager(caches, detect_all(caches), [EngineGroupInfo(0, (0,), tokens_per_block=512)])
    with pytest.raises(ValueError, match="tokens_per_chunk=0"):
        KVLayerGroupsManager(caches, detect_all(caches), tokens_per_chunk=0)


def test_sub_chunk_sliding_window_must_be_whole_blocks() -> None:
    caches = [attn(bs=16)]
    fmts = detect_all(caches)
    with pytest.raises(ValueError, match="sub-chunk sliding window sw_size_tokens=100"):
        KVLayerGroupsManager(caches, fmts, [EngineGroupInfo(0, (0,), 16, sw_size_tokens=100)])
    # whole blocks, or at least a chunk, are fine
    for sw in (128, 256, 1000):
        m = KVLayerGroupsManager(caches, fmts, [EngineGroupInfo(0, (0,), 16, sw_size_tokens=sw)])
        assert m.kernel_groups[0].sw_size_tokens == sw
        assert m.kernel_groups[0].subchunk_sw_size_tokens(256) == min(sw, 256)


def test_layers_of_a_kernel_group_must_have_the_same_blocks() -> None:
    caches = [attn(nb=8), attn(nb=9)]
    with pytest.raises(ValueError, match="layer 1 has 9 blocks"):
        KVLayerGroupsManager(caches, detect_all(caches))


def test_formats_must_match_caches() -> None:
    with pytest.raises(ValueError, match="kv_formats has 0 entries but kv_caches has 1"):
        KVLayerGroupsManager([attn()], [])


# ------------------------------------------------------------------------ compression, chunks


def test_compression_is_derived_never_stored() -> None:
    """DeepSeek-V4-like: 64 slots hold a 256-token block (4 tokens per slot)."""
    caches = [mla(bs=64, c=576, dtype=torch.bfloat16), attn(bs=64)]
    infos = [EngineGroupInfo(0, (0,), tokens_per_block=256), EngineGroupInfo(1, (1,), tokens_per_block=64)]
    m = KVLayerGroupsManager(caches, detect_all(caches), infos, tokens_per_chunk=256)
    packed, plain = m.kernel_groups
    assert (packed.tokens_per_block, packed.slots_per_block, packed.shape.compression) == (256, 64, 4)
    assert plain.shape.compression == 1
    assert "compression" not in {f.name for f in dataclasses.fields(KVLayerGroupInfo)}
    assert "compression" not in {f.name for f in dataclasses.fields(KernelGroupGeometry)}
    assert packed.shape.slots_per_chunk(256) == 64 and plain.shape.slots_per_chunk(256) == 256
    # the same 256 tokens are 1 block id of a 256-token group and 4 of a 64-token group
    assert packed.calculate_num_blocks(256) == 1 and plain.calculate_num_blocks(256) == 4
    assert m.blocks_per_chunk(1) == 4 and m.slots_per_chunk(0) == 64
    with pytest.raises(ValueError, match="num_tokens=6"):
        packed.shape.slots_per_chunk(6)
    with pytest.raises(
        ValueError, match="num_tokens=100: expected a non-negative multiple of tokens_per_block=64"
    ):
        plain.calculate_num_blocks(100)
    assert packed.bytes_per_chunk(256) == 64 * 576 * 2
    assert plain.bytes_per_chunk(256) == 4 * (2 * 64 * 2 * 8 * 2)
    assert m.bytes_per_chunk() == packed.bytes_per_chunk(256) + plain.bytes_per_chunk(256)


def test_no_infos_means_one_uncompressed_engine_group() -> None:
    caches = [attn(), attn()]
    m = KVLayerGroupsManager(caches, detect_all(caches))
    (g,) = m.kernel_groups
    assert g.layer_indices == (0, 1) and g.tokens_per_block == 16 and g.shape.compression == 1
    assert g.engine_group_idx == 0 and g.sw_size_tokens == -1 and not g.recurrent_state
    info_zero_tpb = KVLayerGroupsManager(caches, detect_all(caches), [EngineGroupInfo(0, (0, 1))])
    assert info_zero_tpb.kernel_groups[0].tokens_per_block == 16  # 0 = unknown -> slots


# ------------------------------------------------------------------------------ object groups


def hybrid() -> tuple[list[torch.Tensor], list[EngineGroupInfo]]:
    """Full attention, two sliding windows (one shared by two engine groups), Mamba state, aux."""
    caches = [
        attn(),
        attn(),
        attn(),
        attn(),
        empty_kv_cache(KVFormat.OPAQUE_PAGES, NB, 1, 1, 512, torch.uint8),
    ]
    caches.append(attn())
    infos = [
        EngineGroupInfo(0, (0,), 16),
        EngineGroupInfo(1, (1,), 16, sw_size_tokens=128),
        EngineGroupInfo(2, (2,), 16, sw_size_tokens=512),
        EngineGroupInfo(3, (3,), 16, sw_size_tokens=128),
        EngineGroupInfo(4, (4,), 16, sw_size_tokens=16, recurrent_state=True),
        EngineGroupInfo(5, (5,), 16, extra_object_group_tag=1),
    ]
    return caches, infos


def test_object_groups_merged_by_default() -> None:
    caches, infos = hybrid()
    m = KVLayerGroupsManager(caches, detect_all(caches), infos)
    assert m.num_object_groups == 1
    assert m.object_groups[0].kernel_group_indices == (0, 1, 2, 3, 4, 5)
    assert {g.object_group for g in m.kernel_groups} == {0}


def test_object_groups_separated_by_window_recurrence_and_tag() -> None:
    caches, infos = hybrid()
    m = KVLayerGroupsManager(caches, detect_all(caches), infos, separate_object_groups=True)
    summary = [
        (
            og.kernel_group_indices,
            og.sw_size_tokens,
            og.sw_size_chunks,
            og.recurrent_state,
            og.extra_object_group_tag,
        )
        for og in m.object_groups
    ]
    assert summary == [
        ((0,), -1, -1, False, 0),  # full attention
        ((1, 3), 128, 1, False, 0),  # one window size -> one object group across engine groups
        ((2,), 512, 2, False, 0),
        ((4,), 16, 1, True, 0),  # recurrent state
        ((5,), -1, -1, False, 1),  # connector-private bucket
    ]
    assert [g.object_group for g in m.kernel_groups] == [0, 1, 2, 1, 3, 4]
    mamba = m.kernel_groups[4]
    assert mamba.kv_format is KVFormat.OPAQUE_PAGES and mamba.slots_per_block == 1
    assert mamba.shape.compression == 16 and mamba.calculate_num_blocks(256) == 16


def test_empty_registration_has_no_groups() -> None:
    m = KVLayerGroupsManager([], [])
    assert m.kernel_groups == [] and m.object_groups == []


# -------------------------------------------------------------------------------- shape spec


def test_shape_spec_example() -> None:
    spec = "(2,1024,16,8,128):float16:30;(1,1024,16,4,64):bfloat16:2"
    groups = parse_kvcache_shape_spec(spec)
    assert [g.layer_indices for g in groups] == [tuple(range(30)), (30, 31)]
    assert groups[0].shape == KernelGroupGeometry(2, 30, 1024, 16, 8, 128, torch.float16)
    assert groups[1].dtype == torch.bfloat16 and groups[1].kv_format is None
    assert format_kvcache_shape_spec(groups) == spec
    # lenient input, canonical output
    loose = " ( 2, 1024,16 ,8,128 ) : FP16 : 30 ;(1,1024,16,4,64):BFloat16:2; "
    assert format_kvcache_shape_spec(parse_kvcache_shape_spec(loose)) == spec


def test_shape_spec_of_manager_groups() -> None:
    caches = worked_caches()
    m = KVLayerGroupsManager(caches, detect_all(caches), WORKED_INFOS)
    assert format_kvcache_shape_spec(m.kernel_groups) == (
        f"(2,{NB},16,2,8):float16:2;(2,{NB},16,2,8):float16:2;(1,{NB},16,1,32):float16:1"
    )


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "empty"),
        ("   ", "empty"),
        (";", r"group 1 \(''\) is empty"),
        ("2,1024,16,8,128:float16:30", r"group 1 .*expected '\(kv_size"),
        ("(2,1024,16,8,128):float16", r"group 1 .*expected '\(kv_size"),
        ("(2,1024,16,8,128):float16:30;(2,1024,16,8):float16:2", r"group 2 .*expected 5 numbers .* got 4"),
        ("(2,1024,16,8,128):float17:30", "group 1 .*unrecognized dtype 'float17'"),
        ("(2,10x4,16,8,128):float16:30", "group 1 .*NB='10x4' is not a non-negative integer"),
        ("(2,1024,16,8,128):float16:-3", "num_layers='-3'"),
        ("(2,1024,0,8,128):float16:3", "BS=0, expected > 0"),
        ("(3,1024,16,8,128):float16:3", "kv_size=3, expected 1"),
        ("(2,1024,16,8,128):float16:0", "num_layers=0"),
        ("(2,1024,16,8,128):float16:3;;(1,1,1,1,1):uint8:1", r"group 2 \(''\) is empty"),
    ],
)
def test_shape_spec_errors_say_what_and_where(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_kvcache_shape_spec(spec)


def test_format_errors() -> None:
    with pytest.raises(ValueError, match="at least one group"):
        format_kvcache_shape_spec([])
    g = parse_kvcache_shape_spec("(1,4,4,1,4):float32:1")[0]
    with pytest.raises(ValueError, match="no shape-spec name"):
        format_kvcache_shape_spec(
            [dataclasses.replace(g, shape=dataclasses.replace(g.shape, dtype=torch.complex64))]
        )


positive = st.integers(1, 100_000)
group_text = st.builds(
    lambda kv, nb, bs, nh, hs, dtype, nl: f"({kv},{nb},{bs},{nh},{hs}):{dtype}:{nl}",
    st.sampled_from([1, 2]),
    positive,
    positive,
    positive,
    positive,
    st.sampled_from(sorted(DTYPES)),
    st.integers(1, 200),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(group_text, min_size=1, max_size=6).map(";".join))
def test_shape_spec_round_trip(spec: str) -> None:
    groups = parse_kvcache_shape_spec(spec)
    assert format_kvcache_shape_spec(groups) == spec
    assert parse_kvcache_shape_spec(format_kvcache_shape_spec(groups)) == groups
    # layers are numbered consecutively across groups
    layers = [i for g in groups for i in g.layer_indices]
    assert layers == list(range(len(layers)))
