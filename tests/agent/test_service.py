"""The agent as a real process, driven over its Unix socket (and TCP) by engine processes and clients.

KV tensors live in shared-memory files that both sides map; the hybrid layout is described in
``tests.agent.helpers``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvgrid.api.v1 import agent_pb2
from kvgrid.common.groups import EngineGroupInfo, to_proto
from kvgrid.common.wire import key_namespace_to_proto
from kvgrid.engine.client import AgentClient
from kvgrid.engine.tensors import export_layer_tensor
from tests.agent.helpers import (
    GROUPS,
    HINTS,
    NAMESPACE,
    NUM_BLOCKS,
    AgentProc,
    block_ids,
    blocks_of,
    keys_for,
    make_kv,
    register_kv,
    start_agent,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("agent")


@pytest.fixture(scope="module")
def agent(shared_dir: Path) -> Iterator[AgentProc]:
    a = start_agent(shared_dir)
    yield a
    a.stop()


@pytest.fixture(scope="module")
def engine(agent: AgentProc, shared_dir: Path) -> Iterator[tuple[AgentClient, list[torch.Tensor]]]:
    """This test process as an engine instance "local" with its own KV files."""
    client = AgentClient(agent.uds_path, timeout_s=30)
    client.wait_ready()
    tensors, _ = register_kv(client, "local", shared_dir, seed=1)
    yield client, tensors
    client.close()


def run_engine(agent: AgentProc, directory: Path, instance: str, mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.agent.engine_process", agent.uds_path, str(directory), instance, mode],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


def test_engine_process_stores_and_retrieves_bit_exact_through_hybrid_groups(
    agent: AgentProc, shared_dir: Path
) -> None:
    proc = run_engine(agent, shared_dir, "engine-a", "roundtrip")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    res = json.loads(out.strip().splitlines()[-1])
    assert res["kernel_groups"] == 3  # (g0,[0,2]), (g1,[1,3]), (g0,[4])
    # 2 layers x 4 blocks x 2 planes x 16 slots x 2 heads x 8 x 2 B, the same for g1 at 32 tokens
    # per block, plus the MLA-like layer: 4 blocks x 16 x 24 x 2 B.
    assert res["bytes_per_chunk"] == 8192 + 8192 + 3072
    assert res["stored"] == 4 and res["lookup"] == 4
    assert res["hit_mask"] == [True] * 4
    assert res["bit_exact"] is True
    assert res["health_pins"] == 0  # retrieve dropped the lookup's pins


def test_store_is_fail_closed_when_block_ids_do_not_cover_every_group(
    engine: tuple[AgentClient, list[torch.Tensor]],
) -> None:
    client, _ = engine
    keys = keys_for(100, 4)
    ids = block_ids(0, 4)
    ids[1] = ids[1][:-1]  # engine group 1 is one block short of the 4th chunk
    with pytest.raises(grpc.RpcError) as err:
        client.store("local", keys, ids)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "info 1 (engine group 1) has 7 ids" in (err.value.details() or "")
    assert client.lookup("local", "", keys).num_hit_chunks == 0
    snap = client.snapshot()
    assert not set(keys) & set(snap.chunk_keys)


def test_retrieve_leaves_holes_unwritten_and_a_store_must_name_every_block(
    engine: tuple[AgentClient, list[torch.Tensor]],
) -> None:
    # -1 in a retrieve is a hole: a sliding-window group keeps no block outside its window
    # (vLLM's null block), so nothing is written there; every other block is loaded bit-exact.
    client, tensors = engine
    keys = keys_for(300, 2)
    src, dst = block_ids(0, 2), block_ids(40, 2)
    assert client.store("local", keys, src).num_stored_chunks == 2
    for t in tensors:
        t[40:56] = 0  # dst covers blocks 40..47 (group 0) and 40..43 (group 1)
    hole = dst[1][0]
    dst[1][0] = -1
    assert client.retrieve("local", "", keys, dst).num_retrieved_chunks == 2
    dst[1][0] = hole
    got, want = blocks_of(tensors, dst), blocks_of(tensors, src)
    for layer, (g, w) in enumerate(zip(got, want, strict=True)):
        if layer in (1, 3):  # engine group 1's layers: the hole stayed zero, the rest arrived
            assert not g[0].any() and torch.equal(g[1:], w[1:])
        else:
            assert torch.equal(g, w)
    src[1][0] = -1
    with pytest.raises(grpc.RpcError) as err:
        client.store("local", keys_for(301, 2), src)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "id -1 at position 0 is outside [0, 64)" in (err.value.details() or "")


def test_bad_requests_are_invalid_argument_and_the_agent_keeps_its_data(
    agent: AgentProc, engine: tuple[AgentClient, list[torch.Tensor]]
) -> None:
    client, tensors = engine
    keys = keys_for(200, 3)
    src = block_ids(0, 3)
    want = blocks_of(tensors, src)
    assert client.store("local", keys, src).num_stored_chunks == 3

    def invalid(fn: object, *args: object, **kw: object) -> str:
        with pytest.raises(grpc.RpcError) as err:
            fn(*args, **kw)  # type: ignore[operator]
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        return err.value.details() or ""

    raw = client.channel.unary_unary("/kvgrid.v1.AgentService/Store")
    assert "malformed StoreRequest" in invalid(raw, b"\xff\xff\xff\xff", timeout=10)
    assert "instance_id='nobody' is not registered" in invalid(client.store, "nobody", keys, src)
    bad = block_ids(0, 3)
    bad[0][5] = 64
    assert "id 64 at position 5 is outside [0, 64)" in invalid(client.store, "local", keys, bad)
    bad_key = invalid(client.lookup, "local", "r", [keys[0], b"abc"])
    assert "chunk_keys[1]: got 3 bytes, expected a 16-byte chunk key" in bad_key
    assert "block_ids has 1 lists; instance 'local' registered 2 engine groups" in invalid(
        client.retrieve, "local", "r", keys, [src[0]]
    )
    # Infos that contradict the tensors: a split the tensors do not form, and a block size that
    # disagrees with the tensors' 32-slot blocks.
    tensors2, paths2 = make_kv(Path(tensors_dir(agent)), seed=3)
    for wrong, expected in [
        (
            [EngineGroupInfo(0, (0, 1), 16), EngineGroupInfo(1, (2, 3), 32), EngineGroupInfo(0, (4,), 16)],
            "3 engine group infos but the tensors form 5 kernel groups",
        ),
        (
            [GROUPS[0], EngineGroupInfo(1, (1, 3), 16, sw_size_tokens=64), GROUPS[2]],
            "tokens_per_block=16 must be a multiple of slots_per_block=32",
        ),
    ]:
        msg = invalid(
            client.register_kv_caches,
            "liar",
            tensors2,
            namespace=NAMESPACE,
            engine_groups=wrong,
            shm_paths=paths2,
            layout_hints=HINTS,
        )
        assert expected in msg

    def raw_register(first_layer_blocks: int = NUM_BLOCKS, **fields: Any) -> str:
        """RegisterKVCaches as bytes on the wire (what the client would refuse to send)."""
        layers = [export_layer_tensor(i, t, shm_path=paths2[i]) for i, t in enumerate(tensors2)]
        layers[0].shape[0] = first_layer_blocks
        for m in layers[:4]:
            m.layout_hints["backend"] = "FLASHINFER"
        req = agent_pb2.RegisterKVCachesRequest(
            instance_id="liar",
            engine_groups=to_proto(GROUPS),
            layers=layers,
            namespace=key_namespace_to_proto(NAMESPACE),
            **fields,
        )
        raw = client.channel.unary_unary("/kvgrid.v1.AgentService/RegisterKVCaches")
        return invalid(raw, req.SerializeToString(), timeout=10)

    # A handle whose shape reaches past the end of its shared-memory file.
    msg = raw_register(first_layer_blocks=NUM_BLOCKS * 2)
    assert "beyond the" in msg and "layers[0]" in msg
    # A fence event for CPU tensors, and a transfer that asks for a fence never registered.
    msg = raw_register(fence_event=b"\x01" * 64)
    assert "fence_event given but the layers are on ['cpu']; expected one CUDA device" in msg
    assert "after_fence=true but instance 'local' registered no fence_event" in invalid(
        client.store, "local", keys, src, after_fence=True
    )
    assert "registered no fence_event" in invalid(client.retrieve, "local", "r", keys, src, after_fence=True)
    assert "signal_done=true but instance 'local' registered no done_event" in invalid(
        client.retrieve, "local", "r", keys, src, signal_done=True
    )
    assert "liar" not in client.health().instance_ids
    # Still serving, data intact.
    dst = block_ids(40, 3)
    res = client.retrieve("local", "r2", keys, dst)
    assert res.hit_mask == [True, True, True]
    got = blocks_of(tensors, dst)
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(want, got, strict=True))


def tensors_dir(agent: AgentProc) -> str:
    return str(Path(agent.uds_path).parent)


def test_concurrent_stores_and_retrieves_from_several_clients(
    agent: AgentProc, engine: tuple[AgentClient, list[torch.Tensor]]
) -> None:
    _, tensors = engine
    errors: list[str] = []

    def worker(t: int) -> None:
        with AgentClient(agent.uds_path, timeout_s=60) as c:
            for it in range(4):
                keys = keys_for(1000 + 10 * t + it, 2)
                src = [list(range(t * 8, t * 8 + 8)), list(range(t * 4, t * 4 + 4))]
                dst = [list(range(32 + t * 8, 40 + t * 8)), list(range(32 + t * 4, 36 + t * 4))]
                want = blocks_of(tensors, src)
                s = c.store("local", keys, src)
                # Another worker's prompt (hit or not, depending on timing), then our own on top.
                c.retrieve("local", f"s{t}-{it}", keys_for(1000 + 10 * ((t + 1) % 4), 2), dst)
                r = c.retrieve("local", f"w{t}-{it}", keys, dst)
                if s.num_stored_chunks != 2 or r.num_retrieved_chunks != 2:
                    errors.append(f"worker {t} it {it}: {s} {r}")
                    return
                got = blocks_of(tensors, dst)
                if not all(
                    torch.equal(a.view(torch.int16), b.view(torch.int16))
                    for a, b in zip(want, got, strict=True)
                ):
                    errors.append(f"worker {t} it {it}: retrieved bytes differ")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert errors == []


def test_sigkilled_engine_loses_its_registration_and_pins(agent: AgentProc, shared_dir: Path) -> None:
    d = shared_dir / "held"
    d.mkdir()
    proc = run_engine(agent, d, "engine-held", "hold")
    assert proc.stdout is not None
    res = json.loads(proc.stdout.readline())
    assert res["pinned"] == 4
    with AgentClient(agent.uds_path) as c:
        h = c.health()
        assert "engine-held" in h.instance_ids and h.num_pinned_chunks >= 4
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and "engine-held" in c.health().instance_ids:
            time.sleep(0.05)
        h = c.health()
        assert "engine-held" not in h.instance_ids
        assert h.num_pinned_chunks == 0
        with pytest.raises(grpc.RpcError) as err:
            c.lookup("engine-held", "x", keys_for(5, 1))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_snapshot_health_and_reflection_over_tcp(
    agent: AgentProc, engine: tuple[AgentClient, list[torch.Tensor]]
) -> None:
    client, _ = engine
    keys = keys_for(300, 2)
    client.store("local", keys, block_ids(0, 2))
    assert agent.tcp_port
    with AgentClient(f"127.0.0.1:{agent.tcp_port}") as tcp:
        snap = tcp.snapshot()
        assert snap.pod.pod_uid == "uid-agent-test" and snap.pod.epoch == agent.epoch
        assert set(keys) <= set(snap.chunk_keys)
        assert snap.last_sequence >= 1
        (group,) = [g for g in snap.by_namespace if g.namespace == NAMESPACE.namespace_id()]
        assert set(keys) <= set(group.chunk_keys)
        health = health_pb2_grpc.HealthStub(tcp.channel).Check(
            health_pb2.HealthCheckRequest(service="kvgrid.v1.AgentService"), timeout=10
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(tcp.channel)
        (resp,) = list(
            stub.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
            )
        )
        names = {s.name for s in resp.list_services_response.service}
        assert "kvgrid.v1.AgentService" in names


def test_eviction_under_a_small_l1_keeps_pinned_prefixes(tmp_path: Path) -> None:
    # One chunk is 19456 bytes = 5 pages of 4 KiB; the pool holds 12 chunks.
    small = start_agent(
        tmp_path, "--high-watermark", "1.0", "--low-watermark", "0.9", l1_size=f"{12 * 5 * 4096}"
    )
    try:
        with AgentClient(small.uds_path) as c:
            tensors, _ = register_kv(c, "e", tmp_path, seed=7)
            a = keys_for(1, 8)
            src_a = block_ids(0, 8)
            want_a = blocks_of(tensors, block_ids(0, 4))
            assert c.store("e", a, src_a).num_stored_chunks == 8
            assert c.lookup("e", "keep", a[:4], pin_ttl_ms=60_000).num_hit_chunks == 4
            b = keys_for(2, 8)
            stored = c.store("e", b, block_ids(0, 8))
            # 4 pinned chunks leave room for 8 more: B fits only by evicting A's unpinned tail.
            assert stored.num_stored_chunks == 8, stored
            h = c.health()
            assert h.num_evictions >= 4
            assert h.l1_used_bytes <= h.l1_capacity_bytes
            assert c.lookup("e", "", a).num_hit_chunks == 4
            # A third prompt cannot fit at all beyond the pins + B: it keeps a prefix and says why.
            c.lookup("e", "keep-b", b, pin_ttl_ms=60_000)
            third = c.store("e", keys_for(3, 4), block_ids(0, 4))
            assert third.num_stored_chunks == 0
            assert third.partial_reason.startswith("l1_full: chunk 0 of 4")
            # The pinned prefix of A is intact, bit for bit.
            for t in tensors:
                t.zero_()
            r = c.retrieve("e", "keep", a[:4], block_ids(0, 4))
            assert r.num_retrieved_chunks == 4
            got = blocks_of(tensors, block_ids(0, 4))
            assert all(
                torch.equal(x.view(torch.int16), y.view(torch.int16))
                for x, y in zip(want_a, got, strict=True)
            )
    finally:
        small.stop()
