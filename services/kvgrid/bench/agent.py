"""Store/retrieve GB/s through a real agent process (gRPC + IPC handles + L1) against the kernel alone.

The bench process plays the engine: it allocates a KV cache (Llama-3-8B geometry by default: 32
layers, 8 KV heads, head 128, 16-token blocks, bf16, so one 256-token chunk is 32 MiB) on the GPU
(``--device cuda``, handed over by CUDA IPC) or in a shared-memory file (``--device cpu``), starts
``kvgrid agent``, registers, and times Store and Retrieve RPCs of ``--chunks`` chunks. In the same
run it times ``TransferPlan`` directly on the same tensors into a buffer like the agent's L1 (pinned
on CUDA): the reference limit. The ratio is what the agent's RPC path costs on top of the copy.

``--peer`` measures peer fetch instead: a ``kvgrid controller`` and two agents on loopback, the
chunks stored on agent A, then timed ``Lookup`` calls on agent B that fetch them from A
(controller query + FetchChunks stream + commit into B's L1), against a plain copy of the same
bytes between two host buffers in this process (the local-copy limit).

``--engines N`` measures a TP=N pod instead: N engine ranks (threads of this process, each with its
own KV cache and its own client; the gRPC calls release the GIL) store and retrieve at the same time,
served by one shared agent (``--agents 1``) or one agent per rank (``--agents N``). Each round starts
all ranks together; aggregate GB/s is N ranks' bytes over the round's wall time (first start to last
finish), against N ranks' kernels run at once in the same run. Agent CPU is read from
``/proc/<pid>/stat`` (Linux) over the timed rounds. Afterwards every rank's chunks are stored, its KV
cache zeroed and retrieved again, and compared bit-exact with what it held.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Literal

import msgspec
import torch

from kvgrid.bench.agent_procs import KVGRID, AgentDidNotStart, bench_env, shm_scratch, start_agent, stop_all
from kvgrid.common.config import add_config_arguments, config_from_args

__all__ = ["AgentBenchConfig", "add_arguments", "run"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


ENV_PREFIX = "KVGRID_BENCH_AGENT_"


def _d(text: str) -> msgspec.Meta:
    return msgspec.Meta(description=text)


class AgentBenchConfig(msgspec.Struct, frozen=True, kw_only=True):
    """``kvgrid bench agent``'s options, loaded like a service config (``kvgrid.common.config``):
    defaults < ``--config`` YAML < ``KVGRID_BENCH_AGENT_*`` env < flags."""

    device: Annotated[
        Literal["cpu", "cuda"],
        _d(
            "where the KV cache lives: cuda (pinned L1, Triton kernels) or cpu (torch reference); "
            "default cuda when a GPU is visible"
        ),
    ] = "cuda" if torch.cuda.is_available() else "cpu"
    layers: Annotated[int, _d("KV layers")] = 32
    kv_heads: Annotated[int, _d("KV heads per layer")] = 8
    head_size: Annotated[int, _d("head size")] = 128
    block_size: Annotated[int, _d("tokens per block")] = 16
    tokens_per_chunk: Annotated[int, _d("tokens per chunk")] = 256
    dtype: Annotated[Literal["bf16", "fp16", "fp32"], _d("KV element type")] = "bf16"
    chunks: Annotated[int, _d("chunks per store/retrieve call")] = 8
    iters: Annotated[int, _d("timed calls per figure (median)")] = 5
    peer: Annotated[
        bool, _d("measure peer fetch (agent B pulling chunks from agent A over TCP) vs a local copy")
    ] = False
    peer_part_size: Annotated[str, _d("--peer: FetchChunks part size on agent A")] = "1MiB"
    engines: Annotated[
        int,
        msgspec.Meta(
            ge=1,
            description="engine ranks storing and retrieving at once, each with its own KV cache "
            "(a TP=N pod); more than 1 measures the agent topology chosen by --agents (on cuda all "
            "ranks share the current GPU)",
        ),
    ] = 1
    agents: Annotated[
        Literal["1", "N"],
        _d("--engines > 1: 1 = one agent serves every rank, N = one agent per rank"),
    ] = "1"
    json: Annotated[bool, _d("print one JSON object instead of a table")] = False


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, AgentBenchConfig, env_prefix=ENV_PREFIX)


def _sig(x: float) -> float:
    return float(f"{x:.4g}")


def _median_gbps(nbytes: int, times: list[float]) -> float:
    return nbytes / statistics.median(times) / 1e9


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _result_header(cfg: AgentBenchConfig, chunk_bytes: int) -> dict[str, object]:
    """The fields every mode's result starts with: the device, the KV geometry, the chunks moved."""
    return {
        "device": torch.cuda.get_device_name() if cfg.device == "cuda" else "cpu",
        "geometry": {"layers": cfg.layers, "kv_heads": cfg.kv_heads, "head_size": cfg.head_size,
                     "block_size": cfg.block_size, "dtype": cfg.dtype,
                     "tokens_per_chunk": cfg.tokens_per_chunk},
        "chunk_bytes": chunk_bytes,
        "chunks": cfg.chunks,
    }  # fmt: skip


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(AgentBenchConfig, args, env_prefix=ENV_PREFIX)
    if cfg.device == "cuda" and not torch.cuda.is_available():
        print("kvgrid bench agent: --device cuda but no CUDA device is visible", file=sys.stderr)
        return 2
    if cfg.engines > 1:
        if cfg.peer:
            print("kvgrid bench agent: --peer measures one engine; drop --engines", file=sys.stderr)
            return 2
        from kvgrid.bench.agent_tp import run_tp

        return run_tp(cfg)
    with shm_scratch("kvgrid-bench-") as tmp:
        return _run(cfg, tmp)


