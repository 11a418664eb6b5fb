"""vLLM's KV cache specs -> kvgrid's engine groups: the only kvgrid code that reads vLLM's spec classes.

Registration turns vLLM's ``KVCacheConfig`` plus the registered KV tensors into the engine-neutral
``list[EngineGroupInfo]`` (docs/hybrid-groups.md):

1. :func:`validate_kv_cache_groups` rejects the groups the transfer path cannot serve.
2. :func:`apply_kv_cache_group_edits` re-views tensors whose paging does not match their block ids
   (Mamba state pages, attention split into smaller kernel pages) -- pure views, never copies.
3. :func:`create_engine_group_infos_from_vllm` detects each layer's physical format, maps each
   layer to its engine group (layers that reuse another layer's KV are excluded), splits by
   transfer identity with the same ``group_layers_by_identity`` the agent uses, and emits one
   info per bucket.

Layer indices are positions in :func:`ordered_layer_names` (layer names sorted by the integers in
them, e.g. ``model.layers.3.self_attn.attn`` -> 3); the connector registers tensors in that order,
so both sides index layers alike.

The connector class that uses these, :class:`kvgrid.connector.vllm.KVGridConnector`, re-exports
the public ones (``kvgrid.connector.vllm`` is what other code imports).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

from kvgrid.common.groups import EXCLUDED_ENGINE_GROUP, EngineGroupInfo
from kvgrid.common.layer_groups import group_layers_by_identity
from kvgrid.common.layouts import detect_kv_format

__all__ = [
    "apply_kv_cache_group_edits",
    "create_engine_group_infos_from_vllm",
    "hints_per_layer",
    "layer_sort_key",
    "ordered_layer_names",
    "tokens_per_block",
    "validate_kv_cache_groups",
]

ALIGN_MAMBA_CACHE_MODE = "align"
_LAYER_NUMBER = re.compile(r"[0-9]+")


# --- layer order -------------------------------------------------------------------------------


def layer_sort_key(layer_name: str) -> tuple[int, ...]:
    """The integers among a layer name's dotted parts: ``model.layers.3.self_attn.attn`` -> (3,)."""
    ints = tuple(int(part) for part in layer_name.split(".") if _LAYER_NUMBER.fullmatch(part))
    if not ints:
        raise ValueError(
            f"layer name {layer_name!r} has no layer number; expected a dotted module path with the "
            f"layer index as one part, e.g. 'model.layers.3.self_attn.attn'"
        )
    return ints


def ordered_layer_names(layer_names: Iterable[str]) -> list[str]:
    """Layer names in registration order: by their layer numbers; ties keep their given order."""
    return sorted(layer_names, key=layer_sort_key)


# --- specs ---------------------------------------------------------------------------------------


def _layer_specs(group: KVCacheGroupSpec) -> list[tuple[str, KVCacheSpec]]:
    """(layer name, that layer's own spec) for every layer of a group."""
    spec = group.kv_cache_spec
    if not isinstance(spec, UniformTypeKVCacheSpecs):
        return [(name, spec) for name in group.layer_names]
    out = []
    for name in group.layer_names:
        if name not in spec.kv_cache_specs:
            raise ValueError(
                f"layer {name!r} is in a group whose UniformTypeKVCacheSpecs has no spec for it "
                f"(it has {sorted(spec.kv_cache_specs)})"
            )
        out.append((name, spec.kv_cache_specs[name]))
    return out


def _unsupported_reason(spec: KVCacheSpec) -> str | None:
    if isinstance(spec, CrossAttentionSpec):
        return "CrossAttentionSpec (encoder-decoder cross-attention: its KV depends on the encoder input)"
    if isinstance(spec, MambaSpec) and spec.mamba_cache_mode != ALIGN_MAMBA_CACHE_MODE:
        return (
            f"MambaSpec with mamba_cache_mode={spec.mamba_cache_mode!r} (expected "
            f"{ALIGN_MAMBA_CACHE_MODE!r}: only align mode keeps a reusable state per block; "
            f"enable prefix caching)"
        )
    return None


