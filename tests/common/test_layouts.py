"""kvgrid.common.layouts: physical KV layouts detected from real tensors
(docs/hybrid-groups.md, "Layouts")."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgrid.common.layouts import (
    BLOCK_VIEW_DIMS,
    KVFormat,
    block_view,
    detect_kv_format,
    empty_kv_cache,
    kv_geometry,
    physical_dims,
)

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

NB, BS, NH, HS = 6, 16, 4, 8

# Legacy vLLM (0.14-0.22): logical shape from get_kv_cache_shape, physical order from
# get_kv_cache_stride_order (the table in docs/hybrid-groups.md, "Layouts"). The engine hands over
# the *logical* view.
LEGACY = {
    ("FLASH_ATTN", "NHD"): ((2, NB, BS, NH, HS), (0, 1, 2, 3, 4), KVFormat.FLASH_ATTN_NHD),
    ("FLASH_ATTN", "HND"): ((2, NB, BS, NH, HS), (0, 1, 3, 2, 4), KVFormat.FLASH_ATTN_HND),
    ("FLASHINFER", "NHD"): ((NB, 2, BS, NH, HS), (0, 1, 2, 3, 4), KVFormat.FLASHINFER_NHD),
    ("FLASHINFER", "HND"): ((NB, 2, BS, NH, HS), (0, 1, 3, 2, 4), KVFormat.FLASHINFER_HND),
}


def legacy_view(logical: tuple[int, ...], stride_order: tuple[int, ...]) -> torch.Tensor:
    """What legacy vLLM registered: storage in stride order, permuted back to the logical shape."""
    storage = torch.arange(torch.Size(logical).numel(), dtype=torch.float32)
    physical = storage.view([logical[d] for d in stride_order])
    inverse = [stride_order.index(d) for d in range(len(logical))]
    return physical.permute(inverse)


def expected_block(view: torch.Tensor, fmt: KVFormat, b: int) -> torch.Tensor:
    """Block b as [kv, BS, NH, HS], read through the logical view the engine documents."""
    if fmt in (KVFormat.FLASH_ATTN_NHD, KVFormat.FLASH_ATTN_HND):
        return view[:, b]
    return view[b]


# ------------------------------------------------------------------------------------ legacy 5-D


@pytest.mark.parametrize(("backend", "layout"), list(LEGACY))
def test_legacy_views_with_backend_hint(backend: str, layout: str) -> None:
    logical, order, fmt = LEGACY[(backend, layout)]
    view = legacy_view(logical, order)
    assert detect_kv_format(view, {"backend": backend}) is fmt
    geo = kv_geometry(view, fmt)
    assert geo[:5] == (2, NB, BS, NH, HS)
    assert geo.bytes_per_block == 2 * BS * NH * HS * 4
    bv = block_view(view, fmt, slot_major=True)
    assert bv.shape == (NB, 2, BS, NH, HS)
    for b in (0, 3, NB - 1):
        assert torch.equal(bv[b], expected_block(view, fmt, b))


@pytest.mark.parametrize(
    ("backend", "fmt"), [("FLASH_ATTN", KVFormat.FLASH_ATTN_HND), ("FLASHINFER", KVFormat.FLASHINFER_HND)]
)
def test_hnd_storage_under_an_nhd_view_is_decided_by_strides(backend: str, fmt: KVFormat) -> None:
    logical, order, _ = LEGACY[(backend, "HND")]
    view = legacy_view(logical, order)
    assert not view.is_contiguous()
    assert detect_kv_format(view) is fmt  # no hint needed: the permutation is the evidence
    # physical block view walks memory forwards: heads before slots
    assert BLOCK_VIEW_DIMS[fmt] == ("head", "slot", "dim")
    assert block_view(view, fmt).shape == (NB, 2, NH, BS, HS)


def test_block_major_storage_under_flash_attention_view() -> None:
    """A logical [2, NB, BS, NH, HS] view whose storage is block-major (K and V side by side
    inside each block) is the FlashInfer layout, whatever the logical shape says."""
    view = legacy_view((2, NB, BS, NH, HS), (1, 0, 2, 3, 4))
    fmt = detect_kv_format(view)
    assert fmt is KVFormat.FLASHINFER_NHD
    geo = kv_geometry(view, fmt)
    assert geo.block_contiguous and geo.block_stride == 2 * BS * NH * HS
    bv = block_view(view, fmt)
    for b in range(NB):
        assert torch.equal(bv[b, 0], view[0, b]) and torch.equal(bv[b, 1], view[1, b])


def test_contiguous_5d_is_ambiguous_without_hints() -> None:
    t = torch.zeros(2, NB, BS, NH, HS)
    with pytest.raises(ValueError, match="ambiguous") as e:
        detect_kv_format(t)
    assert "kv_layout" in str(e.value) and "num_kv_heads or block_size" in str(e.value)
    assert detect_kv_format(t, {"kv_layout": "NHD"}) is KVFormat.FLASH_ATTN_NHD
    assert detect_kv_format(t, {"kv_layout": "HND"}) is KVFormat.FLASH_ATTN_HND
    assert detect_kv_format(t, {"num_kv_heads": NH}) is KVFormat.FLASH_ATTN_NHD
    assert detect_kv_format(t, {"block_size": NH}) is KVFormat.FLASH_ATTN_HND
    assert detect_kv_format(t, {"backend": "cpu_attn"}) is KVFormat.FLASH_ATTN_HND  # CPU logical is HND


def test_nh_equal_bs_needs_kv_layout() -> None:
    t = torch.zeros(NB, 2, 16, 16, HS)
    for hints in (None, {"num_kv_heads": 16}, {"block_size": 16, "num_kv_heads": 16}):
        with pytest.raises(ValueError, match=r"ambiguous.*kv_layout"):
            detect_kv_format(t, hints)
    assert detect_kv_format(t, {"num_kv_heads": 16, "kv_layout": "HND"}) is KVFormat.FLASHINFER_HND
    assert detect_kv_format(t, {"kv_layout": "LBNHC"}) is KVFormat.FLASHINFER_NHD  # vLLM name alias


def test_nhd_and_hnd_with_equal_geometry_are_different_formats() -> None:
    nhd = legacy_view((2, NB, 16, 16, HS), (0, 1, 2, 3, 4))
    hnd = legacy_view((2, NB, 16, 16, HS), (0, 1, 3, 2, 4))
    assert detect_kv_format(nhd, {"backend": "FLASH_ATTN"}) is KVFormat.FLASH_ATTN_NHD
    assert detect_kv_format(hnd) is KVFormat.FLASH_ATTN_HND
    assert kv_geometry(nhd, KVFormat.FLASH_ATTN_NHD)[:5] == kv_geometry(hnd, KVFormat.FLASH_ATTN_HND)[:5]


def test_kv_dim_position_ambiguous_when_nb_is_two() -> None:
    t = torch.zeros(2, 2, BS, NH, HS)
    with pytest.raises(ValueError, match=r"ambiguous.*backend"):
        detect_kv_format(t, {"kv_layout": "NHD"})
    assert detect_kv_format(t, {"kv_layout": "NHD", "backend": "FLASHINFER"}) is KVFormat.FLASHINFER_NHD
    assert detect_kv_format(t, {"backend": "FLASH_ATTN"}) is KVFormat.FLASH_ATTN_NHD


def test_single_head_mamba_edit_view() -> None:
    # apply_kv_cache_group_edits re-views Mamba state pages as (NB, 2, block_size, 1, head_size)
    t = torch.zeros(NB, 2, BS, 1, 96, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="ambiguous"):
        detect_kv_format(t)  # BS=16 x 1 head, or 16 heads x 1 slot?
    fmt = detect_kv_format(t, {"num_kv_heads": 1})
    assert fmt is KVFormat.FLASHINFER_NHD
    assert kv_geometry(t, fmt).block_size == BS
    # a kv_layout hint cannot contradict a single head: both orders are the same bytes
    assert detect_kv_format(t, {"num_kv_heads": 1, "kv_layout": "HND"}) is KVFormat.FLASHINFER_NHD


def test_hints_that_contradict_the_tensor_are_errors() -> None:
    view = legacy_view((2, NB, BS, NH, HS), (0, 1, 3, 2, 4))
    with pytest.raises(ValueError, match="num_kv_heads=3 contradicts"):
        detect_kv_format(view, {"num_kv_heads": 3})
    with pytest.raises(ValueError, match="num_blocks=7"):
        detect_kv_format(view, {"num_blocks": 7})
    with pytest.raises(ValueError, match="backend='FLASHINFER' contradicts"):
        detect_kv_format(torch.zeros(2, NB, BS, NH, HS), {"backend": "FLASHINFER"})
    with pytest.raises(ValueError, match="kv_layout='XYZ'"):
        detect_kv_format(view, {"kv_layout": "XYZ"})
    with pytest.raises(ValueError, match="block_size=0"):
        detect_kv_format(view, {"block_size": 0})


# ------------------------------------------------------------------------ vLLM >= 0.30 unified


def _vllm_views(
    layout_name: str, spec: object, num_layers: int = 3
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    from vllm.v1.kv_cache_interface import KVCacheLayout, KVCacheTensor, create_kv_cache_views

    layout = KVCacheLayout[layout_name]
    page = spec.page_size_bytes  # type: ignore[attr-defined]
    if layout.is_layer_compact:
        layer_stride, block_stride = NB * page, page
    else:
        layer_stride, block_stride = page, num_layers * page
    if layout_name in ("LHBNC", "BHLNC"):  # heads outside layers/blocks: no per-page strides
        layer_stride = block_stride = None  # type: ignore[assignment]
    tensor = KVCacheTensor(
        size=NB * num_layers * page,
        layers=[f"layer.{i}" for i in range(num_layers)],
        layer_stride=layer_stride,  # type: ignore[arg-type]
        block_stride=block_stride,  # type: ignore[arg-type]
    )
    # bytes < 100 keep every float16 finite, so torch.equal compares real values
    raw = (torch.arange(NB * num_layers * page, dtype=torch.int32) % 100).to(torch.int8)
    return raw, create_kv_cache_views(raw, spec, NB, layout, tensor)  # type: ignore[arg-type]


UNIFIED = {
    "LBNHC": (KVFormat.UNIFIED_NHD, True),
    "BLNHC": (KVFormat.UNIFIED_NHD, True),
    "LBHNC": (KVFormat.UNIFIED_HND, True),
    "BLHNC": (KVFormat.UNIFIED_HND, True),
    "BHLNC": (KVFormat.UNIFIED_HND, False),
    "LHBNC": (KVFormat.UNIFIED_HEAD_MAJOR, False),
}


@pytest.mark.parametrize("layout_name", list(UNIFIED))
def test_vllm_unified_views_are_decided_by_strides(layout_name: str) -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(block_size=BS, num_kv_heads=NH, head_size=HS, dtype=torch.float16)
    raw, views = _vllm_views(layout_name, spec)
    fmt, contiguous = UNIFIED[layout_name]
    for view in views:
        assert view.shape == (NB, NH, BS, 2 * HS)  # K|V side by side in the content dim
        assert detect_kv_format(view) is fmt
        assert detect_kv_format(view, {"num_kv_heads": NH, "block_size": BS}) is fmt
        geo = kv_geometry(view, fmt)
        assert geo[:5] == (1, NB, BS, NH, 2 * HS)
        assert geo.bytes_per_block == spec.page_size_bytes
        assert geo.block_contiguous is contiguous
        bv = block_view(view, fmt)
        assert bv.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr()
        sm = block_view(view, fmt, slot_major=True)
        for b in (0, NB - 1):
            assert torch.equal(sm[b, 0], view[b].transpose(0, 1))
            if contiguous:
                start = (bv[b].data_ptr() - raw.data_ptr()) // raw.element_size()
                page = raw[start : start + spec.page_size_bytes]
                assert torch.equal(bv[b].contiguous().view(torch.int8).flatten(), page)


def test_vllm_mla_view_is_one_plane() -> None:
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    spec = MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    _, views = _vllm_views("LBNHC", spec)
    fmt = detect_kv_format(views[0], {"kv_layout": "NHD"})
    # a size-1 head dim keeps its logical place: NHD and HND are the same bytes here
    assert fmt is KVFormat.UNIFIED_HND
    geo = kv_geometry(views[0], fmt)
    assert (geo.kv_size, geo.num_heads, geo.block_size, geo.head_size) == (1, 1, BS, 576)
    assert geo.bytes_per_block == spec.page_size_bytes


def test_contiguous_copy_of_nhd_view_relabelled_by_hints() -> None:
    view = empty_kv_cache(KVFormat.UNIFIED_NHD, NB, BS, NH, 2 * HS)
    copy = view.transpose(1, 2).contiguous()  # physical [B, N, H, C] presented as is
    assert detect_kv_format(copy) is KVFormat.UNIFIED_HND  # vLLM's logical [B, H, N, C] convention
    assert detect_kv_format(copy, {"num_kv_heads": NH}) is KVFormat.UNIFIED_NHD
    assert detect_kv_format(copy, {"kv_layout": "NHD"}) is KVFormat.UNIFIED_NHD


# ------------------------------------------------------------------------------ MLA, pages


def test_mla_and_indexer_caches() -> None:
    mla = torch.zeros(NB, 64, 576, dtype=torch.bfloat16)
    assert detect_kv_format(mla) is KVFormat.MLA
    geo = kv_geometry(mla, KVFormat.MLA)
    assert (geo.kv_size, geo.num_heads, geo.block_size, geo.head_size, geo.bytes_per_block) == (
        1,
        1,
        64,
        576,
        64 * 576 * 2,
    )
    indexer = torch.zeros(NB, 64, 132, dtype=torch.uint8)  # DSA indexer: values then scales
    assert detect_kv_format(indexer) is KVFormat.MLA
    assert block_view(indexer, KVFormat.MLA).shape == (NB, 1, 64, 1, 132)


def test_opaque_pages() -> None:
    pages = torch.zeros(NB, 4096, dtype=torch.uint8)
    fmt = detect_kv_format(pages, {"num_kv_heads": 8})  # attention hints do not apply to pages
    assert fmt is KVFormat.OPAQUE_PAGES
    geo = kv_geometry(pages, fmt)
    assert (geo.block_size, geo.num_heads, geo.head_size, geo.bytes_per_block) == (1, 1, 4096, 4096)
    # padded pages (a view into a larger per-block stride) keep the block stride
    padded = torch.zeros(NB, 5000, dtype=torch.uint8)[:, :4096]
    assert kv_geometry(padded, detect_kv_format(padded)).block_stride == 5000


@pytest.mark.parametrize(
    "tensor",
    [
        torch.zeros(2, 3, 4, 5, 6, 7),
        torch.zeros(3, NB, BS, NH, HS),
        torch.zeros(NB, BS, 576).transpose(0, 1),
        torch.zeros(NB, 4096).t(),
        torch.zeros(NB, NH, BS, 8).permute(2, 0, 1, 3),
        torch.zeros(1024),
    ],
)
def test_unknown_layouts_name_shape_and_strides(tensor: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="unknown KV cache layout") as e:
        detect_kv_format(tensor)
    assert str(tuple(tensor.shape)) in str(e.value)
    assert str(tuple(tensor.stride())) in str(e.value)


def test_broadcast_strides_rejected() -> None:
    t = torch.zeros(NB, 1, BS, NH, HS).expand(NB, 2, BS, NH, HS)
    with pytest.raises(ValueError, match="broadcast"):
        detect_kv_format(t, {"backend": "FLASHINFER"})


def test_block_view_is_a_view() -> None:
    view = legacy_view((2, NB, BS, NH, HS), (0, 1, 3, 2, 4))
    bv = block_view(view, KVFormat.FLASH_ATTN_HND)
    bv[2, 1, 0, 5, 3] = -1.0  # V, head 0, slot 5, dim 3 of block 2
    assert view[1, 2, 5, 0, 3] == -1.0
    with pytest.raises(ValueError, match="cannot have format"):
        block_view(view, KVFormat.MLA)
    with pytest.raises(ValueError, match="K/V dim"):
        block_view(torch.zeros(NB, 3, BS, NH, HS), KVFormat.FLASHINFER_NHD)


def test_format_properties() -> None:
    assert [f.kv_size for f in KVFormat] == [2, 2, 2, 2, 1, 1, 1, 1, 1]
    assert {f for f in KVFormat if f.is_hnd} == {
        KVFormat.FLASH_ATTN_HND,
        KVFormat.FLASHINFER_HND,
        KVFormat.UNIFIED_HND,
        KVFormat.UNIFIED_HEAD_MAJOR,
    }
    assert physical_dims(KVFormat.FLASHINFER_HND) == ("block", "2", "head", "slot", "dim")
    assert KVFormat("NB_BS_C") is KVFormat.MLA  # the value is the stable name


# ----------------------------------------------------------------------------- property test


@settings(max_examples=80, deadline=None)
@given(
    fmt=st.sampled_from(list(KVFormat)),
    nb=st.integers(3, 5),  # NB == 2 makes [2, 2, ...] need a backend hint (tested above)
    bs=st.integers(2, 9),
    nh=st.integers(2, 5),
    hs=st.integers(1, 6),
    dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.uint8]),
)
def test_every_format_round_trips(
    fmt: KVFormat, nb: int, bs: int, nh: int, hs: int, dtype: torch.dtype
) -> None:
    if fmt is KVFormat.MLA:
        nh = 1
    if fmt is KVFormat.OPAQUE_PAGES:
        bs = nh = 1
    t = empty_kv_cache(fmt, nb, bs, nh, hs, dtype)
    hints: dict[str, object] = {"num_kv_heads": nh, "block_size": bs}
    if fmt.kv_size == 2:
        hints["kv_layout"] = "HND" if fmt.is_hnd else "NHD"
    assert detect_kv_format(t, hints) is fmt
    geo = kv_geometry(t, fmt)
    assert geo[:5] == (fmt.kv_size, nb, bs, nh, hs)
    assert geo.element_size == t.element_size()
    # the physical block view reads memory forwards: block b is one run unless K and V are planes
    # or heads are outermost
    bv = block_view(t, fmt)
    assert bv.shape[0] == nb and bv.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    assert geo.block_contiguous is (
        fmt not in (KVFormat.FLASH_ATTN_NHD, KVFormat.FLASH_ATTN_HND, KVFormat.UNIFIED_HEAD_MAJOR)
    )
    sm = block_view(t, fmt, slot_major=True)
    assert sm.shape == (nb, fmt.kv_size, bs, nh, hs)
