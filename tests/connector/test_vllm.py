"""kvgrid.connector.vllm_specs against vLLM's real spec classes and its real per-layer cache views.

Caches are allocated the way vLLM's worker does it (``allocate_kv_cache``): one int8 backing
buffer, viewed per layer by vLLM's own ``create_kv_cache_views``.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvgrid.common.groups import (
    EXCLUDED_ENGINE_GROUP,
    EngineGroupInfo,
    expand_engine_block_ids,
    from_proto,
    get_engine_group_indices,
    to_proto,
)
from kvgrid.common.layer_groups import KVLayerGroupsManager
from kvgrid.common.layouts import KVFormat, detect_kv_format
from kvgrid.connector.vllm_specs import (
    apply_kv_cache_group_edits,
    create_engine_group_infos_from_vllm,
    hints_per_layer,
    layer_sort_key,
    ordered_layer_names,
    validate_kv_cache_groups,
)

NB = 6
BF16 = torch.bfloat16


def attn(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def full(block_size: int = 16, heads: int = 2, head_size: int = 8, **kw: object) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype=BF16, **kw)


def mamba(block_size: int, page: int | None, mode: str = "align") -> MambaSpec:
    # conv state (3, 8) bf16 + ssm state (2, 4, 4) fp32 = 176 bytes, padded to the attention page.
    return MambaSpec(
        block_size=block_size,
        shapes=((3, 8), (2, 4, 4)),
        dtypes=(BF16, torch.float32),
        page_size_padded=page,
        mamba_cache_mode=mode,
    )


def _leaf(group: KVCacheGroupSpec, name: str) -> KVCacheSpec:
    spec = group.kv_cache_spec
    return spec.kv_cache_specs[name] if isinstance(spec, UniformTypeKVCacheSpecs) else spec


def allocate(
    groups: Sequence[KVCacheGroupSpec],
    *,
    layout: KVCacheLayout = KVCacheLayout.LBNHC,
    kernel_block_sizes: Sequence[int | None] | None = None,
    shared: dict[str, str] | None = None,
    num_blocks: int = NB,
) -> tuple[KVCacheConfig, dict[str, torch.Tensor], torch.Tensor]:
    """A real KVCacheConfig (one layer-outermost KVCacheTensor per layer in one backing buffer)
    and vLLM's per-layer views of it, registered in reverse name order to exercise ordering."""
    placements = []
    offset = 0
    for gid, group in enumerate(groups):
        for name in group.layer_names:
            page = _leaf(group, name).page_size_bytes
            placements.append((gid, name, page, offset))
            offset += page * num_blocks
    tensors = [
        KVCacheTensor(
            size=offset, layers=[name], layer_stride=page * num_blocks, block_stride=page, offset=off
        )
        for _, name, page, off in placements
    ]
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=list(groups),
        kv_cache_layout=layout.name,
    )
    buf = torch.zeros(offset, dtype=torch.int8)
    caches: dict[str, torch.Tensor] = {}
    for (gid, name, _, _), tensor in reversed(list(zip(placements, tensors, strict=True))):
        kbs = kernel_block_sizes[gid] if kernel_block_sizes else None
        (view,) = create_kv_cache_views(buf, _leaf(groups[gid], name), num_blocks, layout, tensor, kbs)
        caches[name] = view
    for sharer, target in (shared or {}).items():
        caches[sharer] = caches[target]  # what vLLM does for cross-layer KV sharing
    return config, caches, buf


def config_of(*groups: KVCacheGroupSpec) -> KVCacheConfig:
    """A config without placements, for tensors made by hand."""
    return KVCacheConfig(num_blocks=NB, kv_cache_tensors=[], kv_cache_groups=list(groups))


def infos_of(config: KVCacheConfig, caches: dict[str, torch.Tensor], **kw: object) -> list[EngineGroupInfo]:
    return create_engine_group_infos_from_vllm(config, apply_kv_cache_group_edits(config, caches), **kw)  # type: ignore[arg-type]


# --- layer order --------------------------------------------------------------------------------


