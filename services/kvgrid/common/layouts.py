"""Physical layouts of one layer's paged KV tensor, detected from the real tensor.

Every engine version lays a layer's KV cache out differently (``docs/hybrid-groups.md`` has the
table). kvgrid never assumes a shape: :func:`detect_kv_format` reads shape, strides and dtype (plus
optional *layout hints*) and names the physical layout as a :class:`KVFormat`; :func:`block_view`
and :func:`kv_geometry` then give the kernels one uniform, copy-free way to address block ``b``.

Vocabulary (per layer): NB blocks, BS slots per block (the tensor's block dimension; equals the
engine's tokens per block unless slots are compressed), NH KV heads, HS head size, C content
(``head_size + head_size_v`` elements with K and V side by side), ``kv_size`` 2 when K and V are
separate planes, 1 when there is one plane (MLA, fused K|V content, opaque pages).

How the physical order is read: the non-singleton dimensions are sorted by stride (largest
first); a size-1 dimension has no meaningful stride and stays at its own position. A format is
the *labelled* physical order, e.g. ``[NB, 2, NH, BS, HS]``. Overlapping or broadcast strides are
rejected.

How labels are decided (never guessed):

* rank 2 ``[NB, P]``: opaque pages (any dtype; Mamba state, edited pages).
* rank 3 ``[NB, BS, C]`` in that physical order: MLA-like, one plane (also uint8 indexer caches).
* rank 4: vLLM >= 0.28 per-layer views are always *logically* ``[B, H, N, C]`` (K|V fused in C);
  the strides give the physical order (``LBNHC`` → ``[B, N, H, C]`` = NHD, ``LBHNC`` →
  ``[B, H, N, C]`` = HND, ``LHBNC`` → ``[H, B, N, C]`` head-major). Hints that contradict that
  convention (e.g. a contiguous copy of an NHD view plus ``num_kv_heads``) relabel dims 1/2.
* rank 5 (legacy vLLM 0.14-0.22, and edited Mamba/sub-paged views): K/V and block dims are
  logical dims 0/1 (whichever is 2 is K/V), slot/head are dims 2/3. Hints filter the possible
  labellings first; if several survive, the ``backend`` hint's logical order is preferred, then,
  for a *permuted* view (strides differ from row-major), vLLM's legacy logical order
  ``[.., BS, NH, HS]``, so the strides decide NHD vs HND. A row-major tensor fits NHD and HND
  alike (and both of dims 0/1 may be 2), so without a deciding hint :func:`detect_kv_format`
  raises a ValueError that says it is ambiguous and which hint to pass.

Layout hints (a mapping; unknown keys are ignored; describe *this* tensor, so pass per-layer
values for hybrid models):

* ``kv_layout``: ``"NHD"``/``"HND"`` or a vLLM ``KVCacheLayout`` name (``LBNHC``/``BLNHC`` → NHD,
  ``LBHNC``/``BLHNC``/``BHLNC`` → HND, ``LHBNC`` → head-major). Ignored when NH or BS is 1
  (both orders are then the same bytes).
* ``backend``: the attention backend whose *logical* shape the tensor has: ``FLASH_ATTN``
  (``[2,NB,BS,NH,HS]``), ``FLASHINFER``/``TRITON_ATTN`` (``[NB,2,BS,NH,HS]``), ``CPU_ATTN``/
  ``TORCH_SDPA`` (``[2,NB,NH,BS,HS]``). Only rank-5 tensors consult it: it fixes which of dims
  0/1 is K/V (an error if that dim is not 2) and prefers its slot/head order.
* ``num_kv_heads``, ``block_size`` (slots per block *in the tensor*, i.e. the kernel block size,
  not a compressed group's tokens per block), ``num_blocks``: must match the tensor (ValueError
  otherwise) for rank-4/5 tensors; they tell candidate labellings apart.

A size-1 head or slot dim keeps its logical position, so vLLM's MLA view ``[B, 1, N, C]`` reads
as ``UNIFIED_HND`` under any layout: NHD and HND are then the same bytes. Detect on the same
(shape, strides, dtype, hints) on both sides of the wire and you get the same format.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

__all__ = [
    "BLOCK_VIEW_DIMS",
    "KVFormat",
    "KVGeometry",
    "block_view",
    "detect_kv_format",
    "empty_kv_cache",
    "kv_geometry",
    "physical_dims",
]


class KVFormat(enum.StrEnum):
    """Physical layout of one layer's KV tensor; the value spells the physical dim order.

    The names say which engine made a layout common; the value is what matters. ``kv_size`` is 2
    for the FlashAttention/FlashInfer forms and 1 for the rest.
    """

    FLASH_ATTN_NHD = "2_NB_BS_NH_HS"
    """``[2, NB, BS, NH, HS]``: K plane then V plane (vLLM FlashAttention, NHD)."""
    FLASH_ATTN_HND = "2_NB_NH_BS_HS"
    """``[2, NB, NH, BS, HS]`` (vLLM FlashAttention with HND; vLLM CPU attention)."""
    FLASHINFER_NHD = "NB_2_BS_NH_HS"
    """``[NB, 2, BS, NH, HS]``: K and V inside each block (FlashInfer/Triton, NHD; Mamba edits)."""
    FLASHINFER_HND = "NB_2_NH_BS_HS"
    """``[NB, 2, NH, BS, HS]`` (FlashInfer/Triton, HND)."""
    MLA = "NB_BS_C"
    """``[NB, BS, C]``: one latent vector per slot (MLA; DSA indexer as uint8)."""
    UNIFIED_NHD = "NB_BS_NH_C"
    """vLLM >= 0.28 view ``[B, H, N, C]`` stored ``[B, N, H, C]``; K|V side by side in C (LBNHC)."""
    UNIFIED_HND = "NB_NH_BS_C"
    """vLLM >= 0.28 view ``[B, H, N, C]`` stored as is; K|V side by side in C (LBHNC, BLHNC)."""
    UNIFIED_HEAD_MAJOR = "NH_NB_BS_C"
    """vLLM >= 0.30 view ``[B, H, N, C]`` stored ``[H, B, N, C]`` (LHBNC): a block is NH runs."""
    OPAQUE_PAGES = "NB_PAGE"
    """``[NB, P]``: one opaque page per block (Mamba state, edited pages; usually uint8)."""

    @property
    def kv_size(self) -> int:
        """2 when K and V are separate planes, else 1."""
        return 2 if "2" in _PHYS_LABELS[self] else 1

    @property
    def is_hnd(self) -> bool:
        """True when heads come before slots in memory."""
        labels = _PHYS_LABELS[self]
        return "head" in labels and "slot" in labels and labels.index("head") < labels.index("slot")


# Physical dim labels per format ("2" = the K/V dim, "dim" = head size or content).
_PHYS_LABELS: dict[KVFormat, tuple[str, ...]] = {
    KVFormat.FLASH_ATTN_NHD: ("2", "block", "slot", "head", "dim"),
    KVFormat.FLASH_ATTN_HND: ("2", "block", "head", "slot", "dim"),
    KVFormat.FLASHINFER_NHD: ("block", "2", "slot", "head", "dim"),
    KVFormat.FLASHINFER_HND: ("block", "2", "head", "slot", "dim"),
    KVFormat.MLA: ("block", "slot", "dim"),
    KVFormat.UNIFIED_NHD: ("block", "slot", "head", "dim"),
    KVFormat.UNIFIED_HND: ("block", "head", "slot", "dim"),
    KVFormat.UNIFIED_HEAD_MAJOR: ("head", "block", "slot", "dim"),
    KVFormat.OPAQUE_PAGES: ("block", "dim"),
}
_FORMAT_BY_LABELS = {labels: fmt for fmt, labels in _PHYS_LABELS.items()}

BLOCK_VIEW_DIMS: dict[KVFormat, tuple[str, str, str]] = {
    fmt: ("head", "slot", "dim") if fmt.is_hnd else ("slot", "head", "dim") for fmt in KVFormat
}
"""Meaning of dims 2, 3, 4 of :func:`block_view` (physical order) for each format."""


def physical_dims(fmt: KVFormat) -> tuple[str, ...]:
    """Physical dim labels of ``fmt`` outermost first: ``"2"`` (K/V), ``"block"``, ``"slot"``,
    ``"head"``, ``"dim"`` (head size, fused K|V content, or page elements)."""
    return _PHYS_LABELS[fmt]


# ---------------------------------------------------------------------------------------------
# hints

_KV_LAYOUT_ALIASES = {
    "NHD": "NHD",
    "LBNHC": "NHD",
    "BLNHC": "NHD",
    "HND": "HND",
    "LBHNC": "HND",
    "BLHNC": "HND",
    "BHLNC": "HND",
    "LHBNC": "HEAD_MAJOR",
}
# backend -> (logical position of the K/V dim, logical labels of dims 2 and 3) for rank-5 caches
_BACKENDS: dict[str, tuple[int, tuple[str, str]]] = {
    "FLASH_ATTN": (0, ("slot", "head")),
    "FLASH_ATTENTION": (0, ("slot", "head")),
    "FLASHINFER": (1, ("slot", "head")),
    "TRITON_ATTN": (1, ("slot", "head")),
    "TRITON": (1, ("slot", "head")),
    "CPU_ATTN": (0, ("head", "slot")),
    "TORCH_SDPA": (0, ("head", "slot")),
}
_INT_HINTS = ("num_kv_heads", "block_size", "num_blocks")


class _Hints(NamedTuple):
    kv_layout: str | None
    backend: str | None
    num_kv_heads: int | None
    block_size: int | None
    num_blocks: int | None


def _parse_hints(layout_hints: Mapping[str, Any] | None) -> _Hints:
    hints = dict(layout_hints or {})
    kv_layout = hints.get("kv_layout")
    if kv_layout is not None:
        if not isinstance(kv_layout, str) or kv_layout.upper() not in _KV_LAYOUT_ALIASES:
            raise ValueError(
                f"layout_hints kv_layout={kv_layout!r}: expected one of {sorted(_KV_LAYOUT_ALIASES)}"
            )
        kv_layout = _KV_LAYOUT_ALIASES[kv_layout.upper()]
    backend = hints.get("backend")
    if backend is not None:
        if not isinstance(backend, str):
            raise ValueError(f"layout_hints backend={backend!r}: expected a backend name string")
        backend = backend.upper()
    ints: dict[str, int | None] = {}
    for key in _INT_HINTS:
        value = hints.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ValueError(f"layout_hints {key}={value!r}: expected a positive int")
        ints[key] = value
    return _Hints(kv_layout, backend, ints["num_kv_heads"], ints["block_size"], ints["num_blocks"])


# ---------------------------------------------------------------------------------------------
# physical order


def _describe(tensor: torch.Tensor) -> str:
    return f"shape {tuple(tensor.shape)}, strides {tuple(tensor.stride())}, dtype {tensor.dtype}"


def _physical_perm(tensor: torch.Tensor) -> tuple[int, ...]:
    """Logical dims in physical order (outermost first); size-1 dims keep their own position."""
    shape, stride = tuple(tensor.shape), tuple(tensor.stride())
    movable = [d for d in range(tensor.dim()) if shape[d] != 1]
    ordered = sorted(movable, key=lambda d: -stride[d])  # stable: ties keep logical order
    for outer, inner in itertools.pairwise(ordered):
        if stride[outer] < stride[inner] * shape[inner]:
            raise ValueError(
                f"KV tensor with {_describe(tensor)} has overlapping or broadcast strides "
                f"(dim {outer} vs dim {inner}); expected a dense or padded paged buffer"
            )
    if ordered and stride[ordered[-1]] < 1:
        raise ValueError(
            f"KV tensor with {_describe(tensor)} has a broadcast (zero) stride; "
            f"expected a dense or padded paged buffer"
        )
    it = iter(ordered)
    return tuple(d if shape[d] == 1 else next(it) for d in range(tensor.dim()))


class _Candidate(NamedTuple):
    fmt: KVFormat
    sizes: dict[str, int]  # label -> size


def _candidate(tensor: torch.Tensor, perm: tuple[int, ...], labels: tuple[str, ...]) -> _Candidate | None:
    fmt = _FORMAT_BY_LABELS.get(tuple(labels[p] for p in perm))
    if fmt is None:
        return None
    return _Candidate(fmt, {label: int(tensor.shape[d]) for d, label in enumerate(labels)})


def _layout_class(fmt: KVFormat) -> str:
    if fmt is KVFormat.UNIFIED_HEAD_MAJOR:
        return "HEAD_MAJOR"
    return "HND" if fmt.is_hnd else "NHD"


def _unknown(tensor: torch.Tensor, why: str) -> ValueError:
    return ValueError(
        f"unknown KV cache layout: {_describe(tensor)} ({why}); kvgrid understands "
        f"{', '.join(f'{f.name} {list(_PHYS_LABELS[f])}' for f in KVFormat)}"
    )


# ---------------------------------------------------------------------------------------------
# detection


def detect_kv_format(tensor: torch.Tensor, layout_hints: Mapping[str, Any] | None = None) -> KVFormat:
    """Name the physical layout of one layer's KV tensor (see the module docstring for the rules).

    Raises ValueError when the layout is unknown (the message has shape, strides and dtype), when
    the geometry fits several layouts and no hint or stride decides (the message names the hint
    to pass), or when a hint contradicts the tensor.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"detect_kv_format: expected a torch.Tensor, got {type(tensor).__name__}")
    hints = _parse_hints(layout_hints)
    if tensor.dtype.is_complex or tensor.dtype == torch.bool:
        raise _unknown(tensor, "complex and bool tensors are not KV caches")
    rank = tensor.dim()
    perm = _physical_perm(tensor)
    if rank == 2:
        if perm != (0, 1):
            raise _unknown(tensor, "a 2-D page tensor must be block-major")
        return KVFormat.OPAQUE_PAGES
    if rank == 3:
        if perm != (0, 1, 2):
            raise _unknown(tensor, "a 3-D cache must be stored [NB, BS, C]")
        return KVFormat.MLA
    if rank == 4:
        return _detect_rank4(tensor, perm, hints)
    if rank == 5:
        return _detect_rank5(tensor, perm, hints)
    raise _unknown(tensor, f"rank {rank} is not a per-layer paged KV layout")


