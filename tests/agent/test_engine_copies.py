"""Engine-side copies over the agent's shared L1 (agent ``--l1-shared-dir``, Retrieve
``engine_copies``): a real agent process, this test process as the engine with its KV in
shared-memory files (the hybrid layout of ``tests.agent.helpers``), and the connector's
:class:`~kvgrid.connector.engine_copies.EngineCopier` doing the copy here."""

from __future__ import annotations

import fcntl
import itertools
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from kvgrid.agent.l1 import L1Pool
from kvgrid.agent.transfer import build_mover
from kvgrid.common.groups import EngineGroupInfo
from kvgrid.connector.engine_copies import EngineCopier, open_engine_copier
from kvgrid.connector.staged_loads import stage_bounds
from kvgrid.engine.client import AgentClient
from tests.agent.helpers import (
    GROUPS,
    HINTS,
    AgentProc,
    block_ids,
    blocks_of,
    keys_for,
    register_kv,
    start_agent,
)


@pytest.fixture(scope="module")
def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine-copies")


@pytest.fixture(scope="module")
def dead_agents_file(shared_dir: Path) -> Path:
    """An L1 file left by an agent that was killed (nobody holds its lock)."""
    path = shared_dir / "kvgrid-l1-1-0badc0de"
    path.write_bytes(b"\0" * 4096)
    return path


@pytest.fixture(scope="module")
def live_agents_file(shared_dir: Path) -> Iterator[Path]:
    """The L1 file of an agent that runs (its lock held): in another pid namespace it may have the
    same pid as ours, so only the lock tells."""
    path = shared_dir / "kvgrid-l1-1-11ve0000"
    path.write_bytes(b"\0" * 4096)
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    yield path
    os.close(fd)


@pytest.fixture(scope="module")
def agent(shared_dir: Path, dead_agents_file: Path, live_agents_file: Path) -> Iterator[AgentProc]:
    a = start_agent(shared_dir, "--l1-shared-dir", str(shared_dir), pod_uid="uid-shared-l1")
    yield a
    a.stop()


@pytest.fixture(scope="module")
def client(agent: AgentProc) -> Iterator[AgentClient]:
    c = agent.client()
    yield c
    c.close()


def invalid(fn: object, *args: object, **kw: object) -> str:
    with pytest.raises(grpc.RpcError) as err:
        fn(*args, **kw)  # type: ignore[operator]
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    return err.value.details() or ""


def test_the_engine_scatters_leased_chunks_itself_bit_exact(
    agent: AgentProc, client: AgentClient, shared_dir: Path, dead_agents_file: Path, live_agents_file: Path
) -> None:
    tensors, reg = register_kv(client, "e1", shared_dir, seed=5)
    assert Path(reg.l1_file).parent == shared_dir
    assert Path(reg.l1_file).name.startswith(f"kvgrid-l1-{agent.proc.pid}-")
    assert os.stat(reg.l1_file).st_size == reg.l1_file_bytes > 0
    assert not dead_agents_file.exists()  # the killed agent's file was removed at start
    assert live_agents_file.exists()  # a running agent's was not
    keys, src, dst = keys_for(500, 3), block_ids(0, 3), block_ids(20, 3)
    want = blocks_of(tensors, src)
    assert client.store("e1", keys, src).num_stored_chunks == 3
    assert [b.ne(w).any() for b, w in zip(blocks_of(tensors, dst), want, strict=True)] == [True] * 5

    res = client.retrieve("e1", "req-1", keys, dst, engine_copies=True)
    assert res.num_retrieved_chunks == 3 and len(res.chunk_offsets) == 3 and res.bytes_moved == 0
    assert client.health().num_leased_chunks == 3
    # The agent wrote nothing: the destination blocks are as they were.
    assert [b.ne(w).any() for b, w in zip(blocks_of(tensors, dst), want, strict=True)] == [True] * 5

    copier = open_engine_copier(reg, tensors, GROUPS, HINTS, None)
    assert copier is not None and copier.mover.layout_id == reg.layout_id
    released = threading.Event()
    answers = []

    def release() -> None:
        answers.append(client.release_all("e1", "req-1"))
        released.set()

    copier.scatter(res.chunk_offsets, dst, 0, fence=None, release=release)
    assert released.wait(10)
    copier.close()
    for got, w in zip(blocks_of(tensors, dst), want, strict=True):
        assert torch.equal(got, w)
    assert answers[0].released_chunks == 3
    assert client.health().num_leased_chunks == 0


