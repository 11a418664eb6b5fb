"""The TTFT model's forward: Llama's math (against a dense reference written here), and on CUDA its
piecewise CUDA graphs (``kvgrid.bench.ttft.graphs``) against the eager forward, bit for bit.

What the GPU tests would catch: a static input not refreshed before a replay (token ids, positions,
the attention output between pieces), a hook moved or skipped, a replay that does not wait for a load
the hook made the stream wait for, and a capture broken by copies in flight on other streams or by
another thread's CUDA calls (the connector's loader threads).
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from kvgrid.bench.ttft import graphs
from kvgrid.bench.ttft.model import ModelShape, PagedLlama, masked_gqa_attention, tail_bias
from kvgrid.cli import main

# Three layers: a first, a middle and a last piece; 4 query heads per 2 KV heads (GQA).
SHAPE = ModelShape(layers=3, hidden=256, heads=4, kv_heads=2, head_size=64, intermediate=512, vocab=1024)
BLOCK = 16
NUM_BLOCKS = 80  # 1280 slots

gpu = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _caches(device: str, dtype: torch.dtype) -> list[torch.Tensor]:
    """Per-layer KV in vLLM's LBNHC view: logical [blocks, kv_heads, block, 2 * head_size], stored
    [blocks, block, kv_heads, 2 * head_size]."""
    s = SHAPE
    return [
        torch.zeros(NUM_BLOCKS, BLOCK, s.kv_heads, 2 * s.head_size, device=device, dtype=dtype).permute(
            0, 2, 1, 3
        )
        for _ in range(s.layers)
    ]


def _rows(cache: torch.Tensor) -> torch.Tensor:
    """The cache as [slot, kv_heads, 2 * head_size] (a view)."""
    return cache.permute(0, 2, 1, 3).reshape(-1, SHAPE.kv_heads, 2 * SHAPE.head_size)


def _slots(n: int, device: str, seed: int = 0) -> torch.Tensor:
    """Scattered slots: positions next to each other are not next to each other in the cache."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(NUM_BLOCKS * BLOCK, generator=gen)[:n].to(device)


def _tokens(n: int, seed: int, device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, SHAPE.vocab, (n,), generator=gen).to(device)


def _dense_reference(model: PagedLlama, tokens: torch.Tensor) -> torch.Tensor:
    """Llama-3 over ``tokens`` from position 0, written independently of ``PagedLlama``: dense causal
    attention, GQA by repeating KV heads, RoPE in Hugging Face's ``rotate_half`` form. The last
    token's logits, float32."""
    s, n = model.shape, tokens.numel()
    half = s.head_size // 2

    def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w.float()

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    inv_freq = 1.0 / (s.rope_theta ** (torch.arange(half, dtype=torch.float64) / half))
    angles = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos = torch.cat((angles.cos(), angles.cos()), dim=-1)[:, None, :].float().to(tokens.device)
    sin = torch.cat((angles.sin(), angles.sin()), dim=-1)[:, None, :].float().to(tokens.device)
    causal = torch.ones(n, n, dtype=torch.bool, device=tokens.device).tril()
    q_size, kv_size = s.heads * s.head_size, s.kv_heads * s.head_size
    h = model.embed.float()[tokens]
    for layer in model.layers:
        qkv = norm(h, layer.norm1) @ layer.qkv.float().T
        q = qkv[:, :q_size].view(n, s.heads, s.head_size)
        k = qkv[:, q_size : q_size + kv_size].view(n, s.kv_heads, s.head_size)
        v = qkv[:, q_size + kv_size :].view(n, s.kv_heads, s.head_size)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        rep = s.heads // s.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(s.head_size)
        weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        out = torch.einsum("hqk,khd->qhd", weights, v).reshape(n, q_size)
        h = h + out @ layer.o.float().T
        gate, up = (norm(h, layer.norm2) @ layer.gate_up.float().T).chunk(2, dim=-1)
        h = h + (F.silu(gate) * up) @ layer.down.float().T
    return (norm(h[-1:], model.final_norm) @ model.lm_head.float().T)[0]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
