"""Does a small operation on the engine's stream wait behind another stream's train of DMAs? (GPU, by hand)

    python3 scripts/probe_upload_behind_dma.py

A side stream queues ``--stages`` stages of 31 pinned host-to-GPU copies of 6 MiB each (a
layer-wise load's DMAs at 8k tokens); the default stream queues one small operation and a matmul,
either before the first stage ("engine_first") or right after it, the other stages queued after it
("dma_first"). Printed: when the engine's work and the DMA train ended, ms after the start. On the
H200 (docs/benchmarks.md, *a pinned upload behind a DMA train*) only a pinned upload queued after
the first stage waits for the whole train, stages queued after it included: the reason the
connector's loads must start after the step's inputs are uploaded (vLLM's order).
"""

from __future__ import annotations

import argparse

import torch

PER, SIZE = 31, 6 << 20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", type=int, default=8)
    args = p.parse_args()
    dev = torch.device("cuda")
    host = torch.empty(PER * SIZE, dtype=torch.uint8).pin_memory()
    bufs = [torch.empty(PER * SIZE, dtype=torch.uint8, device=dev) for _ in range(2)]
    small_pinned = torch.arange(8192, dtype=torch.int64).pin_memory()
    small_pageable = torch.arange(8192, dtype=torch.int64)
    small_dev = torch.empty(8192, dtype=torch.int64, device=dev)
    src, dst = torch.arange(256, device=dev), torch.empty(256, dtype=torch.int64, device=dev)
    x = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    dma = torch.cuda.Stream()

    def stage(s: int) -> None:
        with torch.cuda.stream(dma):
            buf = bufs[s % 2]
            for c in range(PER):
                buf[c * SIZE : (c + 1) * SIZE].copy_(host[c * SIZE : (c + 1) * SIZE], non_blocking=True)

    ops = {
        "pinned upload": lambda: small_dev.copy_(small_pinned, non_blocking=True),
        "pageable upload": lambda: small_dev.copy_(small_pageable, non_blocking=True),
        "device copy": lambda: dst.copy_(src),
        "kernel": lambda: dst.add_(1),
    }
    for rnd in range(2):  # the first round warms up
        for name, op in ops.items():
            for order in ("engine_first", "dma_first"):
                torch.cuda.synchronize()
                start, engine_done, dma_done = (torch.cuda.Event(enable_timing=True) for _ in range(3))
                start.record()
                first = 1 if order == "dma_first" else 0
                if first:
                    stage(0)
                op()
                _ = x @ x
                engine_done.record()
                for s in range(first, args.stages):
                    stage(s)
                dma_done.record(dma)
                torch.cuda.synchronize()
                if rnd:
                    print(
                        f"{name:16s} {order:13s} engine done at {start.elapsed_time(engine_done):7.2f} ms, "
                        f"DMA train at {start.elapsed_time(dma_done):6.2f} ms"
                    )


if __name__ == "__main__":
    main()