@pytest.mark.parametrize("layers", [1, 2, 3, 5, 9, 32, 80])
@pytest.mark.parametrize("stages", [1, 2, 3, 8, 32, 100])
def test_stages_cover_the_layers_in_order_shrinking_to_one_layer_last(layers: int, stages: int) -> None:
    """Stages are consecutive, non-empty and cover every layer once; at most ``layers`` of them.
    With 3 stages or more and more layers than stages, sizes never grow and the last stage holds
    one layer (little compute is left once the last copy landed); otherwise they differ by at most
    one."""
    bounds = stage_bounds(layers, stages)
    assert len(bounds) == min(stages, layers)
    assert bounds[0][0] == 0 and bounds[-1][1] == layers
    assert all(hi > lo for lo, hi in bounds) and all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    sizes = [hi - lo for lo, hi in bounds]
    if len(bounds) >= 3 and layers > len(bounds):
        assert sizes[-1] == 1 and sizes == sorted(sizes, reverse=True)
    else:
        assert max(sizes) - min(sizes) <= 1
    if (layers, stages) == (32, 8):  # Llama-3-8B's default, as measured (docs/benchmarks.md)
        assert sizes == [6, 5, 5, 4, 4, 4, 3, 1]


def test_layerwise_loads_land_stage_by_stage(client: AgentClient, shared_dir: Path) -> None:
    """A staged load writes a stage's layers when that stage is waited for, never a later stage's
    (on CPU the engine's thread copies each stage on demand), bit-exact, and ends its lease once
    the last stage landed. Three stages over the five layers of three kernel groups: one layer
    first, one last (``stage_bounds``), and stage 1 (layers 1 to 3) needs parts from two kernel
    groups."""
    tensors, reg = register_kv(client, "e5", shared_dir, seed=8)
    keys, src, dst = keys_for(800, 3), block_ids(0, 3), block_ids(30, 3)
    want = blocks_of(tensors, src)
    assert client.store("e5", keys, src).num_stored_chunks == 3
    res = client.retrieve("e5", "req-s", keys, dst, engine_copies=True)
    copier = open_engine_copier(reg, tensors, GROUPS, HINTS, None, stages=3)
    assert copier is not None and copier.num_stages == 3
    assert copier.stage_of_layer == {0: 0, 1: 0, 2: 1, 3: 1, 4: 2}
    assert [len(parts) for parts in copier.stage_parts] == [2, 2, 1]
    released = threading.Event()

    def release() -> None:
        client.release_all("e5", "req-s")
        released.set()

    load = copier.scatter_staged(res.chunk_offsets, dst, 0, fence=None, release=release)

    def loaded_layers() -> list[int]:
        got = blocks_of(tensors, dst)
        return [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if torch.equal(g, w)]

    assert loaded_layers() == []
    load.wait(0)
    assert loaded_layers() == [0, 1] and not released.is_set()
    load.wait(0)  # again: nothing more
    assert loaded_layers() == [0, 1]
    load.wait(1)
    assert loaded_layers() == [0, 1, 2, 3] and client.health().num_leased_chunks == 3
    load.finish()
    assert loaded_layers() == [0, 1, 2, 3, 4]
    assert released.wait(30) and client.health().num_leased_chunks == 0  # off the engine's thread
    load.finish()  # idempotent: released once
    copier.close()


