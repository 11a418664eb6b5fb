"""``kvgrid bench p2p`` as a user runs it, tiny: every data-plane mode asked for is measured between
real agent processes in the same run as the raw socket copy, and reported against it. Structure
only: no timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def test_bench_p2p_measures_every_security_mode_against_the_raw_socket() -> None:
    r = subprocess.run(
        [
            sys.executable, "-m", "kvgrid.cli", "bench", "p2p", "--layers", "1", "--chunks", "2",
            "--streams", "2", "--iters", "1", "--security", "none,mac,aead,tls", "--json",
        ],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    # A chunk: layers x 256 tokens x K/V x 8 heads x 128 x 2 bytes; no --tls-dir: a throwaway
    # certificate made for the run serves the mTLS modes.
    assert (res["chunks"], res["chunk_bytes"], res["streams"]) == (2, 256 * 2 * 8 * 128 * 2, 2)
    assert list(res["modes"]) == ["none", "mac", "aead", "tls"]
    assert res["raw_socket_gbps"] > 0
    for mode in res["modes"].values():
        assert mode["fetch_gbps"] > 0 and mode["fetch_ms"] > 0
        assert mode["ratio"] == pytest.approx(mode["fetch_gbps"] / res["raw_socket_gbps"], rel=0.05)
    # The first mode's figures stay where a single-mode run puts them.
    assert (res["security"], res["tls"], res["fetch_gbps"]) == (
        "none",
        False,
        res["modes"]["none"]["fetch_gbps"],
    )


def test_bench_p2p_refuses_an_unknown_mode() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "kvgrid.cli", "bench", "p2p", "--security", "mac,rot13"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2
    assert "security" in r.stderr and "rot13" in r.stderr and "'mac'" in r.stderr, r.stderr
