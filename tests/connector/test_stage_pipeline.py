"""The CUDA layer-wise load pipeline (``staged_loads.StagePipeline``) run on CPU, for its logic.

What cannot run here is CUDA, so these tests stand in for it, and say so: streams and events are
fakes that log what is queued, the driver's ``cuMemcpyAsync`` is a synchronous ``memmove``, and a
stage's scatter is the CPU transfer plan's (synchronous, real bytes) returning a fake event. Every
queued operation then completes at once, in queueing order, so what these tests check is the
schedule: which job is queued when, what each DMA waits for, when leases end, what failures and a
closing copier do -- and that the bytes that land equal a whole load's. The real CUDA behaviour is
checked on a GPU by ``tests/agent/test_engine_copies.py``'s ``test_cuda_*`` tests.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvgrid.agent.transfer import build_mover
from kvgrid.common.groups import EngineGroupInfo
from kvgrid.connector import staged_loads
from kvgrid.connector.engine_copies import EngineCopier
from kvgrid.connector.staged_loads import StagedLoad
from kvgrid_kernels.plan import PreparedRetrieve, TransferHandle, TransferPlan

LAYERS, BLOCKS, TPC = 8, 64, 64  # 4 blocks of 16 tokens per chunk
GROUPS = [EngineGroupInfo(engine_group_id=0, layer_indices=tuple(range(LAYERS)), tokens_per_block=16)]
HINTS = [{"backend": "FLASHINFER"}] * LAYERS


class FakeEvent:
    _ids = itertools.count()

    def __init__(self, *a: Any, **k: Any) -> None:
        self.name = f"ev{next(self._ids)}"
        self.recorded_on: str | None = None

    def record(self, stream: FakeStream | None = None) -> None:
        self.recorded_on = stream.name if stream is not None else "engine"

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class FakeStream:
    def __init__(self, log: list[tuple[str, ...]], name: str) -> None:
        self.log, self.name, self.cuda_stream = log, name, 0

    def wait_event(self, event: Any) -> None:
        self.log.append(("wait", self.name, event.name))


class Rig:
    """A CPU copier whose layer-wise loads go through the CUDA pipeline, over fakes (module doc)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, stages: int = 4) -> None:
        self.log: list[tuple[str, ...]] = []
        self.memcpys = 0
        self.fail_memcpy_at = 0  # the n-th memcpy from now raises (0: never)
        engine = FakeStream(self.log, "engine")
        monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: FakeStream(self.log, "dma"))
        monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
        monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: self.log.append(("sync",)))
        monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: engine)

        rig = self

        class Driver:
            def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
                rig.memcpys += 1
                if rig.memcpys == rig.fail_memcpy_at:
                    raise RuntimeError("injected driver error")
                ctypes.memmove(dst, src, nbytes)

        driver = Driver()
        monkeypatch.setattr(staged_loads.Driver, "get", staticmethod(lambda: driver))
        cpu_retrieve = TransferPlan.retrieve_async
        self.fail_scatter_of: int | None = None  # a stage's scatter raises

        # A prepared scatter keeps its chunk views (into a pipeline buffer) and ids; its launch
        # runs the CPU plan's scatter then, so the bytes it reads are the buffer's at launch time.
        def prepare(plan: TransferPlan, views: list[torch.Tensor], ids: list[Any]) -> PreparedRetrieve:
            self.log.append(("prepare", f"stage{self.stage_of_plan[id(plan)]}"))
            return PreparedRetrieve(list(views), [torch.as_tensor(i) for i in ids], (), torch.empty(0))

        def launch(plan: TransferPlan, prepared: PreparedRetrieve, *, wait_event: Any) -> TransferHandle:
            stage = self.stage_of_plan[id(plan)]
            if stage == self.fail_scatter_of:
                raise RuntimeError("injected scatter error")
            self.log.append(("scatter", f"stage{stage}", wait_event.name))
            cpu_retrieve(plan, prepared.chunks, [t.numpy() for t in prepared.tables])
            event = FakeEvent()
            event.record()
            return TransferHandle(event)  # type: ignore[arg-type]  # a fake CUDA event

        monkeypatch.setattr(TransferPlan, "prepare_retrieve", prepare)
        monkeypatch.setattr(TransferPlan, "launch_prepared", launch)
        monkeypatch.setattr(
            TransferPlan, "kernel_stream", property(lambda p: FakeStream(self.log, "scatter"))
        )
        monkeypatch.setattr(
            torch.Tensor, "record_stream", lambda t, stream: self.log.append(("record", stream.name))
        )
        gen = torch.Generator().manual_seed(stages)
        self.kv = [
            torch.full((BLOCKS, 2, 16, 2, 64), float("nan"), dtype=torch.bfloat16) for _ in range(LAYERS)
        ]
        self.whole_kv = [torch.full_like(t, float("nan")) for t in self.kv]
        movers = [build_mover(t, GROUPS, TPC, layout_hints=HINTS) for t in (self.kv, self.whole_kv)]
        self.bpc = movers[0].bytes_per_chunk
        self.pool = torch.randint(0, 255, (12 * self.bpc,), dtype=torch.uint8, generator=gen)
        device = torch.device("cpu")
        self.copier = EngineCopier(self.pool, "", movers[0], GROUPS, None, device, stages=stages)
        self.copier._pipeline = staged_loads.StagePipeline(self.copier)  # CUDA's path, on the fakes
        self.whole = EngineCopier(self.pool, "", movers[1], GROUPS, None, device)
        self.stage_of_plan = {id(p.plan): s for s, parts in enumerate(self.copier.stage_parts) for p in parts}
        self.released: list[str] = []
        self.failed: list[str] = []

    def load(self, name: str, chunks: list[int], blocks: list[int]) -> StagedLoad:
        offsets = [c * self.bpc for c in chunks]
        return self.copier.scatter_staged(
            offsets, [blocks], 0, fence=None,
            release=lambda: self.released.append(name), failed=lambda: self.failed.append(name),
        )  # fmt: skip

    def settle(self) -> None:
        """The completer thread ran every lease release queued so far."""
        self.copier._completer.submit(lambda: None).result()

    def equals_whole(self, chunks: list[int], blocks: list[int]) -> bool:
        done = threading.Event()
        self.whole.scatter([c * self.bpc for c in chunks], [blocks], 0, fence=None, release=done.set)
        assert done.wait(10)
        return all(
            torch.equal(a[blocks].view(torch.int16), b[blocks].view(torch.int16))
            for a, b in zip(self.kv, self.whole_kv, strict=True)
        )

    def close(self) -> None:
        self.copier.close()
        self.whole.close()