def test_layer_order_follows_layer_numbers() -> None:
    names = [attn(10), attn(2), "model.layers.1.mixer", attn(0)]
    assert ordered_layer_names(names) == [attn(0), "model.layers.1.mixer", attn(2), attn(10)]
    assert layer_sort_key("model.layers.3.self_attn.attn") == (3,)
    # Two modules per layer sort by both numbers; a tie keeps the given order.
    assert ordered_layer_names(["m.layers.1.attn.1", "m.layers.1.attn.0", "b.layers.0", "a.layers.0"]) == [
        "b.layers.0",
        "a.layers.0",
        "m.layers.1.attn.0",
        "m.layers.1.attn.1",
    ]
    with pytest.raises(ValueError, match=r"'lm_head\.attn' has no layer number"):
        layer_sort_key("lm_head.attn")


# --- the seed's worked example ------------------------------------------------------------------


def test_worked_example_engine_groups_split_by_shape() -> None:
    # Engine group 0 = layers [0, 2, 4] (layer 4 has another head geometry, so the group carries
    # per-layer specs), engine group 1 = layers [1, 3] with the shape of layers 0 and 2.
    uniform = UniformTypeKVCacheSpecs(
        block_size=16,
        kv_cache_specs={attn(0): full(), attn(2): full(), attn(4): full(heads=1, head_size=32)},
    )
    groups = [
        KVCacheGroupSpec([attn(0), attn(2), attn(4)], uniform),
        KVCacheGroupSpec([attn(1), attn(3)], full()),
    ]
    config, caches, _ = allocate(groups)
    infos = infos_of(config, caches)
    assert infos == [
        EngineGroupInfo(0, (0, 2), tokens_per_block=16),
        EngineGroupInfo(1, (1, 3), tokens_per_block=16),
        EngineGroupInfo(0, (4,), tokens_per_block=16),
    ]
    assert expand_engine_block_ids(infos, [[10, 11], [20, 21]]) == [[10, 11], [20, 21], [10, 11]]
    assert from_proto(to_proto(infos)) == infos


def test_five_d_and_three_d_layouts_in_one_engine_group_become_two_infos() -> None:
    # Legacy per-layer tensors (FlashInfer K/V [NB, 2, BS, NH, HS] and a key-only [NB, BS, HS]
    # cache) registered for one engine group of per-layer specs.
    kv = {attn(i): torch.zeros(NB, 2, 16, 2, 8, dtype=BF16) for i in range(4)}
    kv[attn(4)] = torch.zeros(NB, 16, 128, dtype=BF16)
    specs: dict[str, KVCacheSpec] = {attn(i): full() for i in range(4)}
    specs[attn(4)] = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=128, dtype=BF16)
    uniform = UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs=specs)
    config = KVCacheConfig(
        num_blocks=NB, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(list(specs), uniform)]
    )
    hints = {"backend": "FLASHINFER", "kv_layout": "NHD"}
    infos = create_engine_group_infos_from_vllm(config, kv, layout_hints=hints)
    assert infos == [EngineGroupInfo(0, (0, 1, 2, 3), 16), EngineGroupInfo(0, (4,), 16)]


# --- sliding windows, Mamba, DCP --------------------------------------------------------------------


def test_sliding_window_groups_carry_their_window_and_block_size() -> None:
    # gemma-like: sliding-window layers in 32-token blocks, full attention in 16-token blocks.
    groups = [
        KVCacheGroupSpec([attn(0), attn(2)], full(16)),
        KVCacheGroupSpec(
            [attn(1), attn(3)],
            SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=8, dtype=BF16, sliding_window=512),
        ),
        KVCacheGroupSpec(
            [attn(4)],
            ChunkedLocalAttentionSpec(
                block_size=16, num_kv_heads=2, head_size=8, dtype=BF16, attention_chunk_size=256
            ),
        ),
        # Hybrid allocator off: a sliding-window layer is full attention for the allocator.
        KVCacheGroupSpec([attn(5)], full(16, sliding_window=4096)),
    ]
    config, caches, _ = allocate(groups)
    assert infos_of(config, caches) == [
        EngineGroupInfo(0, (0, 2), 16),
        EngineGroupInfo(1, (1, 3), 32, sw_size_tokens=512),
        EngineGroupInfo(2, (4,), 16, sw_size_tokens=256),
        EngineGroupInfo(3, (5,), 16),
    ]