def _run(cfg: AgentBenchConfig, tmp: Path) -> int:
    """One engine, one agent (or ``--peer``): the KV cache under ``tmp`` on cpu."""
    from kvgrid.agent.transfer import kernel_group_pages
    from kvgrid.common.hashing import KeyNamespace, chunk_keys
    from kvgrid.common.layer_groups import KVLayerGroupsManager
    from kvgrid.common.layouts import detect_kv_format
    from kvgrid.engine.client import AgentClient
    from kvgrid.engine.tensors import allocate_shared_tensor
    from kvgrid_kernels import TransferPlan

    dtype = _DTYPES[cfg.dtype]
    bpc = cfg.tokens_per_chunk // cfg.block_size
    num_blocks = bpc * cfg.chunks
    shape = (num_blocks, 2, cfg.block_size, cfg.kv_heads, cfg.head_size)
    hints = {"backend": "FLASHINFER"}
    tensors: list[torch.Tensor] = []
    paths: list[str] | None = [] if cfg.device == "cpu" else None
    for layer in range(cfg.layers):
        if paths is not None:
            path = tmp / f"layer{layer}.kv"
            t = allocate_shared_tensor(path, shape, dtype)
            paths.append(str(path))
        else:
            t = torch.empty(shape, dtype=dtype, device="cuda")
        t.copy_(
            torch.randn(shape, dtype=torch.float32).to(dtype)
            if cfg.device == "cpu"
            else torch.randn(shape, device="cuda").to(dtype)
        )
        tensors.append(t)
    manager = KVLayerGroupsManager(
        tensors, [detect_kv_format(t, hints) for t in tensors], tokens_per_chunk=cfg.tokens_per_chunk
    )
    chunk_bytes = manager.bytes_per_chunk()
    total = chunk_bytes * cfg.chunks
    ids = [list(range(num_blocks))]

    if cfg.peer:
        return _run_peer(cfg, tensors, paths, hints, chunk_bytes, ids, tmp)

    # Kernel alone: the same plan the agent builds, into an L1-like buffer.
    plan = TransferPlan(kernel_group_pages(manager, tensors), cfg.tokens_per_chunk)
    l1 = torch.empty(total, dtype=torch.uint8, pin_memory=cfg.device == "cuda")
    bufs = list(l1.view(cfg.chunks, chunk_bytes).unbind(0))
    kernel: dict[str, list[float]] = {"store": [], "retrieve": []}
    for i in range(cfg.iters + 1):
        for direction in ("store", "retrieve"):
            _sync(cfg.device)
            t0 = time.perf_counter()
            (plan.store if direction == "store" else plan.retrieve)(bufs, ids)
            _sync(cfg.device)
            if i:  # the first round warms up (Triton compile, page faults)
                kernel[direction].append(time.perf_counter() - t0)

    # Through the agent.
    uds = tmp / "agent.sock"
    l1_size = total * 3 + (64 << 20)
    try:
        agent, _ = start_agent(
            str(uds),
            ["--uds-path", str(uds), "--tcp-port", "-1", "--l1-size", str(l1_size),
             "--shm-allowed-dirs", str(tmp), "--log-level", "warning"],
        )  # fmt: skip
    except AgentDidNotStart as e:
        print(f"kvgrid bench agent: {e}", file=sys.stderr)
        return 1
    agent_path: dict[str, list[float]] = {"store": [], "retrieve": []}
    rtt: list[float] = []
    try:
        ns = KeyNamespace(model="bench", tokens_per_chunk=cfg.tokens_per_chunk)
        with AgentClient(str(uds), timeout_s=600) as c:
            c.register_kv_caches(
                "bench", tensors, namespace=ns, shm_paths=paths, layout_hints=[hints] * len(tensors)
            )
            # The fixed cost of one RPC (Health does no work): what a store/retrieve pays on top.
            for _ in range(60):
                t0 = time.perf_counter()
                c.health()
                rtt.append(time.perf_counter() - t0)
            for i in range(cfg.iters + 1):
                keys = chunk_keys(
                    [(i * 100_003 + j) % 32_000 for j in range(cfg.chunks * cfg.tokens_per_chunk)], ns
                )
                _sync(cfg.device)
                t0 = time.perf_counter()
                s = c.store("bench", keys, ids)
                t1 = time.perf_counter()
                r = c.retrieve("bench", "", keys, ids)
                _sync(cfg.device)
                t2 = time.perf_counter()
                if s.num_stored_chunks != cfg.chunks or r.num_retrieved_chunks != cfg.chunks:
                    print(f"kvgrid bench agent: store {s} / retrieve {r} fell short", file=sys.stderr)
                    return 1
                if i:
                    agent_path["store"].append(t1 - t0)
                    agent_path["retrieve"].append(t2 - t1)
    finally:
        stop_all([], [agent])

    result = _result_header(cfg, chunk_bytes)
    result["rpc_roundtrip_ms"] = round(statistics.median(rtt[10:]) * 1e3, 3)
    for direction in ("store", "retrieve"):
        k = _median_gbps(total, kernel[direction])
        a = _median_gbps(total, agent_path[direction])
        # Four significant digits, not decimals: tiny CPU rates would round to 0.001 and the
        # printed ratio would no longer be the ratio of the printed figures.
        result[direction] = {"agent_gbps": _sig(a), "kernel_gbps": _sig(k), "ratio": _sig(a / k)}
    if cfg.json:
        print(json.dumps(result))
        return 0
    print(
        f"{result['device']}: {cfg.chunks} chunks x {chunk_bytes / 2**20:.1f} MiB "
        f"({cfg.layers} layers, {cfg.kv_heads} heads x {cfg.head_size}, "
        f"block {cfg.block_size}, {cfg.dtype})"
    )
    print(f"{'':10}{'agent GB/s':>12}{'kernel GB/s':>13}{'ratio':>8}")
    for direction in ("store", "retrieve"):
        d = result[direction]
        assert isinstance(d, dict)
        print(f"{direction:10}{d['agent_gbps']:>12.2f}{d['kernel_gbps']:>13.2f}{d['ratio']:>8.3f}")
    print(f"empty RPC round trip over the Unix socket: {result['rpc_roundtrip_ms']} ms")
    return 0


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _run_peer(
    cfg: AgentBenchConfig,
    tensors: list[torch.Tensor],
    paths: list[str] | None,
    hints: dict[str, str],
    chunk_bytes: int,
    ids: list[list[int]],
    tmp: Path,
) -> int:
    """Peer fetch GB/s: Lookup on agent B fetching ``--chunks`` chunks that agent A holds."""
    import grpc

    from kvgrid.api.v1 import common_pb2, controller_pb2, controller_pb2_grpc
    from kvgrid.common.hashing import KeyNamespace, chunk_keys
    from kvgrid.engine.client import AgentClient

    if paths is None:
        print("kvgrid bench agent: --peer runs with --device cpu (KV in shared memory)", file=sys.stderr)
        return 2
    total = chunk_bytes * cfg.chunks
    # The local-copy limit: the same bytes between two host buffers.
    src = torch.randint(0, 256, (total,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    copy_s = []
    for i in range(cfg.iters + 1):
        t0 = time.perf_counter()
        dst.copy_(src)
        if i:
            copy_s.append(time.perf_counter() - t0)

    env = bench_env()
    ctrl = f"127.0.0.1:{_free_port()}"
    # The controller's log goes nowhere: agents stopping at the end close their event streams.
    procs = [
        subprocess.Popen(
            [*KVGRID, "controller", "--listen", ctrl, "--log-level", "ERROR"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True, env=env,
        )
    ]  # fmt: skip
    clients: list[AgentClient] = []
    fetch_s: list[float] = []
    lookup_rtt: list[float] = []
    ns = KeyNamespace(model="bench", tokens_per_chunk=cfg.tokens_per_chunk)
    try:
        for name in ("a", "b"):
            uds = tmp / f"agent-{name}.sock"
            proc, _ = start_agent(
                name,
                ["--uds-path", str(uds), "--tcp-host", "127.0.0.1", "--tcp-port", "0",
                 "--l1-size", str(total * 3 + (64 << 20)), "--shm-allowed-dirs", str(tmp),
                 "--controller-address", ctrl, "--event-flush-interval-ms", "5",
                 "--peer-fetch-max-chunks", str(cfg.chunks), "--peer-fetch-timeout-ms", "600000",
                 "--peer-fetch-mode", "sync",  # the Lookup returns when the bytes are in: it times the fetch
                 "--pin-ttl-ms", "610000", "--pin-ttl-max-ms", "610000",  # pins outlive a fetch
                 "--peer-fetch-part-size", cfg.peer_part_size, "--log-level", "warning"],
                env={**env, "POD_UID": f"bench-{name}", "POD_IP": "127.0.0.1"},
            )  # fmt: skip
            procs.append(proc)
            c = AgentClient(str(uds), timeout_s=600)
            c.register_kv_caches(
                "bench", tensors, namespace=ns, shm_paths=paths, layout_hints=[hints] * len(tensors)
            )
            clients.append(c)
        a, b = clients
        with grpc.insecure_channel(ctrl) as channel:
            stub = controller_pb2_grpc.ControllerServiceStub(channel)
            for i in range(cfg.iters + 1):
                keys = chunk_keys(
                    [(i * 100_003 + j) % 32_000 for j in range(cfg.chunks * cfg.tokens_per_chunk)], ns
                )
                if a.store("bench", keys, ids).num_stored_chunks != cfg.chunks:
                    print("kvgrid bench agent: store on agent A fell short", file=sys.stderr)
                    return 1
                query = controller_pb2.MatchPrefixRequest(
                    chunk_keys=common_pb2.ChunkKeys(keys=keys),
                    namespace_id=ns.namespace_id(),
                    candidate_pod_uids=["bench-a"],
                )
                deadline = time.monotonic() + 30
                while not any(m.l1_chunks == cfg.chunks for m in stub.MatchPrefix(query, timeout=5).matches):
                    if time.monotonic() > deadline:
                        print(
                            "kvgrid bench agent: controller did not index agent A's chunks", file=sys.stderr
                        )
                        return 1
                    time.sleep(0.005)
                t0 = time.perf_counter()
                got = b.lookup("bench", "", keys)
                dt = time.perf_counter() - t0
                if got.num_peer_chunks != cfg.chunks:
                    print(f"kvgrid bench agent: peer fetch fell short: {got}", file=sys.stderr)
                    return 1
                t0 = time.perf_counter()
                b.lookup("bench", "", keys)  # everything local now: the Lookup's own cost
                rtt = time.perf_counter() - t0
                if i:
                    fetch_s.append(dt)
                    lookup_rtt.append(rtt)
    except AgentDidNotStart as e:
        print(f"kvgrid bench agent: {e}", file=sys.stderr)
        return 1
    finally:
        stop_all(clients, procs)

    peer = _median_gbps(total, fetch_s)
    local = _median_gbps(total, copy_s)
    result = {
        "mode": "peer",
        "chunk_bytes": chunk_bytes,
        "chunks": cfg.chunks,
        "part_size": cfg.peer_part_size,
        # Four significant digits: a loaded machine's small rates must still agree with the ratio.
        "peer_fetch_gbps": _sig(peer),
        "local_copy_gbps": _sig(local),
        "ratio": _sig(peer / local),
        "peer_lookup_ms": _sig(statistics.median(fetch_s) * 1e3),
        "local_lookup_ms": _sig(statistics.median(lookup_rtt) * 1e3),
    }
    if cfg.json:
        print(json.dumps(result))
        return 0
    print(
        f"peer fetch over loopback TCP: {cfg.chunks} chunks x {chunk_bytes / 2**20:.1f} MiB, "
        f"parts of {cfg.peer_part_size}"
    )
    print(f"  Lookup on agent B fetching from agent A: {peer:.2f} GB/s ({result['peer_lookup_ms']} ms)")
    print(f"  local copy of the same bytes (limit):    {local:.2f} GB/s   ratio {result['ratio']:.3f}")
    print(f"  the same Lookup once the chunks are local: {result['local_lookup_ms']} ms")
    return 0
