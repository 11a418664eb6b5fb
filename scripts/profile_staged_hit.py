"""The timeline of layer-wise, engine-copied hits in the TTFT harness (GPU machine, by hand).

    PYTHONPATH=services:kernels:<site> python3 scripts/profile_staged_hit.py [--prompt 8192]
        [--max-prompt 8192] [--stages 8] [--iters 4] [--whole-engine] [--no-marks] [--trace]
        [--torch-trace FILE] [--stage-sizes 2,6,...] [--first-dmas 0|1|2] [--retrieve] [--inline-start]

One Llama-3-8B-shaped engine (``kvgrid.bench.ttft``) with ``layerwise`` and ``engine_copies`` over a real
agent with a shared L1; per iteration a miss, the cache poisoned, then the hit, printing: the hit's
time to first token; when the loader thread queued the load (host ms from the hit's start: the
Retrieve's answer checked and the first stage's DMA queued; the engine's thread queues the other
stages just in time); when each stage's copy ended on the GPU; and, every fourth layer, when the
layer's wait returned on the host and when the engine's stream passed it on the GPU.
``--max-prompt`` sizes the KV cache and L1 as ``kvgrid bench ttft`` does for its longest prompt;
``--whole-engine`` also builds an engine without layer-wise loads first, as the bench does;
``--no-marks`` leaves the layers' hooks as the bench runs them (no event per layer: only the hit
times and the stages print); ``--trace`` also prints host spans of vLLM's and the connector's
calls, one line per call: where the time before the first DMA goes; ``--torch-trace`` writes the
last hit's CUPTI trace and prints each GPU stream's busy spans. Experiments, replacing parts in this
process only: ``--stage-sizes`` (layers per stage), ``--first-dmas`` (DMAs queued when a load is
added; 0: at the first layer's wait), ``--inline-start`` (leased loads started on the engine's
thread), ``--retrieve`` (no lease at Lookup). Not a benchmark (``kvgrid
bench ttft`` is); it shows whether stages overlap the compute (the first iteration compiles, the
second captures graphs).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from kvgrid.bench.ttft.engine import AgentProcess, TTFTEngine
from kvgrid.bench.ttft.model import LLAMA3_8B, PagedLlama
from kvgrid.connector import engine_copies, staged_loads


class _Marks:
    """Wraps the engine's layer hooks: host time and a GPU event after each layer's wait."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.marks: list[tuple[int, float, torch.cuda.Event]] = []

    def before_attention(self, i: int) -> None:
        self.inner.before_attention(i)
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.marks.append((i, time.perf_counter(), event))

    def after_attention(self, i: int, kv: torch.Tensor) -> None:
        self.inner.after_attention(i, kv)


def _trace_host(spans: list[tuple[str, str, float, float]]) -> None:
    """Record (name, thread, start, end) host spans of the calls on a hit's way to its first DMA."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvgrid.bench.ttft.engine import TTFTEngine
    from kvgrid.connector.vllm import KVGridConnector
    from kvgrid.connector.worker import ConnectorWorker
    from kvgrid.engine.client import AgentClient
    from kvgrid_kernels.plan import TransferPlan

    targets: list[tuple[Any, str]] = [
        (Scheduler, "add_request"), (Scheduler, "schedule"), (Scheduler, "update_from_output"),
        (KVGridConnector, "get_num_new_matched_tokens"), (KVGridConnector, "update_state_after_alloc"),
        (KVGridConnector, "build_connector_meta"), (KVGridConnector, "start_load_kv"),
        (KVGridConnector, "wait_for_layer_load"), (KVGridConnector, "wait_for_save"),
        (AgentClient, "lookup"), (AgentClient, "retrieve"), (ConnectorWorker, "_load_here"),
        (engine_copies.EngineCopier, "_chunk_ids"), (TransferPlan, "check_retrieve_ids"),
        (staged_loads.StagePipeline, "add"), (staged_loads.StagePipeline, "_queue_dma"),
        (staged_loads.StagePipeline, "_queue_scatter"), (TransferPlan, "prepare_retrieve"),
        (TTFTEngine, "_execute"),
    ]  # fmt: skip
    for owner, name in targets:
        inner = getattr(owner, name)

        def traced(*a: Any, _inner: Any = inner, _name: str = f"{owner.__name__}.{name}", **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return _inner(*a, **k)
            finally:
                spans.append((_name, threading.current_thread().name, t, time.perf_counter()))

        setattr(owner, name, traced)


def _digest(trace: str) -> None:
    """Per GPU stream of the hit: busy spans (gaps over 0.2 ms split them), ms from the hit's start."""
    import json
    from collections import defaultdict

    events = json.loads(Path(trace).read_text())["traceEvents"]
    t0 = min(e["ts"] for e in events if e.get("name") == "hit" and e.get("ph") == "X")
    ops: dict[int, list[tuple[float, float, str]]] = defaultdict(list)
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e.get("ph") == "X":
            a = (e["ts"] - t0) / 1e3
            ops[e["args"].get("stream", -1)].append((a, a + e.get("dur", 0) / 1e3, e["cat"]))
    for stream, items in sorted(ops.items()):
        items.sort()
        spans: list[list[float]] = []
        for a, b, _ in items:
            if spans and a - spans[-1][1] <= 0.2:
                spans[-1][1] = max(spans[-1][1], b)
            else:
                spans.append([a, b])
        kinds = sorted({k for _, _, k in items})
        text = " ".join(f"{a:.2f}-{b:.2f}" for a, b in spans)
        print(f"  stream {stream}: {len(items)} ops {kinds}: {text}")


