"""``scripts/measure_index_capacity.py`` (the figures of docs/capacity.md) still runs against every
index back-end and reports figures that hang together: the entries it wrote, memory per entry above
the 16-byte key itself, CPU per key and per lookup, and Score sending each query to its holder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "measure_index_capacity.py"


def _run(*args: str) -> dict:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--chunks", "3000", "--pods", "8", "--seconds", "0.3", "--json", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=SCRIPT.parents[1],
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize("backend", ["memory", "valkey", "valkey-cluster"])
def test_every_backend_reports_consistent_figures(backend: str) -> None:
    extra = ["--score"] if backend == "memory" else []
    r = _run("--backend", backend, *extra)
    # 3000 chunks in L1, every sixth also on GPU (64-key runs sliced from the start of each run)
    assert r["entries"] == 3000 + sum(
        len(range(0, len(range(s, min(s + 64, 3000))), 6)) for s in range(0, 3000, 64)
    )
    assert r["bytes_per_entry"] > 16  # a key alone is 16 bytes
    assert r["ingest"]["client_cpu_us_per_key"] > 0 and r["lookup"]["lookups"] > 0
    if backend == "valkey":  # one pipeline: HGETALL of each chunk's hash and speculative hash + owners
        assert r["lookup"]["commands_per_lookup"] == pytest.approx(2 * 53 + 1)
    if backend != "memory":
        assert r["lookup"]["commands_per_lookup"] > 0 and r["ingest"]["server_cpu_us_per_key"] > 0
    else:
        assert r["score"]["pods"] == 8 and r["score"]["scores"] > 0


def test_bad_arguments_name_the_value() -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--backend", "memory", "--holders", "9", "--pods", "8"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "--holders=9: expected at most --pods (8)" in out.stderr
