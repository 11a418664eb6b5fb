"""``kvgrid bench serve`` on the CPU: many requests at once through vLLM's scheduler with a KV cache too
small for the batch (preemption forced), the same greedy tokens with and without kvgrid, nothing
left behind, and a sampled hit bit for bit against the same forwards without kvgrid."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from kvgrid.bench.ttft import serve
from kvgrid.bench.ttft.model import PagedLlama
from kvgrid.bench.ttft.serve import ServeBenchConfig

pytestmark = pytest.mark.timeout(900)

# Tiny model, 6 users x 3 rounds of ~264-token prompts and 40-token answers, every user's first question
# at once (whatever the machine's speed); the GPU cache is its floor (one longest request plus two
# blocks), so requests prefilled in chunks beside a decoding one outgrow it and vLLM preempts.
CFG = ServeBenchConfig(
    device="cpu", model="tiny", rates=(math.inf,), run_s=3.0, drain_s=60.0, users=6, rounds=3, think_s=0.0,
    gpu_cache_fraction=0.01, max_num_seqs=8, check_tokens=True, output_tokens=40,
)  # fmt: skip


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return serve.measure(CFG, tmp_path_factory.mktemp("serve"))


def _rows(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["config"]: row for row in result["rows"]}


def test_every_configuration_serves_the_same_tokens_and_leaves_nothing_behind(result: dict[str, Any]) -> None:
    # failures hold the token comparison, the drained engines' blocks, requests and runner states,
    # and the agent's pinned and leased chunks
    assert result["failures"] == []
    rows = _rows(result)
    assert set(rows) == {"vllm-prefix", "vllm-nocache", "kvgrid"}
    for row in rows.values():
        assert row["completed"] == row["admitted"] > 0
        assert row["without_first_token"] == 0
        assert row["ttft_p50_ms"] is not None and row["itl_p50_ms"] is not None
    assert rows["kvgrid"]["requests_with_other_tokens"] == 0
    assert rows["vllm-nocache"]["requests_with_other_tokens"] == 0


def test_the_batch_outgrew_the_cache_and_kvgrid_served_hits(result: dict[str, Any]) -> None:
    rows = _rows(result)
    assert result["working_set_over_gpu_cache"] >= 3  # the workload does not fit vLLM's own cache
    assert sum(row["preemptions"] for row in rows.values()) > 0
    assert 0 < rows["kvgrid"]["kvgrid_hit_rate"] <= 1  # of prompt tokens, counted once per request
    assert rows["kvgrid"]["bytes_loaded"] > 0 and rows["kvgrid"]["bytes_stored"] > 0
    assert rows["vllm-nocache"]["gpu_prefix_hit_rate"] == 0
    assert rows["vllm-prefix"]["kvgrid_hit_rate"] == 0


def test_the_sampled_hit_is_bit_exact(result: dict[str, Any]) -> None:
    hit = result["sampled_hit"]
    assert hit["bit_exact"] is True
    assert hit["loaded_tokens"] >= CFG.chunk_size


def test_a_wrong_loaded_byte_fails_the_sampled_hit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Control: one changed KV value in a hit's first block (as a bad load would leave it)."""
    original = PagedLlama.forward_batch

    def corrupting(self: PagedLlama, batch: Any, kv_caches: list[torch.Tensor], hooks: Any = None) -> Any:
        if hooks is not None and batch.starts and batch.starts[0] > 0:
            kv_caches[0][int(batch.block_table[0, 0]), 0, 0, 0] += 1.0
        return original(self, batch, kv_caches, hooks)

    monkeypatch.setattr(PagedLlama, "forward_batch", corrupting)
    cfg = msgspec.structs.replace(CFG, configs=("kvgrid",), run_s=1.0)
    r = serve.resolve(cfg)
    model = PagedLlama(r.shape, device="cpu", dtype=torch.float32, seed=cfg.seed)
    wl = serve.workload(cfg, r)
    check, failures = serve.sampled_hit_check(cfg, r, model, wl, 64, tmp_path)
    assert check["bit_exact"] is False
    assert any("the hit's logits differ" in f for f in failures)


def test_other_tokens_fail_the_comparison(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Control: an engine that samples another token for one request under one configuration."""
    from kvgrid.bench.ttft.serve_engine import ServeEngine

    original = ServeEngine.step

    def step(self: ServeEngine) -> Any:
        events = original(self)
        if self.rank.has_connector:
            for rid in events.sampled:
                if rid.endswith("-r0"):
                    events.sampled[rid] += 1
        return events

    monkeypatch.setattr(ServeEngine, "step", step)
    cfg = msgspec.structs.replace(CFG, configs=("vllm-nocache", "kvgrid"), users=3, rounds=2, run_s=1.0)
    out = serve.measure(cfg, tmp_path)
    assert any("generated other tokens" in f for f in out["failures"])


def test_the_connector_without_stores_serves_the_same_tokens_and_stores_nothing(tmp_path: Path) -> None:
    cfg = msgspec.structs.replace(CFG, configs=("vllm-prefix", "kvgrid-lookup-only"), users=3, rounds=2)
    out = serve.measure(cfg, tmp_path)
    assert out["failures"] == []
    row = _rows(out)["kvgrid-lookup-only"]
    assert row["completed"] > 0 and row["requests_with_other_tokens"] == 0
    assert row["bytes_stored"] == 0 and row["kvgrid_hit_rate"] == 0


def test_bad_values_name_themselves() -> None:
    with pytest.raises(ValueError, match=r"rates=.*expected requests/s > 0"):
        serve.resolve(msgspec.structs.replace(CFG, rates=(0.0,)))
    with pytest.raises(ValueError, match="chunk_size=100 is not a multiple of block_size=16"):
        serve.resolve(msgspec.structs.replace(CFG, chunk_size=100))
