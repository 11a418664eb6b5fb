"""KVGridConnector in a real vLLM engine with an MLA model under tensor parallelism 2 on the CPU
(two worker processes, one agent): the latent KV is the same on both TP ranks, so it is stored once
(by rank 0) under one namespace for both ranks. The connector loads nothing into MLA attention
outside GPUs (vLLM's reference CPU MLA cannot prefill on top of cached KV; vLLM turns its own prefix
cache off for it), so this engine stores but never loads.

vLLM picks the CPU MLA backend by the CPU: the reference ``CPU_MLA`` runs 16-token blocks only
(vLLM overrides any other size to 16), ``AMX_MLA`` (x86 CPUs with AMX tiles) multiples of 32 only;
no size suits both, so the engine gets the size of the backend vLLM picks here (:func:`mla_block_size`).
Either divides the 64-token chunk: a 300-token prompt is 4 full chunks on both."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvgrid.engine.client import AgentClient
from tests.agent.helpers import AgentProc
from tests.connector.engines import CHUNK, Engine, make_tiny_mla, prompt

pytestmark = pytest.mark.slow


def mla_block_size() -> int:
    """The smallest KV block size of the MLA attention backend vLLM picks on this CPU for the tiny
    MLA model (bf16, 512 latent + 64 rope dims per token), as the backend states it."""
    import torch
    from vllm.platforms import current_platform
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.attention.selector import AttentionSelectorConfig

    selector = AttentionSelectorConfig(
        head_size=576, dtype=torch.bfloat16, kv_cache_dtype=None, block_size=None, use_mla=True
    )
    backend = resolve_obj_by_qualname(current_platform.get_attn_backend_cls(None, selector))
    size = backend.get_supported_kernel_block_sizes()[0]
    return size.base if isinstance(size, MultipleOf) else int(size)


@pytest.fixture(scope="module")
def block_size() -> int:
    size = mla_block_size()
    assert size in (16, 32) and CHUNK % size == 0  # CPU_MLA's or AMX_MLA's; whole blocks per chunk
    return size


@pytest.fixture(scope="module")
def engine(workdir: Path, agent: AgentProc, block_size: int) -> Iterator[Engine]:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per CPU worker process
    eng = Engine(
        make_tiny_mla(workdir / "model"),
        agent,
        workdir,
        llm_options={
            "tensor_parallel_size": 2,
            "distributed_executor_backend": "mp",
            "block_size": block_size,
        },
    )
    yield eng
    eng.close()


def totals(agent: AgentProc) -> tuple[int, int]:
    """(chunks stored, chunks retrieved) by the agent since it started."""
    with AgentClient(agent.uds_path) as client:
        h = client.health()
        return h.stored_chunks, h.retrieved_chunks


def test_mla_under_tp2_is_stored_once_for_both_ranks(
    engine: Engine, agent: AgentProc, block_size: int
) -> None:
    ident = engine.worker_scheduler.identity
    assert ident.world_size == 2 and ident.replicated_kv
    assert ident.tokens_per_block == (block_size,)  # the engine runs the size asked for, not another
    assert ident.kv_identities[0] == ident.kv_identities[1]  # one namespace for both ranks
    with AgentClient(agent.uds_path) as client:
        assert len(client.health().instance_ids) == 2  # each rank registered its own KV memory
    tokens = prompt(300, seed=41)
    stored, retrieved = totals(agent)
    first = engine.generate(tokens, salt="mla")
    assert totals(agent) == (stored + 4, retrieved)  # 4 chunks stored once, not once per rank
    # CPU MLA: no load is offered (the engine would compute wrong attention on loaded KV), so the
    # repeat recomputes -- the same output, nothing retrieved, nothing stored twice.
    assert engine.generate(tokens, salt="mla") == first
    assert totals(agent) == (stored + 4, retrieved)
