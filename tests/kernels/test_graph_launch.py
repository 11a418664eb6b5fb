"""CUDA-graph replay of transfers (``kvgrid_kernels.graph_launch``): bit-exact like the regular path
while every call brings new chunk buffers and block ids, and ordered against regular calls that
share the staging slots (GPU: ``pytest -m gpu``), and the upload layout the replays write (CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvgrid.common.layouts import KVFormat
from kvgrid_kernels import TransferPlan

from .test_kernels import (
    HYBRID,
    GroupSpec,
    _check_retrieved,
    build_plan,
    chunk_buffers,
    expected_chunk,
    random_fill,
    random_ids,
)

PLACEMENTS = [
    pytest.param("staged", False, id="staged-pinned"),
    pytest.param("direct", False, id="direct-pinned"),
    pytest.param("direct", True, id="direct-device"),
]
SPECS = {
    "flash-attn": [GroupSpec(KVFormat.FLASH_ATTN_NHD, num_layers=3, num_blocks=40, dtype=torch.float16)],
    "swa+full": HYBRID["swa+full"],
    "mla+indexer+pages": HYBRID["mla+indexer+pages"],
}


def _with_graphs(plan: TransferPlan, graphs: bool) -> TransferPlan:
    """The same groups in a plan with graph replay on or off (``build_plan`` uses the default)."""
    return TransferPlan(
        plan.groups, plan.tokens_per_chunk, mode=plan.mode, pipeline_bytes=plan.pipeline_bytes, graphs=graphs
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "no-graphs"])
@pytest.mark.parametrize(("mode", "on_device"), PLACEMENTS)
@pytest.mark.parametrize("name", list(SPECS))
def test_replays_are_bit_exact_with_new_buffers_and_ids_every_call(
    name: str, mode: str, on_device: bool, graphs: bool
) -> None:
    specs = SPECS[name]
    gen = torch.Generator().manual_seed(21)
    rng = np.random.default_rng(22)
    plan, tensors = build_plan(specs, "cuda", mode, gen, tokens_per_chunk=16)
    plan = _with_graphs(plan, graphs)
    rounds, n = 4, 2
    for r in range(rounds):
        # a new pool each round: the graph's DMA nodes must follow the buffers, its upload the ids
        chunks = chunk_buffers(plan, n, "cuda", on_device, poison=0x3C + r)
        ids = random_ids(plan, n, rng)
        source = [[t.clone() for t in layers] for layers in tensors]
        plan.store(chunks, ids)
        for c in range(n):
            assert torch.equal(chunks[c].cpu(), expected_chunk(plan, specs, tensors, ids, c)), (r, c)
        targets = random_ids(plan, n, rng)
        for layers in tensors:
            for t in layers:
                random_fill(t, gen)
        poisoned = [[t.clone() for t in layers] for layers in tensors]
        plan.retrieve(chunks, targets)
        _check_retrieved(plan, specs, tensors, poisoned, source, ids, targets, skip_blocks=[0] * len(specs))
    assert plan.graph_error is None
    # each direction: seen once on the regular path, then captured and replayed in every later round
    assert plan.graph_launches == (2 * (rounds - 1) if graphs else 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("mode", "on_device"), PLACEMENTS[:2])
def test_replays_and_regular_calls_queued_together_keep_their_own_data(mode: str, on_device: bool) -> None:
    # Stores of 1, 2 and 3 chunks interleaved while the kernel stream is held: some run as graph
    # replays, some on the regular path (a shape's first sighting), all sharing the staging slots
    # and the upload rings. Every chunk must hold exactly its own call's pages.
    specs = [GroupSpec(KVFormat.UNIFIED_NHD, num_layers=4, num_blocks=64, slots=16, heads=2, head_size=64)]
    gen = torch.Generator().manual_seed(23)
    rng = np.random.default_rng(24)
    plan, tensors = build_plan(specs, "cuda", mode, gen, tokens_per_chunk=64)
    warm = chunk_buffers(plan, 2, "cuda", on_device, poison=0)
    for _ in range(2):  # shape "2 chunks" becomes a graph
        plan.store(warm, random_ids(plan, 2, rng))
    before = plan.graph_launches
    with torch.cuda.stream(plan._kernel_stream):
        torch.cuda._sleep(100_000_000)  # everything below queues behind this
    jobs = []
    for n in (2, 1, 2, 3, 1, 2, 3, 3, 1, 2):
        ids = random_ids(plan, n, rng)
        chunks = chunk_buffers(plan, n, "cuda", on_device, poison=0x77)
        jobs.append((n, ids, chunks, plan.store_async(chunks, ids)))
    for n, ids, chunks, handle in jobs:
        handle.wait()
        for c in range(n):
            assert torch.equal(chunks[c].cpu(), expected_chunk(plan, specs, tensors, ids, c)), (n, c)
    assert plan.graph_error is None
    replays = plan.graph_launches - before
    assert 0 < replays < len(jobs), replays  # both paths ran in the queue


def test_staged_upload_positions_follow_the_piece_layout() -> None:
    # CPU: two groups, 2 chunks; pieces (chunk, group) in the order the plan queues them. The upload
    # is, per piece, one slot-offset word then that chunk's ids of that group.
    from kvgrid_kernels.graph_launch import _id_positions
    from kvgrid_kernels.plan import _Piece

    bpc = (3, 2)
    ids = [np.array([10, 11, 12, 13, 14, 15]), np.array([20, 21, 22, 23])]
    pieces = [_Piece(0, 0, 0, 1, 0, 0), _Piece(0, 1, 0, 1, 0, 0), _Piece(1, 0, 0, 1, 0, 0)]
    sizes = [1, 3, 1, 2, 1, 3]
    pos, src = _id_positions(sizes, pieces, ids, bpc)
    host = np.full(sum(sizes), -7)
    host[pos] = np.concatenate(ids)[src]
    assert host.tolist() == [-7, 10, 11, 12, -7, 20, 21, -7, 13, 14, 15]