def _patch_inline_start() -> None:
    """Experiment: a leased in-step load needs no round trip, so start it on the engine's thread (this
    ignores the loader thread's ordering against a copier swap: a profile has no re-registration)."""
    from concurrent.futures import Future

    from kvgrid.connector.worker import ConnectorWorker

    start_loads = ConnectorWorker.start_loads

    def inline(self: Any, meta: Any) -> None:
        rest = []
        for order in meta.loads:
            if order.in_step and self._my_lease(order) is not None:
                self._fence_engine_stream()
                done: Future[Any] = Future()
                done.set_result(self._load(order))
                self._step_loads.append(done)
            else:
                rest.append(order)
        start_loads(self, dataclasses.replace(meta, loads=rest))

    ConnectorWorker.start_loads = inline  # type: ignore[method-assign]


def _patch_pipeline(stage_sizes: str, first_dmas: int) -> None:
    """Experiments on the layer-wise pipeline, by replacing its parts in this process only."""
    if stage_sizes:
        sizes = [int(x) for x in stage_sizes.split(",")]

        def bounds(num_layers: int, stages: int) -> list[tuple[int, int]]:
            if sum(sizes) != num_layers or len(sizes) != stages:
                raise SystemExit(f"--stage-sizes {stage_sizes}: expected {stages} sizes, {num_layers} layers")
            edges = [sum(sizes[:s]) for s in range(len(sizes) + 1)]
            return list(itertools.pairwise(edges))

        engine_copies.stage_bounds = bounds
    if first_dmas == 1:
        return
    pipeline = staged_loads.StagePipeline
    add, queue_dma = pipeline.add, pipeline._queue_dma
    adding = threading.local()

    def queue_dma_unless_adding(self: Any) -> None:
        if not (getattr(adding, "on", False) and first_dmas == 0):
            queue_dma(self)

    def add_then_fill(self: Any, load: Any) -> None:
        adding.on = True
        try:
            add(self, load)
        finally:
            adding.on = False
        if first_dmas == 2:
            self.fill()

    pipeline._queue_dma = queue_dma_unless_adding  # type: ignore[method-assign]
    pipeline.add = add_then_fill  # type: ignore[method-assign]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt", type=int, default=8192)
    p.add_argument("--max-prompt", type=int, default=0, help="KV cache and L1 sized for this (0: --prompt)")
    p.add_argument("--stages", type=int, default=8)
    p.add_argument("--retrieve", action="store_true", help="lease_at_lookup off: the load Retrieves")
    p.add_argument("--iters", type=int, default=4)
    p.add_argument("--whole-engine", action="store_true")
    p.add_argument("--no-marks", action="store_true", help="no per-layer events (the bench's hooks)")
    p.add_argument("--trace", action="store_true", help="host spans of the connector's and vLLM's calls")
    p.add_argument("--torch-trace", default="", help="write the last hit's torch.profiler trace (CUPTI) here")
    p.add_argument("--stage-sizes", default="", help="layers per stage: 2,6,6,6,6,4,1,1")
    p.add_argument("--inline-start", action="store_true", help="leased loads start on the engine thread")
    p.add_argument(
        "--first-dmas",
        type=int,
        default=1,
        choices=(0, 1, 2),
        help="DMAs the loader thread queues when a load is added (0: the first layer's wait does)",
    )
    args = p.parse_args()
    _patch_pipeline(args.stage_sizes, args.first_dmas)
    if args.inline_start:
        _patch_inline_start()
    n, top = args.prompt, max(args.max_prompt, args.prompt)
    model = PagedLlama(LLAMA3_8B, device="cuda", seed=0)
    work = Path(tempfile.mkdtemp(dir="/dev/shm"))
    l1 = 3 * top * LLAMA3_8B.kv_bytes_per_token(torch.bfloat16) + (64 << 20)
    agent = AgentProcess(work, l1, l1_shared_dir="/dev/shm")
    engines = []
    if args.whole_engine:
        engines.append(TTFTEngine(model, agent.uds_path, work, max_prompt_tokens=top, engine_copies=True,
                                  engine_id="whole"))  # fmt: skip
    eng = TTFTEngine(model, agent.uds_path, work, max_prompt_tokens=top, layerwise=True, engine_copies=True,
                     layerwise_stages=args.stages, engine_id="layerwise",
                     lease_at_lookup=not args.retrieve)  # fmt: skip
    engines.append(eng)
    queued: list[tuple[float, float, staged_loads.StagedLoad]] = []
    scatter_staged = engine_copies.EngineCopier.scatter_staged

    def timed_scatter(self: engine_copies.EngineCopier, *a: Any, **k: Any) -> staged_loads.StagedLoad:
        t = time.perf_counter()
        load = scatter_staged(self, *a, **k)
        queued.append((t, time.perf_counter(), load))
        return load

    engine_copies.EngineCopier.scatter_staged = timed_scatter  # type: ignore[method-assign]
    spans: list[tuple[str, str, float, float]] = []
    if args.trace:
        _trace_host(spans)
    marks = _Marks(eng._hooks)
    if not args.no_marks:
        eng._hooks = marks
    try:
        for it in range(args.iters):
            tokens = [(it * 7919 + j * 31) % LLAMA3_8B.vocab for j in range(n)]
            eng.run(f"miss-{it}", tokens)
            eng.poison()
            torch.cuda.synchronize()
            marks.marks.clear()
            queued.clear()
            spans.clear()
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            profiler = None
            if args.torch_trace and it == args.iters - 1:
                profiler = torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
                )
                profiler.start()
            t0 = time.perf_counter()
            with torch.profiler.record_function("hit"):
                hit = eng.run(f"hit-{it}", tokens)
            torch.cuda.synchronize()
            if profiler is not None:
                profiler.stop()
                profiler.export_chrome_trace(args.torch_trace)
                _digest(args.torch_trace)

            def ms(t: float, t0: float = t0) -> float:
                return round(1e3 * (t - t0), 2)

            line = f"iter {it}: hit {1e3 * hit.ttft_s:.1f} ms, loaded {hit.loaded_tokens} tokens"
            for q0, q1, load in queued:
                ends = [round(start.elapsed_time(e), 1) for e in load.stage_events()]
                line += f"; load queued (host) {ms(q0)}..{ms(q1)}; stage copies end (GPU) {ends}"
            layers = [(i, ms(t), round(start.elapsed_time(e), 1)) for i, t, e in marks.marks if i % 4 == 0]
            print(f"{line}; layer (i, wait returned on host, passed on GPU) {layers}", flush=True)
            for name, thread, a, b in sorted(spans, key=lambda span: span[2]):
                print(f"    {ms(a):8.3f} .. {ms(b):8.3f} ms  {thread:<16} {name}")
        print(eng.worker.worker.stats)
    finally:
        for e in engines:
            e.close()
        agent.stop()


if __name__ == "__main__":
    main()
