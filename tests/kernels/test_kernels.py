"""Transfer kernels: bit-exact store/retrieve round trips for every layout x dtype x grouping.

Expected bytes come from ``kvgrid.common.layouts.block_view`` (logical indexing of the original
tensors), not from the kernels' page views. Destinations are poisoned first, so a page that is not
written, or a byte written outside the target blocks, shows up as a mismatch. The same tests run on
CUDA (``pytest -m gpu``) for every mode and chunk buffer placement.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from kvgrid.agent.transfer import format_page_view, kernel_group_pages
from kvgrid.common.layouts import KVFormat, block_view, empty_kv_cache
from kvgrid_kernels import ChunkLayout, KernelGroupPages, TransferPlan, page_view

HAS_CUDA = torch.cuda.is_available()

# (device, mode, chunks on device?)
TARGETS = [
    pytest.param("cpu", "auto", False, id="cpu"),
    pytest.param("cuda", "staged", False, id="cuda-staged-pinned", marks=pytest.mark.gpu),
    pytest.param("cuda", "direct", False, id="cuda-direct-pinned", marks=pytest.mark.gpu),
    pytest.param("cuda", "direct", True, id="cuda-direct-device", marks=pytest.mark.gpu),
    pytest.param("cuda", "torch", False, id="cuda-torch-pinned", marks=pytest.mark.gpu),
]
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.uint8, torch.float8_e4m3fn]


@dataclass(frozen=True)
class GroupSpec:
    fmt: KVFormat
    num_layers: int
    num_blocks: int = 29
    slots: int = 4  # slots per block in the tensor
    heads: int = 2
    head_size: int = 8
    dtype: torch.dtype = torch.bfloat16
    tokens_per_block: int = 0  # 0 = slots (uncompressed)

    def geometry(self) -> tuple[int, int, int]:
        if self.fmt is KVFormat.OPAQUE_PAGES:
            return 1, 1, self.slots * self.heads * self.head_size
        if self.fmt is KVFormat.MLA:
            return self.slots, 1, self.head_size
        return self.slots, self.heads, self.head_size


def random_fill(t: torch.Tensor, gen: torch.Generator) -> None:
    """Random bytes over the tensor's whole storage (any dtype and view; NaN bit patterns included:
    comparisons are on bytes)."""
    storage = t.untyped_storage()
    raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (storage.nbytes(),), (1,))
    raw.copy_(torch.randint(0, 256, (storage.nbytes(),), dtype=torch.uint8, generator=gen))


def make_layers(spec: GroupSpec, device: str, gen: torch.Generator) -> list[torch.Tensor]:
    bs, nh, hs = spec.geometry()
    layers = []
    for _ in range(spec.num_layers):
        t = empty_kv_cache(spec.fmt, spec.num_blocks, bs, nh, hs, spec.dtype, device)
        random_fill(t, gen)
        layers.append(t)
    return layers


def as_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(-1).view(torch.uint8)


def expected_page(t: torch.Tensor, fmt: KVFormat, planes: int, plane: int, block: int) -> torch.Tensor:
    """One page's bytes read through the layouts module's logical view."""
    v = block_view(t, fmt)  # [NB, kv_size, X, Y, Z] in physical order
    if planes == 1:
        return as_bytes(v[block])
    if planes == fmt.kv_size:
        return as_bytes(v[block, plane])
    return as_bytes(v[block, 0, plane])  # head-major: one plane per head


def build_plan(
    specs: list[GroupSpec], device: str, mode: str, gen: torch.Generator, tokens_per_chunk: int
) -> tuple[TransferPlan, list[list[torch.Tensor]]]:
    groups, tensors = [], []
    for i, spec in enumerate(specs):
        layers = make_layers(spec, device, gen)
        tensors.append(layers)
        views = tuple(format_page_view(t, spec.fmt) for t in layers)
        groups.append(
            KernelGroupPages.from_views(
                views,
                tokens_per_block=spec.tokens_per_block or spec.slots,
                slots_per_block=spec.slots,
                name=f"g{i}",
            )
        )
    return TransferPlan(groups, tokens_per_chunk, mode=mode, pipeline_bytes=1000), tensors  # type: ignore[arg-type]


def chunk_buffers(
    plan: TransferPlan, n: int, device: str, on_device: bool, poison: int
) -> list[torch.Tensor]:
    # Chunks are views into one pool (like L1), with gaps between them that must stay untouched.
    stride = plan.bytes_per_chunk + 48
    if device == "cuda" and on_device:
        pool = torch.full((n * stride,), poison, dtype=torch.uint8, device="cuda")
    else:
        pool = torch.full((n * stride,), poison, dtype=torch.uint8, pin_memory=device == "cuda")
    return [pool[i * stride : i * stride + plan.bytes_per_chunk] for i in range(n)]


def random_ids(plan: TransferPlan, n: int, rng: np.random.Generator) -> list[np.ndarray]:
    return [
        rng.permutation(g.num_blocks)[: n * bpc]
        for g, bpc in zip(plan.groups, plan.blocks_per_chunk, strict=True)
    ]


def expected_chunk(
    plan: TransferPlan,
    specs: list[GroupSpec],
    tensors: list[list[torch.Tensor]],
    ids: list[np.ndarray],
    c: int,
) -> torch.Tensor:
    out = torch.empty(plan.bytes_per_chunk, dtype=torch.uint8)
    lay = plan.layout
    for g, (spec, layers) in enumerate(zip(specs, tensors, strict=True)):
        bpc, planes, page = lay.blocks_per_chunk[g], lay.planes[g], lay.page_bytes[g]
        for i, t in enumerate(layers):
            for p in range(planes):
                for b in range(bpc):
                    off = lay.page_offset(g, i, p, b)
                    out[off : off + page] = expected_page(
                        t, spec.fmt, planes, p, int(ids[g][c * bpc + b])
                    ).cpu()
    return out


FORMAT_IDS = [f.name for f in KVFormat]


@pytest.mark.parametrize(("device", "mode", "on_device"), TARGETS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", list(KVFormat), ids=FORMAT_IDS)
def test_round_trip_every_layout_and_dtype(
    fmt: KVFormat, dtype: torch.dtype, device: str, mode: str, on_device: bool
) -> None:
    gen = torch.Generator().manual_seed(hash((fmt.value, str(dtype))) % 2**31)
    rng = np.random.default_rng(7)
    specs = [GroupSpec(fmt, num_layers=3, dtype=dtype)]
    _round_trip(specs, device, mode, on_device, gen, rng, num_chunks=2, tokens_per_chunk=8)


HYBRID = {
    # sliding-window (block 8) + full attention (block 4), different layouts and dtypes
    "swa+full": [
        GroupSpec(KVFormat.UNIFIED_NHD, num_layers=3, slots=8, heads=2, head_size=16),
        GroupSpec(KVFormat.FLASH_ATTN_NHD, num_layers=2, slots=4, heads=1, head_size=8, num_blocks=31),
    ],
    # MLA latent cache + a uint8 indexer cache + fp32 opaque state pages
    "mla+indexer+pages": [
        GroupSpec(KVFormat.MLA, num_layers=2, slots=8, head_size=24),
        GroupSpec(KVFormat.MLA, num_layers=2, slots=8, head_size=33, dtype=torch.uint8),
        GroupSpec(KVFormat.OPAQUE_PAGES, num_layers=1, slots=2, heads=1, head_size=5, dtype=torch.float32),
    ],
    # compressed groups: 4 and 8 tokens packed per slot (slots_per_block < tokens_per_block)
    "compressed": [
        GroupSpec(KVFormat.MLA, num_layers=2, slots=2, head_size=16, tokens_per_block=8),
        GroupSpec(
            KVFormat.MLA, num_layers=1, slots=1, head_size=12, tokens_per_block=8, dtype=torch.float8_e4m3fn
        ),
        GroupSpec(KVFormat.UNIFIED_HND, num_layers=2, slots=4, tokens_per_block=4, dtype=torch.float16),
    ],
    "head-major+flashinfer-hnd": [
        GroupSpec(KVFormat.UNIFIED_HEAD_MAJOR, num_layers=2, heads=3),
        GroupSpec(KVFormat.FLASHINFER_HND, num_layers=2, dtype=torch.float32),
    ],
}


@pytest.mark.parametrize(("device", "mode", "on_device"), TARGETS)
@pytest.mark.parametrize("name", list(HYBRID))
def test_round_trip_multi_group(name: str, device: str, mode: str, on_device: bool) -> None:
    gen = torch.Generator().manual_seed(11)
    rng = np.random.default_rng(12)
    _round_trip(HYBRID[name], device, mode, on_device, gen, rng, num_chunks=3, tokens_per_chunk=16)


def _round_trip(
    specs: list[GroupSpec],
    device: str,
    mode: str,
    on_device: bool,
    gen: torch.Generator,
    rng: np.random.Generator,
    *,
    num_chunks: int,
    tokens_per_chunk: int,
) -> None:
    plan, tensors = build_plan(specs, device, mode, gen, tokens_per_chunk)
    ids = random_ids(plan, num_chunks, rng)
    # store: every chunk byte is written with the right page, the gaps between chunks stay poisoned
    chunks = chunk_buffers(plan, num_chunks, device, on_device, poison=0xA5)
    before = [[t.clone() for t in layers] for layers in tensors]
    plan.store(chunks, ids)
    for c in range(num_chunks):
        assert torch.equal(chunks[c].cpu(), expected_chunk(plan, specs, tensors, ids, c)), f"chunk {c}"
    pool = chunks[0]._base if chunks[0]._base is not None else chunks[0]
    gaps = pool.view(num_chunks, -1)[:, plan.bytes_per_chunk :].cpu()
    assert bool((gaps == 0xA5).all()), "bytes between chunk buffers were written"
    for layers, old in zip(tensors, before, strict=True):  # store never writes KV
        assert all(
            torch.equal(as_bytes(t).cpu(), as_bytes(o).cpu()) for t, o in zip(layers, old, strict=True)
        )

    # retrieve into poisoned KV at other (random) block ids: targets equal the stored source blocks,
    # every other block keeps its poison
    targets = random_ids(plan, num_chunks, rng)
    for layers in tensors:
        for t in layers:
            random_fill(t, gen)
    poisoned = [[t.clone() for t in layers] for layers in tensors]
    plan.retrieve(chunks, targets)
    _check_retrieved(plan, specs, tensors, poisoned, before, ids, targets, skip_blocks=[0] * len(specs))


def _check_retrieved(
    plan: TransferPlan,
    specs: list[GroupSpec],
    tensors: list[list[torch.Tensor]],
    poisoned: list[list[torch.Tensor]],
    source: list[list[torch.Tensor]],
    src_ids: list[np.ndarray],
    dst_ids: list[np.ndarray],
    skip_blocks: list[int],
) -> None:
    for g, (spec, layers) in enumerate(zip(specs, tensors, strict=True)):
        for i, t in enumerate(layers):
            # expected: the poisoned tensor with source blocks copied to the targets via block_view
            want_t = poisoned[g][i].clone()
            src_v, want_v = block_view(source[g][i], spec.fmt), block_view(want_t, spec.fmt)
            for k, (s, d) in enumerate(zip(src_ids[g], dst_ids[g], strict=True)):
                if k >= skip_blocks[g] and d >= 0:
                    want_v[int(d)] = src_v[int(s)]
            assert torch.equal(as_bytes(t).cpu(), as_bytes(want_t).cpu()), f"group {g} layer {i}"


@pytest.mark.parametrize(("device", "mode", "on_device"), TARGETS)
def test_retrieve_skips_first_tokens_per_group(device: str, mode: str, on_device: bool) -> None:
    # Group 0: 4 tokens per block, group 1: 8 tokens per block (compressed 2 slots), chunk 16 tokens.
    specs = [
        GroupSpec(KVFormat.UNIFIED_NHD, num_layers=2, slots=4),
        GroupSpec(KVFormat.MLA, num_layers=2, slots=2, head_size=16, tokens_per_block=8, dtype=torch.float16),
    ]
    gen = torch.Generator().manual_seed(3)
    rng = np.random.default_rng(4)
    plan, tensors = build_plan(specs, device, mode, gen, tokens_per_chunk=16)
    n = 2
    ids = random_ids(plan, n, rng)
    chunks = chunk_buffers(plan, n, device, on_device, poison=0x5A)
    source = [[t.clone() for t in layers] for layers in tensors]
    plan.store(chunks, ids)
    for skip in (0, 4, 10, 16, 20, 32):
        for layers in tensors:
            for t in layers:
                random_fill(t, gen)
        poisoned = [[t.clone() for t in layers] for layers in tensors]
        targets = random_ids(plan, n, rng)
        plan.retrieve(chunks, targets, skip_first_n_tokens=skip)
        skip_blocks = [skip // 4, skip // 8]  # a block only partly skipped is written whole
        _check_retrieved(plan, specs, tensors, poisoned, source, ids, targets, skip_blocks)


@pytest.mark.parametrize(("device", "mode", "on_device"), TARGETS)
def test_negative_block_ids_are_left_alone(device: str, mode: str, on_device: bool) -> None:
    specs = [GroupSpec(KVFormat.FLASH_ATTN_HND, num_layers=2, dtype=torch.float16)]
    gen = torch.Generator().manual_seed(5)
    rng = np.random.default_rng(6)
    plan, tensors = build_plan(specs, device, mode, gen, tokens_per_chunk=8)
    ids = random_ids(plan, 2, rng)
    chunks = chunk_buffers(plan, 2, device, on_device, poison=0x11)
    source = [[t.clone() for t in layers] for layers in tensors]
    plan.store(chunks, ids)
    # a sliding window's freed blocks: -1 entries (here the whole first chunk and one later block)
    targets = random_ids(plan, 2, rng)
    targets[0][:2] = -1
    targets[0][3] = -1
    for t in tensors[0]:
        random_fill(t, gen)
    poisoned = [[t.clone() for t in layers] for layers in tensors]
    plan.retrieve(chunks, targets)
    _check_retrieved(plan, specs, tensors, poisoned, source, ids, targets, skip_blocks=[0])
    # store with -1: the other pages are still right
    chunks2 = chunk_buffers(plan, 2, device, on_device, poison=0x22)
    sparse = [ids[0].copy()]
    sparse[0][1] = -1
    plan.store(chunks2, sparse)
    want = expected_chunk(plan, specs, tensors, ids, 1)
    assert torch.equal(chunks2[1].cpu(), want)


def test_cross_layer_and_padded_strides_cpu() -> None:
    # One tensor holding every layer block-outermost (vLLM BLHNC), and a padded block stride.
    gen = torch.Generator().manual_seed(9)
    nb, layers, heads, slots, content = 9, 3, 2, 4, 16
    big = torch.empty(nb, layers, heads, slots, content, dtype=torch.float16)
    random_fill(big, gen)
    padded_storage = torch.empty(nb, 700, dtype=torch.uint8)
    random_fill(padded_storage, gen)
    padded = padded_storage[:, 4 : 4 + 4 * 64].view(torch.float32).view(nb, 4, 16)  # MLA, padded stride
    plan = TransferPlan(
        [
            KernelGroupPages.from_tensors(
                [big[:, i] for i in range(layers)], block_dim=0, tokens_per_block=slots
            ),
            KernelGroupPages.from_tensors([padded], block_dim=0, tokens_per_block=4),
        ],
        tokens_per_chunk=8,
    )
    assert plan.groups[0].layers[1].stride(1) == layers * heads * slots * content * 2
    ids = [np.array([5, 2]), np.array([7, 0])]
    chunk = torch.full((plan.bytes_per_chunk,), 0xEE, dtype=torch.uint8)
    plan.store([chunk], ids)
    lay = plan.layout
    for i in range(layers):
        for b, blk in enumerate(ids[0]):
            off = lay.page_offset(0, i, 0, b)
            assert torch.equal(chunk[off : off + lay.page_bytes[0]], as_bytes(big[blk, i]))
    for b, blk in enumerate(ids[1]):
        off = lay.page_offset(1, 0, 0, b)
        assert torch.equal(chunk[off : off + lay.page_bytes[1]], as_bytes(padded[blk]))
    before_pad = padded_storage.clone()
    big_before = big.clone()
    plan.retrieve([chunk], [np.array([1, 8]), np.array([3, 4])])
    assert torch.equal(as_bytes(big[1]), as_bytes(big_before[5]))
    assert torch.equal(as_bytes(big[8]), as_bytes(big_before[2]))
    assert torch.equal(as_bytes(padded[3]), as_bytes(before_pad[7, 4 : 4 + 256]))
    # padding bytes around each page never change
    changed = (padded_storage != before_pad).any(dim=0).nonzero().flatten()
    assert changed.numel() > 0 and int(changed.min()) >= 4 and int(changed.max()) < 4 + 256


def test_chunk_layout_offsets() -> None:
    a = KernelGroupPages.from_views((torch.zeros(2, 5, 32, dtype=torch.uint8),), tokens_per_block=4)
    b = KernelGroupPages.from_views(
        tuple(torch.zeros(1, 3, 10, dtype=torch.uint8) for _ in range(3)),
        tokens_per_block=8,
        slots_per_block=2,
    )
    lay = ChunkLayout.of([a, b], 16)
    assert lay.blocks_per_chunk == (4, 2)
    assert lay.group_bytes == (2 * 4 * 32, 3 * 2 * 10)
    assert lay.bytes_per_chunk == 256 + 60
    assert lay.page_offset(0, 0, 1, 2) == (1 * 4 + 2) * 32
    assert lay.page_offset(1, 2, 0, 1) == 256 + (2 * 2 + 1) * 10


def test_page_view_rejects_non_dense_pages_and_bad_axes() -> None:
    t = torch.zeros(4, 6, 8)
    with pytest.raises(ValueError, match="dense region"):
        page_view(t[:, ::2], 0)
    with pytest.raises(ValueError, match="out of range"):
        page_view(t, 3)
    with pytest.raises(ValueError, match="must differ"):
        page_view(t, 1, 1)
    assert page_view(t, 0).shape == (1, 4, 6 * 8 * 4)
    assert page_view(t, 1, 0).shape == (4, 6, 32)


def test_plan_validates_inputs() -> None:
    g = KernelGroupPages.from_views(
        (torch.zeros(1, 6, 16, dtype=torch.uint8),), tokens_per_block=4, name="full"
    )
    plan = TransferPlan([g], tokens_per_chunk=8)
    buf = torch.zeros(plan.bytes_per_chunk, dtype=torch.uint8)
    with pytest.raises(ValueError, match="expected 2"):
        plan.store([buf], [[1, 2, 3]])
    with pytest.raises(ValueError, match="block id 6"):
        plan.store([buf], [[1, 6]])
    with pytest.raises(ValueError, match="repeats a block id"):
        plan.retrieve([buf], [[2, 2]])
    with pytest.raises(ValueError, match="expected chunk buffers on the plan's GPU, got cpu"):
        plan.prepare_retrieve([buf], [[1, 2]])  # prepared scatters read GPU buffers only
    with pytest.raises(ValueError, match="one per kernel group"):
        plan.store([buf], [[1, 2], [3, 4]])
    with pytest.raises(ValueError, match="at least 32"):
        plan.store([buf[:10]], [[1, 2]])
    with pytest.raises(ValueError, match="uint8"):
        plan.store([torch.zeros(8, dtype=torch.float32)], [[1, 2]])
    with pytest.raises(ValueError, match="skip_first_n_tokens"):
        plan.retrieve([buf], [[1, 2]], skip_first_n_tokens=-1)
    with pytest.raises(ValueError, match="multiple of kernel group 'full''s tokens_per_block=4"):
        TransferPlan([g], tokens_per_chunk=6)
    with pytest.raises(ValueError, match="multiple of slots_per_block"):
        KernelGroupPages.from_views(
            (torch.zeros(1, 6, 16, dtype=torch.uint8),), tokens_per_block=6, slots_per_block=4
        )
    plan.store([buf], [np.array([1, 2])])  # duplicates allowed in store; numpy ids accepted
    plan.store(buf.view(1, -1), [torch.tensor([3, 3])])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_async_store_does_not_block_the_callers_stream() -> None:
    gen = torch.Generator().manual_seed(1)
    specs = [GroupSpec(KVFormat.UNIFIED_NHD, num_layers=4, num_blocks=64, slots=16, heads=8, head_size=256)]
    plan, tensors = build_plan(specs, "cuda", "staged", gen, tokens_per_chunk=256)
    ids = random_ids(plan, 2, np.random.default_rng(0))
    chunks = chunk_buffers(plan, 2, "cuda", False, poison=0)
    # Warm up: the first transfer builds the plan's device tables and pinned buffers (one-time syncs).
    plan.store_async(chunks, ids).wait()
    torch.cuda.synchronize()
    # Hold the transfer back (~1 s of GPU sleep queued on the plan's own stream): if the store queued
    # any of its work on the caller's stream, syncing that stream would wait for the transfer too.
    with torch.cuda.stream(plan._kernel_stream):
        torch.cuda._sleep(2_000_000_000)
    t0 = time.perf_counter()
    handle = plan.store_async(chunks, ids)
    t1 = time.perf_counter()
    torch.cuda.current_stream().synchronize()
    t2 = time.perf_counter()
    assert not handle.done(), f"store_async took {t1 - t0:.3f} s, syncing the caller's stream {t2 - t1:.3f} s"
    handle.wait_stream(torch.cuda.current_stream())
    handle.wait()
    assert handle.done()
    assert torch.equal(chunks[1].cpu(), expected_chunk(plan, specs, tensors, ids, 1))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("mode", ["staged", "direct"])
def test_back_to_back_async_stores_keep_their_own_block_ids(mode: str) -> None:
    # More transfers in flight than the plan's pinned upload ring has slots, each with other block
    # ids: a reused upload buffer must never hand one transfer another's ids.
    gen = torch.Generator().manual_seed(2)
    specs = [GroupSpec(KVFormat.FLASH_ATTN_NHD, num_layers=3, num_blocks=96, slots=16, heads=2, head_size=64)]
    plan, tensors = build_plan(specs, "cuda", mode, gen, tokens_per_chunk=64)
    rng = np.random.default_rng(3)
    plan.store_async(chunk_buffers(plan, 1, "cuda", False, poison=0), random_ids(plan, 1, rng)).wait()
    with torch.cuda.stream(plan._kernel_stream):
        torch.cuda._sleep(200_000_000)  # keep the uploads in flight while the host queues
    jobs = []
    for _ in range(7):
        ids = random_ids(plan, 2, rng)
        chunks = chunk_buffers(plan, 2, "cuda", False, poison=0)
        jobs.append((ids, chunks, plan.store_async(chunks, ids)))
    for ids, chunks, handle in jobs:
        handle.wait()
        for c in range(2):
            assert torch.equal(chunks[c].cpu(), expected_chunk(plan, specs, tensors, ids, c))


def test_pipeline_pieces_lead_with_a_small_piece_and_cover_every_layer_once() -> None:
    # 10 layers of 4 blocks x 256 B pages = 1 KiB per layer per chunk; pieces <= 4 KiB, lead 1.5 KiB
    g = KernelGroupPages.from_views(
        tuple(torch.zeros(1, 9, 256, dtype=torch.uint8) for _ in range(10)), tokens_per_block=4
    )
    h = KernelGroupPages.from_views(
        tuple(torch.zeros(2, 9, 64, dtype=torch.uint8) for _ in range(3)), tokens_per_block=8
    )
    plan = TransferPlan([g, h], tokens_per_chunk=16, pipeline_bytes=4096, lead_bytes=1536)
    ids = [np.arange(8), np.array([1, 2, -1, -1])]  # chunk 1 of group h has nothing to move
    store = plan._pieces(ids, 2, to_chunk=True)
    retrieve = plan._pieces(ids, 2, to_chunk=False)
    assert (store[0].layer_end - store[0].layer_start) == 1  # lead: 1 layer (1.5 KiB // 1 KiB)
    assert (retrieve[-1].layer_end - retrieve[-1].layer_start) == 1
    for pieces in (store, retrieve):
        assert max(p.nbytes for p in pieces) <= 4096
        covered = sorted(
            (p.chunk, p.group, layer) for p in pieces for layer in range(p.layer_start, p.layer_end)
        )
        want = sorted([(c, 0, i) for c in range(2) for i in range(10)] + [(0, 1, i) for i in range(3)])
        assert covered == want
        for p in pieces:  # each piece is the contiguous byte range of its layers in the chunk
            assert p.offset == plan.layout.page_offset(p.group, p.layer_start, 0, 0)
            assert p.nbytes == (p.layer_end - p.layer_start) * plan.layout.layer_bytes(p.group)


@pytest.mark.parametrize(("device", "mode", "on_device"), TARGETS)
def test_manager_kernel_groups_round_trip(device: str, mode: str, on_device: bool) -> None:
    # The worked example of docs/hybrid-groups.md: engine group 0 = layers [0, 2, 4], group 1 =
    # [1, 3]; layer 4 has another shape, so three kernel groups: (g0, [0, 2]), (g1, [1, 3]), (g0, [4]).
    from kvgrid.common.groups import EngineGroupInfo, expand_engine_block_ids
    from kvgrid.common.layer_groups import KVLayerGroupsManager

    gen = torch.Generator().manual_seed(21)
    caches = {}
    for i in range(5):
        shape = (10, 2, 4, 16) if i < 4 else (10, 4, 24)  # unified [B, H, N, C] / MLA [NB, BS, C]
        caches[f"layer.{i}"] = torch.empty(shape, dtype=torch.bfloat16, device=device)
        random_fill(caches[f"layer.{i}"], gen)
    formats = [KVFormat.UNIFIED_HND] * 4 + [KVFormat.MLA]
    infos = [
        EngineGroupInfo(engine_group_id=0, layer_indices=(0, 2), tokens_per_block=4),
        EngineGroupInfo(engine_group_id=1, layer_indices=(1, 3), tokens_per_block=4),
        EngineGroupInfo(engine_group_id=0, layer_indices=(4,), tokens_per_block=4),
    ]
    manager = KVLayerGroupsManager(caches, formats, infos, tokens_per_chunk=8)
    plan = TransferPlan(kernel_group_pages(manager, caches), manager.tokens_per_chunk, mode=mode)
    assert plan.num_groups == 3 and plan.blocks_per_chunk == (2, 2, 2)
    assert plan.bytes_per_chunk == manager.bytes_per_chunk()
    src = expand_engine_block_ids(infos, [[7, 3, 5, 0], [9, 1, 2, 8]])
    assert src == [[7, 3, 5, 0], [9, 1, 2, 8], [7, 3, 5, 0]]
    chunks = chunk_buffers(plan, 2, device, on_device, poison=0x33)
    before = {k: v.clone() for k, v in caches.items()}
    plan.store(chunks, src)
    dst = expand_engine_block_ids(infos, [[4, 6, 8, 1], [0, 3, 5, 7]])
    plan.retrieve(chunks, dst)
    for name, t in caches.items():
        layer = int(name.split(".")[1])
        s_ids, d_ids = ([7, 3, 5, 0], [4, 6, 8, 1]) if layer in (0, 2, 4) else ([9, 1, 2, 8], [0, 3, 5, 7])
        want = before[name].clone()
        want[d_ids] = before[name][s_ids]
        assert torch.equal(as_bytes(t), as_bytes(want)), name


def test_bench_transfer_cpu_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from kvgrid.cli import main

    rc = main(
        [
            "bench",
            "transfer",
            "--device",
            "cpu",
            "--geometry",
            "tiny",
            "--chunks",
            "1,2",
            "--json",
            "--repeats",
            "2",
        ]
    )
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    rows = doc["results"]
    assert {(r["direction"], r["chunks"]) for r in rows} == {
        ("store", 1),
        ("retrieve", 1),
        ("store", 2),
        ("retrieve", 2),
    }
    for r in rows:
        assert r["gbps"] > 0 and r["limit_gbps"] > 0
        assert r["ratio"] == pytest.approx(r["gbps"] / r["limit_gbps"])


def test_lmcache_wheel_that_is_not_a_wheel_is_named(tmp_path: Path) -> None:
    import zipfile

    from kvgrid_kernels.bench.lmcache_ref import load_c_ops

    bad = tmp_path / "lmcache.whl"
    bad.write_text("not a zip")
    with pytest.raises(ValueError, match="not a readable wheel"):
        load_c_ops(str(bad))
    empty = tmp_path / "other.whl"
    with zipfile.ZipFile(empty, "w") as z:
        z.writestr("other/__init__.py", "")
    with pytest.raises(ValueError, match="no lmcache/c_ops"):
        load_c_ops(str(empty))