def _mamba_hybrid(dcp: bool = False) -> tuple[KVCacheConfig, dict[str, torch.Tensor], torch.Tensor]:
    page = full(64).page_size_bytes  # vLLM pads the Mamba page to the attention page
    groups = [
        KVCacheGroupSpec([attn(0), attn(2)], full(64)),
        KVCacheGroupSpec(["model.layers.1.mixer", "model.layers.3.mixer"], mamba(64, page)),
    ]
    return allocate(groups)


def test_mamba_align_is_a_one_block_recurrent_window() -> None:
    config, caches, _ = _mamba_hybrid()
    assert infos_of(config, caches) == [
        EngineGroupInfo(0, (0, 2), 64),
        EngineGroupInfo(1, (1, 3), 64, sw_size_tokens=64, recurrent_state=True),
    ]


def test_dcp_scales_attention_groups_only() -> None:
    config, caches, _ = _mamba_hybrid()
    infos = infos_of(config, caches, dcp_size=4)
    assert [(i.engine_group_id, i.tokens_per_block) for i in infos] == [(0, 256), (1, 64)]
    with pytest.raises(ValueError, match="dcp_size=0"):
        create_engine_group_infos_from_vllm(config, caches, dcp_size=0)


# --- exclusion ----------------------------------------------------------------------------------------


def test_cross_layer_kv_sharing_layers_are_excluded() -> None:
    # Layers 4 and 5 reuse layers 0's and 1's KV; vLLM lists only the owners in its groups.
    groups = [
        KVCacheGroupSpec([attn(0), attn(2)], full(16)),
        KVCacheGroupSpec(
            [attn(1), attn(3)],
            SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=8, dtype=BF16, sliding_window=64),
        ),
    ]
    config, caches, _ = allocate(groups, shared={attn(4): attn(0), attn(5): attn(1)})
    edited = apply_kv_cache_group_edits(config, caches)
    assert edited[attn(4)] is edited[attn(0)]
    infos = create_engine_group_infos_from_vllm(config, edited)
    assert infos == [EngineGroupInfo(0, (0, 2), 16), EngineGroupInfo(1, (1, 3), 32, sw_size_tokens=64)]
    assert get_engine_group_indices(infos, 6) == [0, 1, 0, 1, EXCLUDED_ENGINE_GROUP, EXCLUDED_ENGINE_GROUP]


def test_groups_without_kv_transfer_get_no_info() -> None:
    groups = [
        KVCacheGroupSpec([attn(0), attn(1)], full(16)),
        KVCacheGroupSpec([attn(2)], full(16, heads=1), enable_kv_transfer=False),
    ]
    config, caches, _ = allocate(groups)
    infos = infos_of(config, caches)
    assert infos == [EngineGroupInfo(0, (0, 1), 16)]
    # The engine still sends one block-id list per group.
    assert expand_engine_block_ids(infos, [[1, 2], [3]]) == [[1, 2]]