def validate_kv_cache_groups(kv_cache_config: KVCacheConfig | None) -> None:
    """Raise one ValueError listing every KV cache group kvgrid cannot serve.

    Rejected: cross-attention groups and Mamba groups not in ``align`` cache mode. Declared slot
    compression (``tokens_per_state > 1``) is served and not rejected. ``None`` means no config
    yet: nothing to check.
    """
    if kv_cache_config is None:
        return
    problems = []
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        reasons: dict[str, list[str]] = {}
        for name, spec in _layer_specs(group):
            reason = _unsupported_reason(spec)
            if reason is not None:
                reasons.setdefault(reason, []).append(name)
        for reason, names in reasons.items():
            problems.append(f"group {gid} (layers {names}): {reason}")
    if problems:
        raise ValueError(f"unsupported KV cache groups for kvgrid ({len(problems)}): " + "; ".join(problems))


def tokens_per_block(group_spec: KVCacheSpec, dcp_size: int) -> int:
    # Decode context parallelism shards attention token positions over the DCP ranks, so one
    # block id covers block_size * dcp_size tokens; replicated state (Mamba) is not scaled.
    if group_spec.dcp_sharded:
        return group_spec.block_size * dcp_size
    return group_spec.block_size


def _sw_size_tokens(spec: KVCacheSpec) -> int:
    if isinstance(spec, SlidingWindowSpec):  # includes SlidingWindowMLASpec
        return spec.sliding_window
    if isinstance(spec, ChunkedLocalAttentionSpec):
        # Attention never looks back past the current chunk, and vLLM frees the blocks before it:
        # the chunk size bounds the window that has to be moved.
        return spec.attention_chunk_size
    if isinstance(spec, MambaSpec):
        # Align mode snapshots the state at each block boundary: one block is the whole window.
        return spec.block_size
    # FullAttentionSpec.sliding_window (hybrid allocator off) still allocates every block: full.
    return -1


# --- group edits -----------------------------------------------------------------------------------


def _byte_offset(t: torch.Tensor) -> int:
    return int(t.storage_offset()) * t.element_size()


def _mamba_page_view(
    name: str, state: torch.Tensor, page_bytes: int, block_stride_bytes: int, spec: MambaSpec
) -> torch.Tensor:
    """View each block's padded state page as ``[num_blocks, 1, block_size, C]``.

    The page is opaque bytes (conv | ssm | padding); viewing it with ``block_size`` slots makes its
    paging granularity the block-id granularity, so it is not mistaken for a compressed group.
    """
    bs = spec.block_size
    if block_stride_bytes < page_bytes:
        raise ValueError(
            f"layer {name!r}: Mamba block stride {block_stride_bytes} B is smaller than its page "
            f"{page_bytes} B"
        )
    dtype = spec.dtypes[0] if spec.dtypes else torch.uint8
    itemsize = torch.empty((), dtype=dtype).element_size()
    if page_bytes % (bs * itemsize) or block_stride_bytes % itemsize or _byte_offset(state) % itemsize:
        dtype, itemsize = torch.uint8, 1
    if page_bytes % bs:
        raise ValueError(
            f"layer {name!r}: Mamba page of {page_bytes} B does not split into block_size={bs} "
            f"slots; expected a page size that is a multiple of the block size"
        )
    if state.dim() and state.stride(-1) != 1 and state.shape[-1] != 1:
        raise ValueError(
            f"layer {name!r}: Mamba state strides {state.stride()} have no unit-stride last dim; "
            f"expected a dense state page"
        )
    slot_bytes = page_bytes // bs
    # uint8 view -> strided page view -> element view: views all the way, the bytes never move.
    pages = state.view(torch.uint8).as_strided(
        (state.shape[0], 1, bs, slot_bytes),
        (block_stride_bytes, page_bytes, slot_bytes, 1),
        _byte_offset(state),
    )
    return pages if dtype == torch.uint8 else pages.view(dtype)


