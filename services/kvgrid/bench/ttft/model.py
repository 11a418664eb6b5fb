"""A Llama-shaped decoder with random weights over a paged KV cache in vLLM's layout.

The KV of layer ``i`` is vLLM 0.32's own per-layer view (``create_kv_cache_views`` with
``KVCacheLayout.LBNHC``): logical ``[num_blocks, kv_heads, block_size, 2 * head_size]``, stored
``[num_blocks, block_size, kv_heads, 2 * head_size]``, K then V in the last dimension.

Invariants:

* :meth:`PagedLlama.forward` over positions ``[start, end)`` first writes those tokens' K/V into
  the slots ``slots`` names, then attends over positions ``[0, end)`` *read back from the cache*
  (torch SDPA over the gathered slots). KV the agent scattered into the cache is therefore used
  exactly like KV computed here: the same bytes give the same attention inputs.
* Weights come from one seeded generator: a model of one :class:`ModelShape` and seed is the same
  model in every process.
* Tensor parallelism (``tp_size`` > 1, Megatron-style as vLLM shards Llama): rank ``r`` holds query
  heads, KV heads and MLP columns ``[r * n / tp, (r + 1) * n / tp)`` (column-parallel QKV and
  gate/up, row-parallel o and down) sliced from the *full* seeded weights, so every ``tp`` is the
  same model: a rank's KV is exactly its KV heads' slice of the TP=1 model's, and logits differ from
  TP=1's only by the reduction order. The partial sums of o and down are all-reduced over
  ``torch.distributed``'s default group (gloo on CPU, NCCL on CUDA), so the residual stream and the
  logits are replicated on every rank. Embedding and LM head are replicated (not vocab-parallel).
  ``shard`` is the rank's geometry (what its attention and KV cache see), ``shape`` the model's.
  With ``tp_size`` > 1 CUDA graphs are off (an all-reduce inside a captured graph would need NCCL
  graph capture, which the piecewise graphs do not set up): every forward runs eager.
* ``hooks`` see each layer in order: ``before_attention(i)`` before layer ``i`` reads the cache
  (where vLLM calls ``wait_for_layer_load``), ``after_attention(i)`` once its KV is written and its
  attention ran (where vLLM calls ``save_kv_layer``).
* On CUDA (``cuda_graphs``, the default there) a forward of at most ``graph_max_tokens`` tokens runs
  as vLLM runs such sizes: piecewise CUDA graphs around an eager attention (:mod:`kvgrid.bench.ttft.graphs`),
  the hooks where they are above. Its results equal the eager forward's bit for bit; longer
  forwards stay eager. Whether a forward is replayed depends only on its token count, so two
  forwards of the same count always take the same path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import torch
import torch.distributed as dist
import torch.nn.functional as F

from kvgrid.bench.ttft.graphs import Attention, GraphCache

__all__ = ["LLAMA3_8B", "LayerHooks", "ModelShape", "PackedBatch", "PagedLlama", "layer_name"]


class ModelShape(msgspec.Struct, frozen=True, kw_only=True):
    """A Llama decoder's geometry (``LLAMA3_8B`` is Llama-3-8B's)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_size: int
    intermediate: int
    vocab: int
    rope_theta: float = 500_000.0

    def check(self) -> None:
        for field in ("layers", "hidden", "heads", "kv_heads", "head_size", "intermediate", "vocab"):
            if getattr(self, field) < 1:
                raise ValueError(f"model shape: {field}={getattr(self, field)}; expected >= 1")
        if self.heads % self.kv_heads:
            raise ValueError(f"model shape: heads={self.heads} is not a multiple of kv_heads={self.kv_heads}")
        if self.head_size % 2:
            raise ValueError(f"model shape: head_size={self.head_size}; expected an even size (RoPE)")

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return self.layers * 2 * self.kv_heads * self.head_size * dtype.itemsize

    def check_tp(self, tp_size: int) -> None:
        """ValueError naming ``tp_size`` unless it divides heads, kv_heads and intermediate."""
        if tp_size < 1:
            raise ValueError(f"tp={tp_size}; expected >= 1")
        for field in ("heads", "kv_heads", "intermediate"):
            if getattr(self, field) % tp_size:
                raise ValueError(
                    f"tp={tp_size} does not divide the model's {field}={getattr(self, field)}; expected "
                    f"a divisor of heads={self.heads}, kv_heads={self.kv_heads} and "
                    f"intermediate={self.intermediate}"
                )

    def sharded(self, tp_size: int) -> ModelShape:
        """One tensor-parallel rank's geometry: heads, kv_heads and intermediate divided by ``tp_size``."""
        self.check_tp(tp_size)
        return msgspec.structs.replace(
            self,
            heads=self.heads // tp_size,
            kv_heads=self.kv_heads // tp_size,
            intermediate=self.intermediate // tp_size,
        )


