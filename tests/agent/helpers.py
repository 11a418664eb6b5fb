"""Shared pieces of the agent tests: a real agent process, and a hybrid KV layout in shared memory.

The layout follows the worked example of docs/hybrid-groups.md: engine group 0 = layers 0, 2 (full attention,
FlashInfer ``[NB, 2, BS, NH, HS]``, 16 tokens per block) plus layer 4 (an MLA-like ``[NB, BS, C]``
cache, so a separate info of engine group 0); engine group 1 = layers 1, 3 (sliding window of 64
tokens, 32 tokens per block). Infos: (g0, [0, 2]), (g1, [1, 3]), (g0, [4]).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import grpc
import torch

from kvgrid.agent.peers.directory import PeerCandidate
from kvgrid.agent.peers.fetcher import PeerFetcher, PeerFetchResult
from kvgrid.api.v1 import agent_pb2, controller_pb2, controller_pb2_grpc
from kvgrid.common.groups import EngineGroupInfo
from kvgrid.common.hashing import KeyNamespace, chunk_keys
from kvgrid.engine.client import AgentClient
from kvgrid.engine.tensors import allocate_shared_tensor

TOKENS_PER_CHUNK = 64
NUM_BLOCKS = 64
GROUPS = [
    EngineGroupInfo(engine_group_id=0, layer_indices=(0, 2), tokens_per_block=16),
    EngineGroupInfo(engine_group_id=1, layer_indices=(1, 3), tokens_per_block=32, sw_size_tokens=64),
    EngineGroupInfo(engine_group_id=0, layer_indices=(4,), tokens_per_block=16),
]
HINTS: list[dict[str, object] | None] = [{"backend": "FLASHINFER"}] * 4 + [None]
NAMESPACE = KeyNamespace(model="test-model", tokens_per_chunk=TOKENS_PER_CHUNK, kv_identity="hybrid-test")
# Blocks per chunk per engine group: 64 tokens / 16 and 64 tokens / 32.
BPC = (4, 2)


def layer_shape(layer: int) -> tuple[int, ...]:
    if layer == 4:
        return (NUM_BLOCKS, 16, 24)  # MLA-like
    bs = 16 if layer % 2 == 0 else 32
    return (NUM_BLOCKS, 2, bs, 2, 8)


def make_kv(directory: Path, seed: int = 0) -> tuple[list[torch.Tensor], list[str]]:
    """Five layer tensors in shared-memory files under ``directory``, filled with random bf16."""
    g = torch.Generator().manual_seed(seed)
    tensors, paths = [], []
    for layer in range(5):
        path = directory / f"kv-{seed}-{layer}.bin"
        t = allocate_shared_tensor(path, layer_shape(layer), torch.bfloat16)
        t.copy_(torch.randn(layer_shape(layer), generator=g, dtype=torch.float32).to(torch.bfloat16))
        tensors.append(t)
        paths.append(str(path))
    return tensors, paths


def register_kv(
    client: AgentClient, instance_id: str, directory: Path, seed: int
) -> tuple[list[torch.Tensor], agent_pb2.RegisterKVCachesResponse]:
    """This process as engine ``instance_id``: :func:`make_kv` under ``directory``, registered with
    the worked-example groups; returns the tensors and the agent's answer."""
    tensors, paths = make_kv(directory, seed=seed)
    reg = client.register_kv_caches(
        instance_id, tensors, namespace=NAMESPACE, engine_groups=GROUPS, shm_paths=paths, layout_hints=HINTS
    )
    return tensors, reg


def block_ids(first_block: int, num_chunks: int) -> list[list[int]]:
    """One list per engine group: consecutive blocks from ``first_block`` covering the chunks."""
    return [list(range(first_block, first_block + num_chunks * bpc)) for bpc in BPC]


def keys_for(prompt_seed: int, num_chunks: int) -> list[bytes]:
    tokens = [(prompt_seed * 7919 + i) % 50_000 for i in range(num_chunks * TOKENS_PER_CHUNK)]
    return chunk_keys(tokens, NAMESPACE)


def blocks_of(tensors: list[torch.Tensor], ids: list[list[int]]) -> list[torch.Tensor]:
    """Copies of the given blocks of every layer (engine group of layer decides the list)."""
    out = []
    for layer, t in enumerate(tensors):
        group = 1 if layer in (1, 3) else 0
        out.append(t[ids[group]].clone())
    return out


