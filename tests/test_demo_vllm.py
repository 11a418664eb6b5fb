"""`kvgrid demo --engine vllm`: real vLLM CPU engines with and without kvgrid, end to end (tiny model)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_vllm_demo_hits_and_generates_the_same_tokens(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvgrid.cli", "demo", "--engine", "vllm", "--model-size", "tiny",
         "--conversations", "2", "--turns", "2", "--system-tokens", "512", "--user-tokens", "64",
         "--reply-tokens", "64", "--chunk-size", "64", "--log-dir", str(tmp_path), "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout)
    assert r["engine"] == "vllm" and r["model"]["size"] == "tiny" and r["requests"] == 4
    # The first request of the shared system prompt misses; the other three load it (and more).
    o = r["overall"]
    assert o["miss_requests"] == 1 and o["hit_requests"] == 3
    assert r["chunks_loaded"] >= 3 * (512 // 64) and r["chunks_stored"] > 0
    assert r["bytes_loaded"] == r["chunks_loaded"] * 64 * r["model"]["kv_bytes_per_token"]
    assert r["outputs_identical"] and r["identical_requests"] == 4
    assert o["ttft_baseline_s"] > 0 and o["ttft_kvgrid_hit_s"] > 0 and o["ttft_kvgrid_miss_s"] > 0
    assert r["ttft_source"].startswith("vLLM RequestOutput.metrics")
    assert [b["prompt_length"] for b in r["per_prompt_length"]] == [576, 704]
    for row in r["request_log"]:
        assert row["ttft_baseline_s"] > 0 and row["ttft_kvgrid_s"] > 0
        assert (row["loaded_tokens"] > 0) == (row["chunks_loaded"] > 0)
    assert (tmp_path / "engine-kvgrid.log").is_file() and (tmp_path / "agent.log").is_file()


def test_vllm_demo_help_and_bad_values() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvgrid.cli", "demo", "--engine", "vllm", "--help"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0
    assert "--model-size {base,tiny}" in out.stdout and "time to first token" in out.stdout.lower()
    out = subprocess.run(
        [sys.executable, "-m", "kvgrid.cli", "demo", "--engine", "vllm", "--chunk-size", "48"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2 and "--chunk-size must be a multiple of 32" in out.stderr
    # The default demo keeps its flags; --engine is listed there too.
    out = subprocess.run(
        [sys.executable, "-m", "kvgrid.cli", "demo", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and "--engine {synthetic,vllm}" in out.stdout and "--pods" in out.stdout


def test_cli_imports_no_vllm() -> None:
    """The controller image has no vLLM or torch: importing the CLI imports neither, and parsing the
    demo's flags imports no vLLM (the engines import it in their own processes)."""
    code = (
        "import sys, kvgrid.cli\n"
        "assert not [m for m in ('vllm', 'torch') if m in sys.modules]\n"
        "kvgrid.cli.build_parser(['demo', '--engine', 'vllm'])\n"
        "bad = [m for m in ('vllm', 'transformers') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
