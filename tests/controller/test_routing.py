"""``kvgrid bench routing``: the simulated cluster's model, and the replay through a real controller.

The model's rules are checked on hand-made requests with known answers; the replay is checked on a
small trace where prefix-aware routing must win (conversations whose turns share long prefixes,
caches too small to hold them all), so a policy that ignored the controller's answers would fail.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from kvgrid.bench.routing_sim import CacheEvent, Cluster, Hardware, TraceRequest, load_trace, summarize

# 1000 tokens/s and 100-token blocks: one recomputed block costs 100 ms, an L1 copy 1 ms.
HW = Hardware(
    block_tokens=100,
    bytes_per_token=10_000,
    prefill_tokens_per_s=1_000.0,
    l1_gbps=1.0,
    peer_gbps=0.1,
    peer_latency_ms=5.0,
    decode_ms_per_token=1.0,
    gpu_blocks=4,
    l1_blocks=8,
)


def req(t: float, blocks: tuple[int, ...], output: int = 10) -> TraceRequest:
    return TraceRequest(t, len(blocks) * HW.block_tokens, output, blocks)


def test_a_miss_is_prefilled_then_its_blocks_enter_gpu_and_l1() -> None:
    c = Cluster(1, HW)
    c.submit(0, 0, req(0, (1, 2)))
    assert c.loads()[0].waiting == 1
    events = c.advance(200)
    assert events == [CacheEvent(0, "admit", "gpu", (1, 2)), CacheEvent(0, "admit", "l1", (1, 2))]
    (s,) = c.served
    assert s.ttft_ms == pytest.approx(200) and s.prefill_tokens == 200 and s.gpu_blocks == 0
    assert c.loads()[0].running == 1 and c.loads()[0].waiting == 0
    c.advance(210)  # 10 output tokens at 1 ms each
    assert c.loads()[0].running == 0


def test_gpu_blocks_are_free_l1_blocks_cost_a_copy_and_peers_a_fetch() -> None:
    c = Cluster(2, HW)
    c.submit(0, 0, req(0, (1, 2, 3, 4, 5, 6)))  # pod 0: gpu keeps 3..6, l1 all six
    c.advance(1_000)
    c.submit(1, 0, req(1_000, (1, 2, 3)))
    c.advance(2_000)
    # Pod 0 again: block 1 left the GPU (LRU of 4), so the prefix is 0 GPU + 3 L1 blocks.
    assert (c.served[1].gpu_blocks, c.served[1].l1_blocks) == (0, 3)
    assert c.served[1].ttft_ms == pytest.approx(3 * HW.copy_ms(HW.l1_gbps))
    c.submit(2, 1, req(2_000, (1, 2, 3, 4)))  # pod 1 holds nothing: four blocks from pod 0's L1
    c.advance(3_000)
    s = c.served[2]
    assert s.peer_blocks == 4
    per_block = HW.copy_ms(HW.l1_gbps) + HW.copy_ms(HW.peer_gbps)  # 1 + 10 ms, cheaper than 100
    assert s.ttft_ms == pytest.approx(4 * per_block + HW.peer_latency_ms)


def test_a_tier_slower_than_recomputing_is_not_used() -> None:
    slow = msgspec.structs.replace(HW, peer_gbps=0.009)  # 111 ms a block, recompute 100
    c = Cluster(2, slow)
    c.submit(0, 0, req(0, (1, 2)))
    c.advance(1_000)
    c.submit(1, 1, req(1_000, (1, 2)))
    c.drain()
    assert c.served[1].peer_blocks == 0 and c.served[1].prefill_tokens == 200


def test_requests_queue_fifo_behind_each_other() -> None:
    c = Cluster(1, HW)
    c.submit(0, 0, req(0, (1,)))
    c.submit(1, 0, req(0, (2,)))
    assert c.loads()[0].waiting == 2
    c.drain()
    assert [s.queue_ms for s in c.served] == [0, pytest.approx(100)]
    assert c.served[1].ttft_ms == pytest.approx(200)


def test_lru_evictions_are_published_and_capacity_holds() -> None:
    c = Cluster(1, HW)
    c.submit(0, 0, req(0, (1, 2, 3, 4, 5)))
    events = c.drain()
    assert CacheEvent(0, "evict", "gpu", (1,)) not in events  # admitted and evicted in one go: no event
    assert CacheEvent(0, "admit", "gpu", (2, 3, 4, 5)) in events
    assert len(c.pods[0].gpu.blocks) == HW.gpu_blocks
    c.submit(1, 0, req(10_000, (6,)))
    assert CacheEvent(0, "evict", "gpu", (2,)) in c.drain()


def test_summary_splits_hits_by_tier_and_measures_spread() -> None:
    c = Cluster(2, HW)
    c.submit(0, 0, req(0, (1, 2)))
    c.advance(500)
    c.submit(1, 0, req(500, (1, 2, 3)))
    c.drain()
    s = summarize(c.served, 2, HW)
    assert s["requests"] == 2 and s["gpu_hit"] == pytest.approx(200 / 500) and s["hit"] == s["gpu_hit"]
    assert s["load_max_over_mean"] == pytest.approx(2.0)  # every prefilled token on pod 0 of 2


def test_bad_trace_lines_name_the_line(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text(
        '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n{"timestamp": 1}\n'
    )
    with pytest.raises(ValueError, match=r"t.jsonl:2: expected a JSON object with timestamp"):
        load_trace(p)
    assert len(load_trace(p, limit=1)) == 1


def _conversations(path: Path, convs: int = 7, turns: int = 5, blocks_per_turn: int = 3) -> None:
    """Conversations taking turns (7: round-robin over 3 pods moves each one every turn), each turn
    extending its conversation's prefix."""
    lines, t = [], 0
    for turn in range(turns):
        for conv in range(convs):
            n = (turn + 1) * blocks_per_turn
            ids = [conv * 1000 + i for i in range(n)]
            lines.append({"timestamp": t, "input_length": n * 512, "output_length": 4, "hash_ids": ids})
            t += 700
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_replay_through_a_real_controller_rewards_prefix_aware_routing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvgrid import cli

    trace = tmp_path / "conv.jsonl"
    _conversations(trace)
    args = [
        "bench",
        "routing",
        "--trace",
        str(trace),
        "--pods",
        "3",
        "--gpu-blocks",
        "20",
        "--l1-blocks",
        "30",
    ]
    assert cli.main([*args, "--peer-gbps", "0.01", "--json"]) == 0  # peers too slow to help
    out = json.loads(capsys.readouterr().out)["results"]
    assert set(out) == {"round_robin", "least_loaded", "prefix", "score"}
    for r in out.values():
        assert r["requests"] == 35
        assert r["hit"] == pytest.approx(r["gpu_hit"] + r["l1_hit"] + r["peer_hit"])
        # every turn admits its new blocks to GPU and L1 (3 pods, 35 requests over 23.8 s)
        assert 35 * 2 * 3 / 3 / 23.8 <= r["event_keys_per_pod_s"] <= 35 * 2 * 15 * 2 / 3 / 23.8
    # Prefix and Score send each turn where its conversation lives: a hit on every turn after the
    # first; round-robin scatters turns over pods that do not hold them.
    for policy in ("prefix", "score"):
        assert out[policy]["hit"] > out["round_robin"]["hit"] + 0.2, (policy, out)
        assert out[policy]["ttft_mean_ms"] < out["round_robin"]["ttft_mean_ms"]


def test_missing_trace_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvgrid import cli

    assert cli.main(["bench", "routing", "--trace", str(tmp_path / "nope.jsonl")]) == 2
    assert "nope.jsonl: no such file (expected the Mooncake conversation trace" in capsys.readouterr().err


def test_trace_block_keys_are_spread_like_real_chunk_keys() -> None:
    """The memory index hashes a key's leading bits; trace ids are small integers, so the replay
    must turn them into digests (raw ids put every key in a few rows: ~1 ms per ingested key)."""
    from kvgrid.bench.routing import _key

    ids = range(4096)
    keys = [_key(i) for i in ids]
    assert all(len(k) == 16 for k in keys) and _key(7) == _key(7)
    assert len(set(keys)) == len(keys)
    leading = {int.from_bytes(k[:8], "little") >> 52 for k in keys}  # 12 leading bits: 4096 buckets
    assert len(leading) > 2000  # uniform: ~2,590 expected; raw big-endian ids give 1
