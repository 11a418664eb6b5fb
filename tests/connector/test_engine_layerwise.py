"""KVGridConnector's layer-wise mode in a real vLLM engine: loads happen inside the step, the
forward's first attention layer waits for them through ``wait_for_layer_load``, and the step's
stores start from ``save_kv_layer`` of the last layer. On the CPU the agent moves all layers in one
call, so the wait is at the first layer; per-layer pipelining on the GPU builds on these hooks."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agent.helpers import AgentProc
from tests.connector.engines import Engine, agent_frozen_after_lookup, make_tiny_llama, prompt

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(workdir: Path, agent: AgentProc) -> Iterator[Engine]:
    eng = Engine(make_tiny_llama(workdir / "model"), agent, workdir, layerwise=True, rpc_timeout_s=2.0)
    yield eng
    eng.close()


def test_loads_land_inside_the_step_and_stores_start_at_the_last_layer(engine: Engine) -> None:
    assert engine.worker_scheduler.in_step_loads
    stats = engine.worker.worker.stats
    tokens = prompt(300, seed=71)
    stores_before = stats.stores_from_last_layer
    first = engine.generate(tokens, salt="layerwise")
    assert stats.stores_from_last_layer > stores_before  # the miss stored from save_kv_layer
    in_step, loaded = stats.loads_in_step, stats.chunks_loaded
    assert engine.generate(tokens, salt="layerwise") == first
    assert (stats.loads_in_step - in_step, stats.chunks_loaded - loaded) == (1, 4)


def test_a_failed_in_step_load_is_recomputed_from_the_reported_blocks(
    engine: Engine, agent: AgentProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = prompt(300, seed=72)
    reference = engine.generate(tokens, salt="layerwise-fail")
    stats = engine.worker.worker.stats
    failed = stats.chunks_load_failed
    with agent_frozen_after_lookup(engine, agent, monkeypatch) as froze:
        assert engine.generate(tokens, salt="layerwise-fail") == reference
    assert froze == [256]  # the lookup found 4 chunks, then the agent stopped
    assert stats.chunks_load_failed - failed == 4, stats
    assert engine.generate(prompt(200, seed=73), salt="after") is not None  # still serving
