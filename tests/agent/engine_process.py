"""A stand-in engine worker process for the agent tests: owns KV tensors in shared memory and talks
to the agent over its Unix socket, like the vLLM connector does.

usage: python -m tests.agent.engine_process UDS DIR INSTANCE_ID MODE [NUM_CHUNKS]
  roundtrip  register, store NUM_CHUNKS chunks, retrieve them into other blocks, check bit-exact
  hold       register, store, take lookup pins (request "held"), then wait to be killed
Prints one JSON line with what happened.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from kvgrid.engine.client import AgentClient
from tests.agent.helpers import block_ids, blocks_of, keys_for, register_kv


def main() -> int:
    uds, directory, instance_id, mode = sys.argv[1:5]
    n = int(sys.argv[5]) if len(sys.argv) > 5 else 4
    client = AgentClient(uds, timeout_s=30)
    client.wait_ready()
    tensors, reg = register_kv(client, instance_id, Path(directory), seed=11)
    keys = keys_for(5, n)
    src = block_ids(0, n)
    stored = client.store(instance_id, keys, src)
    out: dict[str, object] = {
        "kernel_groups": len(reg.kernel_groups),
        "bytes_per_chunk": reg.bytes_per_chunk,
        "stored": stored.num_stored_chunks,
    }
    if mode == "roundtrip":
        before = blocks_of(tensors, src)
        dst = block_ids(n * 4, n)
        for layer, t in enumerate(tensors):
            t[dst[1 if layer in (1, 3) else 0]] = 0
        hits = client.lookup(instance_id, "r1", keys)
        res = client.retrieve(instance_id, "r1", keys, dst)
        after = blocks_of(tensors, dst)
        out["lookup"] = hits.num_hit_chunks
        out["hit_mask"] = res.hit_mask
        out["bit_exact"] = all(
            torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(before, after, strict=True)
        )
        out["health_pins"] = client.health().num_pinned_chunks
        print(json.dumps(out), flush=True)
        return 0
    if mode == "hold":
        out["pinned"] = client.lookup(instance_id, "held", keys, pin_ttl_ms=600_000).num_hit_chunks
        print(json.dumps(out), flush=True)
        time.sleep(600)
        return 0
    raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    sys.exit(main())