def test_a_staged_load_of_nothing_releases_at_once(client: AgentClient, shared_dir: Path) -> None:
    tensors, reg = register_kv(client, "e6", shared_dir, seed=9)
    copier = open_engine_copier(reg, tensors, GROUPS, HINTS, None, stages=2)
    assert copier is not None
    calls: list[int] = []
    load = copier.scatter_staged([], block_ids(0, 1), 0, fence=None, release=lambda: calls.append(1))
    load.wait(1)
    load.finish()
    assert calls == [1]
    copier.close()


def test_offsets_outside_the_file_are_refused(client: AgentClient, shared_dir: Path) -> None:
    """The staged path copies by raw pointer, so an offset the file does not hold is an error naming
    it (the worker reports the load failed), and the lease is released exactly once."""
    tensors, reg = register_kv(client, "e7", shared_dir, seed=10)
    copier = open_engine_copier(reg, tensors, GROUPS, HINTS, None, stages=2)
    assert copier is not None
    bad = reg.l1_file_bytes - copier.mover.bytes_per_chunk + 1
    for scatter in (copier.scatter, copier.scatter_staged):
        calls: list[int] = []
        with pytest.raises(ValueError, match=f"chunk offset {bad}: expected 0 <= offset"):
            scatter([0, bad], block_ids(0, 2), 0, fence=None, release=lambda: calls.append(1))  # noqa: B023
        assert calls == [1]
    copier.close()


def test_a_repeated_block_id_is_refused_before_any_stage_copies(
    client: AgentClient, shared_dir: Path
) -> None:
    """Block ids a copy would refuse are refused when the load is queued, on every path and device:
    the worker then reports the load failed. (On CPU a staged load copies each stage later, inside
    the forward, where the error would stop the engine.) Nothing is written and the lease ends once."""
    tensors, reg = register_kv(client, "e9", shared_dir, seed=12)
    keys, src = keys_for(900, 2), block_ids(0, 2)
    assert client.store("e9", keys, src).num_stored_chunks == 2
    copier = open_engine_copier(reg, tensors, GROUPS, HINTS, None, stages=2)
    assert copier is not None
    dst = block_ids(40, 2)
    half = len(dst[0]) // 2
    dst[0][half:] = dst[0][:half]  # the second chunk writes the first chunk's blocks again
    before = blocks_of(tensors, dst)
    for scatter in (copier.scatter, copier.scatter_staged):
        res = client.retrieve("e9", "req-r", keys, dst, engine_copies=True)
        calls: list[int] = []

        def release() -> None:
            client.release_all("e9", "req-r")
            calls.append(1)  # noqa: B023

        with pytest.raises(ValueError, match=r"repeats block id \d+: a retrieve writes each block once"):
            scatter(res.chunk_offsets, dst, 0, fence=None, release=release)
        assert calls == [1] and client.health().num_leased_chunks == 0
        assert all(torch.equal(a, b) for a, b in zip(blocks_of(tensors, dst), before, strict=True))
    copier.close()


