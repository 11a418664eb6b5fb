"""KV events and skip-save in a real vLLM engine with vLLM's prefix cache on (as users run it) and
vLLM's KV events published over ZeroMQ, read back by a real subscriber."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
import zmq
from vllm.distributed.kv_events import BlockStored, KVEventBatch

from kvgrid.connector.scheduler import SKIP_SAVE_PARAM
from tests.agent.helpers import AgentProc
from tests.connector.engines import Engine, make_tiny_llama, prompt

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def endpoint(free_port: Callable[[], int]) -> str:
    return f"tcp://127.0.0.1:{free_port()}"


@pytest.fixture(scope="module")
def engine(workdir: Path, agent: AgentProc, endpoint: str) -> Iterator[Engine]:
    from vllm.config import KVEventsConfig

    events = KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint.replace("127.0.0.1", "*")
    )
    eng = Engine(
        make_tiny_llama(workdir / "model"),
        agent,
        workdir,
        llm_options={"enable_prefix_caching": True, "kv_events_config": events},
    )
    yield eng
    eng.close()


@pytest.fixture
def subscriber(engine: Engine, endpoint: str) -> Iterator[zmq.Socket[bytes]]:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    # ZeroMQ's slow joiner: events published before the subscription reached the publisher are
    # lost. Publish (a prompt vLLM caches, which kvgrid does not store) until one arrives, then
    # drain: the subscription is in place, observed rather than waited for.
    deadline = time.monotonic() + 60
    for i in range(1000):
        engine.generate(prompt(40, seed=900 + i), salt=f"join{i}", kv_transfer_params={SKIP_SAVE_PARAM: True})
        if sock.poll(1000):
            break
        assert time.monotonic() < deadline, "no KV event reached the subscriber in 60 s"
    while sock.poll(300):
        sock.recv_multipart()
    yield sock
    sock.close(linger=0)


def _stored_events(sock: zmq.Socket[bytes], wait_s: float = 3.0) -> list[BlockStored]:
    """Every BlockStored the engine published until it has been quiet for a moment."""
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    out: list[BlockStored] = []
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if not sock.poll(200):
            if out:
                break
            continue
        frames = sock.recv_multipart()
        batch = decoder.decode(frames[-1])
        out += [e for e in batch.events if isinstance(e, BlockStored)]
    return out


def test_stored_chunks_are_announced_as_cpu_tier_blocks_over_vllm_block_hashes(
    engine: Engine, subscriber: zmq.Socket[bytes]
) -> None:
    tokens = prompt(300, seed=31)
    engine.generate(tokens, salt="events")
    events = _stored_events(subscriber)
    gpu = [h for e in events if e.medium == "GPU" for h in e.block_hashes]
    cpu = [e for e in events if e.medium == "CPU"]
    assert len(cpu) == 1, events
    (stored,) = cpu
    # 4 chunks of 64 tokens = the first 8 of vLLM's 32-token blocks, in order, chained from the start.
    assert stored.block_hashes == gpu[:8]
    assert stored.parent_block_hash is None and stored.block_size == 32
    assert stored.token_ids == tokens[:256]


def test_skip_save_stores_nothing_and_announces_nothing(
    engine: Engine, subscriber: zmq.Socket[bytes]
) -> None:
    stats = engine.worker.worker.stats
    stored = stats.chunks_stored
    engine.generate(prompt(300, seed=32), salt="skip", kv_transfer_params={SKIP_SAVE_PARAM: True})
    assert stats.chunks_stored == stored
    assert [e for e in _stored_events(subscriber) if e.medium == "CPU"] == []
    # The control: the same prompt without the flag is stored and announced.
    engine.generate(prompt(300, seed=32), salt="no-skip")
    assert stats.chunks_stored - stored == 4
    assert len([e for e in _stored_events(subscriber) if e.medium == "CPU"]) == 1