def kvgrid_env(pod_uid: str) -> dict[str, str]:
    """Environment of a ``kvgrid`` process under test: this one's without any ``KVGRID_*`` setting,
    plus a pod identity on loopback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGRID_")}
    env.update(POD_UID=pod_uid, POD_NAME=pod_uid, POD_IP="127.0.0.1")
    return env


@dataclass
class AgentProc:
    proc: subprocess.Popen[str]
    uds_path: str
    tcp_port: int | None
    epoch: int
    pod_uid: str

    def client(self) -> AgentClient:
        c = AgentClient(self.uds_path, timeout_s=30)
        c.wait_ready()
        return c

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_agent(
    directory: Path,
    *flags: str,
    l1_size: str = "8MiB",
    pod_uid: str = "uid-agent-test",
    shm_dir: Path | None = None,
) -> AgentProc:
    """``kvgrid agent`` as a real process on a socket in ``directory``; waits until it serves.

    Engines' shared-memory tensors may live under ``shm_dir`` (default ``directory``).
    """
    cmd = [
        sys.executable, "-m", "kvgrid.cli", "agent", "--uds-path", str(directory / "agent.sock"),
        "--tcp-host", "127.0.0.1", "--tcp-port", "0", "--l1-size", l1_size, "--l1-page-size", "4KiB",
        "--shm-allowed-dirs", str(shm_dir or directory), "--reaper-interval-ms", "100",
        "--log-level", "warning",
        *flags,
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=kvgrid_env(pod_uid))
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    line = ""
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("{"):
            break
        if proc.poll() is not None:
            raise RuntimeError(f"agent {pod_uid} exited with {proc.returncode}")
    info = json.loads(line)
    assert info["event"] == "serving"
    return AgentProc(proc, info["uds_path"], info["tcp_port"], info["epoch"], pod_uid)


def wait_for(what: str, fn: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Poll ``fn`` every 50 ms until it holds; AssertionError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not fn():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def start_pod_agent(root: Path, uid: str, controller: str, *flags: str, l1_size: str = "8MiB") -> AgentProc:
    """:func:`start_agent` as pod ``uid`` (its socket in ``root/uid``) publishing to ``controller``
    (events flushed every 20 ms, heartbeats every 200 ms); engines' tensors live under ``root``."""
    directory = root / uid
    directory.mkdir()
    return start_agent(
        directory,
        "--controller-address", controller, "--event-flush-interval-ms", "20",
        "--heartbeat-interval-ms", "200",
        *flags,
        l1_size=l1_size,
        pod_uid=uid,
        shm_dir=root,
    )  # fmt: skip


def fetch_once(
    fetcher: PeerFetcher, address: str, keys: list[bytes], nbytes: int, *, peer_uid: str, timeout_s: float
) -> PeerFetchResult:
    """One ``fetch_from`` of ``keys`` (layout ``"L"``, :data:`NAMESPACE`) from the peer agent
    ``peer_uid`` at ``address``, ``nbytes`` a chunk; the fetcher is closed afterwards."""
    try:
        cand = PeerCandidate(pod_uid=peer_uid, address=address, l1_chunks=len(keys), total_chunks=len(keys))
        return fetcher.fetch_from(
            cand, keys, NAMESPACE.namespace_id(), "L", nbytes, time.monotonic() + timeout_s
        )
    finally:
        fetcher.close()


def start_controller(
    address: str, *flags: str, env: Mapping[str, str] | None = None, stdout: IO[bytes] | int | None = None
) -> subprocess.Popen[bytes]:
    """``kvgrid controller`` as a real process listening on ``address`` (``--log-level WARNING``,
    then ``flags``), in this process's environment without ``KVGRID_*`` plus ``env``; its output
    (stdout and stderr) goes to ``stdout`` when given (a file, ``subprocess.PIPE``).

    Returns once started, not once serving: a plaintext caller waits with
    ``grpc.channel_ready_future`` on its channel, an mTLS one with a call of its own."""
    cmd = [sys.executable, "-m", "kvgrid.cli", "controller", "--listen", address, "--log-level", "WARNING"]
    return subprocess.Popen(
        [*cmd, *flags],
        env=kvgrid_env("controller") | dict(env or {}),
        stdout=stdout,
        stderr=None if stdout is None else subprocess.STDOUT,
    )


@contextlib.contextmanager
def controller_with_pods(
    root: Path, address: str, pods: Sequence[tuple[str, Sequence[str]]]
) -> Iterator[tuple[controller_pb2_grpc.ControllerServiceStub, list[AgentProc]]]:
    """A real controller on ``address`` and one :func:`start_pod_agent` per ``(pod uid, flags)``,
    yielded once every agent registered; all stopped afterwards."""
    ctrl = start_controller(address)
    agents: list[AgentProc] = []
    channel = grpc.insecure_channel(address)
    try:
        grpc.channel_ready_future(channel).result(timeout=60)
        agents += [start_pod_agent(root, uid, address, *flags) for uid, flags in pods]
        stub = controller_pb2_grpc.ControllerServiceStub(channel)
        wait_for(
            f"{len(pods)} agents registered",
            lambda: stub.GetStats(controller_pb2.GetStatsRequest(), timeout=5).num_agents >= len(pods),
        )
        yield stub, agents
    finally:
        for agent in agents:
            agent.stop()
        channel.close()
        ctrl.terminate()
        ctrl.wait(10)


class FakePeer:
    """A real gRPC server on loopback whose FetchChunks answers ``answer(request, context)``: a
    peer agent that streams exactly what a test says (parts cut short, wrong bytes, an abort)."""

    def __init__(
        self,
        answer: Callable[
            [agent_pb2.FetchChunksRequest, grpc.ServicerContext], Iterable[agent_pb2.FetchChunksResponse]
        ],
    ) -> None:
        self.requests: list[agent_pb2.FetchChunksRequest] = []

        def fetch(raw: bytes, context: grpc.ServicerContext) -> Iterator[agent_pb2.FetchChunksResponse]:
            req = agent_pb2.FetchChunksRequest.FromString(raw)
            self.requests.append(req)
            yield from answer(req, context)

        handler = grpc.method_handlers_generic_handler(
            "kvgrid.v1.AgentService",
            {
                "FetchChunks": grpc.unary_stream_rpc_method_handler(
                    fetch, response_serializer=lambda m: m.SerializeToString()
                )
            },
        )
        self.server = grpc.server(ThreadPoolExecutor(2))
        self.server.add_generic_rpc_handlers((handler,))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"
