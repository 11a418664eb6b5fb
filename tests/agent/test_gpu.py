"""The agent with CUDA IPC handles: this process owns KV tensors on the GPU, the agent process maps
them by IPC handle (device found by UUID) and moves chunks between them and its pinned L1.

Run on a machine with an NVIDIA GPU: ``pytest -m gpu tests/agent/test_gpu.py``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch

from kvgrid.common.tensor_wire import device_index_for_uuid, device_uuid
from kvgrid.engine.client import AgentClient
from kvgrid.engine.tensors import export_layer_tensor
from tests.agent.helpers import (
    GROUPS,
    HINTS,
    NAMESPACE,
    NUM_BLOCKS,
    block_ids,
    keys_for,
    layer_shape,
    start_agent,
)

pytestmark = pytest.mark.gpu


def cuda_kv(seed: int) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [
        torch.randn(layer_shape(layer), generator=g, device="cuda", dtype=torch.float32).to(torch.bfloat16)
        for layer in range(5)
    ]


def gpu_blocks(tensors: list[torch.Tensor], ids: list[list[int]]) -> list[torch.Tensor]:
    return [t[ids[1 if layer in (1, 3) else 0]].clone() for layer, t in enumerate(tensors)]


@pytest.fixture
def gpu_agent(tmp_path: Path):  # type: ignore[no-untyped-def]
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    agent = start_agent(tmp_path, l1_size="64MiB")
    yield agent
    agent.stop()


def test_device_uuid_round_trip() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    uuid = device_uuid(0)
    assert uuid.startswith("GPU-")
    assert device_index_for_uuid(uuid) == 0
    assert device_index_for_uuid(uuid.removeprefix("GPU-").upper()) == 0
    with pytest.raises(ValueError, match="no such GPU"):
        device_index_for_uuid("GPU-00000000-0000-0000-0000-000000000000")


def test_cuda_ipc_store_retrieve_bit_exact_across_processes(gpu_agent) -> None:  # type: ignore[no-untyped-def]
    tensors = cuda_kv(seed=5)
    with AgentClient(gpu_agent.uds_path) as c:
        reg = c.register_kv_caches(
            "gpu", tensors, namespace=NAMESPACE, engine_groups=GROUPS, layout_hints=HINTS
        )
        assert len(reg.kernel_groups) == 3
        assert export_layer_tensor(0, tensors[0]).WhichOneof("storage") == "cuda"
        keys = keys_for(9, 4)
        src = block_ids(0, 4)
        want = gpu_blocks(tensors, src)
        torch.cuda.synchronize()
        assert c.store("gpu", keys, src).num_stored_chunks == 4
        # Scribble over the source blocks and retrieve into other ones: only L1 can hold the bytes now.
        for t in tensors:
            t.zero_()
        torch.cuda.synchronize()
        dst = block_ids(NUM_BLOCKS // 2, 4)
        assert c.lookup("gpu", "r", keys).num_hit_chunks == 4
        res = c.retrieve("gpu", "r", keys, dst)
        assert res.hit_mask == [True] * 4
        got = gpu_blocks(tensors, dst)
        for a, b in zip(want, got, strict=True):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))
        # The blocks not named stayed as they were (zero).
        assert int(tensors[0][: NUM_BLOCKS // 2].abs().sum()) == 0
        h = c.health()
        assert h.num_chunks == 4 and h.num_pinned_chunks == 0
        c.unregister_kv_caches("gpu")
        with pytest.raises(grpc.RpcError):
            c.lookup("gpu", "", keys)


def test_fenced_transfers_wait_on_the_gpu_for_the_engine_s_queued_work(gpu_agent) -> None:  # type: ignore[no-untyped-def]
    """The engine queues a slow kernel, then writes the blocks, records its fence and -- without
    waiting -- asks for the Store; then a slow kernel, the zeroing of the destination blocks (as
    vLLM's runner does) and a fenced Retrieve. Both copies must see the engine's final bytes. (The
    agent's copies do run while this process's stream is busy: without the fence the test fails.)"""
    tensors = cuda_kv(seed=6)
    fence = torch.cuda.Event(interprocess=True)
    spin = 2_000_000_000  # GPU clock cycles: ~1 s on an H200, far longer than an RPC and a copy

    with AgentClient(gpu_agent.uds_path) as c:
        c.register_kv_caches(
            "fenced", tensors, namespace=NAMESPACE, engine_groups=GROUPS, layout_hints=HINTS,
            fence_event=fence,
        )  # fmt: skip
        keys, src, dst = keys_for(13, 4), block_ids(0, 4), block_ids(NUM_BLOCKS // 2, 4)
        # Warm the agent up (its first copy of a geometry compiles kernels, which takes longer than
        # the spin): the copies below start within milliseconds of their RPC.
        c.store("fenced", keys_for(14, 4), dst, after_fence=True)
        c.lookup("fenced", "w", keys_for(14, 4))
        c.retrieve("fenced", "w", keys_for(14, 4), src, after_fence=True)
        # Writes that queue without waiting: indexing with a Python list, or assigning a Python
        # scalar through t[ids] = x, copies from pageable host memory, which waits for the stream
        # and would hide the race the fence closes.
        on_gpu = {
            name: [torch.tensor(i, device="cuda") for i in ids] for name, ids in (("src", src), ("dst", dst))
        }
        # Load the kernels used below once: CUDA loads a module at its first launch, and that waits.
        torch.cuda._sleep(1)
        tensors[0][:2].clone().index_fill_(0, on_gpu["src"][0][:1], 1.0)
        torch.cuda.synchronize()
        torch.cuda._sleep(spin)
        for layer, t in enumerate(tensors):
            t.index_fill_(0, on_gpu["src"][1 if layer in (1, 3) else 0], float(layer + 3))
        fence.record()
        assert c.store("fenced", keys, src, after_fence=True).num_stored_chunks == 4
        torch.cuda.synchronize()
        want = gpu_blocks(tensors, src)
        assert c.lookup("fenced", "r", keys).num_hit_chunks == 4
        torch.cuda._sleep(spin)
        for layer, t in enumerate(tensors):
            t.index_fill_(0, on_gpu["dst"][1 if layer in (1, 3) else 0], 0.0)
        fence.record()
        assert c.retrieve("fenced", "r", keys, dst, after_fence=True).hit_mask == [True] * 4
        torch.cuda.synchronize()
        for a, b in zip(want, gpu_blocks(tensors, dst), strict=True):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))
        c.unregister_kv_caches("fenced")


def test_a_signalled_retrieve_answers_at_once_and_the_engine_waits_on_the_gpu(gpu_agent) -> None:  # type: ignore[no-untyped-def]
    """``signal_done``: the Retrieve answers while its copy still waits behind the engine's queued
    work (fence); the engine's stream then waits for the done event, and what it reads after that
    wait is the loaded bytes."""
    tensors = cuda_kv(seed=7)
    fence, done = torch.cuda.Event(interprocess=True), torch.cuda.Event(interprocess=True)
    with AgentClient(gpu_agent.uds_path) as c:
        c.register_kv_caches(
            "signal", tensors, namespace=NAMESPACE, engine_groups=GROUPS, layout_hints=HINTS,
            fence_event=fence, done_event=done,
        )  # fmt: skip
        keys, src, dst = keys_for(15, 4), block_ids(0, 4), block_ids(NUM_BLOCKS // 2, 4)
        torch.cuda.synchronize()
        assert c.store("signal", keys, src).num_stored_chunks == 4
        want = gpu_blocks(tensors, src)
        c.lookup("signal", "w", keys_for(15, 4))
        c.retrieve("signal", "w", keys, dst, after_fence=True, signal_done=True)  # warm-up
        torch.cuda.synchronize()
        on_gpu = [torch.tensor(i, device="cuda") for i in dst]
        tensors[0][:2].clone().index_fill_(0, on_gpu[0][:1] * 0, 1.0)  # load the kernel now (it waits)
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)  # ~1 s of queued engine work before the fence
        for layer, t in enumerate(tensors):
            t.index_fill_(0, on_gpu[1 if layer in (1, 3) else 0], 0.0)
        fence.record()
        assert c.lookup("signal", "r", keys).num_hit_chunks == 4
        res = c.retrieve("signal", "r", keys, dst, after_fence=True, signal_done=True)
        assert res.hit_mask == [True] * 4
        assert not torch.cuda.current_stream().query()  # answered while the engine is still busy
        torch.cuda.current_stream().wait_event(done)
        got = [t.index_select(0, on_gpu[1 if layer in (1, 3) else 0]) for layer, t in enumerate(tensors)]
        torch.cuda.synchronize()
        for a, b in zip(want, got, strict=True):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))
        assert c.health().num_pinned_chunks == 0
        c.unregister_kv_caches("signal")


ENGINE = r"""
import sys, time, torch
sys.path.insert(0, {root!r})
from tests.agent.helpers import GROUPS, HINTS, NAMESPACE, block_ids, keys_for, layer_shape
from kvgrid.engine.client import AgentClient
ts = [torch.ones(layer_shape(i), device="cuda", dtype=torch.bfloat16) for i in range(5)]
c = AgentClient({uds!r})
c.register_kv_caches("doomed", ts, namespace=NAMESPACE, engine_groups=GROUPS, layout_hints=HINTS)
c.store("doomed", keys_for(3, 2), block_ids(0, 2))
print(c.lookup("doomed", "held", keys_for(3, 2), pin_ttl_ms=600000).num_hit_chunks, flush=True)
time.sleep(600)
"""


def test_sigkilled_cuda_engine_is_dropped_and_the_agent_keeps_serving(gpu_agent) -> None:  # type: ignore[no-untyped-def]
    code = ENGINE.format(root=str(Path(__file__).resolve().parents[2]), uds=gpu_agent.uds_path)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "2"
    proc.kill()
    proc.wait(30)
    import time

    with AgentClient(gpu_agent.uds_path) as c:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and "doomed" in c.health().instance_ids:
            time.sleep(0.1)
        h = c.health()
        assert "doomed" not in h.instance_ids and h.num_pinned_chunks == 0
        # The chunks it stored stay in L1 and can be served to a new engine of the same layout.
        tensors = cuda_kv(seed=1)
        c.register_kv_caches("fresh", tensors, namespace=NAMESPACE, engine_groups=GROUPS, layout_hints=HINTS)
        res = c.retrieve("fresh", "", keys_for(3, 2), block_ids(0, 2))
        assert res.num_retrieved_chunks == 2
        assert bool((tensors[0][:8] == 1).all())