def _edit_mamba(name: str, cache: Any, spec: MambaSpec) -> torch.Tensor:
    if isinstance(cache, torch.Tensor):
        # vLLM >= 0.26: one int8 view per layer, [num_blocks, 1, 1, state bytes], strided by page.
        if cache.dim() != 4 or tuple(cache.shape[1:3]) != (1, 1):
            raise ValueError(
                f"layer {name!r}: Mamba cache of shape {tuple(cache.shape)}: expected "
                f"[num_blocks, 1, 1, state_bytes] or a (conv_state, ssm_state) pair"
            )
        stride_bytes = cache.stride(0) * cache.element_size()
        return _mamba_page_view(name, cache, spec.page_size_bytes, stride_bytes, spec)
    states = list(cache)
    if not states or not all(isinstance(s, torch.Tensor) for s in states):
        raise TypeError(f"layer {name!r}: expected a tensor or a sequence of state tensors, got {cache!r}")
    first = states[0]
    storage = first.untyped_storage().data_ptr()
    page_bytes = spec.page_size_bytes
    start = _byte_offset(first)
    for i, s in enumerate(states):
        stride_bytes = s.stride(0) * s.element_size()
        if s.untyped_storage().data_ptr() != storage or s.shape[0] != first.shape[0]:
            raise ValueError(
                f"layer {name!r}: Mamba state {i} does not share one paged allocation with state 0; "
                f"expected (conv_state, ssm_state) views into one buffer"
            )
        if stride_bytes != page_bytes:
            raise ValueError(
                f"layer {name!r}: Mamba state {i} block stride {stride_bytes} B != page_size_bytes "
                f"{page_bytes} B; expected states packed in one page per block"
            )
        if not start <= _byte_offset(s) < start + page_bytes:
            raise ValueError(
                f"layer {name!r}: Mamba state {i} starts outside the page of state 0; expected the "
                f"conv state at the start of the page"
            )
    return _mamba_page_view(name, first, page_bytes, page_bytes, spec)


def _edit_sub_paged_attention(
    name: str, cache: torch.Tensor, spec: AttentionSpec, num_blocks: int
) -> torch.Tensor:
    """Merge the ``k`` kernel pages of each logical block back into one page (a view).

    vLLM hands connectors ``[num_blocks * k, H, N / k, C]`` when the attention kernel pages
    smaller than the block (logical block n = kernel pages n*k .. n*k+k-1). Token-major (NHD)
    pages merge into ``[num_blocks, H, N, C]`` exactly; head-major (HND) pages become the opaque
    ``[num_blocks, 1, N, H*C]``: whole blocks round-trip byte for byte, but slot i is not token i,
    so only whole-block transfers are valid for them.
    """
    if cache.dim() != 4 or cache.shape[0] == num_blocks:
        return cache
    k, rem = divmod(cache.shape[0], num_blocks)
    if rem or k < 1:
        raise ValueError(
            f"layer {name!r}: {cache.shape[0]} pages is not a multiple of num_blocks={num_blocks}"
        )
    if spec.tokens_per_state != 1:
        raise ValueError(
            f"layer {name!r}: declared slot compression (tokens_per_state={spec.tokens_per_state}) "
            f"with {k} kernel pages per block cannot be re-paged"
        )
    _, heads, rows, content = cache.shape
    page_bytes = heads * rows * content * cache.element_size()
    if page_bytes * k != spec.page_size_bytes:
        raise ValueError(
            f"layer {name!r}: {k} kernel pages of {page_bytes} B != page_size_bytes "
            f"{spec.page_size_bytes} B of one block"
        )
    strides = cache.stride()
    order = sorted((1, 2, 3), key=lambda d: -strides[d])
    physical = cache.permute(0, *order)
    if not physical.is_contiguous() or order[-1] != 3:
        raise ValueError(
            f"layer {name!r}: kernel pages of shape {tuple(cache.shape)} and strides "
            f"{cache.stride()} are not dense, so {k} of them cannot be merged by a view"
        )
    n = k * rows
    if heads == 1 or order == [2, 1, 3]:  # token-major: [B*k, N/k, H, C] -> [B, N, H, C]
        return physical.view(num_blocks, n, heads, content).permute(0, 2, 1, 3)
    return physical.view(num_blocks, 1, n, heads * content)


