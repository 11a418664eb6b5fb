"""The servers the fuzzers hit: a real ``kvgrid agent`` process (gRPC on its Unix socket and on
loopback TCP, the hot path on ``{uds}.hot``, the peer data plane on loopback TCP) with one engine
instance registered and a few chunks stored, and a real ``kvgrid controller`` process with a
publishing test agent. Both run as processes so their RSS can be measured and a crash is visible;
their logs (ERROR level: where a traceback of an INTERNAL answer goes) are files a finding quotes.

Both listen on loopback/Unix sockets without TLS (nothing to authorize), with a 4 MiB message
limit so oversize messages are cheap to send.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import torch

from kvgrid.api.v1 import agent_pb2, controller_pb2, controller_pb2_grpc
from kvgrid.common.groups import to_proto
from kvgrid.common.wire import key_namespace_to_proto
from kvgrid.engine.client import AgentClient
from kvgrid.engine.tensors import export_layer_tensor
from tests.agent.helpers import GROUPS, HINTS, NAMESPACE, block_ids, keys_for, kvgrid_env, make_kv
from tests.controller.support import FakeAgent
from tests.fuzz.fuzzlib import log_tail

MAX_MESSAGE_BYTES = 4 << 20
IDLE_TIMEOUT_MS = 2000
"""The controller's ``publish_idle_timeout_ms`` (tests/fuzz/test_controller.py leaves streams idle)."""
L1_BYTES = 16 << 20
ENGINE = "e"
"""The engine instance the agent fixture registers (the liveness checks use it)."""
NS_ID = NAMESPACE.namespace_id()


@dataclass
class Agent:
    proc: subprocess.Popen[str]
    uds_path: str
    tcp_port: int
    directory: Path
    log: Path
    layout_id: str
    bytes_per_chunk: int
    keys: list[bytes]
    """Chunks stored by :data:`ENGINE` at start (blocks :func:`block_ids` (0, len(keys)))."""
    register_request: agent_pb2.RegisterKVCachesRequest
    """A valid registration of instance ``fz`` (other files than :data:`ENGINE`'s)."""
    client: AgentClient = field(repr=False)
    tensors: list[torch.Tensor] = field(repr=False, default_factory=list)
    """:data:`ENGINE`'s KV tensors (kept mapped while the agent runs)."""

    @property
    def hot_path(self) -> str:
        return f"{self.uds_path}.hot"

    def alive(self) -> None:
        if self.proc.poll() is not None:
            raise AssertionError(
                f"the agent process exited with {self.proc.returncode}; its log ends:\n{log_tail(self.log)}"
            )

    def restore_engine(self) -> None:
        """Make :data:`ENGINE` registered with its chunks stored again (a fuzzed Unregister or
        Register may have replaced it; eviction may have taken its chunks)."""
        try:
            self.client.lookup(ENGINE, "restore", [])
        except grpc.RpcError:
            self.client.register_kv_caches(
                ENGINE,
                self.tensors[:5],
                namespace=NAMESPACE,
                engine_groups=GROUPS,
                shm_paths=[str(self.directory / f"kv-1-{layer}.bin") for layer in range(5)],
                layout_hints=HINTS,
            )
        self.client.store(ENGINE, self.keys, block_ids(0, len(self.keys)))


def start_agent_process(
    directory: Path, *flags: str
) -> tuple[subprocess.Popen[str], dict[str, object], Path]:
    """``kvgrid agent`` on ``directory/agent.sock`` and 127.0.0.1 (port 0), its stderr in
    ``directory/agent.log``; returns once it printed its serving line."""
    log = directory / "agent.log"
    cmd = [
        sys.executable, "-m", "kvgrid.cli", "agent", "--uds-path", str(directory / "agent.sock"),
        "--tcp-host", "127.0.0.1", "--tcp-port", "0", "--l1-size", str(L1_BYTES), "--l1-page-size", "4KiB",
        "--shm-allowed-dirs", str(directory), "--l1-shared-dir", str(directory),
        "--reaper-interval-ms", "100", "--max-message-bytes", str(MAX_MESSAGE_BYTES),
        "--log-level", "error", *flags,
    ]  # fmt: skip
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=kvgrid_env("uid-fuzz-agent")
        )
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("{"):
            return proc, json.loads(line), log
        if proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError(f"agent did not start; log:\n{log_tail(log)}")