def test_forward_is_llama_over_the_paged_cache(device: str) -> None:
    """float32, so the dense reference's other order of operations stays within a small tolerance: a
    whole prompt, then a tail on top of its cached prefix (on CUDA both are graph replays)."""
    model = PagedLlama(SHAPE, device=device, dtype=torch.float32)
    caches, slots, tokens = _caches(device, torch.float32), _slots(300, device), _tokens(300, 1, device)
    # On CUDA, TF32 matmuls may be on (a library imported earlier in the process may enable them);
    # a wrong rotation or head mapping moves logits by O(1).
    tol = 1e-4 if device == "cpu" else 1e-2
    full = model.forward(tokens[:260], 0, caches, slots)
    torch.testing.assert_close(full, _dense_reference(model, tokens[:260]), rtol=tol, atol=tol)
    tail = model.forward(tokens[260:], 260, caches, slots)
    torch.testing.assert_close(tail, _dense_reference(model, tokens), rtol=tol, atol=tol)
    if device == "cuda":
        assert model.graph_sizes == (40, 260)


def test_the_cuda_tails_attention_is_gqa_under_the_mask() -> None:
    """A masked tail on CUDA stacks the query heads that share a KV head along the query axis (no KV
    head repeated) under a padded additive bias built once per forward; it must equal SDPA's own
    GQA under the same mask. Checked on CPU, where both run; a wrong head or row mapping moves the
    result by O(1)."""
    g = torch.Generator().manual_seed(3)
    t, length, heads, kv_heads, d = 5, 37, 8, 2, 16
    q = torch.randn(t, heads, d, generator=g)
    k, v = (torch.randn(1, kv_heads, length, d, generator=g) for _ in range(2))
    positions = torch.arange(length - t, length)  # the tail: query t sees keys 0..length-t+t
    mask = torch.arange(length)[None, :] <= positions[:, None]
    want = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, attn_mask=mask, enable_gqa=True)
    bias = tail_bias(mask, heads // kv_heads, torch.float32)
    assert bias.shape == (heads // kv_heads * t, length) and bias.stride(0) % 16 == 0
    got = masked_gqa_attention(q, k, v, bias)
    assert got.shape == (t, heads, d)
    torch.testing.assert_close(got, want[0].transpose(0, 1), rtol=1e-5, atol=1e-5)


def test_cpu_runs_eager_and_bad_values_are_named() -> None:
    model = PagedLlama(SHAPE, cuda_graphs=True)
    assert not model.cuda_graphs  # CUDA only
    model.forward(_tokens(20, 0, "cpu"), 0, _caches("cpu", torch.bfloat16), _slots(20, "cpu"))
    assert model.graph_sizes == ()
    with pytest.raises(ValueError, match="graph_max_tokens=-1; expected >= 0"):
        PagedLlama(SHAPE, graph_max_tokens=-1)
    with pytest.raises(ValueError, match="no tokens"):
        model.forward(_tokens(0, 0, "cpu"), 0, _caches("cpu", torch.bfloat16), _slots(20, "cpu"))


def _pair(**kwargs: Any) -> tuple[PagedLlama, PagedLlama]:
    """(graphed, eager): one seed, so the same weights."""
    graphed = PagedLlama(SHAPE, device="cuda", **kwargs)
    eager = PagedLlama(SHAPE, device="cuda", cuda_graphs=False)
    assert graphed.cuda_graphs and not eager.cuda_graphs
    assert all(
        torch.equal(a.qkv, b.qkv) and torch.equal(a.down, b.down)
        for a, b in zip(graphed.layers, eager.layers, strict=True)
    )
    return graphed, eager


def _replays_equal_eager(graphed: PagedLlama, eager: PagedLlama, device: str) -> None:
    """Forwards of several counts and starts on both models, each over its own cache: the logits and
    every layer's KV equal bit for bit after each, and the counts up to the bound were captured."""
    kv_g, kv_e = _caches(device, torch.bfloat16), _caches(device, torch.bfloat16)
    slots = _slots(NUM_BLOCKS * BLOCK, device)

    def both(ids: torch.Tensor, start: int) -> torch.Tensor:
        lg = graphed.forward(ids, start, kv_g, slots)
        le = eager.forward(ids, start, kv_e, slots)
        assert torch.equal(lg, le), f"{ids.numel()} tokens at {start}: graph replay != eager"
        for i, (cg, ce) in enumerate(zip(kv_g, kv_e, strict=True)):
            assert torch.equal(cg, ce), f"{ids.numel()} tokens at {start}: layer {i}'s KV differs"
        return lg

    both(_tokens(700, 0, device), 0)  # over the bound: eager on both sides (the tails' prefix)
    assert graphed.graph_sizes == ()
    x, y = _tokens(40, 1, device), _tokens(40, 2, device)
    first = both(x, 700)  # a masked tail over 740 positions: captured, then replayed
    # The same count with other tokens, another start (positions), another context length: a static
    # input left from the replay before would give the first call's inputs.
    other = both(y, 300)
    assert not torch.equal(first, other)
    both(x, 660)  # the first tokens at other positions
    both(x, 700)  # and back (the prefix at 300..340 changed: the context is read, not cached)
    both(_tokens(100, 3, device), 0)  # causal, from position 0
    both(_tokens(1, 4, device), 740)  # one token
    both(_tokens(512, 5, device), 0)  # the bound itself
    assert graphed.graph_sizes == (1, 40, 100, 512)
    both(_tokens(513, 6, device), 0)  # past it: eager
    assert graphed.graph_sizes == (1, 40, 100, 512)
    assert eager.graph_sizes == ()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_replay_equals_eager_bit_for_bit() -> None:
    _replays_equal_eager(*_pair(), "cuda")


class _RerunGraph:
    """Stand-in for a captured CUDA graph, for CPU-only machines (CI has no GPU): ``replay`` runs the
    captured piece again and writes its results into the tensors the capture returned, as a graph
    writes its outputs in place. It checks the pieces' wiring (static inputs refreshed, outputs
    passed on, hooks between pieces); what real capture and replay do on the device is the GPU
    tests' part."""

    def __init__(self, fn: Callable[[], tuple[torch.Tensor, ...]], out: tuple[torch.Tensor, ...]) -> None:
        self.fn, self.out = fn, out

    def replay(self) -> None:
        for old, new in zip(self.out, self.fn(), strict=True):
            old.copy_(new)


class _NoStream:
    def wait_stream(self, other: object) -> None:
        pass


@pytest.fixture
def rerun_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """``kvgrid.bench.ttft.graphs`` on the CPU: captures are :class:`_RerunGraph`, streams do nothing."""

    def capture(fn: Callable[[], tuple[torch.Tensor, ...]], pool: object, what: str) -> tuple[Any, Any]:
        out = fn()
        return _RerunGraph(fn, out), out

    monkeypatch.setattr(graphs, "_capture", capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, 0))
    monkeypatch.setattr(torch.cuda, "Stream", lambda **kwargs: _NoStream())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *args: _NoStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())