def apply_kv_cache_group_edits(
    kv_cache_config: KVCacheConfig | None,
    kv_caches: Mapping[str, Any],
) -> dict[str, torch.Tensor]:
    """Re-view registered caches so each tensor's paging granularity is its block-id granularity.

    - Mamba layers (``align`` mode): the state page (conv | ssm | padding), either vLLM >= 0.26's
      ``[NB, 1, 1, bytes]`` view or an older ``(conv_state, ssm_state)`` pair sharing one page, is
      viewed as ``[NB, 1, block_size, C]`` (conv-state dtype when it divides the page, else uint8).
    - Attention split into ``k`` kernel pages per block: the ``k`` pages are merged into one.

    Every edit is a view of the same storage (never a copy); other layers pass through unchanged,
    and layers that alias one tensor (cross-layer KV sharing) still alias one view. Edited groups
    are byte-addressed: store/retrieve round-trip exactly on the same engine configuration, but
    content-aware processing (layout conversion, head resharding) is not valid for them.
    """
    if kv_cache_config is None:
        specs: dict[str, KVCacheSpec] = {}
    else:
        specs = {
            name: spec
            for group in kv_cache_config.kv_cache_groups
            if not group.host_resident
            for name, spec in _layer_specs(group)
        }
    edited: dict[int, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    # Group owners first, so a sharing layer (no spec) finds its owner's edit by identity.
    for name in sorted(kv_caches, key=lambda n: n not in specs):
        cache = kv_caches[name]
        spec = specs.get(name)
        if id(cache) in edited:
            out[name] = edited[id(cache)]
            continue
        if isinstance(spec, MambaSpec):
            new = _edit_mamba(name, cache, spec)
        elif not isinstance(cache, torch.Tensor):
            raise TypeError(
                f"layer {name!r}: expected a torch.Tensor, got {type(cache).__name__} "
                f"(only Mamba layers may register a list of state tensors)"
            )
        elif isinstance(spec, AttentionSpec) and kv_cache_config is not None:
            new = _edit_sub_paged_attention(name, cache, spec, kv_cache_config.num_blocks)
        else:
            new = cache
        edited[id(cache)] = new
        out[name] = new
    return {name: out[name] for name in kv_caches}


# --- engine group infos ---------------------------------------------------------------------------


def hints_per_layer(
    names: Sequence[str],
    layout_hints: Mapping[str, Any] | None,
    kv_cache_config: KVCacheConfig,
    tensors: Sequence[torch.Tensor] | None = None,
) -> list[Mapping[str, Any] | None]:
    """Each layer's layout hints: what the operator gave (``layout_hints``, one mapping for every
    layer or {layer name: hints}) over what vLLM already says -- the layout it resolved
    (``KVCacheConfig.kv_cache_layout``) and the layer's spec (``num_kv_heads`` of attention layers,
    which tells the heads dim from the slots dim whenever the two sizes differ). Given the layers'
    ``tensors``, the spec's heads count is passed only where the tensor has a dim of that size
    after its block dim (a kernel-page view from :func:`apply_kv_cache_group_edits` folds it away)."""
    default: dict[str, Any] = {}
    if kv_cache_config.kv_cache_layout:
        default["kv_layout"] = kv_cache_config.kv_cache_layout
    shapes = {n: tuple(t.shape) for n, t in zip(names, tensors, strict=True)} if tensors is not None else {}
    from_spec: dict[str, dict[str, Any]] = {}
    for group in kv_cache_config.kv_cache_groups:
        for name, spec in _layer_specs(group):
            if not isinstance(spec, AttentionSpec) or isinstance(spec, MLAAttentionSpec):
                continue
            if name in shapes and spec.num_kv_heads not in shapes[name][1:]:
                continue
            from_spec[name] = {"num_kv_heads": spec.num_kv_heads}
    if layout_hints is not None and any(name in layout_hints for name in names):
        per_layer = [layout_hints.get(name) for name in names]
    else:
        per_layer = [layout_hints] * len(names)
    return [
        {**default, **from_spec.get(name, {}), **(hints or {})} or None
        for name, hints in zip(names, per_layer, strict=True)
    ]


def create_engine_group_infos_from_vllm(
    kv_cache_config: KVCacheConfig | None,
    kv_caches: Mapping[str, torch.Tensor],
    layout_hints: Mapping[str, Any] | None = None,
    dcp_size: int = 1,
) -> list[EngineGroupInfo]:
    """The engine-group view of vLLM's KV cache: one info per (engine group, transfer identity).

    ``kv_caches`` are the registered tensors after :func:`apply_kv_cache_group_edits`; their
    layer indices are positions in ``ordered_layer_names(kv_caches)``. Layers listed by no
    transferable group (cross-layer KV sharing: their KV lives in the owner's blocks; groups with
    ``enable_kv_transfer=False``) get no info. Infos are ordered by their first layer. With no
    config the result is ``[]``: a single non-hybrid group.

    ``layout_hints`` (see ``kvgrid.common.layouts``) is one mapping for all layers or a mapping
    from layer name to that layer's hints. ``dcp_size`` (decode context parallelism) scales the
    tokens per block of attention groups, whose token positions are sharded over the DCP ranks.
    """
    if dcp_size < 1:
        raise ValueError(f"dcp_size={dcp_size}: expected >= 1")
    if kv_cache_config is None or not kv_cache_config.kv_cache_groups:
        return []
    validate_kv_cache_groups(kv_cache_config)

    names = ordered_layer_names(kv_caches)
    index = {name: i for i, name in enumerate(names)}
    tensors = []
    for name in names:
        cache = kv_caches[name]
        if not isinstance(cache, torch.Tensor):
            raise TypeError(
                f"layer {name!r}: expected a torch.Tensor, got {type(cache).__name__}; "
                f"run apply_kv_cache_group_edits first"
            )
        tensors.append(cache)

    per_layer_group = [EXCLUDED_ENGINE_GROUP] * len(names)
    per_layer_spec: dict[int, KVCacheSpec] = {}
    group_tpb: dict[int, int] = {}
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        group_tpb[gid] = tokens_per_block(group.kv_cache_spec, dcp_size)
        for name, spec in _layer_specs(group):
            if name not in index:
                raise ValueError(
                    f"KV cache group {gid} lists layer {name!r}, which has no registered tensor "
                    f"(registered: {names})"
                )
            i = index[name]
            if i in per_layer_spec:
                raise ValueError(f"layer {name!r} is listed by more than one KV cache group")
            per_layer_spec[i] = spec
            if group.enable_kv_transfer:
                per_layer_group[i] = gid

    hints = hints_per_layer(names, layout_hints, kv_cache_config, tensors)
    formats = [detect_kv_format(t, h) for t, h in zip(tensors, hints, strict=True)]
    infos = []
    for identity, layers in group_layers_by_identity(tensors, formats, per_layer_group):
        gid = identity.engine_group_idx
        sws = {_sw_size_tokens(per_layer_spec[i]) for i in layers}
        recurrent = {isinstance(per_layer_spec[i], MambaSpec) for i in layers}
        layer_names = [names[i] for i in layers]
        if len(sws) > 1:
            raise ValueError(
                f"layers {layer_names} share a transfer identity but have different sliding window "
                f"sizes {sorted(sws)}"
            )
        if len(recurrent) > 1:
            raise ValueError(
                f"layers {layer_names} share a transfer identity but mix recurrent-state and attention layers"
            )
        infos.append(
            EngineGroupInfo(
                engine_group_id=gid,
                layer_indices=tuple(layers),
                tokens_per_block=group_tpb[gid],
                sw_size_tokens=sws.pop(),
                recurrent_state=recurrent.pop(),
            )
        )
    return infos