def test_a_lookup_with_lease_hands_the_hits_to_the_engine_without_a_retrieve(
    client: AgentClient, shared_dir: Path
) -> None:
    """The scheduler's Lookup with ``lease`` answers what a Retrieve with ``engine_copies`` would:
    the hits' offsets (the same ones), leased to the request; their pins go, the lease holds them."""
    tensors, reg = register_kv(client, "e11", shared_dir, seed=14)
    keys, src, dst = keys_for(1100, 3), block_ids(0, 3), block_ids(20, 3)
    want = blocks_of(tensors, src)
    assert client.store("e11", keys, src).num_stored_chunks == 3
    missing = keys_for(1101, 1)
    res = client.lookup("e11", "req-l", [*keys, *missing], lease=True)
    assert (res.num_hit_chunks, len(res.chunk_offsets), res.l1_file) == (3, 3, reg.l1_file)
    assert res.lease_id > 0
    health = client.health()
    assert (health.num_leased_chunks, health.num_pinned_chunks) == (3, 0)
    same = client.retrieve("e11", "other", keys, dst, engine_copies=True)
    assert same.chunk_offsets == res.chunk_offsets
    client.release_all("e11", "other")

    copier = open_engine_copier(reg, tensors, GROUPS, HINTS, None)
    assert copier is not None
    released = threading.Event()
    copier.scatter(res.chunk_offsets, dst, 0, fence=None, release=released.set)
    assert released.wait(10)
    copier.close()
    assert all(torch.equal(g, w) for g, w in zip(blocks_of(tensors, dst), want, strict=True))
    assert client.release_all("e11", "req-l", lease_id=res.lease_id).released_chunks == 3
    assert client.health().num_leased_chunks == 0
    # Without a request id (nothing could end the lease) or without ``lease``: pins, no lease.
    assert client.lookup("e11", "", keys, lease=True).lease_id == 0
    plain = client.lookup("e11", "req-p", keys)
    assert (plain.num_hit_chunks, plain.lease_id, plain.chunk_offsets) == (3, 0, [])
    assert client.health().num_pinned_chunks == 3
    client.release_all("e11", "req-p")


def test_a_release_naming_a_lease_ends_that_lease_only(client: AgentClient, shared_dir: Path) -> None:
    """Two loads of one request id (a preempted request loading again) hold two leases. The first
    load's Release, sent when its bytes landed on another thread than the second Retrieve, may reach
    the agent after it: naming its lease, it must not end the second load's, whose chunks are still
    being copied. Release without a lease id ends every lease and the pins, as before."""
    register_kv(client, "e10", shared_dir, seed=13)
    keys = keys_for(1000, 2)
    assert client.store("e10", keys, block_ids(0, 2)).num_stored_chunks == 2
    first = client.retrieve("e10", "req-p", keys, block_ids(10, 2), engine_copies=True)
    second = client.retrieve("e10", "req-p", keys[:1], block_ids(20, 1), engine_copies=True)
    assert 0 < first.lease_id != second.lease_id > 0
    assert client.health().num_leased_chunks == 3
    late = client.release_all("e10", "req-p", lease_id=first.lease_id)
    assert (late.released_pins, late.released_chunks) == (0, 2)
    assert client.health().num_leased_chunks == 1  # the second load's chunk is still held
    again = client.release_all("e10", "req-p", lease_id=first.lease_id)  # a repeat ends nothing
    assert again.released_chunks == 0 and client.health().num_leased_chunks == 1
    assert client.lookup("e10", "req-p", keys).num_hit_chunks == 2  # pins beside the lease
    whole = client.release_all("e10", "req-p")
    assert (whole.released_pins, whole.released_chunks) == (2, 1)
    assert client.health().num_leased_chunks == 0


def test_leases_end_with_the_registration(client: AgentClient, shared_dir: Path) -> None:
    register_kv(client, "e2", shared_dir, seed=6)
    keys = keys_for(600, 2)
    assert client.store("e2", keys, block_ids(0, 2)).num_stored_chunks == 2
    before = client.health().num_leased_chunks
    client.retrieve("e2", "a", keys, block_ids(10, 2), engine_copies=True)
    client.retrieve("e2", "b", keys, block_ids(20, 2), engine_copies=True)
    assert client.health().num_leased_chunks == before + 4
    client.unregister_kv_caches("e2")
    assert client.health().num_leased_chunks == before


def test_bad_engine_copies_requests_are_invalid_argument(client: AgentClient, shared_dir: Path) -> None:
    register_kv(client, "e3", shared_dir, seed=7)
    keys, ids = keys_for(700, 1), block_ids(0, 1)
    assert "needs a request_id" in invalid(client.retrieve, "e3", "", keys, ids, engine_copies=True)
    text = invalid(client.retrieve, "e3", "r", keys, ids, engine_copies=True, after_fence=True)
    assert "nothing for the agent to wait for" in text
    assert client.health().num_leased_chunks == 0
    # The agent still serves.
    assert client.store("e3", keys, ids).num_stored_chunks == 1