def _singleton_slot_or_head(c: _Candidate) -> bool:
    return c.sizes.get("slot", 1) == 1 or c.sizes.get("head", 1) == 1


def _filter(cands: list[_Candidate], hints: _Hints, tensor: torch.Tensor) -> list[_Candidate]:
    """Keep the candidates every given hint agrees with; error if a hint rules out all of them."""
    checks: list[tuple[str, Any, Any]] = [
        ("num_kv_heads", hints.num_kv_heads, lambda c: c.sizes.get("head") == hints.num_kv_heads),
        ("block_size", hints.block_size, lambda c: c.sizes.get("slot") == hints.block_size),
        ("num_blocks", hints.num_blocks, lambda c: c.sizes.get("block") == hints.num_blocks),
        (
            "kv_layout",
            hints.kv_layout,
            lambda c: _singleton_slot_or_head(c) or _layout_class(c.fmt) == hints.kv_layout,
        ),
    ]
    for key, value, ok in checks:
        if value is None:
            continue
        kept = [c for c in cands if ok(c)]
        if not kept:
            options = "; ".join(f"{c.fmt.name} {c.sizes}" for c in cands)
            raise ValueError(
                f"layout_hints {key}={value!r} contradicts the KV tensor with {_describe(tensor)}: "
                f"it fits only {options}"
            )
        cands = kept
    return cands


