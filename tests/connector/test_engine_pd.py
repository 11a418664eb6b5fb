"""Prefill/decode disaggregation with two real vLLM engines and two agents, no controller: the
producer engine (``kv_role=kv_producer``) prefills and stores, and its finished request returns
``kv_transfer_params`` naming its agent; the proxy passes them to the consumer engine
(``kv_role=kv_consumer``), whose agent fetches the chunks from the producer's agent and whose
output equals a single engine's. This is what the usual P/D proxy does (docs/vllm-connector.md)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from kvgrid.connector.scheduler import PEERS_PARAM
from tests.agent.helpers import AgentProc, start_agent
from tests.connector.engine_process import EngineProc
from tests.connector.engines import make_tiny_llama, prompt

pytestmark = pytest.mark.slow

MODEL_NAME = "tiny-llama-pd"  # the same key namespace on both sides, whatever their --model path


@dataclass
class PD:
    producer_agent: AgentProc
    consumer_agent: AgentProc
    producer: EngineProc
    consumer: EngineProc


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PD]:
    root = tmp_path_factory.mktemp("pd")
    model = make_tiny_llama(root / "model")
    agents: list[AgentProc] = []
    engines: list[EngineProc] = []
    try:
        for role in ("producer", "consumer"):
            (root / role).mkdir()
            agents.append(start_agent(root / role, l1_size="32MiB", pod_uid=f"uid-{role}", shm_dir=root))
        for role, agent in zip(("producer", "consumer"), agents, strict=True):
            engines.append(
                EngineProc(
                    role,
                    model,
                    agent,
                    root / f"shm-{role}",
                    root,
                    model_name=MODEL_NAME,
                    kv_role=f"kv_{role}",
                )
            )
        for e in engines:
            e.wait_ready()
        yield PD(agents[0], agents[1], engines[0], engines[1])
    finally:
        for e in engines:
            e.close()
        for a in agents:
            a.stop()


def delta(after: dict[str, object], before: dict[str, object], key: str) -> int:
    return int(after["stats"][key]) - int(before["stats"][key])  # type: ignore[index]


def test_consumer_loads_the_producers_prefill_with_single_engine_output(pd: PD) -> None:
    tokens = prompt(300, seed=61)
    # A single engine's answer: the producer computing the whole request in a namespace of its own.
    reference = pd.producer.generate(tokens, salt="reference")
    # 1. The proxy sends the prompt to the producer for prefill only (one token).
    prefill = pd.producer.generate(tokens, salt="pd", max_tokens=1)
    assert delta(prefill, reference, "chunks_stored") == 4
    params = prefill["kv_transfer_params"]
    with pd.producer_agent.client() as client:
        producer_address = client.health().pod.agent_address
    assert params == {PEERS_PARAM: [producer_address]}
    # 2. ... then to the consumer with the producer's kv_transfer_params.
    before = pd.consumer.call("stats")
    decoded = pd.consumer.generate(tokens, salt="pd", kv_transfer_params=params)
    assert delta(decoded, before, "chunks_loaded") == 4
    assert delta(decoded, before, "chunks_stored") == 0  # a consumer never stores
    with pd.consumer_agent.client() as client:
        assert client.health().peer_fetched_chunks == 4
    assert (decoded["token_ids"], decoded["logprobs"]) == (reference["token_ids"], reference["logprobs"])


def test_control_without_the_params_the_consumer_computes_everything(pd: PD) -> None:
    # No controller and no named peer: nothing tells the consumer's agent where the prefix is.
    tokens = prompt(300, seed=62)
    pd.producer.generate(tokens, salt="pd2", max_tokens=1)
    before = pd.consumer.call("stats")
    decoded = pd.consumer.generate(tokens, salt="pd2")
    assert delta(decoded, before, "chunks_loaded") == 0
    assert decoded["kv_transfer_params"] is None  # and a consumer hands nothing on
