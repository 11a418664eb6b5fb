"""`kvgrid demo` end to end: real controller and agent processes, a chat workload, bit-exact loads."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvgrid.bench.demo import DemoSettings, run_demo


@pytest.mark.slow
def test_demo_routes_to_prefix_holders_and_loads_bit_exact_chunks() -> None:
    s = DemoSettings(
        conversations=6, turns=3, system_prompts=2, system_tokens=1024, user_tokens=200, reply_tokens=100
    )
    r = run_demo(s, progress=False)
    assert r["requests"] == 18
    assert r["controller_agents"] == 2
    # Every turn after a conversation's first reuses at least its system prompt's chunks.
    assert r["chunks_retrieved"] > 0 and r["hit_rate"] > 0.5
    assert r["chunks_verified"] == r["chunks_retrieved"] and r["chunks_corrupt"] == 0
    # Score sends a request to the pod holding its prefix unless that pod is over its load bound.
    assert r["requests_with_holder"] > 0 and r["routed_to_holder"] >= 0.75 * r["requests_with_holder"]
    assert set(r["requests_per_pod"]) == {"demo-pod-0", "demo-pod-1"}  # type: ignore[arg-type]
    assert r["bytes_moved"] > 0 and r["retrieve_gbps"] > 0 and r["store_gbps"] > 0


def test_demo_cli_rejects_bad_values_by_name() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvgrid.cli", "demo", "--turns", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "--turns must be >= 1, got 0" in out.stderr


def test_demo_cli_json_summary() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvgrid.cli", "demo", "--conversations", "2", "--turns", "2",
         "--system-tokens", "512", "--json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert (
        r["requests"] == 4 and r["chunks_corrupt"] == 0 and r["chunks_verified"] == r["chunks_retrieved"] > 0
    )
