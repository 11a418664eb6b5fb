"""Shared pytest setup and fixtures of every area (each area's own live in its conftest.py)."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

import pytest

# vLLM picks its platform at import time; the test machines have no GPU.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def _bind_free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def free_port() -> Callable[[], int]:
    """A loopback TCP port nobody listens on right now (for servers started as subprocesses)."""
    return _bind_free_port