@pytest.fixture
def rig(monkeypatch: pytest.MonkeyPatch) -> Iterator[Rig]:
    r = Rig(monkeypatch)
    yield r
    r.close()


def scatters(log: list[tuple[str, ...]]) -> list[str]:
    return [e[1] for e in log if e[0] == "scatter"]


def test_stages_are_queued_when_asked_two_dmas_ahead_into_alternate_buffers_bit_for_bit(rig: Rig) -> None:
    """Adding a load queues only its first stage's DMA; a layer's wait queues that stage's scatter
    and then DMAs until two are in flight, each into the buffer the scatter two stages before read
    (it waits for that scatter, not for the one before it); nothing of a later stage is scattered
    before it is asked for; the lease ends once, after the last stage's DMA. The fake DMAs land at
    once, so a DMA into a buffer not yet scattered would change the bytes that land."""
    chunks, blocks = [2, 5, 7], list(range(10, 22))
    assert [hi - lo for lo, hi in staged_loads.stage_bounds(LAYERS, 4)] == [3, 2, 2, 1]
    load = rig.load("A", chunks, blocks)
    assert rig.memcpys == 3 and scatters(rig.log) == []  # stage 0's DMA: one per chunk
    for stage in range(4):
        load.wait(stage)
        assert scatters(rig.log) == [f"stage{s}" for s in range(stage + 1)]
        assert rig.memcpys == 3 * min(stage + 3, 4)  # two DMAs ahead of the scatters
        assert all(e is None for e in load.events[stage + 1 :])
    load.finish()
    rig.settle()
    assert rig.released == ["A"] and rig.failed == []
    # Stage s's DMA (s >= 2) waited for stage s-2's scatter: the last reader of its buffer.
    waits = [e[2] for e in rig.log if e[0] == "wait" and e[1] == "dma"]
    assert waits == [load.events[s].name for s in range(2)]  # type: ignore[union-attr]
    # Each scatter's tables went up on the DMA stream with its bytes: prepared when its DMA queued.
    prepared = [e[1] for e in rig.log if e[0] == "prepare"]
    assert prepared == [f"stage{s}" for s in range(4)]
    assert rig.equals_whole(chunks, blocks)


