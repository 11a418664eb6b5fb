"""``kvgrid bench ttft`` on the CPU: the harness drives vLLM's scheduler and KVGridConnector against a
real agent process, and a hit's first-token logits are the ones the model computes itself.

Exactness: on every device a hit's logits equal a tail prefill over self-computed KV bit for bit
(same kernels, same shapes: only the KV's origin differs), and a miss's a full prefill's. Hit
against miss is close, not bit for bit: the tail's rows run other shapes than the whole prompt's,
and on some CPUs (oneDNN's AMX GEMMs on Intel Xeon) those sum in another order and round
differently in bf16 (:data:`tests.ttft.helpers.CROSS_SHAPE_ATOL`). The control perturbs one loaded
KV block and sees the logits move, so the comparison can fail.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvgrid.bench.ttft.bench import PRESETS
from kvgrid.bench.ttft.engine import AgentProcess, TTFTEngine, slots_of
from kvgrid.bench.ttft.model import PagedLlama
from kvgrid.cli import main
from kvgrid.engine.client import AgentClient
from tests.ttft.helpers import CROSS_SHAPE_ATOL, assert_cross_shape_close, prompt

pytestmark = pytest.mark.slow

CHUNK = 64


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    proc = AgentProcess(tmp_path_factory.mktemp("ttft-agent"), 64 << 20)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.mark.parametrize("layerwise", [False, True])
def test_hit_logits_equal_a_tail_prefill_and_a_wrong_byte_shows(agent: AgentProcess, layerwise: bool) -> None:
    directory = Path(agent.uds_path).parent
    model = PagedLlama(PRESETS["tiny"])
    eng = TTFTEngine(
        model, agent.uds_path, directory, max_prompt_tokens=256, chunk_size=CHUNK, layerwise=layerwise,
        engine_id=f"test-{layerwise}",
    )  # fmt: skip
    try:
        tokens = prompt(200, seed=int(layerwise))
        miss = eng.run("miss", tokens)
        assert miss.loaded_tokens == 0 and miss.steps == 1
        eng.poison()  # every KV byte NaN: what the hit does not load or compute shows in its logits
        hit = eng.run("hit", tokens)
        # vLLM loads the 3 full chunks before the last token. A whole-request load runs between steps
        # (the engine steps with nothing scheduled until the worker reports it); a layer-wise one inside.
        assert hit.loaded_tokens == 3 * CHUNK
        assert hit.steps == 1 if layerwise else hit.steps >= 2
        assert torch.isfinite(hit.logits).all()
        t = torch.tensor(tokens)
        slots = slots_of(list(range(13)), eng.block_size, 200, model.device)
        # Bit for bit against forwards of the same shapes: the miss a full prefill, the hit a tail
        # prefill over the KV the full prefill just computed.
        assert torch.equal(model.forward(t, 0, eng.kv_list, slots), miss.logits)
        assert torch.equal(model.forward(t[192:], 192, eng.kv_list, slots), hit.logits)
        assert_cross_shape_close(hit.logits, miss.logits)  # other shapes: close

        # Control: one loaded block of one layer nudged after the load; the logits must move.
        def nudge(request_id: str, blocks: list[int]) -> None:
            view = eng.kv_list[0]
            view[blocks[1]] = view[blocks[1]] + 1.0

        eng.poison()
        eng.after_load = nudge
        wrong = eng.run("hit-nudged", tokens)
        assert wrong.loaded_tokens == 3 * CHUNK
        assert not torch.equal(wrong.logits, hit.logits)  # same shapes as the hit's: only the KV differs
    finally:
        eng.close()


def _bench_row(
    device: str, prompt_tokens: int, capsys: pytest.CaptureFixture[str], *flags: str
) -> dict[str, Any]:
    """``kvgrid bench ttft --json`` of the tiny model, one prompt length, 64-token chunks: the one
    row, once the run exited 0 and reported no failures (among them the bit-exact checks: every
    mode's last hit against a tail prefill over the same KV, its miss against a full prefill)."""
    argv = ["bench", "ttft", "--device", device, "--model", "tiny", "--prompts", str(prompt_tokens),
            "--chunk-size", "64", "--iters", "1", "--json", *flags]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["failures"] == []
    row: dict[str, Any]
    (row,) = result["rows"]
    return row


def test_bench_reports_both_modes_and_the_limits(capsys: pytest.CaptureFixture[str]) -> None:
    row = _bench_row("cpu", 200, capsys)
    assert (row["prompt_tokens"], row["hit_tokens"]) == (200, 192)
    lim = row["limits"]
    assert lim["copy_bytes"] == 192 * PRESETS["tiny"].kv_bytes_per_token(torch.bfloat16)
    # The JSON rounds every figure to 4 significant digits, a ratio of two is off by up to 1.5e-3.
    assert lim["ceiling"] == pytest.approx(lim["prefill_ms"] / lim["copy_ms"], rel=2e-3)
    for mode in ("whole", "layerwise"):
        r = row[mode]
        assert 0.0 <= r["hit_vs_miss_max_abs_logit_diff"] <= CROSS_SHAPE_ATOL  # other shapes: close
        assert r["speedup"] == pytest.approx(lim["prefill_ms"] / r["hit_ms"], rel=2e-3)
        ratio = r["miss_ms"] / lim["prefill_ms"]
        assert r["store_overhead"] == pytest.approx(ratio - 1, abs=2e-3 * ratio)
        assert r["of_ceiling"] == pytest.approx(r["speedup"] / lim["ceiling"], rel=2e-3)


def test_a_step_uploads_its_inputs_before_the_connector_starts_loads(
    agent: AgentProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's runner uploads a step's inputs (``_prepare_inputs``) before the connector's context
    starts loads; the harness must too. On CUDA a pinned upload queued after a load's first DMA waits
    on the copy engine behind every DMA of the load (docs/benchmarks.md, *a pinned upload behind a
    DMA train*), which made the harness's layer-wise hits wait for the whole load."""
    import kvgrid.bench.ttft.engine as engine_mod

    directory = Path(agent.uds_path).parent
    model = PagedLlama(PRESETS["tiny"])
    eng = TTFTEngine(
        model, agent.uds_path, directory, max_prompt_tokens=256, chunk_size=CHUNK, layerwise=True,
        engine_id="test-order",
    )  # fmt: skip
    calls: list[str] = []
    upload, start = engine_mod.slots_of, type(eng.worker).start_load_kv

    def logged_upload(*a: Any, **k: Any) -> torch.Tensor:
        calls.append("inputs")
        return upload(*a, **k)

    def logged_start(self: Any, *a: Any, **k: Any) -> None:
        calls.append("start_load_kv")
        start(self, *a, **k)

    monkeypatch.setattr(engine_mod, "slots_of", logged_upload)
    monkeypatch.setattr(type(eng.worker), "start_load_kv", logged_start)
    try:
        tokens = prompt(200, seed=11)
        eng.run("order-miss", tokens)
        calls.clear()
        hit = eng.run("order-hit", tokens)
        assert hit.loaded_tokens == 3 * CHUNK and hit.steps == 1  # an in-step load: start_load_kv first
        assert calls == ["inputs", "start_load_kv"]
    finally:
        eng.close()


def test_engine_without_connector_shares_the_cache_and_stores_nothing(agent: AgentProcess) -> None:
    """The bench's ``plain miss`` engine: vLLM without any KV connector over the other engine's KV
    cache. The agent sees nothing of it (a connector would register its cache and store the
    prompt's chunks), its scheduler has no connector half, and its logits are a full prefill's."""
    directory = Path(agent.uds_path).parent
    model = PagedLlama(PRESETS["tiny"])
    eng = TTFTEngine(
        model, agent.uds_path, directory, max_prompt_tokens=256, chunk_size=CHUNK, engine_id="test-plain"
    )
    plain: TTFTEngine | None = None
    try:
        tokens = prompt(200, seed=7)
        with AgentClient(agent.uds_path) as client:
            before = client.health()
            plain = eng.without_connector()
            alone = plain.run("plain", tokens)
            after = client.health()
            assert alone.loaded_tokens == 0 and alone.steps == 1
            assert list(after.instance_ids) == list(before.instance_ids)
            assert after.stored_chunks == before.stored_chunks
            # Control in place: kvgrid's engine serving the same prompt stores its 3 chunks.
            miss = eng.run("after-plain", tokens)
            assert miss.loaded_tokens == 0
            assert client.health().stored_chunks == after.stored_chunks + 3
        assert plain.scheduler.connector is None and plain.rank.vllm_config.kv_transfer_config is None
        assert plain.rank.hooks is None
        with pytest.raises(RuntimeError, match="without a KV connector"):
            _ = plain.worker
        # One KV cache: the plain engine's views are the first engine's memory.
        assert [v.data_ptr() for v in plain.kv_list] == [v.data_ptr() for v in eng.kv_list]
        slots = slots_of(list(range(13)), eng.block_size, 200, model.device)
        assert torch.equal(alone.logits, model.forward(torch.tensor(tokens), 0, eng.kv_list, slots))
        assert torch.equal(alone.logits, miss.logits)
    finally:
        if plain is not None:
            plain.close()
        eng.close()


def test_bench_reports_the_miss_without_kvgrid(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``plain_miss_ms`` and ``kvgrid_overhead`` = miss / plain miss - 1 are reported, and the plain
    misses ran on an engine whose vLLM scheduler has no connector, one new prompt per round."""
    seen: list[tuple[str, bool, tuple[int, ...]]] = []
    run = TTFTEngine.run

    def spy(self: TTFTEngine, request_id: str, prompt: list[int]) -> Any:
        if request_id.startswith("plain"):
            seen.append((request_id, self.scheduler.connector is not None, tuple(prompt)))
        return run(self, request_id, prompt)

    monkeypatch.setattr(TTFTEngine, "run", spy)
    row = _bench_row("cpu", 200, capsys)
    assert [(rid, conn) for rid, conn, _ in seen] == [("plain-200-0", False), ("plain-200-1", False)]
    assert len({p for _, _, p in seen}) == 2
    plain = row["limits"]["plain_miss_ms"]
    assert isinstance(plain, float) and plain > 0
    for mode in ("whole", "layerwise"):
        r = row[mode]
        assert math.isfinite(r["kvgrid_overhead"]) and r["kvgrid_overhead"] > -1
        # The JSON rounds to 4 significant digits, the ratio from unrounded times: each of the three
        # figures may be off by 5e-4 of itself (1.222 against 1.2207 seen), so allow 2e-3 of the ratio.
        ratio = r["miss_ms"] / plain
        assert r["kvgrid_overhead"] == pytest.approx(ratio - 1, abs=2e-3 * ratio)


def test_bad_values_are_refused_with_their_name() -> None:
    with pytest.raises(SystemExit, match="2"):
        main(["bench", "ttft", "--device", "cpu", "--prompts", "64", "--chunk-size", "64"])


@pytest.mark.gpu
@pytest.mark.parametrize("copies", ["agent", "engine"])
def test_bench_runs_on_cuda(capsys: pytest.CaptureFixture[str], copies: str) -> None:
    """The same bench with the KV cache on the GPU (handed to the agent by CUDA IPC; with engine
    copies the engine's own kernels load from the agent's shared L1): the hit equals a tail
    prefill over the same KV bit for bit (checked by the bench: failures empty)."""
    row = _bench_row("cuda", 300, capsys, "--copies", copies)
    assert row["hit_tokens"] == 256
    for mode in ("whole", "layerwise"):
        assert row[mode]["hit_vs_miss_max_abs_logit_diff"] < 0.1  # bf16 rounding of other kernel shapes