def _rerun_model() -> PagedLlama:
    model = PagedLlama(SHAPE)
    model._graphs = graphs.GraphCache(model)  # what the constructor does on CUDA
    return model


@pytest.mark.usefixtures("rerun_graphs")
def test_piece_wiring_on_cpu_equals_eager() -> None:
    _replays_equal_eager(_rerun_model(), PagedLlama(SHAPE), "cpu")


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def before_attention(self, layer: int) -> None:
        self.calls.append(("before", layer))

    def after_attention(self, layer: int, kv: torch.Tensor) -> None:
        self.calls.append(("after", layer))


@pytest.mark.usefixtures("rerun_graphs")
def test_piece_wiring_on_cpu_calls_the_hooks_per_layer() -> None:
    model, hooks = _rerun_model(), _Recorder()
    model.forward(_tokens(30, 0, "cpu"), 0, _caches("cpu", torch.bfloat16), _slots(30, "cpu"), hooks)
    assert model.graph_sizes == (30,)
    assert hooks.calls == [(w, i) for i in range(SHAPE.layers) for w in ("before", "after")]


class _LateLoads:
    """Plays the connector around one forward of the graphed model: layer ``i``'s prefix KV lands in
    the (NaN-poisoned) cache from another stream, late (a sleep kernel before each copy), and
    ``before_attention(i)`` makes the engine's stream wait for it, as ``wait_for_layer_load`` does.
    ``after_attention(i)`` snapshots, on the engine's stream, layer ``i``'s new rows (written by now)
    and layer ``i + 1``'s (not yet)."""

    def __init__(
        self, caches: list[torch.Tensor], prefix: torch.Tensor, saved: list[torch.Tensor], new: torch.Tensor
    ):
        self.caches, self.prefix, self.saved, self.new = caches, prefix, saved, new
        self.stream = torch.cuda.Stream()
        self.events = [torch.cuda.Event() for _ in caches]
        self.calls: list[tuple[str, int]] = []
        self.written: list[torch.Tensor] = []
        self.not_yet: list[torch.Tensor] = []

    def start(self) -> None:
        for cache in self.caches:
            _rows(cache)[self.prefix] = float("nan")
            _rows(cache)[self.new] = float("nan")
        self.stream.wait_stream(torch.cuda.current_stream())  # after the poison
        with torch.cuda.stream(self.stream):
            for cache, saved, event in zip(self.caches, self.saved, self.events, strict=True):
                torch.cuda._sleep(20_000_000)  # ~10 ms on an H200: the forward is queued long before
                _rows(cache)[self.prefix] = saved
                event.record()

    def before_attention(self, layer: int) -> None:
        self.calls.append(("before", layer))
        torch.cuda.current_stream().wait_event(self.events[layer])

    def after_attention(self, layer: int, kv: torch.Tensor) -> None:
        self.calls.append(("after", layer))
        assert kv is self.caches[layer]
        self.written.append(_rows(kv)[self.new].clone())
        if layer + 1 < len(self.caches):
            self.not_yet.append(_rows(self.caches[layer + 1])[self.new].clone())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_hooks_and_late_loads_around_capture_and_replay() -> None:
    """The first forward of the tail's count captures while the loads are in flight on another stream
    and another thread launches copies and synchronizes on events (the connector's threads do);
    the second replays. Both must equal the eager forward over the KV present from the start."""
    graphed, eager = _pair()
    kv_g, kv_e = _caches("cuda", torch.bfloat16), _caches("cuda", torch.bfloat16)
    slots = _slots(600, "cuda")
    tokens = _tokens(600, 7, "cuda")
    graphed.forward(tokens[:560], 0, kv_g, slots)  # the prefix, eager (over the bound)
    eager.forward(tokens[:560], 0, kv_e, slots)
    prefix, new = slots[:560], slots[560:]
    saved = [_rows(c)[prefix].clone() for c in kv_g]
    expected = eager.forward(tokens[560:], 560, kv_e, slots)

    # Another thread's CUDA work during the capture: copies on its own stream, event queries and
    # syncs (forbidden to other threads while a capture in the default "global" mode runs).
    side = torch.cuda.Stream()
    src, dst = torch.ones(1 << 20, device="cuda"), torch.empty(1 << 20, device="cuda")
    done, stop = torch.cuda.Event(), threading.Event()
    errors: list[Exception] = []
    rounds = [0]

    def churn() -> None:
        try:
            while not stop.is_set():
                with torch.cuda.stream(side):
                    dst.copy_(src, non_blocking=True)
                    done.record(side)
                done.query()
                done.synchronize()
                rounds[0] += 1
        except Exception as e:  # reported below: the test's thread must see it
            errors.append(e)

    thread = threading.Thread(target=churn, daemon=True)
    thread.start()
    try:
        for attempt in ("capture", "replay"):
            hooks = _LateLoads(kv_g, prefix, saved, new)
            hooks.start()
            got = graphed.forward(tokens[560:], 560, kv_g, slots, hooks)
            assert graphed.graph_sizes == (40,)
            assert hooks.calls == [(w, i) for i in range(SHAPE.layers) for w in ("before", "after")], attempt
            assert torch.equal(got, expected), f"{attempt}: the tail's logits differ from eager's"
            assert all(torch.isfinite(w).all() for w in hooks.written), (
                f"{attempt}: new KV not written by then"
            )
            assert all(torch.isnan(n).all() for n in hooks.not_yet), f"{attempt}: the next layer's KV early"
    finally:
        stop.set()
        thread.join(30)
    assert errors == [], errors
    assert rounds[0] > 0


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("graphs", ["true", "false"])
def test_bench_captures_the_tail_or_nothing(capsys: pytest.CaptureFixture[str], graphs: str) -> None:
    """``kvgrid bench ttft`` with and without ``--cuda-graphs``: its bit-exact checks pass (hit ==
    tail reference, miss == full prefill) and the forwards it captured are the miss (300 tokens) and
    the tail (44), or none."""
    argv = ["bench", "ttft", "--device", "cuda", "--model", "tiny", "--prompts", "300", "--chunk-size", "64",
            "--iters", "1", "--json", "--cuda-graphs", graphs]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["failures"] == []
    assert result["cuda_graphs"] is (graphs == "true")
    assert result["graph_sizes"] == ([44, 300] if graphs == "true" else [])
