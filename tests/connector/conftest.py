"""Fixtures of the connector tests that run real engines: a work directory and a real agent per
test module (each module starts its own engine: vLLM keeps one connector per process)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agent.helpers import AgentProc, start_agent


@pytest.fixture(scope="module")
def workdir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])


@pytest.fixture(scope="module")
def agent(workdir: Path) -> Iterator[AgentProc]:
    """A real ``kvgrid agent`` whose socket and allowed shared-memory directory is ``workdir``."""
    proc = start_agent(workdir, l1_size="64MiB")
    try:
        yield proc
    finally:
        if proc.proc.poll() is None:
            os.kill(proc.proc.pid, signal.SIGCONT)  # a test may have frozen it
        proc.stop()
