"""KVGridConnector in a real vLLM engine with a hybrid model (sliding-window + full-attention layers:
two KV cache groups under vLLM's hybrid KV cache manager), against a real ``kvgrid agent``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agent.helpers import AgentProc
from tests.connector.engines import Engine, agent_frozen_after_lookup, make_tiny_hybrid, prompt

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(workdir: Path, agent: AgentProc) -> Iterator[Engine]:
    # A short agent deadline: the failure test freezes the agent and waits for the load to time out.
    eng = Engine(make_tiny_hybrid(workdir / "model"), agent, workdir, rpc_timeout_s=2.0)
    yield eng
    eng.close()


def test_the_engine_has_two_kv_cache_groups(engine: Engine) -> None:
    assert len(engine.worker.identity.tokens_per_block) == 2


def test_repeated_prompt_loads_both_groups_with_identical_output(engine: Engine) -> None:
    stats = engine.worker.worker.stats
    tokens = prompt(300, seed=21)
    first = engine.generate(tokens, salt="hybrid")
    loaded = stats.chunks_loaded
    assert engine.generate(tokens, salt="hybrid") == first
    assert stats.chunks_loaded - loaded == 4


def test_a_failed_load_recomputes_that_request_and_the_engine_keeps_serving(
    engine: Engine, agent: AgentProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent freezes right after the scheduler's lookup found the chunks: the load times out,
    the request is reported in failed_recving (block ids cannot name a hybrid request's blocks) and
    vLLM recomputes it (kv_load_failure_policy=recompute); its output is the reference output."""
    tokens = prompt(300, seed=22)
    reference = engine.generate(tokens, salt="fail")
    stats = engine.worker.worker.stats
    failed = stats.chunks_load_failed
    with agent_frozen_after_lookup(engine, agent, monkeypatch):
        assert engine.generate(tokens, salt="fail") == reference
    assert stats.chunks_load_failed - failed == 4
    # The engine still serves, and once the worker registered again hits resume.
    assert engine.generate(tokens, salt="fail") == reference