def stop_process(proc: subprocess.Popen[str] | subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    directory = tmp_path_factory.mktemp("fuzz-agent")
    proc, info, log = start_agent_process(directory)
    try:
        client = AgentClient(str(info["uds_path"]), timeout_s=30, hot_path=False)
        client.wait_ready()
        tensors, paths = make_kv(directory, seed=1)
        reg = client.register_kv_caches(
            ENGINE, tensors, namespace=NAMESPACE, engine_groups=GROUPS, shm_paths=paths, layout_hints=HINTS
        )
        keys = keys_for(7, 4)
        assert client.store(ENGINE, keys, block_ids(0, len(keys))).num_stored_chunks == len(keys)
        other, other_paths = make_kv(directory, seed=2)
        register = agent_pb2.RegisterKVCachesRequest(
            instance_id="fz",
            engine_groups=to_proto(GROUPS),
            layers=[
                _with_hints(export_layer_tensor(i, t, shm_path=other_paths[i]), HINTS[i])
                for i, t in enumerate(other)
            ],
            namespace=key_namespace_to_proto(NAMESPACE),
            engine_pid=os.getpid(),
        )
        yield Agent(
            proc=proc,
            uds_path=str(info["uds_path"]),
            tcp_port=int(info["tcp_port"]),  # type: ignore[call-overload]
            directory=directory,
            log=log,
            layout_id=reg.layout_id,
            bytes_per_chunk=reg.bytes_per_chunk,
            keys=keys,
            register_request=register,
            client=client,
            tensors=tensors + other,
        )
        client.close()
    finally:
        stop_process(proc)


def _with_hints(msg: agent_pb2.LayerTensor, hints: dict[str, object] | None) -> agent_pb2.LayerTensor:
    for k, v in (hints or {}).items():
        msg.layout_hints[k] = str(v)
    return msg


@dataclass
class ControllerProc:
    proc: subprocess.Popen[bytes]
    address: str
    log: Path
    stub: controller_pb2_grpc.ControllerServiceStub
    channel: grpc.Channel
    pod: FakeAgent
    """A test agent that keeps registering, heartbeating and publishing (the liveness checks'
    admits go through it)."""

    def alive(self) -> None:
        if self.proc.poll() is not None:
            raise AssertionError(
                f"the controller exited with {self.proc.returncode}; its log ends:\n{log_tail(self.log)}"
            )


@pytest.fixture(scope="session")
def controller(tmp_path_factory: pytest.TempPathFactory, free_port: object) -> Iterator[ControllerProc]:
    directory = tmp_path_factory.mktemp("fuzz-controller")
    log = directory / "controller.log"
    address = f"127.0.0.1:{free_port()}"  # type: ignore[operator]
    cmd = [
        sys.executable, "-m", "kvgrid.cli", "controller", "--listen", address, "--log-level", "ERROR",
        "--max-message-bytes", str(MAX_MESSAGE_BYTES), "--lease-ttl-ms", "2000",
        "--snapshot-timeout-ms", "500", "--publish-idle-timeout-ms", str(IDLE_TIMEOUT_MS),
    ]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=kvgrid_env("controller"))
    channel = grpc.insecure_channel(address)
    pod: FakeAgent | None = None
    try:
        grpc.channel_ready_future(channel).result(timeout=60)
        stub = controller_pb2_grpc.ControllerServiceStub(channel)
        pod = FakeAgent(address, "uid-fuzz-live", namespace_id=NS_ID)
        deadline = time.monotonic() + 30
        while stub.GetStats(controller_pb2.GetStatsRequest(), timeout=5).num_agents < 1:
            assert time.monotonic() < deadline, "the test agent did not register"
            time.sleep(0.05)
        yield ControllerProc(proc, address, log, stub, channel, pod)
    finally:
        if pod is not None:
            pod.close()
        channel.close()
        stop_process(proc)