def _same_bytes(perm: tuple[int, ...], cands: list[_Candidate]) -> bool:
    # Candidates that differ only in where a size-1 slot/head dim sits describe the same bytes.
    first = cands[0]
    return _singleton_slot_or_head(first) and all(
        c.sizes == first.sizes and _kv_logical_pos(c, perm) == _kv_logical_pos(first, perm) for c in cands
    )


def _ambiguous(tensor: torch.Tensor, cands: list[_Candidate], hint_names: list[str]) -> ValueError:
    options = "; ".join(f"{c.fmt.name} {c.sizes}" for c in cands)
    return ValueError(
        f"ambiguous KV cache layout: {_describe(tensor)} fits {options}; pass "
        f"layout_hints with {' or '.join(hint_names)} to decide"
    )


def _detect_rank4(tensor: torch.Tensor, perm: tuple[int, ...], hints: _Hints) -> KVFormat:
    conventional = ("block", "head", "slot", "dim")  # vLLM >= 0.28 logical [B, H, N, C]
    labellings = [conventional]
    if hints.num_kv_heads or hints.block_size or hints.kv_layout:
        # Only a hint may relabel dims 1/2 (e.g. a contiguous copy of an NHD view).
        labellings.append(("block", "slot", "head", "dim"))
    cands = [c for c in (_candidate(tensor, perm, lab) for lab in labellings) if c]
    if not cands:
        raise _unknown(tensor, "a 4-D cache must be a [B, H, N, C] view stored B,N,H,C / B,H,N,C / H,B,N,C")
    cands = _filter(cands, hints, tensor)
    # Both labellings survive only when the hints cannot tell them apart: vLLM's fixed logical
    # order decides.
    return cands[0].fmt