def test_two_loads_of_a_step_go_stage_by_stage_and_both_land(rig: Rig) -> None:
    """Loads of one step share the pipeline in the engine's order: stage s of A, then of B."""
    a, b = ([1, 3, 4], list(range(0, 12))), ([6, 9], list(range(30, 38)))
    loads = [rig.load("A", *a), rig.load("B", *b)]
    order: list[str] = []
    for stage in range(4):
        for name, load in zip("AB", loads, strict=True):
            before = len(scatters(rig.log))
            load.wait(stage)
            order += [f"{name}{s[-1]}" for s in scatters(rig.log)[before:]]
    for load in loads:
        load.finish()
    rig.settle()
    assert order == ["A0", "B0", "A1", "B1", "A2", "B2", "A3", "B3"]
    assert sorted(rig.released) == ["A", "B"] and rig.failed == []
    assert rig.equals_whole(*a) and rig.equals_whole(*b)


@pytest.mark.parametrize("where", ["scatter", "last-dma", "close"])
def test_a_load_that_cannot_finish_is_abandoned_once_without_raising(rig: Rig, where: str) -> None:
    """A stage's scatter or the last DMA failing to queue inside the forward, or the copier closing
    mid-load: no exception reaches the engine, the device is synced, each load ends its lease once
    and is reported failed once, on the engine's thread, and the pipeline serves the next load."""
    loads = [rig.load("A", [1, 3, 4], list(range(0, 12))), rig.load("B", [6, 9], list(range(30, 38)))]
    if where == "scatter":
        rig.fail_scatter_of = 2
    elif where == "last-dma":
        rig.fail_memcpy_at = rig.memcpys + 2 + 3 + 2 + 3 + 2 + 3 + 2  # B's stage 3, second chunk
    for stage in range(4):
        if where == "close" and stage == 2:
            closer = threading.Thread(target=rig.copier._pipeline.close)  # type: ignore[union-attr]
            closer.start()
            closer.join()
            assert sorted(rig.released) == ["A", "B"] and rig.failed == []  # leases end at once
        for load in loads:
            load.wait(stage)
    for load in loads:
        load.finish()
    rig.settle()
    assert ("sync",) in rig.log
    assert sorted(rig.released) == ["A", "B"] and sorted(rig.failed) == ["A", "B"]
    rig.fail_scatter_of, rig.fail_memcpy_at = None, 0
    if where == "close":
        return  # a closed copier serves no more
    chunks, blocks = [0, 11], list(range(50, 58))
    rig.load("C", chunks, blocks).finish()
    rig.settle()
    assert rig.released[-1] == "C" and rig.equals_whole(chunks, blocks)


def test_a_stage_nobody_scheduled_is_an_error_not_a_hang(rig: Rig) -> None:
    """A load the pipeline does not know (never added, or dropped) cannot loop forever waiting for
    a DMA: its wait fails loudly (logged), abandons it, and returns."""
    stray = StagedLoad(
        4,
        lambda: rig.released.append("S"),
        pipeline=rig.copier._pipeline,
        failed=lambda: rig.failed.append("S"),
    )
    stray.wait(1)
    assert rig.released == ["S"] and rig.failed == ["S"]


def test_a_longer_load_grows_both_buffers_without_disturbing_one_in_flight(rig: Rig) -> None:
    """A load longer than the buffers replaces both at its add, each new buffer recorded on every
    scatter stream (the allocator then reuses it only after the scatters queued on it ran); a load
    whose first DMA already landed in an old buffer still scatters the right bytes from it."""

    def records() -> int:
        return sum(1 for e in rig.log if e[0] == "record")

    streams = len(rig.copier.scatter_streams())
    a = rig.load("A", [1, 3], list(range(0, 8)))  # its stage 0 lands in buffer 0 now
    assert records() == 2 * streams
    old = list(rig.copier._pipeline.buffers)  # type: ignore[union-attr]
    b = rig.load("B", [4, 6, 8, 10], list(range(20, 36)))  # longer: both buffers replaced
    new = rig.copier._pipeline.buffers  # type: ignore[union-attr]
    assert records() == 4 * streams and all(x is not y for x, y in zip(old, new, strict=True))
    for stage in range(4):
        for load in (a, b):
            load.wait(stage)
    for load in (a, b):
        load.finish()
    rig.settle()
    assert sorted(rig.released) == ["A", "B"] and rig.failed == []
    assert rig.equals_whole([1, 3], list(range(0, 8))) and rig.equals_whole(
        [4, 6, 8, 10], list(range(20, 36))
    )
    rig.load("C", [2], list(range(40, 44))).finish()  # shorter: the buffers stay
    assert records() == 4 * streams
