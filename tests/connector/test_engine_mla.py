"""KVGridConnector in a real vLLM engine with an MLA model under tensor parallelism 2 on the CPU
(two worker processes, one agent): the latent KV is the same on both TP ranks, so it is stored once
(by rank 0) under one namespace for both ranks. vLLM's CPU MLA attention cannot prefill on top of
cached KV (vLLM turns its own prefix cache off for it), so this engine stores but never loads."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvgrid.agent.client import AgentClient
from tests.agent.helpers import AgentProc
from tests.connector.engines import Engine, make_tiny_mla, prompt

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(workdir: Path, agent: AgentProc) -> Iterator[Engine]:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per CPU worker process
    eng = Engine(
        make_tiny_mla(workdir / "model"),
        agent,
        workdir,
        llm_options={"tensor_parallel_size": 2, "distributed_executor_backend": "mp", "block_size": 16},
    )
    yield eng
    eng.close()


def totals(agent: AgentProc) -> tuple[int, int]:
    """(chunks stored, chunks retrieved) by the agent since it started."""
    with AgentClient(agent.uds_path) as client:
        h = client.health()
        return h.stored_chunks, h.retrieved_chunks


def test_mla_under_tp2_is_stored_once_for_both_ranks(engine: Engine, agent: AgentProc) -> None:
    ident = engine.worker_scheduler.identity
    assert ident.world_size == 2 and ident.replicated_kv
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