def test_a_private_l1_refuses_engine_copies(tmp_path: Path) -> None:
    agent = start_agent(tmp_path, pod_uid="uid-private-l1")
    try:
        with agent.client() as client:
            _, reg = register_kv(client, "p", tmp_path, seed=8)
            assert reg.l1_file == "" and reg.l1_file_bytes == 0
            text = invalid(client.retrieve, "p", "r", keys_for(800, 1), block_ids(0, 1), engine_copies=True)
            assert "engine_copies=true but this agent's L1 is private" in text
            assert "--l1-shared-dir" in text
            # A Lookup asking for a lease gets pins instead: the engine Retrieves (agent copies).
            assert client.store("p", keys_for(801, 1), block_ids(0, 1)).num_stored_chunks == 1
            res = client.lookup("p", "r", keys_for(801, 1), lease=True)
            assert (res.num_hit_chunks, res.lease_id, res.chunk_offsets, res.l1_file) == (1, 0, [], "")
            assert client.health().num_pinned_chunks == 1
    finally:
        agent.stop()


def test_the_agent_removes_its_file_when_it_stops(tmp_path: Path) -> None:
    agent = start_agent(tmp_path, "--l1-shared-dir", str(tmp_path), pod_uid="uid-stops")
    (path,) = tmp_path.glob("kvgrid-l1-*")
    agent.stop()
    assert not path.exists()


def test_a_shared_l1_that_does_not_fit_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match=rf"l1_shared_dir='{tmp_path}': cannot allocate the \d+-byte L1 file"
    ):
        L1Pool(1 << 52, shared_dir=str(tmp_path), pin=False)
    assert list(tmp_path.glob("kvgrid-l1-*")) == []


def _cuda_copiers(stages: int) -> tuple[EngineCopier, EngineCopier, list[torch.Tensor], list[torch.Tensor]]:
    """Two copiers over one pinned pool of random chunks: one staged, one whole, each with its own
    8-layer KV cache of NaNs (FlashInfer layout, 256 blocks of 16 tokens)."""
    dev = torch.device("cuda")
    layers, nb = 8, 256
    groups = [EngineGroupInfo(engine_group_id=0, layer_indices=tuple(range(layers)), tokens_per_block=16)]
    hints = [{"backend": "FLASHINFER"}] * layers
    nan = float("nan")
    staged_kv, whole_kv = (
        [torch.full((nb, 2, 16, 2, 64), nan, dtype=torch.bfloat16, device=dev) for _ in range(layers)]
        for _ in range(2)
    )
    movers = [build_mover(t, groups, 64, layout_hints=hints) for t in (staged_kv, whole_kv)]
    pool = torch.randint(0, 255, (40 * movers[0].bytes_per_chunk,), dtype=torch.uint8).pin_memory()
    staged = EngineCopier(pool, "", movers[0], groups, None, dev, stages=stages)
    whole = EngineCopier(pool, "", movers[1], groups, None, dev)
    return staged, whole, staged_kv, whole_kv


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("stages", [1, 3, 8])
def test_cuda_staged_loads_equal_a_whole_load_bit_for_bit(stages: int) -> None:
    """On CUDA a layer-wise load moves each stage by DMA into one of two GPU buffers and scatters it
    from there with kernels alone (its tables went up before its DMA), queued just in time: a
    stage's scatter is queued when a layer first asks for it, never before (two DMAs ahead at
    most). Two loads of one step, waited for in the worker's order (each stage of A, then of B),
    share the buffers. What a layer reads right after its stage's wait (queued on the engine's
    stream) equals a whole load of the same chunks, for loads of several sizes that grow and reuse
    the buffers, and each load's lease is released once it landed."""
    staged, whole, staged_kv, whole_kv = _cuda_copiers(stages)
    bpc, layers = staged.mover.bytes_per_chunk, len(staged_kv)
    gen = torch.Generator().manual_seed(stages)
    for n_a, n_b in ((3, 2), (9, 4), (9, 9), (9, 1), (5, 7)):  # 9 grows the buffers
        picked = [int(c) * bpc for c in torch.randperm(40, generator=gen)[: n_a + n_b]]
        blocks = torch.randperm(256, generator=gen)[: (n_a + n_b) * 4].tolist()
        parts = [(picked[:n_a], blocks[: n_a * 4]), (picked[n_a:], blocks[n_a * 4 :])]
        released = [threading.Event(), threading.Event()]
        loads = [
            staged.scatter_staged(offs, [ids], 0, fence=None, release=done.set)
            for (offs, ids), done in zip(parts, released, strict=True)
        ]
        seen = []
        for i in range(layers):
            stage = staged.stage_of_layer[i]
            for load in loads:
                load.wait(stage)
                assert all(e is None for e in load.events[stage + 1 :]), (i, "queued ahead of its wait")
            seen.append(staged_kv[i][blocks].clone())  # queued on the engine's stream after the waits
        for load in loads:
            load.finish()
        copied = threading.Event()
        whole.scatter(picked, [blocks], 0, fence=None, release=copied.set)
        assert all(r.wait(30) for r in released) and copied.wait(30)
        torch.cuda.synchronize()
        for i in range(layers):
            want = whole_kv[i][blocks].view(torch.int16)
            assert torch.equal(seen[i].view(torch.int16), want), (n_a, n_b, i)
    staged.close()
    whole.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("where", ["scatter", "last-dma", "close"])
