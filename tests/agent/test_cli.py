"""``kvgrid agent`` and ``kvgrid bench agent`` as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from kvgrid.agent.config import AgentConfig
from tests.agent.helpers import start_agent


def kvgrid(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvgrid.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def test_help_explains_every_flag() -> None:
    out = kvgrid("agent", "--help").stdout
    flat = " ".join(out.split())
    for f in msgspec.structs.fields(AgentConfig):
        flag = "--" + f.name.replace("_", "-")
        assert flag in out, flag
        assert f"KVGRID_{f.name.upper()}" in flat, f.name
    assert "Unix socket the engine" in flat and "POD_UID" in flat


def test_bad_config_names_the_field() -> None:
    r = kvgrid("agent", "--l1-size", "lots", "--uds-path", "")
    assert r.returncode == 2
    assert "l1_size" in r.stderr and "lots" in r.stderr
    r = kvgrid("agent", "--low-watermark", "0.99", "--high-watermark", "0.5")
    assert r.returncode == 2 and "low_watermark=0.99 > high_watermark=0.5" in r.stderr


def test_agent_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    agent = start_agent(tmp_path)
    assert Path(agent.uds_path).is_socket()
    agent.proc.terminate()
    assert agent.proc.wait(20) == 0
    assert not Path(agent.uds_path).exists()


def test_bench_agent_reports_both_figures_and_the_ratio() -> None:
    r = kvgrid(
        "bench", "agent", "--device", "cpu", "--layers", "2", "--kv-heads", "2", "--head-size", "64",
        "--chunks", "2", "--iters", "2", "--json", timeout=240,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    # layers x blocks per chunk x K/V x slots x heads x head size x 2 bytes
    assert res["chunk_bytes"] == 2 * 16 * 2 * 16 * 2 * 64 * 2
    for direction in ("store", "retrieve"):
        d = res[direction]
        assert d["agent_gbps"] > 0 and d["kernel_gbps"] > 0
        assert d["ratio"] == pytest.approx(d["agent_gbps"] / d["kernel_gbps"], rel=0.05)
    assert res["rpc_roundtrip_ms"] > 0


def test_bench_agent_peer_reports_the_fetch_against_a_local_copy() -> None:
    r = kvgrid(
        "bench", "agent", "--device", "cpu", "--peer", "--layers", "2", "--kv-heads", "2",
        "--head-size", "64", "--chunks", "2", "--iters", "2", "--json", timeout=240,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert (res["mode"], res["chunks"], res["chunk_bytes"]) == ("peer", 2, 2 * 16 * 2 * 16 * 2 * 64 * 2)
    assert res["peer_fetch_gbps"] > 0 and res["local_copy_gbps"] > 0
    assert res["ratio"] == pytest.approx(res["peer_fetch_gbps"] / res["local_copy_gbps"], rel=0.05)
    assert res["peer_lookup_ms"] > 0 and res["local_lookup_ms"] > 0


def test_pins_must_outlive_a_peer_fetch() -> None:
    from kvgrid.agent.config import AgentConfig

    with pytest.raises(ValueError, match="pin_ttl_ms=1000 <= peer_fetch_timeout_ms=2000"):
        AgentConfig(pin_ttl_ms=1000, peer_fetch_timeout_ms=2000, controller_address="c:1")
    assert AgentConfig(pin_ttl_ms=1000, peer_fetch_timeout_ms=2000, peer_fetch="off").pin_ttl_ms == 1000


def test_bench_agent_options_load_like_a_service_config(tmp_path: Path) -> None:
    import argparse

    from kvgrid.bench.agent import AgentBenchConfig, add_arguments
    from kvgrid.common.config import ConfigError, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg_file = tmp_path / "bench.yaml"
    cfg_file.write_text("layers: 4\nchunks: 3\n")
    args = parser.parse_args(["--config", str(cfg_file), "--chunks", "2", "--dtype", "fp16", "--json"])
    cfg = config_from_args(
        AgentBenchConfig, args, env={"KVGRID_BENCH_AGENT_ITERS": "9"}, env_prefix="KVGRID_BENCH_AGENT_"
    )
    assert (cfg.layers, cfg.chunks, cfg.dtype, cfg.iters, cfg.json) == (4, 2, "fp16", 9, True)
    with pytest.raises(ConfigError, match=r"'dtype' has invalid value 'fp8' .*one of 'bf16', 'fp16', 'fp32'"):
        config_from_args(AgentBenchConfig, parser.parse_args(["--dtype", "fp8"]), env={})


@pytest.mark.parametrize(("agents", "processes"), [("1", 1), ("N", 2)])
def test_bench_agent_tp_topologies_both_run(agents: str, processes: int) -> None:
    r = kvgrid(
        "bench", "agent", "--device", "cpu", "--layers", "2", "--kv-heads", "2", "--head-size", "64",
        "--chunks", "2", "--iters", "10", "--engines", "2", "--agents", agents, "--json", timeout=240,
    )  # fmt: skip
    # 10 rounds: the agents' CPU time is read in clock ticks (10 ms); one timed round of this tiny
    # load could stay under a tick (CI saw 0.0 s with --iters 2).
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert (res["mode"], res["engines"], res["agents"]) == ("tp", 2, agents)
    assert res["agent_processes"] == processes
    # Both ranks' chunks were stored, their caches zeroed, retrieved and compared bit-exact.
    assert res["bit_exact"] == [True, True]
    for direction in ("store", "retrieve"):
        d = res[direction]
        assert d["agent_gbps"] > 0 and d["kernel_gbps"] > 0
        assert d["ratio"] == pytest.approx(d["agent_gbps"] / d["kernel_gbps"], rel=0.05)
        assert 0 < d["p50_ms"] <= d["p99_ms"]
    assert res["agent_cpu_s"] > 0 and res["agent_cpu_cores"] > 0


def test_bench_agent_tp_refuses_peer_and_zero_engines() -> None:
    r = kvgrid("bench", "agent", "--device", "cpu", "--engines", "2", "--peer")
    assert r.returncode == 2 and "--peer measures one engine" in r.stderr
    r = kvgrid("bench", "agent", "--device", "cpu", "--engines", "0")
    assert r.returncode == 2 and "engines" in r.stderr and "0" in r.stderr
    r = kvgrid("bench", "agent", "--device", "cpu", "--agents", "2")
    assert r.returncode == 2 and "'agents' has invalid value '2'" in r.stderr
