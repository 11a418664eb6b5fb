"""KVGridConnector in a real vLLM engine with tensor parallelism 2 on the CPU: two worker processes,
one agent per rank. Each rank stores and loads its own shard under its own keys; a lookup is the
minimum over the ranks' agents, since every rank must load its shard."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvgrid.engine.client import AgentClient
from tests.agent.helpers import AgentProc, start_agent, wait_for
from tests.connector.engines import Engine, make_tiny_llama, prompt

pytestmark = pytest.mark.slow


def start_rank_agent(workdir: Path, rank: int) -> AgentProc:
    directory = workdir / f"rank{rank}"
    directory.mkdir(exist_ok=True)
    return start_agent(directory, l1_size="32MiB", pod_uid=f"uid-rank{rank}", shm_dir=workdir)


@pytest.fixture(scope="module")
def agents(workdir: Path) -> Iterator[list[AgentProc]]:
    procs = [start_rank_agent(workdir, r) for r in range(2)]
    try:
        yield procs
    finally:
        for p in procs:
            p.stop()


@pytest.fixture(scope="module")
def engine(workdir: Path, agents: list[AgentProc]) -> Iterator[Engine]:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per CPU worker process
    eng = Engine(
        make_tiny_llama(workdir / "model"),
        agents[0],
        workdir,
        llm_options={"tensor_parallel_size": 2, "distributed_executor_backend": "mp"},
        agent_socket=str(workdir / "rank{rank}" / "agent.sock"),
    )
    yield eng
    eng.close()


def health(agent: AgentProc):  # type: ignore[no-untyped-def]
    with AgentClient(agent.uds_path) as client:
        return client.health()


def test_each_rank_stores_and_loads_its_shard_with_identical_output(
    engine: Engine, agents: list[AgentProc]
) -> None:
    ident = engine.worker_scheduler.identity
    assert ident.world_size == 2 and not ident.replicated_kv
    assert ident.kv_identities[0] != ident.kv_identities[1]  # each rank's shard has its own keys
    tokens = prompt(300, seed=51)
    before = [health(a) for a in agents]
    first = engine.generate(tokens, salt="tp")
    assert [health(a).stored_chunks - b.stored_chunks for a, b in zip(agents, before, strict=True)] == [4, 4]
    assert engine.generate(tokens, salt="tp") == first
    after = [health(a) for a in agents]
    assert [a.retrieved_chunks - b.retrieved_chunks for a, b in zip(after, before, strict=True)] == [4, 4]
    assert [a.num_pinned_chunks for a in after] == [0, 0]


def test_a_hit_is_the_minimum_over_the_ranks(engine: Engine, agents: list[AgentProc], workdir: Path) -> None:
    """Rank 1's agent restarts empty: rank 0's agent still holds the chunks, but rank 1 could not
    load its shard, so nothing is loaded on either rank and the prompt is computed."""
    tokens = prompt(300, seed=52)
    first = engine.generate(tokens, salt="min")
    agents[1].stop()
    agents[1] = start_rank_agent(workdir, 1)
    before = health(agents[0]).retrieved_chunks
    assert engine.generate(tokens, salt="min") == first
    assert health(agents[0]).retrieved_chunks == before
    # Rank 0's lookup pins are released off the scheduler (its release thread): waited for, not raced.
    wait_for("rank 0's lookup pins released", lambda: health(agents[0]).num_pinned_chunks == 0, 10)