def _detect_rank5(tensor: torch.Tensor, perm: tuple[int, ...], hints: _Hints) -> KVFormat:
    shape = tuple(tensor.shape)
    kv_positions = [p for p in (0, 1) if shape[p] == 2]
    if not kv_positions:
        raise _unknown(tensor, "a 5-D cache needs a K/V dim of size 2 at dim 0 or 1")
    backend: tuple[int, tuple[str, str]] | None = None
    if hints.backend is not None and hints.backend in _BACKENDS:
        backend = _BACKENDS[hints.backend]
        if backend[0] not in kv_positions:
            raise ValueError(
                f"layout_hints backend={hints.backend!r} contradicts the KV tensor with {_describe(tensor)}: "
                f"that backend keeps K/V at dim {backend[0]}, which has size {shape[backend[0]]}, not 2"
            )
        kv_positions = [backend[0]]
    cands: list[_Candidate] = []
    for kv_pos in kv_positions:
        first = ("2", "block") if kv_pos == 0 else ("block", "2")
        for mid in (("slot", "head"), ("head", "slot")):
            c = _candidate(tensor, perm, (*first, *mid, "dim"))
            if c is not None:
                cands.append(c)
    if not cands:
        raise _unknown(tensor, "no K/V, block, slot, head, head-size order of kvgrid fits these strides")
    cands = _filter(cands, hints, tensor)
    # Preferences, applied only while several labellings survive the hints: the backend's logical
    # shape, then vLLM's legacy logical order [.., BS, NH, HS] for a permuted (non-row-major) view.
    if len(cands) > 1 and backend is not None:
        cands = [c for c in cands if _logical_mid(perm, c) == backend[1]] or cands
    if len(cands) > 1 and perm != tuple(range(5)):
        cands = [c for c in cands if _logical_mid(perm, c) == ("slot", "head")] or cands
    if len(cands) > 1 and not _same_bytes(perm, cands):
        names = []
        if len({_kv_logical_pos(c, perm) for c in cands}) > 1:
            unknown_backend = f" ({hints.backend!r} is not one of them)" if hints.backend else ""
            names.append(f"backend (one of {sorted(_BACKENDS)}){unknown_backend}")
        if len({_layout_class(c.fmt) for c in cands}) > 1:
            names.append("kv_layout ('NHD' or 'HND')")
            if shape[2] != shape[3]:
                names.append("num_kv_heads or block_size")
        raise _ambiguous(tensor, cands, names)
    return cands[0].fmt


