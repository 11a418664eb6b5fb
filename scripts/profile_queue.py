"""Where the host time of queueing one single-chunk transfer goes (GPU machine, by hand).

    PYTHONPATH=services:kernels python3 scripts/profile_queue.py [--calls 400]

For the Llama-3-8B FlashAttention geometry (one 32 MiB chunk, pinned), graph replay on and off:
the median host time of ``store_async`` / ``retrieve_async`` right after a sync (same chunk buffer
every call, or another one each call as the agent's L1 gives), then the host time of each step of
the graph path alone and a cProfile of it (top functions by own time). Not a benchmark
(``kvgrid bench transfer`` is); it tells where to cut next.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from kvgrid_kernels import KernelGroupPages, TransferPlan, page_view


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=400)
    args = p.parse_args()
    nb = 16 + 64
    layers = [torch.randint(0, 127, (2, nb, 16, 8, 128), dtype=torch.int16, device="cuda") for _ in range(32)]
    views = [page_view(t, 1, 0) for t in layers]
    group = KernelGroupPages.from_views(views, tokens_per_block=16)
    rng = np.random.default_rng(0)
    bufs = [torch.empty(32 << 20, dtype=torch.uint8, pin_memory=True) for _ in range(8)]
    for graphs in (True, False):
        plan = TransferPlan([group], 256, mode="staged", graphs=graphs)
        for direction in ("store", "retrieve"):
            fn = plan.store_async if direction == "store" else plan.retrieve_async
            for rotate in (False, True):  # True: another chunk buffer every call, like the agent's L1
                times = []
                for i in range(args.calls):
                    ids = [rng.permutation(nb)[:16]]
                    buf = bufs[i % len(bufs)] if rotate else bufs[0]
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    h = fn([buf], ids)
                    times.append(time.perf_counter() - t0)
                    h.wait()
                us = np.array(times[5:]) * 1e6
                print(
                    f"graphs={graphs} {direction} new-buffer-each-call={rotate}: queue median "
                    f"{np.median(us):.1f} us, p10 {np.percentile(us, 10):.1f}, "
                    f"p90 {np.percentile(us, 90):.1f}"
                    f"; graph launches {plan.graph_launches}, error {plan.graph_error}"
                )
        if graphs:
            _pieces_of_a_call(plan, bufs[0], [rng.permutation(nb)[:16]], args.calls)


def _median_us(fn: Callable[[], object], calls: int, sync: bool = False) -> float:
    times = []
    for _ in range(calls):
        if sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _pieces_of_a_call(plan: TransferPlan, buf: torch.Tensor, ids: list[np.ndarray], calls: int) -> None:
    """Host time of each step the graph path takes, alone (medians), then a cProfile."""
    from kvgrid_kernels.cuda_driver import Driver

    drv = Driver.get()
    ks = plan._kernel_stream.cuda_stream
    ev = plan._start_raw()
    runner = plan._graphs
    assert runner is not None and runner.graphs
    inst = next(iter(runner.graphs.values())).instances[0]
    steps = {
        "validate chunks": lambda: plan._chunks([buf]),
        "validate ids (retrieve)": lambda: plan._block_ids(ids, 1, retrieve=True),
        "pieces (cached)": lambda: plan._pieces_keyed(ids, 1, True, True),
        "current raw stream": lambda: plan._caller_raw_stream(),
        "cuEventRecord": lambda: drv.raw_event_record(ev, ks),
        "cuStreamWaitEvent": lambda: drv.raw_stream_wait_event(ks, ev, 0),
        "cuEventQuery": lambda: drv.raw_event_query(ev),
        "torch Event() + record": lambda: torch.cuda.Event(enable_timing=True).record(plan._kernel_stream),
    }
    for name, fn in steps.items():
        print(f"  {name:28} {_median_us(fn, calls):7.1f} us")
    launch = _median_us(lambda: drv.raw_graph_launch(inst.exe, ks), calls, True)
    print(f"  {'cuGraphLaunch (idle GPU)':28} {launch:7.1f} us")
    prof = cProfile.Profile()
    for _ in range(calls):
        torch.cuda.synchronize()
        prof.enable()
        h = plan.store_async([buf], ids)
        prof.disable()
        h.wait()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(14)
    print(out.getvalue())


if __name__ == "__main__":
    main()
