"""The TTFT harness with tensor parallelism 2 on the CPU (gloo): two rank processes, one agent each.

What must hold: every rank stores and loads its own shard under its own keys through
its own agent; the scheduler's lookup is the minimum over the ranks; a hit's first-token logits
equal a tail prefill over the KV the ranks computed themselves bit for bit, and a miss's a full
prefill's (same kernels, same shapes; the all-reduce of two ranks is one rounding of the same two
partial sums); hit against miss is close, not equal (other shapes: some CPUs' GEMMs sum in another
order, :data:`tests.ttft.helpers.CROSS_SHAPE_ATOL`); the sharded model is the TP=1 model (logits
close, not equal: the reduction order differs). Controls: a block nudged on
rank 1 only moves the logits (rank 1's loaded bytes matter); the shard test fails when a rank takes
the wrong slice of the weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any, cast

import pytest
import torch

from kvgrid.bench.ttft.bench import PRESETS
from kvgrid.bench.ttft.engine import EngineOptions, TTFTEngine, slots_of
from kvgrid.bench.ttft.model import PagedLlama
from kvgrid.bench.ttft.tp import TPGroup, rank_dir
from kvgrid.cli import main
from kvgrid.connector.vllm import KVGridConnector
from kvgrid.engine.client import AgentClient
from tests.ttft.helpers import CROSS_SHAPE_ATOL, assert_cross_shape_close, prompt

pytestmark = pytest.mark.slow

CHUNK = 64
TINY = PRESETS["tiny"]


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TPGroup]:
    g = TPGroup(TINY, tmp_path_factory.mktemp("tp"), tp=2, timeout_s=120)
    try:
        yield g
    finally:
        g.close()


def nudge_block(kv_list: list[torch.Tensor], request_id: str, blocks: list[int]) -> None:
    """Run on rank 1 only (pickled by reference): one loaded block of layer 0 changed after the load."""
    view = kv_list[0]
    view[blocks[1]] = view[blocks[1]] + 1.0


@pytest.mark.parametrize("layerwise", [False, True])
def test_tp2_hit_equals_a_tail_prefill_each_rank_holds_its_shard(group: TPGroup, layerwise: bool) -> None:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    options = EngineOptions(
        max_prompt_tokens=256, chunk_size=CHUNK, layerwise=layerwise, engine_id=f"tp-{layerwise}"
    )
    eng = group.engine(options)
    try:
        tokens = prompt(200, seed=10 + int(layerwise))
        miss = eng.run("miss", tokens)
        assert miss.loaded_tokens == 0 and miss.steps == 1
        eng.poison()  # every KV byte NaN on both ranks: what a rank neither loads nor computes shows
        hit = eng.run("hit", tokens)
        assert hit.loaded_tokens == 3 * CHUNK  # on both ranks: their outputs were aggregated
        assert hit.steps == 1 if layerwise else hit.steps >= 2
        assert torch.isfinite(hit.logits).all()
        slots = slots_of(list(range(13)), eng.block_size, 200, torch.device("cpu"))
        t = torch.tensor(tokens)
        # Without the connector, over KV the ranks compute themselves: the full prefill, then the tail.
        assert torch.equal(eng.reference(t, 0, slots), miss.logits)
        assert torch.equal(eng.reference(t[192:], 192, slots), hit.logits)
        assert_cross_shape_close(hit.logits, miss.logits)  # other shapes: close

        # Each rank's agent holds that rank's chunks under that rank's keys, and not the other's.
        half = cast(KVGridConnector, eng.scheduler.connector).scheduler  # the scheduler's connector half
        ident = half.identity
        assert ident.world_size == 2 and not ident.replicated_kv
        keys = half.request_keys(Request("probe", tokens, SamplingParams(max_tokens=1), None))
        assert keys is not None and len(keys) == 2 and keys[0] != keys[1] and len(keys[0]) == 3
        for r in range(2):
            with AgentClient(str(rank_dir(group.work, r) / "agent.sock")) as client:
                assert client.lookup(ident.instance_ids[r], "probe", keys[r]).num_hit_chunks == 3
                assert client.lookup(ident.instance_ids[r], "probe", keys[1 - r]).num_hit_chunks == 0

        # Control: one loaded block of rank 1 only nudged after the load; the logits must move.
        eng.set_after_load(1, nudge_block)
        eng.poison()
        wrong = eng.run("hit-nudged", tokens)
        assert wrong.loaded_tokens == 3 * CHUNK
        assert not torch.equal(wrong.logits, hit.logits)  # same shapes as the hit's: only the KV differs
        eng.set_after_load(1, None)
    finally:
        eng.close()


def test_tp2_is_the_tp1_model(group: TPGroup) -> None:
    """Same seed, same model: TP=2's logits are TP=1's up to the reduction order; rank 0's KV of
    layer 0 (before any all-reduce) is TP=1's first KV head."""
    eng = group.engine(EngineOptions(max_prompt_tokens=256, chunk_size=CHUNK, engine_id="tp-vs-1"))
    try:
        tokens = torch.tensor(prompt(200, seed=20))
        slots = slots_of(list(range(13)), eng.block_size, 200, torch.device("cpu"))
        tp2 = eng.reference(tokens, 0, slots)
        whole = PagedLlama(TINY)
        nb, bs, d2 = eng.kv_list[0].shape[0], eng.block_size, 2 * TINY.head_size
        caches = [
            torch.zeros(nb, bs, TINY.kv_heads, d2, dtype=whole.dtype).permute(0, 2, 1, 3) for _ in range(2)
        ]
        tp1 = whole.forward(tokens, 0, caches, slots)
        torch.testing.assert_close(tp2, tp1, atol=0.05, rtol=0.02)
        assert torch.corrcoef(torch.stack((tp1, tp2)))[0, 1] > 0.999
        stored = slice(0, 200)  # blocks 0.. hold positions 0..199 in order
        mine = eng.kv_list[0].permute(0, 2, 1, 3).reshape(-1, 1, d2)[stored].float()
        ref = caches[0].permute(0, 2, 1, 3).reshape(-1, TINY.kv_heads, d2)[stored, :1].float()
        torch.testing.assert_close(mine, ref, atol=1e-2, rtol=1e-2)
    finally:
        eng.close()


