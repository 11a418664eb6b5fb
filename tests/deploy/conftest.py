"""Fixtures of the deployment tests: the helm command with its state kept out of $HOME."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deploy.chart import helm_binary


@pytest.fixture(scope="session")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """The helm command, with its cache/config/data dirs kept out of $HOME."""
    binary = helm_binary()
    if not os.access(binary, os.X_OK):
        pytest.fail(f"helm not found at {binary}: run scripts/fetch_helm.sh (make install runs it)")
    home: Path = tmp_path_factory.mktemp("helm-home")
    saved = {k: os.environ.get(k) for k in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME")}
    for key in saved:
        os.environ[key] = str(home / key.lower())
    yield [str(binary)]
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