LLAMA3_8B = ModelShape(
    layers=32, hidden=4096, heads=32, kv_heads=8, head_size=128, intermediate=14336, vocab=128256
)


def layer_name(i: int) -> str:
    """vLLM's name of layer ``i``'s attention (what the connector keys layers by)."""
    return f"model.layers.{i}.self_attn.attn"


class LayerHooks(Protocol):
    def before_attention(self, layer: int) -> None: ...
    def after_attention(self, layer: int, kv: torch.Tensor) -> None: ...


@dataclass(frozen=True)
class PackedBatch:
    """One scheduler step's tokens of several requests, packed as vLLM's runner packs them.

    Request ``r`` computes positions ``[starts[r], starts[r] + counts[r])``; its rows are
    ``[query_start[r], query_start[r + 1])`` of the packed tensors. Rows past ``query_start[-1]``
    (up to ``len(token_ids)``) are padding for a captured graph's size: position 0, slot 0 (vLLM's
    null block, never given to a request), and no request reads them.
    """

    token_ids: torch.Tensor
    """``[T]`` int64 on the model's device."""
    positions: torch.Tensor
    """``[T]`` int64 on the model's device."""
    new_slots: torch.Tensor
    """``[T]``: the cache slot each row's KV is written to."""
    starts: tuple[int, ...]
    counts: tuple[int, ...]
    query_start: torch.Tensor
    """``[R + 1]`` int32 on the device: the row offsets above (vLLM's ``cu_seqlens_q``)."""
    seq_lens: torch.Tensor
    """``[R]`` int32 on the device: ``starts + counts`` (the context each request attends over)."""
    block_table: torch.Tensor
    """``[R, max blocks]`` int32 on the device: each request's blocks, zero-padded."""
    ctx_slots: tuple[torch.Tensor, ...]
    """Per request the slots of positions ``[0, starts[r] + counts[r])`` (the per-request path)."""
    logit_rows: torch.Tensor
    """Rows whose logits the step returns (each sampling request's last row), int64 on the device."""

    @property
    def rows(self) -> int:
        """Real (unpadded) rows."""
        return sum(self.counts)