@pytest.mark.parametrize(("heads", "expected"), [(8, KVFormat.FLASHINFER_NHD), (16, KVFormat.FLASHINFER_HND)])
def test_specs_decide_nhd_or_hnd_when_vllm_left_the_layout_unset(heads: int, expected: KVFormat) -> None:
    # A contiguous [NB, 2, 16, 8, HS] cache: 16-token blocks of 8 heads (NHD) or 16 heads of 8-token
    # pages (HND) look the same; with kv_cache_layout unset only the spec's head count decides.
    tensors = {attn(i): torch.zeros(NB, 2, 16, 8, 64, dtype=BF16) for i in range(2)}
    block = 16 if heads == 8 else 8
    config = config_of(KVCacheGroupSpec(list(tensors), full(block_size=block, heads=heads, head_size=64)))
    with pytest.raises(ValueError, match="ambiguous KV cache layout"):
        detect_kv_format(tensors[attn(0)])  # the control: the tensor alone cannot decide
    hints = hints_per_layer(list(tensors), None, config, list(tensors.values()))
    assert hints == [{"num_kv_heads": heads}] * 2
    assert [detect_kv_format(t, h) for t, h in zip(tensors.values(), hints, strict=True)] == [expected] * 2
    assert infos_of(config, tensors) == [EngineGroupInfo(0, (0, 1), tokens_per_block=block)]
    # An operator's hint still wins over the spec's; a tensor without such a dim gets no spec hint.
    assert hints_per_layer([attn(0)], {"num_kv_heads": 16}, config) == [{"num_kv_heads": 16}]
    assert hints_per_layer([attn(0)], None, config, [torch.zeros(NB, 1, 32, 32)]) == [None]


def test_no_config_is_a_single_non_hybrid_group() -> None:
    assert create_engine_group_infos_from_vllm(None, {attn(0): torch.zeros(NB, 2, 16, 16)}) == []


def test_registration_errors_name_the_layer() -> None:
    config, caches, _ = allocate([KVCacheGroupSpec([attn(0), attn(1)], full())])
    del caches[attn(1)]
    with pytest.raises(ValueError, match=r"group 0 lists layer 'model\.layers\.1\.self_attn\.attn'"):
        create_engine_group_infos_from_vllm(config, caches)
    with pytest.raises(TypeError, match="run apply_kv_cache_group_edits first"):
        create_engine_group_infos_from_vllm(config, {attn(0): [torch.zeros(1)], attn(1): torch.zeros(1)})  # type: ignore[dict-item]


# --- validation -----------------------------------------------------------------------------------------


def test_validate_aggregates_every_unsupported_group() -> None:
    cross = CrossAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=BF16)
    config = KVCacheConfig(
        num_blocks=NB,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec([attn(0)], full()),
            KVCacheGroupSpec(["model.decoder.layers.0.encoder_attn.attn"], cross),
            KVCacheGroupSpec(["model.layers.1.mixer"], mamba(16, None, mode="none")),
        ],
    )
    with pytest.raises(ValueError) as err:
        validate_kv_cache_groups(config)
    msg = str(err.value)
    assert "(2)" in msg
    assert "group 1 (layers ['model.decoder.layers.0.encoder_attn.attn']): CrossAttentionSpec" in msg
    assert "group 2 (layers ['model.layers.1.mixer']): MambaSpec with mamba_cache_mode='none'" in msg
    assert "group 0" not in msg
    # Registration refuses the same config.
    with pytest.raises(ValueError, match="unsupported KV cache groups"):
        create_engine_group_infos_from_vllm(config, {})


def test_validate_accepts_supported_and_missing_configs() -> None:
    validate_kv_cache_groups(None)
    config, _, _ = _mamba_hybrid()
    validate_kv_cache_groups(config)
    compressed = MLAAttentionSpec(
        block_size=64, num_kv_heads=1, head_size=576, dtype=BF16, tokens_per_state=4
    )
    validate_kv_cache_groups(
        KVCacheConfig(
            num_blocks=NB, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec([attn(0)], compressed)]
        )
    )


# --- group edits --------------------------------------------------------------------------------


def _assert_same_memory(view: torch.Tensor, original: torch.Tensor) -> None:
    assert view.untyped_storage().data_ptr() == original.untyped_storage().data_ptr()
    assert view.data_ptr() == original.data_ptr()