def _bench(*flags: str) -> subprocess.CompletedProcess[str]:
    """``kvgrid bench ttft --json`` in its own process (it starts its own process group)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGRID_")}
    argv = [sys.executable, "-m", "kvgrid.cli", "bench", "ttft", "--model", "tiny", "--chunk-size", "64",
            "--iters", "1", "--json", *flags]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=280, check=False)


def _rows(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(proc.stdout)
    assert result["failures"] == []
    assert result["tp"] == 2
    return result


def test_bench_tp2_runs_without_failures() -> None:
    result = _rows(_bench("--device", "cpu", "--tp", "2", "--prompts", "200"))
    (row,) = result["rows"]
    assert (row["prompt_tokens"], row["hit_tokens"]) == (200, 192)
    # The copy limit is ONE rank's hit KV: half the KV heads.
    assert row["limits"]["copy_bytes"] == 192 * TINY.kv_bytes_per_token(torch.bfloat16) // 2
    for mode in ("whole", "layerwise"):
        assert 0.0 <= row[mode]["hit_vs_miss_max_abs_logit_diff"] <= CROSS_SHAPE_ATOL  # other shapes
        assert row[mode]["kvgrid_overhead"] is None  # no engine without a connector with tp > 1
    assert row["limits"]["plain_miss_ms"] is None
    assert result["cuda_graphs"] is False


def test_tp2_has_no_engine_without_connector(group: TPGroup) -> None:
    with pytest.raises(ValueError, match="tp_size=2"):
        TTFTEngine(group.model, None, group.work, max_prompt_tokens=256)


def test_tp_that_does_not_divide_the_model_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit, match="2"):
        main(["bench", "ttft", "--device", "cpu", "--model", "tiny", "--tp", "3", "--prompts", "200",
              "--chunk-size", "64"])  # fmt: skip
    err = capsys.readouterr().err
    assert "tp=3" in err and "heads=4" in err


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_bench_tp2_on_two_gpus() -> None:
    """One rank per GPU, NCCL for the model's all-reduces (NVLink multicast off), each rank's KV
    cache handed to its own agent by CUDA IPC: no failures (the hit equals a tail prefill over the
    same KV bit for bit on rank 0, whose logits are every rank's)."""
    result = _rows(_bench("--device", "cuda", "--tp", "2", "--prompts", "300"))
    (row,) = result["rows"]
    assert row["hit_tokens"] == 256
    for mode in ("whole", "layerwise"):
        assert row[mode]["hit_vs_miss_max_abs_logit_diff"] < 0.1  # bf16 rounding of other kernel shapes
