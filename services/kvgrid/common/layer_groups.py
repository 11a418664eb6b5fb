"""Kernel groups: the agent's transfer dispatch units, derived from the real KV tensors.

The engine describes its groups as ``list[EngineGroupInfo]`` (``kvgrid.common.groups``, the wire
contract). The agent rebuilds the split from the registered tensors with the *same*
:func:`group_layers_by_identity` the connector used, then :class:`KVLayerGroupsManager` checks
that both sides agree (``docs/hybrid-groups.md``): info i covers exactly the layers of kernel
group i, so block ids sent per info are the block ids of kernel group i. Nothing here goes on
the wire. Each group's shape is a ``kvgrid_kernels.KernelGroupGeometry``, the descriptor the
transfer kernels run on, so chunk sizes are computed in one place.

Each group has two ground-truth quantities: ``tokens_per_block`` (logical tokens one block id
covers, from the engine) and ``slots_per_block`` (physical slots per block, from the tensor).
Their ratio is the slot compression; it is always derived, never stored.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from kvgrid.common.groups import (
    EXCLUDED_ENGINE_GROUP,
    EngineGroupInfo,
    engine_group_tokens_per_block,
    get_engine_group_indices,
)
from kvgrid.common.layouts import KVFormat, KVGeometry, kv_geometry
from kvgrid_kernels import KernelGroupGeometry

__all__ = [
    "DTYPES",
    "KVLayerGroupInfo",
    "KVLayerGroupsManager",
    "KernelGroupIdentity",
    "ObjectGroupInfo",
    "format_kvcache_shape_spec",
    "group_layers_by_identity",
    "parse_kvcache_shape_spec",
]

KVCaches = Sequence[torch.Tensor] | Mapping[str, torch.Tensor]


class KernelGroupIdentity(NamedTuple):
    """Everything that must be equal for layers to share one kernel launch.

    ``engine_group_idx`` keeps identical shapes of different engine groups apart (block ids only
    mean something inside one engine group); ``kv_format`` keeps different layouts of one engine
    group apart (e.g. a 5-D K/V cache and a 3-D key-only cache).
    """

    kv_size: int
    num_heads: int
    head_size: int
    block_size: int
    engine_group_idx: int
    dtype: torch.dtype
    kv_format: KVFormat


def _tensors(kv_caches: KVCaches) -> list[torch.Tensor]:
    return list(kv_caches.values()) if isinstance(kv_caches, Mapping) else list(kv_caches)


def group_layers_by_identity(
    kv_caches: KVCaches,
    kv_formats: Sequence[KVFormat],
    per_layer_engine_group_idx: Sequence[int] | None = None,
) -> list[tuple[KernelGroupIdentity, list[int]]]:
    """Split the registered layers into kernel groups.

    ``kv_caches`` is in registration order (a mapping's value order); layer i is its i-th tensor
    and has format ``kv_formats[i]``. ``per_layer_engine_group_idx[i]`` is layer i's engine group
    (None: every layer in group 0); layers tagged ``EXCLUDED_ENGINE_GROUP`` (cross-layer KV
    sharing) are skipped. One entry per distinct identity, ordered by first layer index, layers
    ascending: the same inputs always give the same order.
    """
    tensors = _tensors(kv_caches)
    if len(kv_formats) != len(tensors):
        raise ValueError(
            f"kv_formats has {len(kv_formats)} entries but kv_caches has {len(tensors)} layers; "
            f"expected one format per layer"
        )
    if per_layer_engine_group_idx is None:
        per_layer_engine_group_idx = [0] * len(tensors)
    elif len(per_layer_engine_group_idx) != len(tensors):
        raise ValueError(
            f"per_layer_engine_group_idx has {len(per_layer_engine_group_idx)} entries but kv_caches "
            f"has {len(tensors)} layers; expected one engine group index per layer"
        )
    groups: dict[KernelGroupIdentity, list[int]] = {}  # insertion order = first layer order
    for layer, (tensor, fmt, group_idx) in enumerate(
        zip(tensors, kv_formats, per_layer_engine_group_idx, strict=True)
    ):
        if group_idx == EXCLUDED_ENGINE_GROUP:
            continue
        if group_idx < 0:
            raise ValueError(
                f"layer {layer}: engine group index {group_idx}; expected >= 0 or "
                f"EXCLUDED_ENGINE_GROUP ({EXCLUDED_ENGINE_GROUP})"
            )
        try:
            geo = kv_geometry(tensor, KVFormat(fmt))
        except ValueError as e:
            raise ValueError(f"layer {layer}: {e}") from None
        identity = KernelGroupIdentity(
            kv_size=geo.kv_size,
            num_heads=geo.num_heads,
            head_size=geo.head_size,
            block_size=geo.block_size,
            engine_group_idx=int(group_idx),
            dtype=tensor.dtype,
            kv_format=KVFormat(fmt),
        )
        groups.setdefault(identity, []).append(layer)
    return list(groups.items())


@dataclass(frozen=True)
class KVLayerGroupInfo:
    """One kernel group: layers transferred by one launch with one block-id list.

    Built by :class:`KVLayerGroupsManager` (or :func:`parse_kvcache_shape_spec` for benchmarks,
    which leaves ``kv_format`` None). Block ids sent for this group index dim ``block`` of each
    layer's tensor (see ``kvgrid.common.layouts.block_view``); one block id covers
    ``tokens_per_block`` tokens held in ``slots_per_block`` slots.
    """

    layer_indices: tuple[int, ...]
    """Registered layer indices, ascending; the kernel iterates layers in this order."""
    shape: KernelGroupGeometry
    """Shape, dtype, ``tokens_per_block`` and the chunk arithmetic (``shape.num_layers`` equals
    ``len(layer_indices)``)."""
    kv_format: KVFormat | None
    engine_group_idx: int = 0
    """Engine block-id space this group reads block ids from."""
    sw_size_tokens: int = -1
    """Sliding window in tokens; -1 = full attention."""
    recurrent_state: bool = False
    """Recurrent (Mamba-like) state snapshots."""
    extra_object_group_tag: int = 0
    object_group: int = 0
    """Index into :attr:`KVLayerGroupsManager.object_groups`."""

    def __post_init__(self) -> None:
        if self.shape.num_layers != len(self.layer_indices):
            raise ValueError(
                f"kernel group of layers {list(self.layer_indices)}: shape.num_layers="
                f"{self.shape.num_layers}, expected {len(self.layer_indices)}"
            )

    @property
    def num_layers(self) -> int:
        return len(self.layer_indices)

    @property
    def dtype(self) -> torch.dtype:
        """Kernel template dtype (``shape.dtype``)."""
        return self.shape.dtype

    @property
    def tokens_per_block(self) -> int:
        """Logical tokens per block id (engine); ``slots_per_block`` when the engine did not say."""
        return self.shape.tokens_per_block

    @property
    def slots_per_block(self) -> int:
        """Physical slots per block, read from the tensor (``shape.block_size``)."""
        return self.shape.block_size

    def calculate_num_blocks(self, num_tokens: int) -> int:
        """Block ids covering ``num_tokens`` tokens; ValueError unless a whole number of blocks."""
        return self.shape.blocks_per_chunk(num_tokens)

    def bytes_per_chunk(self, tokens_per_chunk: int) -> int:
        """Payload bytes of one chunk of ``tokens_per_chunk`` tokens over all layers of the group."""
        return self.shape.bytes_per_chunk(tokens_per_chunk)

    def subchunk_sw_size_tokens(self, tokens_per_chunk: int) -> int:
        """Tokens of a chunk the group must keep: the window if it is shorter than a chunk."""
        if self.sw_size_tokens == -1 or self.sw_size_tokens >= tokens_per_chunk:
            return tokens_per_chunk
        return self.sw_size_tokens


@dataclass(frozen=True)
class ObjectGroupInfo:
    """Kernel groups stored in one memory object: the unit of prefix matching.

    Full-attention KV, each sliding-window size and recurrent state need different prefix
    matching, so with ``separate_object_groups`` each gets its own object group.
    """

    kernel_group_indices: tuple[int, ...]
    sw_size_tokens: int = -1
    """Window in tokens; -1 for full attention (and for the single merged group)."""
    sw_size_chunks: int = -1
    """``ceil(sw_size_tokens / tokens_per_chunk)``; -1 for full attention."""
    recurrent_state: bool = False
    extra_object_group_tag: int = 0


class KVLayerGroupsManager:
    """Kernel and object groups of one registered engine, validated against the engine's infos.

    Raises ValueError (naming the group and the values) when:

    * ``kv_formats`` and ``kv_caches`` differ in length, or ``tokens_per_chunk`` <= 0;
    * an info lists a layer outside ``[0, num_layers)`` or a layer twice;
    * infos of one engine group disagree on ``tokens_per_block``;
    * the number of infos differs from the number of kernel groups, or info i's
      ``layer_indices`` (or engine group) differ from kernel group i's;
    * the layers of one kernel group differ in ``num_blocks`` or block stride;
    * ``tokens_per_block % slots_per_block != 0``;
    * ``tokens_per_chunk % tokens_per_block != 0``;
    * a sliding window shorter than a chunk is not a multiple of ``tokens_per_block``.

    With no infos every layer is in engine group 0 and ``tokens_per_block`` = ``slots_per_block``.
    """

    def __init__(
        self,
        kv_caches: KVCaches,
        kv_formats: Sequence[KVFormat],
        engine_group_infos: Sequence[EngineGroupInfo] = (),
        tokens_per_chunk: int = 256,
        separate_object_groups: bool = False,
    ) -> None:
        tensors = _tensors(kv_caches)
        if len(kv_formats) != len(tensors):
            raise ValueError(
                f"kv_formats has {len(kv_formats)} entries but kv_caches has {len(tensors)} layers; "
                f"expected one format per layer"
            )
        if tokens_per_chunk <= 0:
            raise ValueError(f"tokens_per_chunk={tokens_per_chunk}: expected > 0")
        self.tokens_per_chunk = tokens_per_chunk
        self.separate_object_groups = separate_object_groups
        infos = list(engine_group_infos)
        self.engine_group_infos: tuple[EngineGroupInfo, ...] = tuple(infos)
        engine_group_tokens_per_block(infos)  # one block size per engine group
        self.engine_group_indices: list[int] = get_engine_group_indices(infos, len(tensors))

        identities = group_layers_by_identity(tensors, kv_formats, self.engine_group_indices)
        if infos and len(infos) != len(identities):
            found = "; ".join(
                f"kernel group {i}: engine group {ident.engine_group_idx}, layers {layers}, "
                f"{ident.kv_format.name} {tuple(ident[:4])} {ident.dtype}"
                for i, (ident, layers) in enumerate(identities)
            )
            raise ValueError(
                f"{len(infos)} engine group infos but the tensors form {len(identities)} kernel groups "
                f"({found or 'none'}); expected one info per kernel group, in first-layer order"
            )

        draft: list[KVLayerGroupInfo] = []
        for i, (ident, layers) in enumerate(identities):
            info = infos[i] if infos else None
            if info is not None and (
                info.layer_indices != tuple(layers) or info.engine_group_id != ident.engine_group_idx
            ):
                raise ValueError(
                    f"engine group info {i} covers layers {list(info.layer_indices)} of engine group "
                    f"{info.engine_group_id} but kernel group {i} has layers {layers} of engine group "
                    f"{ident.engine_group_idx}; expected the same layers (the tensors decide the split)"
                )
            geo = _common_geometry(tensors, layers, ident.kv_format, i)
            tokens_per_block = (
                info.tokens_per_block if info is not None and info.tokens_per_block > 0 else geo.block_size
            )
            sw = info.sw_size_tokens if info is not None else -1
            _validate_block_chunk_size(i, geo.block_size, tokens_per_block, tokens_per_chunk, sw)
            shape = KernelGroupGeometry(
                kv_size=geo.kv_size,
                num_layers=len(layers),
                num_blocks=geo.num_blocks,
                block_size=geo.block_size,
                num_heads=geo.num_heads,
                head_size=geo.head_size,
                dtype=ident.dtype,
                tokens_per_block=tokens_per_block,
                block_stride=geo.block_stride,
            )
            draft.append(
                KVLayerGroupInfo(
                    layer_indices=tuple(layers),
                    shape=shape,
                    kv_format=ident.kv_format,
                    engine_group_idx=ident.engine_group_idx,
                    sw_size_tokens=sw,
                    recurrent_state=info.recurrent_state if info is not None else False,
                    extra_object_group_tag=info.extra_object_group_tag if info is not None else 0,
                )
            )
        self.object_groups: list[ObjectGroupInfo] = _detect_object_groups(
            draft, tokens_per_chunk, separate_object_groups
        )
        owner = {k: o for o, og in enumerate(self.object_groups) for k in og.kernel_group_indices}
        self.kernel_groups: list[KVLayerGroupInfo] = [
            _replace_object_group(g, owner[k]) for k, g in enumerate(draft)
        ]

    @property
    def num_kernel_groups(self) -> int:
        return len(self.kernel_groups)

    @property
    def num_object_groups(self) -> int:
        return len(self.object_groups)

    def info_index(self, group: int) -> int:
        """Which per-info block-id list kernel group ``group`` reads: info ``group`` (info i covers
        kernel group i), or the one list of an engine that sent no infos."""
        return group if self.engine_group_infos else 0

    def blocks_per_chunk(self, group: int) -> int:
        """Block ids of kernel group ``group`` per chunk."""
        return self.kernel_groups[group].calculate_num_blocks(self.tokens_per_chunk)

    def slots_per_chunk(self, group: int) -> int:
        return self.kernel_groups[group].shape.slots_per_chunk(self.tokens_per_chunk)

    def bytes_per_chunk(self, group: int | None = None) -> int:
        """Payload bytes of one chunk for one kernel group, or for all of them (None)."""
        groups = self.kernel_groups if group is None else [self.kernel_groups[group]]
        return sum(g.bytes_per_chunk(self.tokens_per_chunk) for g in groups)


def _common_geometry(tensors: list[torch.Tensor], layers: list[int], fmt: KVFormat, group: int) -> KVGeometry:
    """The one geometry every layer of kernel group ``group`` shares (same blocks and block stride)."""
    geos = [kv_geometry(tensors[layer], fmt) for layer in layers]
    first = geos[0]
    for layer, geo in zip(layers, geos, strict=True):
        if (geo.num_blocks, geo.block_stride) != (first.num_blocks, first.block_stride):
            raise ValueError(
                f"kernel group {group}: layer {layer} has {geo.num_blocks} blocks with block stride "
                f"{geo.block_stride} but layer {layers[0]} has {first.num_blocks} with "
                f"{first.block_stride}; expected every layer of a kernel group alike"
            )
    return first


def _replace_object_group(g: KVLayerGroupInfo, object_group: int) -> KVLayerGroupInfo:
    return replace(g, object_group=object_group)


def _validate_block_chunk_size(
    group: int, slots_per_block: int, tokens_per_block: int, tokens_per_chunk: int, sw_size_tokens: int
) -> None:
    if tokens_per_block % slots_per_block:
        raise ValueError(
            f"kernel group {group}: tokens_per_block={tokens_per_block} must be a multiple of "
            f"slots_per_block={slots_per_block} (whole tokens per slot)"
        )
    if tokens_per_chunk % tokens_per_block:
        raise ValueError(
            f"kernel group {group}: tokens_per_chunk={tokens_per_chunk} must be a multiple of the "
            f"group's tokens_per_block={tokens_per_block}"
        )
    if 0 < sw_size_tokens < tokens_per_chunk and sw_size_tokens % tokens_per_block:
        raise ValueError(
            f"kernel group {group}: sub-chunk sliding window sw_size_tokens={sw_size_tokens} "
            f"(< tokens_per_chunk={tokens_per_chunk}) must be a multiple of "
            f"tokens_per_block={tokens_per_block}"
        )


def _detect_object_groups(
    groups: Sequence[KVLayerGroupInfo], tokens_per_chunk: int, separate: bool
) -> list[ObjectGroupInfo]:
    if not groups:
        return []
    if not separate:
        return [ObjectGroupInfo(kernel_group_indices=tuple(range(len(groups))))]
    buckets: dict[tuple[bool, int, int], list[int]] = {}  # insertion order = first kernel group
    for k, g in enumerate(groups):
        buckets.setdefault((g.recurrent_state, g.sw_size_tokens, g.extra_object_group_tag), []).append(k)
    return [
        ObjectGroupInfo(
            kernel_group_indices=tuple(members),
            sw_size_tokens=sw,
            sw_size_chunks=-1 if sw == -1 else math.ceil(sw / tokens_per_chunk),
            recurrent_state=recurrent,
            extra_object_group_tag=tag,
        )
        for (recurrent, sw, tag), members in buckets.items()
    ]


# ---------------------------------------------------------------------------------------------
# --kvcache-shape-spec

DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "uint8": torch.uint8,
    "int8": torch.int8,
}
"""dtype names of the shape spec (canonical spelling; parsing is case-insensitive)."""
_DTYPE_ALIASES = {
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "fp32": "float32",
    "float": "float32",
}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_GROUP_RE = re.compile(r"^\((?P<shape>[^()]*)\):(?P<dtype>[^:]*):(?P<layers>[^:]*)$")


def parse_kvcache_shape_spec(spec: str) -> list[KVLayerGroupInfo]:
    """Parse ``(kv_size,NB,BS,NH,HS):dtype:num_layers`` groups joined by ``;``.

    Example: ``(2,1024,16,8,128):float16:30;(1,1024,16,4,64):bfloat16:2``. Whitespace is
    allowed around numbers and groups; one trailing ``;`` is ignored, an empty group is an error.
    Layers are numbered consecutively across groups; ``tokens_per_block`` = BS, engine group 0,
    ``kv_format`` None.
    Errors name the group (1-based), its text and what is wrong.
    """
    if not isinstance(spec, str):
        raise TypeError(f"kvcache shape spec: expected a str, got {type(spec).__name__}")
    if not spec.strip():
        raise ValueError(
            "kvcache shape spec is empty; expected '(kv_size,NB,BS,NH,HS):dtype:num_layers[;...]'"
        )
    parts = [p.strip() for p in spec.split(";")]
    if parts and parts[-1] == "":
        parts.pop()
    out: list[KVLayerGroupInfo] = []
    next_layer = 0
    for n, part in enumerate(parts, start=1):
        where = f"kvcache shape spec group {n} ({part!r})"
        if not part:
            raise ValueError(f"{where} is empty; expected groups joined by a single ';'")
        compact = re.sub(r"\s+", "", part)
        m = _GROUP_RE.match(compact)
        if m is None:
            raise ValueError(f"{where}: expected '(kv_size,NB,BS,NH,HS):dtype:num_layers'")
        fields = m.group("shape").split(",")
        if len(fields) != 5:
            raise ValueError(f"{where}: expected 5 numbers (kv_size,NB,BS,NH,HS), got {len(fields)}")
        nums = []
        for name, text in zip(
            ("kv_size", "NB", "BS", "NH", "HS", "num_layers"), [*fields, m["layers"]], strict=True
        ):
            if not (text.isascii() and text.isdigit()):
                raise ValueError(f"{where}: {name}={text!r} is not a non-negative integer")
            value = int(text)
            if value <= 0:
                raise ValueError(f"{where}: {name}={value}, expected > 0")
            nums.append(value)
        kv_size, nb, bs, nh, hs, num_layers = nums
        if kv_size not in (1, 2):
            raise ValueError(f"{where}: kv_size={kv_size}, expected 1 (one plane) or 2 (K and V)")
        dtype_name = m.group("dtype").lower()
        dtype_name = _DTYPE_ALIASES.get(dtype_name, dtype_name)
        if dtype_name not in DTYPES:
            raise ValueError(
                f"{where}: unrecognized dtype {m.group('dtype')!r}, expected one of {sorted(DTYPES)}"
            )
        dtype = DTYPES[dtype_name]
        layers = tuple(range(next_layer, next_layer + num_layers))
        next_layer += num_layers
        out.append(
            KVLayerGroupInfo(
                layer_indices=layers,
                shape=KernelGroupGeometry(kv_size, num_layers, nb, bs, nh, hs, dtype, tokens_per_block=bs),
                kv_format=None,
            )
        )
    if not out:
        raise ValueError(f"kvcache shape spec {spec!r} has no groups")
    return out


def format_kvcache_shape_spec(groups: Sequence[KVLayerGroupInfo]) -> str:
    """Canonical spec of ``groups``; ``format(parse(s)) == s`` for canonical ``s`` and
    ``parse(format(g)) == g`` for groups that came from a spec."""
    if not groups:
        raise ValueError("format_kvcache_shape_spec: expected at least one group, got none")
    out = []
    for i, g in enumerate(groups):
        if g.dtype not in _DTYPE_NAMES:
            raise ValueError(
                f"group {i}: dtype {g.dtype} has no shape-spec name; expected one of {sorted(DTYPES)}"
            )
        s = g.shape
        out.append(
            f"({s.kv_size},{s.num_blocks},{s.block_size},{s.num_heads},{s.head_size})"
            f":{_DTYPE_NAMES[g.dtype]}:{g.num_layers}"
        )
    return ";".join(out)
