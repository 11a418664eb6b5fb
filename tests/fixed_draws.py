"""Derandomized Hypothesis runs that are the same in every process.

Hypothesis draws some integers from constants it finds in the source of the non-test modules loaded
in the process (whichever ``kvgrid`` modules the other collected test files imported), and its swarm
testing draws each rule's chance of being left out of an example as such an integer (0-254). So
which examples a fixed (``derandomize=True``) run generates depends on the other modules loaded,
and a CI run's reach floors (rehashes, evictions, ...) could pass alone and fail in the whole
suite. Hash randomisation plays no part (same run under any PYTHONHASHSEED).
"""

from __future__ import annotations

import threading

import pytest

__all__ = ["without_local_constants"]


def without_local_constants(monkeypatch: pytest.MonkeyPatch) -> None:
    """Empty Hypothesis' pool of local constants for this test (the process's cache comes back after
    it). Private API: where it is missing, nothing changes."""
    try:
        from hypothesis.internal.conjecture import providers
        from hypothesis.internal.constants_ast import Constants
    except ImportError:
        return
    cache = getattr(providers, "CONSTANTS_CACHE", None)
    if not hasattr(providers, "_get_local_constants") or not hasattr(cache, "_threadlocal"):
        return
    monkeypatch.setattr(providers, "_get_local_constants", Constants)  # an empty pool
    # The constants each kind of draw may take, computed from the pool: empty for this test.
    monkeypatch.setattr(providers.CONSTANTS_CACHE, "_threadlocal", threading.local())