def test_cuda_a_load_that_cannot_finish_is_abandoned_without_raising(
    monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A load whose stage fails to queue inside the forward (a driver error in stage 2's scatter, or
    in the last stage's DMA), or whose copier closes mid-load (a re-registration), must not stop the
    engine: every wait returns, each load of the step ends its lease once, ``failed`` runs once per
    load on the engine's thread (the worker reports the blocks for recomputation), and the copier
    serves the next load bit for bit."""
    from kvgrid_kernels.cuda_driver import Driver

    staged, whole, staged_kv, whole_kv = _cuda_copiers(4)
    bpc = staged.mover.bytes_per_chunk
    loads_args = [
        ([c * bpc for c in (3, 7, 11)], list(range(100, 112))),
        ([c * bpc for c in (5, 9)], list(range(40, 48))),
    ]
    releases: list[int] = []
    failures: list[int] = []
    loads = []
    for i, (offsets, blocks) in enumerate(loads_args):

        def release(i: int = i) -> None:
            releases.append(i)

        def failed(i: int = i) -> None:
            failures.append(i)
            assert threading.current_thread() is threading.main_thread()  # the engine's thread

        loads.append(staged.scatter_staged(offsets, [blocks], 0, fence=None, release=release, failed=failed))
    drv, real_memcpy = Driver.get(), Driver.get().memcpy_async
    if where == "scatter":
        monkeypatch.setattr(staged.stage_parts[2][0].plan, "launch_prepared", lambda *a, **k: 1 / 0)
    elif where == "last-dma":
        calls = [0]

        def memcpy(*a: object) -> None:  # the last job's DMA: (load 1, stage 3), its second chunk
            calls[0] += 1  # load 0's stage-0 DMA (3 chunks) was queued by its add, before this patch
            if calls[0] == 2 + 3 + 2 + 3 + 2 + 3 + 2:
                raise RuntimeError("injected driver error")
            real_memcpy(*a)  # type: ignore[arg-type]

        monkeypatch.setattr(drv, "memcpy_async", memcpy)
    for stage in range(4):
        if where == "close" and stage == 2:
            threading.Thread(target=staged._pipeline.close).start()  # type: ignore[union-attr]
            time.sleep(0.5)
            assert sorted(releases) == [0, 1]  # at once, before the engine's next wait
        for load in loads:
            load.wait(stage)  # no exception
    for load in loads:
        load.finish()
    torch.cuda.synchronize()
    time.sleep(0.2)  # the completer thread
    assert sorted(releases) == [0, 1] and sorted(failures) == [0, 1]
    monkeypatch.undo()
    if where == "close":  # a closed copier serves no more: the next one does
        staged.close()
        whole.close()
        staged, whole, staged_kv, whole_kv = _cuda_copiers(4)
    offsets, blocks = loads_args[0]
    done, copied = threading.Event(), threading.Event()
    staged.scatter_staged(offsets, [blocks], 0, fence=None, release=done.set).finish()
    whole.scatter(offsets, [blocks], 0, fence=None, release=copied.set)
    assert done.wait(30) and copied.wait(30)
    torch.cuda.synchronize()
    for got, want in zip(staged_kv, whole_kv, strict=True):
        assert torch.equal(got[blocks].view(torch.int16), want[blocks].view(torch.int16))
    staged.close()
    whole.close()


# ---- stores the engine copies itself ----------------------------------------------------------------


def test_the_engine_gathers_a_store_itself_bit_exact(client: AgentClient, shared_dir: Path) -> None:
    """A Store with engine_copies reserves room and answers offsets; nothing is visible until the
    engine's gather landed and a second Store finished it. Then an agent-side Retrieve gives the
    engine's blocks bit for bit."""
    tensors, reg = register_kv(client, "s1", shared_dir, seed=21)
    keys, src, dst = keys_for(2100, 3), block_ids(0, 3), block_ids(20, 3)
    want = blocks_of(tensors, src)
    res = client.store("s1", keys, src, engine_copies=True)
    assert res.store_id > 0 and res.copy_chunk_indices == [0, 1, 2] and len(res.chunk_offsets) == 3
    assert (res.num_stored_chunks, res.bytes_moved) == (0, 0)
    assert client.lookup("s1", "probe", keys).num_hit_chunks == 0  # reserved: invisible
    client.release("s1", "probe")
    assert client.health().num_leased_chunks == 3  # held for the engine meanwhile

    copier = open_engine_copier(reg, tensors, GROUPS, HINTS, None)
    assert copier is not None
    copier.gather(res.chunk_offsets, src, res.copy_chunk_indices, fence=None)
    copier.close()
    done = client.finish_store("s1", res.store_id)
    assert (done.num_stored_chunks, done.num_already_present, done.partial_reason) == (3, 0, "")
    assert client.health().num_leased_chunks == 0
    assert client.retrieve("s1", "r", keys, dst).num_retrieved_chunks == 3  # the agent copies back
    for got, w in zip(blocks_of(tensors, dst), want, strict=True):
        assert torch.equal(got, w)
    # Stored again: nothing new to copy, the answer is final at once.
    again = client.store("s1", keys, src, engine_copies=True)
    assert (again.store_id, again.copy_chunk_indices, again.num_stored_chunks) == (0, [], 3)
    assert again.num_already_present == 3


def test_an_engine_store_copies_only_the_chunks_it_lacks(client: AgentClient, shared_dir: Path) -> None:
    tensors, reg = register_kv(client, "s2", shared_dir, seed=22)
    keys, src = keys_for(2200, 4), block_ids(0, 4)
    assert client.store("s2", keys[:2], src).num_stored_chunks == 2  # the agent stored two
    res = client.store("s2", keys, src, engine_copies=True)
    assert res.copy_chunk_indices == [2, 3]
    copier = open_engine_copier(reg, tensors, GROUPS, HINTS, None)
    assert copier is not None
    copier.gather(res.chunk_offsets, src, res.copy_chunk_indices, fence=None)
    copier.close()
    done = client.finish_store("s2", res.store_id)
    assert (done.num_stored_chunks, done.num_already_present) == (4, 2)
    dst = block_ids(30, 4)
    want = blocks_of(tensors, src)
    assert client.retrieve("s2", "r", keys, dst).num_retrieved_chunks == 4
    for got, w in zip(blocks_of(tensors, dst), want, strict=True):
        assert torch.equal(got, w)


def test_a_failed_engine_copy_stores_nothing(client: AgentClient, shared_dir: Path) -> None:
    register_kv(client, "s3", shared_dir, seed=23)
    keys = keys_for(2300, 2)
    res = client.store("s3", keys, block_ids(0, 2), engine_copies=True)
    done = client.finish_store("s3", res.store_id, copy_failed=True)
    assert done.num_stored_chunks == 0 and done.partial_reason.startswith("copy_failed")
    assert client.health().num_leased_chunks == 0
    assert client.lookup("s3", "probe", keys).num_hit_chunks == 0
    client.release("s3", "probe")
    # The room came back: the same keys store normally.
    assert client.store("s3", keys, block_ids(0, 2)).num_stored_chunks == 2


def test_finishing_an_unknown_or_finished_store_is_invalid_argument(
    client: AgentClient, shared_dir: Path
) -> None:
    register_kv(client, "s4", shared_dir, seed=24)
    assert "store_id=987654" in invalid(client.finish_store, "s4", 987654)
    res = client.store("s4", keys_for(2400, 1), block_ids(0, 1), engine_copies=True)
    client.finish_store("s4", res.store_id, copy_failed=True)
    assert f"store_id={res.store_id}" in invalid(client.finish_store, "s4", res.store_id)
    text = invalid(
        client.store, "s4", keys_for(2401, 1), block_ids(0, 1), engine_copies=True, after_fence=True
    )
    assert "Store with engine_copies=true" in text
    assert client.store("s4", keys_for(2402, 1), block_ids(0, 1)).num_stored_chunks == 1  # still serves


def test_engine_stores_outlive_a_re_registration_and_end_with_unregister(
    client: AgentClient, shared_dir: Path
) -> None:
    """The engine may still be writing into a reservation when it registers again, so that keeps
    it; unregister (the engine is done) drops what was never finished."""
    tensors, reg = register_kv(client, "s5", shared_dir, seed=25)
    before = client.health().num_leased_chunks
    keys = keys_for(2500, 2)
    res = client.store("s5", keys, block_ids(0, 2), engine_copies=True)
    tensors, reg = register_kv(client, "s5", shared_dir, seed=25)  # the same engine registers again
    assert client.health().num_leased_chunks == before + 2
    copier = open_engine_copier(reg, tensors, GROUPS, HINTS, None)
    assert copier is not None
    copier.gather(res.chunk_offsets, block_ids(0, 2), res.copy_chunk_indices, fence=None)
    copier.close()
    assert client.finish_store("s5", res.store_id).num_stored_chunks == 2
    unfinished = client.store("s5", keys_for(2501, 3), block_ids(0, 3), engine_copies=True)
    assert client.health().num_leased_chunks == before + 3
    client.unregister_kv_caches("s5")
    assert client.health().num_leased_chunks == before
    register_kv(client, "s5", shared_dir, seed=25)
    assert f"store_id={unfinished.store_id}" in invalid(client.finish_store, "s5", unfinished.store_id)


def test_a_private_l1_refuses_engine_stores(tmp_path: Path) -> None:
    agent = start_agent(tmp_path, pod_uid="uid-private-l1-store")
    try:
        with agent.client() as client:
            register_kv(client, "p", tmp_path, seed=9)
            text = invalid(client.store, "p", keys_for(900, 1), block_ids(0, 1), engine_copies=True)
            assert "Store with engine_copies=true but this agent's L1 is private" in text
    finally:
        agent.stop()