def test_mamba_state_page_edit_is_a_view() -> None:
    config, caches, buf = _mamba_hybrid()
    name = "model.layers.1.mixer"
    original = caches[name]
    assert tuple(original.shape) == (NB, 1, 1, 176) and original.dtype == torch.int8
    edited = apply_kv_cache_group_edits(config, caches)
    state = edited[name]
    page = full(64).page_size_bytes
    # One page per block id, 64 slots (the block size), conv-state dtype filling the padded page.
    assert tuple(state.shape) == (NB, 1, 64, page // 64 // 2) and state.dtype == BF16
    assert state.stride(0) * 2 == page
    _assert_same_memory(state, original)
    # Write-through both ways.
    state[3].fill_(1.0)
    start = original.storage_offset() + 3 * page
    assert torch.equal(buf[start : start + page].view(BF16), torch.ones(page // 2, dtype=BF16))
    original[4, 0, 0, :2] = torch.tensor([1.0], dtype=BF16).view(torch.int8)
    assert state[4, 0, 0, 0].item() == 1.0
    # Attention layers pass through untouched.
    assert edited[attn(0)] is caches[attn(0)]


def test_legacy_mamba_state_pair_edit_is_a_view() -> None:
    spec = mamba(16, 512)
    raw = torch.zeros(NB * 512, dtype=torch.int8)
    pages = raw.view(NB, 512)
    conv = pages[:, :48].view(BF16).view(NB, 3, 8)
    ssm = pages[:, 48:176].view(torch.float32).view(NB, 2, 4, 4)
    config = KVCacheConfig(
        num_blocks=NB, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.mixer"], spec)]
    )
    edited = apply_kv_cache_group_edits(config, {"model.layers.0.mixer": [conv, ssm]})
    state = edited["model.layers.0.mixer"]
    assert tuple(state.shape) == (NB, 1, 16, 16) and state.dtype == BF16
    _assert_same_memory(state, conv)
    ssm[2].fill_(2.0)
    assert torch.equal(state[2].flatten().view(torch.int8)[48:176], pages[2, 48:176])
    assert pages[2, 48:176].view(torch.float32).eq(2.0).all()
    # States that do not share one page allocation are refused.
    with pytest.raises(ValueError, match="does not share one paged allocation"):
        apply_kv_cache_group_edits(config, {"model.layers.0.mixer": [conv, ssm.clone()]})


@pytest.mark.parametrize("layout", [KVCacheLayout.LBNHC, KVCacheLayout.LBHNC])
def test_sub_paged_attention_edit_merges_kernel_pages_by_view(layout: KVCacheLayout) -> None:
    groups = [KVCacheGroupSpec([attn(0), attn(1)], full(32, heads=2, head_size=8))]
    config, caches, buf = allocate(groups, layout=layout, kernel_block_sizes=[8])
    original = caches[attn(1)]
    assert tuple(original.shape) == (NB * 4, 2, 8, 16)  # 4 kernel pages per 32-token block
    buf.copy_(torch.arange(buf.numel(), dtype=torch.int64).to(torch.int8))
    edited = apply_kv_cache_group_edits(config, caches)
    merged = edited[attn(1)]
    _assert_same_memory(merged, original)
    # vLLM's own view of the same bytes without kernel pages: [NB, H, 32, C].
    (reference,) = create_kv_cache_views(buf, full(32, 2, 8), NB, layout, config.kv_cache_tensors[1])
    if layout is KVCacheLayout.LBNHC:
        # Token-major pages merge exactly: the edited view is vLLM's block view.
        assert merged.shape == reference.shape and merged.stride() == reference.stride()
        assert torch.equal(merged.view(torch.int16), reference.view(torch.int16))  # bitwise (NaNs)
    else:
        # Head-major pages become opaque whole-block pages of the same bytes.
        assert tuple(merged.shape) == (NB, 1, 32, 32)
        page = full(32, 2, 8).page_size_bytes
        start = reference.storage_offset() * 2
        for b in range(NB):
            got = merged[b].flatten().view(torch.int8)
            assert torch.equal(got, buf[start + b * page : start + (b + 1) * page])
    merged[5].zero_()
    assert original[20:24].eq(0).all() and not original[19].eq(0).all()
    # Edited layers still produce one info with the logical block size.
    assert create_engine_group_infos_from_vllm(config, edited) == [EngineGroupInfo(0, (0, 1), 32)]


def test_sub_paged_edit_refuses_what_a_view_cannot_express() -> None:
    groups = [KVCacheGroupSpec([attn(0)], full(32))]
    config, caches, _ = allocate(groups, kernel_block_sizes=[8])
    wrong = KVCacheConfig(
        num_blocks=NB,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([attn(0)], full(32, head_size=16))],
    )
    with pytest.raises(ValueError, match=r"4 kernel pages of 512 B != page_size_bytes 4096 B"):
        apply_kv_cache_group_edits(wrong, caches)
    odd = KVCacheConfig(num_blocks=5, kv_cache_tensors=[], kv_cache_groups=config.kv_cache_groups)
    with pytest.raises(ValueError, match="24 pages is not a multiple of num_blocks=5"):
        apply_kv_cache_group_edits(odd, caches)
    packed = KVCacheConfig(
        num_blocks=NB,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([attn(0)], full(32, tokens_per_state=4))],
    )
    with pytest.raises(ValueError, match="tokens_per_state=4"):
        apply_kv_cache_group_edits(packed, caches)
    with pytest.raises(TypeError, match="only Mamba layers may register a list"):
        apply_kv_cache_group_edits(config, {attn(0): [caches[attn(0)]]})


# --- the agent rebuilds the same split from the tensors -------------------------------------------------


def _worked() -> tuple[KVCacheConfig, dict[str, torch.Tensor], torch.Tensor]:
    uniform = UniformTypeKVCacheSpecs(
        block_size=16,
        kv_cache_specs={attn(0): full(), attn(2): full(), attn(4): full(heads=1, head_size=32)},
    )
    return allocate(
        [KVCacheGroupSpec([attn(0), attn(2), attn(4)], uniform), KVCacheGroupSpec([attn(1), attn(3)], full())]
    )


def _shared_sliding() -> tuple[KVCacheConfig, dict[str, torch.Tensor], torch.Tensor]:
    sliding = SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=8, dtype=BF16, sliding_window=64)
    groups = [KVCacheGroupSpec([attn(0), attn(2)], full(16)), KVCacheGroupSpec([attn(1), attn(3)], sliding)]
    return allocate(groups, shared={attn(4): attn(0), attn(5): attn(1)})