def _logical_mid(perm: tuple[int, ...], c: _Candidate) -> tuple[str, str]:
    # Which label sits at logical dims 2 and 3 for this candidate.
    phys = _PHYS_LABELS[c.fmt]
    logical = [""] * 5
    for pos, d in enumerate(perm):
        logical[d] = phys[pos]
    return logical[2], logical[3]


def _kv_logical_pos(c: _Candidate, perm: tuple[int, ...]) -> int:
    phys = _PHYS_LABELS[c.fmt]
    return perm[phys.index("2")]


# ---------------------------------------------------------------------------------------------
# geometry and views


class KVGeometry(NamedTuple):
    """Geometry of one layer's KV tensor as kvgrid's kernels see it."""

    kv_size: int
    """2 for separate K and V planes, 1 otherwise."""
    num_blocks: int
    block_size: int
    """Slots per block (physical; 1 for opaque pages)."""
    num_heads: int
    """KV heads (1 for MLA and opaque pages)."""
    head_size: int
    """Elements per head per slot (content C for fused K|V, page elements for opaque pages)."""
    element_size: int
    """Bytes per element."""
    block_stride: int
    """Elements between block ``b`` and ``b + 1`` (may exceed one page: padding, other layers)."""
    block_contiguous: bool
    """True when one block's ``bytes_per_block`` bytes (all planes) are one contiguous run."""

    @property
    def bytes_per_block(self) -> int:
        """Payload bytes of one block of this layer (K and V together)."""
        return self.kv_size * self.block_size * self.num_heads * self.head_size * self.element_size


def _labelled_physical(tensor: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, tuple[str, ...]]:
    labels = _PHYS_LABELS[fmt]
    if tensor.dim() != len(labels):
        raise ValueError(
            f"KV tensor with {_describe(tensor)} cannot have format {fmt.name} "
            f"(physical {list(labels)}, rank {len(labels)})"
        )
    phys = tensor.permute(_physical_perm(tensor))
    if "2" in labels and phys.shape[labels.index("2")] != 2:
        raise ValueError(
            f"KV tensor with {_describe(tensor)} cannot have format {fmt.name}: "
            f"its K/V dim (physical dim {labels.index('2')}) has size {phys.shape[labels.index('2')]}, not 2"
        )
    return phys, labels


