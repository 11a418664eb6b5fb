"""`kvgrid demo` with the disk tier at work: an L1 smaller than the workload spills chunks to each
agent's disk tier, later lookups promote them back (in the background; Retrieve waits), and every
loaded chunk is still bit-exact. The counts are the agents' own Prometheus counters."""

from __future__ import annotations

import pytest

from kvgrid.bench.demo import DemoSettings, run_demo


@pytest.mark.slow
def test_demo_spills_to_the_disk_tier_and_promotes_back_bit_exact() -> None:
    s = DemoSettings(
        conversations=6,
        turns=3,
        system_prompts=2,
        system_tokens=1024,
        user_tokens=200,
        reply_tokens=100,
        l1_size="24MiB",
        disk_tier_size="256MiB",
    )
    r = run_demo(s, progress=False)
    assert r["requests"] == 18
    assert r["tier_chunks_written"] > 0  # evicted from L1 onto disk
    assert r["tier_chunks_promoted"] > 0 and r["tier_lookup_hits"] >= r["tier_chunks_promoted"]
    assert r["tier_chunks_failed"] == 0
    assert r["chunks_verified"] == r["chunks_retrieved"] > 0 and r["chunks_corrupt"] == 0