def _sub_paged_hnd() -> tuple[KVCacheConfig, dict[str, torch.Tensor], torch.Tensor]:
    groups = [KVCacheGroupSpec([attn(0), attn(1)], full(32)), KVCacheGroupSpec([attn(2)], full(32, heads=1))]
    return allocate(groups, layout=KVCacheLayout.LBHNC, kernel_block_sizes=[8, None])


@pytest.mark.parametrize(
    ("scenario", "dcp_size"),
    [(_worked, 1), (_shared_sliding, 1), (_mamba_hybrid, 1), (_mamba_hybrid, 4), (_sub_paged_hnd, 1)],
)
def test_agent_side_kernel_groups_match_the_infos(scenario: object, dcp_size: int) -> None:
    config, caches, _ = scenario()  # type: ignore[operator]
    edited = apply_kv_cache_group_edits(config, caches)
    infos = create_engine_group_infos_from_vllm(config, edited, dcp_size=dcp_size)
    # What the agent sees: the tensors in registration order, formats detected from them alone.
    tensors = [edited[name] for name in ordered_layer_names(edited)]
    formats = [detect_kv_format(t, {"kv_layout": config.kv_cache_layout}) for t in tensors]
    manager = KVLayerGroupsManager(tensors, formats, infos, tokens_per_chunk=256)
    assert [g.layer_indices for g in manager.kernel_groups] == [i.layer_indices for i in infos]
    assert [g.tokens_per_block for g in manager.kernel_groups] == [i.tokens_per_block for i in infos]
    # Every transferred byte of a block is one block id's page: 256 tokens of each group are
    # 256 / tokens_per_block whole blocks.
    for g, info in zip(manager.kernel_groups, infos, strict=True):
        assert g.calculate_num_blocks(256) == 256 // info.tokens_per_block