def block_view(tensor: torch.Tensor, fmt: KVFormat, *, slot_major: bool = False) -> torch.Tensor:
    """View one layer's KV tensor as ``[NB, kv_size, X, Y, Z]``, indexed by block id first.

    No copy: the result shares storage with ``tensor`` (only strides change). By default
    ``X, Y, Z`` are in the format's physical order, named by ``BLOCK_VIEW_DIMS[fmt]``
    (``("slot", "head", "dim")`` for NHD-like formats, ``("head", "slot", "dim")`` for HND and
    head-major ones), so ``view[b]`` walks memory forwards. With ``slot_major=True`` it is always
    ``[NB, kv_size, BS, NH, HS]``. MLA becomes ``[NB, 1, BS, 1, C]``, unified formats
    ``[NB, 1, ., ., C]``, opaque pages ``[NB, 1, 1, 1, P]``.

    ``view.stride(0)`` is the block stride and ``view.stride(1)`` the K-to-V distance; block ``b``
    of the original starts at element ``tensor.storage_offset() + b * view.stride(0)``.
    """
    phys, labels = _labelled_physical(tensor, fmt)
    if "2" not in labels:
        phys = phys.unsqueeze(1)
        labels = (labels[0], "2", *labels[1:])
    for missing in ("slot", "head"):  # MLA and opaque pages have neither heads nor (for pages) slots
        if missing not in labels:
            phys = phys.unsqueeze(-2)
            labels = (*labels[:-1], missing, "dim")
    rest = [label for label in labels if label not in ("block", "2")]
    if slot_major:
        rest = ["slot", "head", "dim"]
    order = [labels.index(label) for label in ("block", "2", *rest)]
    return phys.permute(order)


def kv_geometry(tensor: torch.Tensor, fmt: KVFormat) -> KVGeometry:
    """Geometry of ``tensor`` read as ``fmt`` (no copy)."""
    view = block_view(tensor, fmt, slot_major=True)
    nb, kv, bs, nh, hs = (int(s) for s in view.shape)
    physical = block_view(tensor, fmt)
    contiguous = nb == 0 or bool(physical[0].is_contiguous())
    return KVGeometry(
        kv_size=kv,
        num_blocks=nb,
        block_size=bs,
        num_heads=nh,
        head_size=hs,
        element_size=tensor.element_size(),
        block_stride=int(view.stride(0)),
        block_contiguous=contiguous,
    )


def empty_kv_cache(
    fmt: KVFormat,
    num_blocks: int,
    block_size: int,
    num_heads: int,
    head_size: int,
    dtype: torch.dtype = torch.float16,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Allocate an uninitialised KV tensor stored in ``fmt``, shaped as an engine hands it over.

    Unified formats come back as vLLM's logical ``[B, H, N, C]`` view over storage in ``fmt``'s
    order (detected without hints); the others are row-major in ``fmt``'s physical order, so a
    5-D one needs a ``kv_layout`` (or ``backend``/``num_kv_heads``/``block_size``) hint to be
    detected. ``head_size`` is the content C for unified formats and the page elements for opaque
    pages; MLA needs ``num_heads == 1``, opaque pages ``block_size == num_heads == 1``.
    """
    if min(num_blocks, block_size, num_heads, head_size) <= 0:
        raise ValueError(
            f"geometry ({num_blocks}, {block_size}, {num_heads}, {head_size}): expected positive sizes"
        )
    sizes = {"2": 2, "block": num_blocks, "slot": block_size, "head": num_heads, "dim": head_size}
    labels = _PHYS_LABELS[fmt]
    for label, size in sizes.items():
        if label not in labels and label != "2" and size != 1:
            raise ValueError(f"{fmt.name} has no {label} dim; expected {label} size 1, got {size}")
    storage = torch.empty([sizes[label] for label in labels], dtype=dtype, device=device)
    if labels[-1] == "dim" and len(labels) == 4:  # unified: present vLLM's logical [B, H, N, C]
        return storage.permute([labels.index(label) for label in ("block", "head", "slot", "dim")])
    return storage