class _Layer:
    """One layer's weights: the full model's, drawn in the same order for every ``tp``, then rank
    ``rank``'s slices (module docstring); with ``tp`` = 1 the full weights themselves."""

    def __init__(
        self,
        s: ModelShape,
        gen: torch.Generator,
        device: torch.device,
        dtype: torch.dtype,
        rank: int,
        tp: int,
    ) -> None:
        def w(rows: int, cols: int) -> torch.Tensor:
            # N(0, 1/cols): activations keep their scale through the layers.
            t = torch.randn(rows, cols, generator=gen, device=device, dtype=torch.float32)
            return (t / cols**0.5).to(dtype)

        def part(n: int) -> slice:  # rank's slice of n rows or columns
            return slice(rank * n // tp, (rank + 1) * n // tp)

        q, kv, inter = s.heads * s.head_size, s.kv_heads * s.head_size, s.intermediate
        qkv = w(q + 2 * kv, s.hidden)  # rows: q heads | k heads | v heads
        self.qkv = torch.cat((qkv[:q][part(q)], qkv[q : q + kv][part(kv)], qkv[q + kv :][part(kv)]))
        self.o = w(s.hidden, q)[:, part(q)].contiguous()
        gate_up = w(2 * inter, s.hidden)  # rows: gate | up
        self.gate_up = torch.cat((gate_up[:inter][part(inter)], gate_up[inter:][part(inter)]))
        self.down = w(s.hidden, inter)[:, part(inter)].contiguous()
        self.norm1 = torch.ones(s.hidden, device=device, dtype=dtype)
        self.norm2 = torch.ones(s.hidden, device=device, dtype=dtype)


class PagedLlama:
    """Random-weight Llama decoder; ``forward`` runs one request's tokens (module docstring)."""

    def __init__(
        self,
        shape: ModelShape,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.bfloat16,
        seed: int = 0,
        cuda_graphs: bool = True,
        graph_max_tokens: int = 512,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        """``cuda_graphs``: on CUDA, run forwards of at most ``graph_max_tokens`` tokens as piecewise
        CUDA graphs (module docstring); ignored on CPU and with ``tp_size`` > 1. ``tp_rank`` of
        ``tp_size``: hold that rank's shard; forwards then all-reduce over the default process group,
        which every rank must have initialised (module docstring)."""
        shape.check()
        if graph_max_tokens < 0:
            raise ValueError(f"graph_max_tokens={graph_max_tokens}; expected >= 0 (0: never capture)")
        self.shard = shape.sharded(tp_size)
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank={tp_rank}; expected 0 <= tp_rank < tp_size={tp_size}")
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.shape = shape
        self.device = torch.device(device)
        self.dtype = dtype
        gen = torch.Generator(device=self.device).manual_seed(seed)
        self.embed = torch.randn(shape.vocab, shape.hidden, generator=gen, device=self.device).to(dtype)
        self.layers = [_Layer(shape, gen, self.device, dtype, tp_rank, tp_size) for _ in range(shape.layers)]
        self.final_norm = torch.ones(shape.hidden, device=self.device, dtype=dtype)
        self.lm_head = (
            torch.randn(shape.vocab, shape.hidden, generator=gen, device=self.device) / shape.hidden**0.5
        ).to(dtype)
        half = shape.head_size // 2
        self._inv_freq = 1.0 / (
            shape.rope_theta ** (torch.arange(half, device=self.device, dtype=torch.float32) / half)
        )
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda" and tp_size == 1
        self.graph_max_tokens = graph_max_tokens
        self._graphs = GraphCache(self) if self.cuda_graphs else None

    @property
    def graph_sizes(self) -> tuple[int, ...]:
        """Token counts whose forward has been captured (replayed from then on), ascending."""
        return self._graphs.sizes() if self._graphs is not None else ()

    # The pieces of a forward. Eager forwards and graph captures call the same methods in the same
    # order, so a replay runs the kernels an eager forward runs on the same shapes (bit-exact).

    def rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's cos and sin (float32 ``[T, 1, head_size / 2]``) at ``positions``, once per forward."""
        freqs = positions.to(torch.float32)[:, None] * self._inv_freq[None, :]
        return freqs.cos()[:, None, :], freqs.sin()[:, None, :]

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.embed)

    def project(
        self, i: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s norm, QKV projection and RoPE: (q ``[T, heads, head_size]``, a strided view;
        the new KV ``[T, kv_heads, 2 * head_size]``, K then V as the cache stores it)."""
        s, layer = self.shard, self.layers[i]
        heads = (self._norm(h, layer.norm1) @ layer.qkv.T).view(h.shape[0], -1, s.head_size)
        qk = self._rope(heads[:, : s.heads + s.kv_heads], cos, sin)  # q's and k's heads in one go
        kv = torch.cat((qk[:, s.heads :], heads[:, s.heads + s.kv_heads :]), dim=-1)
        return qk[:, : s.heads], kv

    def mlp(self, i: int, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Layer ``i`` after attention (``attn`` ``[T, heads * head_size]``, contiguous): o-proj,
        residual, norm, MLP, residual."""
        layer = self.layers[i]
        h = h + self._reduce(attn @ layer.o.T)
        gate, up = (self._norm(h, layer.norm2) @ layer.gate_up.T).chunk(2, dim=-1)
        return h + self._reduce((F.silu(gate) * up) @ layer.down.T)

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of a row-parallel projection's partial result (itself with tp = 1)."""
        if self.tp_size > 1:
            dist.all_reduce(partial)
        return partial

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """The last row's logits, in the model's dtype (``[vocab]``)."""
        return (self._norm(h[-1:], self.final_norm) @ self.lm_head.T)[0]

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary embedding (Llama's rotate-half form) of ``x`` [T, heads, head_size]."""
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    @staticmethod
    def _norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, eps=1e-5)

    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor,
        start: int,
        kv_caches: list[torch.Tensor],
        slots: torch.Tensor,
        hooks: LayerHooks | None = None,
    ) -> torch.Tensor:
        """Run tokens at positions ``[start, start + len(token_ids))``; ``slots`` [end] gives the
        cache slot (block * block_size + offset) of every position from 0. Returns the last
        token's logits (float32, [vocab])."""
        s = self.shard
        n = token_ids.numel()
        end = start + n
        if n < 1:
            raise ValueError("forward: no tokens; expected at least 1")
        if slots.numel() < end:
            raise ValueError(f"forward: {slots.numel()} slots for positions [0, {end}); expected {end}")
        if len(kv_caches) != s.layers:
            raise ValueError(f"forward: {len(kv_caches)} KV caches for {s.layers} layers")
        token_ids = token_ids.to(self.device)
        positions = torch.arange(start, end, device=self.device)
        mask = None
        if start:  # queries at start.. see keys 0..their own position
            mask = torch.arange(end, device=self.device)[None, :] <= positions[:, None]
        attention = _Attention(self, kv_caches, slots[start:end], slots[:end], mask, hooks)
        if self._graphs is not None and n <= self.graph_max_tokens:
            return self._graphs.get(n).run(token_ids, positions, attention).float()
        return self.head(self._eager(token_ids, positions, attention)).float()

    def _eager(self, token_ids: torch.Tensor, positions: torch.Tensor, attention: Attention) -> torch.Tensor:
        """Every layer eagerly (the pieces the graphs capture, in the same order): the last layer's
        output for every row."""
        s, n = self.shard, token_ids.numel()
        cos, sin = self.rope_tables(positions)
        h = self.embed_tokens(token_ids)
        q, kv = self.project(0, h, cos, sin)
        for i in range(s.layers):
            out = attention(i, q.contiguous(), kv)
            h = self.mlp(i, h, out.reshape(n, s.heads * s.head_size))
            if i + 1 < s.layers:
                q, kv = self.project(i + 1, h, cos, sin)
        return h

    @torch.inference_mode()
    def forward_batch(
        self, batch: PackedBatch, kv_caches: list[torch.Tensor], hooks: LayerHooks | None = None
    ) -> torch.Tensor:
        """One scheduler step over several requests (:class:`PackedBatch`): projections and MLP over
        all packed rows at once, attention per request over its paged context (vLLM's Triton
        varlen kernel on CUDA, SDPA per request on CPU). Returns the logits of ``batch.logit_rows``
        (float32, ``[len(logit_rows), vocab]``). On CUDA a batch of at most ``graph_max_tokens``
        rows replays piecewise graphs of its padded size, as :meth:`forward` does."""
        s = self.shard
        n = batch.token_ids.numel()
        if len(kv_caches) != s.layers:
            raise ValueError(f"forward_batch: {len(kv_caches)} KV caches for {s.layers} layers")
        attention = _BatchAttention(self, kv_caches, batch, hooks)
        if self._graphs is not None and n <= self.graph_max_tokens:
            h = self._graphs.get(n, all_rows=True).run(batch.token_ids, batch.positions, attention)
        else:
            h = self._eager(batch.token_ids, batch.positions, attention)
        return self.head_rows(h, batch.logit_rows)

    def head_rows(self, h: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Logits (float32) of the hidden states ``h[rows]``."""
        return (self._norm(h.index_select(0, rows), self.final_norm) @ self.lm_head.T).float()


class _Attention:
    """One forward's attention of layer ``i`` over the paged cache, eager in every mode (it depends on
    the slots and the context length): the hooks, the cache write of the new KV, the gather of
    positions ``[0, end)`` and SDPA. Returns ``[T, heads, head_size]`` (a strided view)."""

    def __init__(
        self,
        model: PagedLlama,
        kv_caches: list[torch.Tensor],
        new_slots: torch.Tensor,
        ctx_slots: torch.Tensor,
        mask: torch.Tensor | None,
        hooks: LayerHooks | None,
    ) -> None:
        self.model, self.kv_caches, self.hooks = model, kv_caches, hooks
        self.new_slots, self.ctx_slots, self.mask = new_slots, ctx_slots, mask
        self.bias: torch.Tensor | None = None

    def __call__(self, i: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        s, mask = self.model.shard, self.mask
        if self.hooks is not None:
            self.hooks.before_attention(i)
        cache = self.kv_caches[i]
        # The view is logically [NB, H, BS, C] and stored [NB, BS, H, C]: slots are rows.
        stored = cache.permute(0, 2, 1, 3)
        if not stored.is_contiguous():
            raise ValueError(
                f"layer {i}: KV cache of shape {tuple(cache.shape)} strides {cache.stride()} is not "
                f"stored [blocks, slots, heads, 2*head_size] (vLLM's LBNHC view)"
            )
        flat = stored.view(-1, s.kv_heads, 2 * s.head_size)
        flat[self.new_slots] = kv
        ctx = flat[self.ctx_slots]
        keys = ctx[..., : s.head_size].transpose(0, 1)[None]
        values = ctx[..., s.head_size :].transpose(0, 1)[None]
        if mask is not None and self.model.device.type == "cuda":
            if self.bias is None:  # once per forward (the first layer)
                self.bias = tail_bias(mask, s.heads // s.kv_heads, q.dtype)
            out = masked_gqa_attention(q, keys, values, self.bias)
        else:
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], keys, values, attn_mask=mask, is_causal=mask is None, enable_gqa=True
            )[0].transpose(0, 1)
        if self.hooks is not None:
            self.hooks.after_attention(i, cache)
        return out


def tail_bias(mask: torch.Tensor, rep: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive bias of :func:`masked_gqa_attention` for a tail's ``mask`` [T, L] (True: attend):
    [rep * T, L], 0 or -inf, row r*T + t = ``mask[t]``. Built once per forward: stored with its last
    dimension padded to a multiple of 16, as the memory-efficient kernel wants, so SDPA neither
    converts nor pads it again in every layer."""
    t, length = mask.shape
    bias = torch.full((rep * t, -(-length // 16) * 16), float("-inf"), dtype=dtype, device=mask.device)
    view = bias[:, :length]
    view.masked_fill_(mask.repeat(rep, 1), 0.0)
    return view


def masked_gqa_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    """Attention of ``q`` [T, heads, D] over ``keys``/``values`` [1, kv_heads, L, D] under ``bias``
    (:func:`tail_bias`), query head h reading KV head h // (heads / kv_heads) as in GQA; returns
    [T, heads, D] (a strided view).

    Why not SDPA's ``enable_gqa``: with a mask on CUDA only the memory-efficient kernel applies, and
    it takes no ``enable_gqa`` (torch falls back to the math kernel). Repeating the KV heads instead
    moved (heads / kv_heads) x the context's KV per layer (at 32k tokens of Llama-3-8B, ~16 GB per
    forward), which no engine's paged attention does. So the query heads that share a KV head are
    stacked along the query axis: plain multi-head attention over the KV heads as they are."""
    t, heads, d = q.shape
    kv_heads = keys.shape[1]
    stacked = q.transpose(0, 1).reshape(kv_heads, heads // kv_heads * t, d)[None]  # row r*T+t: head kvh*rep+r
    out = F.scaled_dot_product_attention(stacked, keys, values, attn_mask=bias)
    return out[0].reshape(heads, t, d).transpose(0, 1)  # the kernel may answer it strided


def _vllm_unified_attention() -> Any:
    """vLLM's ``unified_attention`` from its Python sources, compiled by the Triton found here.

    The harness runs vLLM's CPU build's sources on the GPU too (no vLLM wheel there); that build
    turns Triton off unless Triton has a CPU backend, so ``vllm.triton_utils`` is pointed at the real
    Triton before the kernel's module is first imported (it binds ``triton`` and ``tl`` then)."""
    import sys

    name = "vllm.v1.attention.ops.triton_unified_attention"
    if name not in sys.modules:
        import triton
        import triton.language as tl
        import vllm.triton_utils as tu

        if not tu.HAS_TRITON:
            from triton.language.extra import libdevice

            tu.triton, tu.tl, tu.tldevice, tu.HAS_TRITON = triton, tl, libdevice, True
            for helper in ("vllm.v1.attention.ops.triton_attention_helpers",):
                if helper in sys.modules:  # bound the placeholders: import it again
                    del sys.modules[helper]
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention

    return unified_attention


def _stored(cache: torch.Tensor, layer: int, kv_heads: int, head_size: int) -> torch.Tensor:
    """Layer ``layer``'s cache as stored, ``[blocks, block_size, kv_heads, 2 * head_size]``."""
    stored = cache.permute(0, 2, 1, 3)
    if not stored.is_contiguous():
        raise ValueError(
            f"layer {layer}: KV cache of shape {tuple(cache.shape)} strides {cache.stride()} is not "
            f"stored [blocks, slots, heads, 2*head_size] (vLLM's LBNHC view)"
        )
    return stored


class _BatchAttention:
    """One step's attention of layer ``i`` over several requests' paged KV: the hooks, the cache
    write of every row's new KV, then per request attention over positions ``[0, seq_len)``.

    On CUDA vLLM's ``unified_attention`` (its Triton kernel for varlen queries over a block table,
    the one its Triton backend runs) does all requests in one launch; elsewhere SDPA runs per
    request over the gathered slots. Padding rows get zeros."""

    def __init__(
        self, model: PagedLlama, kv_caches: list[torch.Tensor], batch: PackedBatch, hooks: LayerHooks | None
    ) -> None:
        self.model, self.kv_caches, self.batch, self.hooks = model, kv_caches, batch, hooks
        self.triton = model.device.type == "cuda"
        self.max_q = max(batch.counts, default=0)
        self.max_k = max((a + b for a, b in zip(batch.starts, batch.counts, strict=True)), default=0)

    def __call__(self, i: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        s, b = self.model.shard, self.batch
        if self.hooks is not None:
            self.hooks.before_attention(i)
        cache = self.kv_caches[i]
        stored = _stored(cache, i, s.kv_heads, s.head_size)
        flat = stored.view(-1, s.kv_heads, 2 * s.head_size)
        flat[b.new_slots] = kv
        out = torch.zeros_like(q)
        rows = b.rows
        if self.triton:
            unified_attention = _vllm_unified_attention()
            unified_attention(
                q=q[:rows], k=stored[..., : s.head_size], v=stored[..., s.head_size :], out=out[:rows],
                cu_seqlens_q=b.query_start, max_seqlen_q=self.max_q, seqused_k=b.seq_lens,
                max_seqlen_k=self.max_k, softmax_scale=s.head_size**-0.5, causal=True,
                window_size=(-1, -1), block_table=b.block_table, softcap=0, q_descale=None,
                k_descale=None, v_descale=None,
            )  # fmt: skip
        else:
            row = 0
            for start, count, slots in zip(b.starts, b.counts, b.ctx_slots, strict=True):
                ctx = flat[slots]
                keys = ctx[..., : s.head_size].transpose(0, 1)[None]
                values = ctx[..., s.head_size :].transpose(0, 1)[None]
                mask = None
                if start:  # queries at start.. see keys 0..their own position
                    end = start + count
                    mask = (
                        torch.arange(end, device=q.device)[None, :]
                        <= torch.arange(start, end, device=q.device)[:, None]
                    )
                out[row : row + count] = F.scaled_dot_product_attention(
                    q[row : row + count].transpose(0, 1)[None], keys, values, attn_mask=mask,
                    is_causal=mask is None, enable_gqa=True,
                )[0].transpose(0, 1)  # fmt: skip
                row += count
        if self.hooks is not None:
            self.hooks.after_attention(i, cache)
        return out
