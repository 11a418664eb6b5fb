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
* ``hooks`` see each layer in order: ``before_attention(i)`` before layer ``i`` reads the cache
  (where vLLM calls ``wait_for_layer_load``), ``after_attention(i)`` once its KV is written and its
  attention ran (where vLLM calls ``save_kv_layer``).
"""

from __future__ import annotations

from typing import Protocol

import msgspec
import torch
import torch.nn.functional as F

__all__ = ["LLAMA3_8B", "LayerHooks", "ModelShape", "PagedLlama", "layer_name"]


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


LLAMA3_8B = ModelShape(
    layers=32, hidden=4096, heads=32, kv_heads=8, head_size=128, intermediate=14336, vocab=128256
)


def layer_name(i: int) -> str:
    """vLLM's name of layer ``i``'s attention (what the connector keys layers by)."""
    return f"model.layers.{i}.self_attn.attn"


class LayerHooks(Protocol):
    def before_attention(self, layer: int) -> None: ...
    def after_attention(self, layer: int, kv: torch.Tensor) -> None: ...


class _Layer:
    def __init__(self, s: ModelShape, gen: torch.Generator, device: torch.device, dtype: torch.dtype) -> None:
        def w(rows: int, cols: int) -> torch.Tensor:
            # N(0, 1/cols): activations keep their scale through the layers.
            t = torch.randn(rows, cols, generator=gen, device=device, dtype=torch.float32)
            return (t / cols**0.5).to(dtype)

        q, kv = s.heads * s.head_size, s.kv_heads * s.head_size
        self.qkv = w(q + 2 * kv, s.hidden)
        self.o = w(s.hidden, q)
        self.gate_up = w(2 * s.intermediate, s.hidden)
        self.down = w(s.hidden, s.intermediate)
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
    ) -> None:
        shape.check()
        self.shape = shape
        self.device = torch.device(device)
        self.dtype = dtype
        gen = torch.Generator(device=self.device).manual_seed(seed)
        self.embed = torch.randn(shape.vocab, shape.hidden, generator=gen, device=self.device).to(dtype)
        self.layers = [_Layer(shape, gen, self.device, dtype) for _ in range(shape.layers)]
        self.final_norm = torch.ones(shape.hidden, device=self.device, dtype=dtype)
        self.lm_head = (
            torch.randn(shape.vocab, shape.hidden, generator=gen, device=self.device) / shape.hidden**0.5
        ).to(dtype)
        half = shape.head_size // 2
        self._inv_freq = 1.0 / (
            shape.rope_theta ** (torch.arange(half, device=self.device, dtype=torch.float32) / half)
        )

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotary embedding (Llama's rotate-half form) of ``x`` [T, heads, head_size]."""
        freqs = positions.to(torch.float32)[:, None] * self._inv_freq[None, :]
        cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
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
        s = self.shape
        n = token_ids.numel()
        end = start + n
        if slots.numel() < end:
            raise ValueError(f"forward: {slots.numel()} slots for positions [0, {end}); expected {end}")
        if len(kv_caches) != s.layers:
            raise ValueError(f"forward: {len(kv_caches)} KV caches for {s.layers} layers")
        positions = torch.arange(start, end, device=self.device)
        new_slots, ctx_slots = slots[start:end], slots[:end]
        mask = None
        if start:  # queries at start.. see keys 0..their own position
            mask = torch.arange(end, device=self.device)[None, :] <= positions[:, None]
        q_size, kv_size = s.heads * s.head_size, s.kv_heads * s.head_size
        h = self.embed[token_ids]
        for i, layer in enumerate(self.layers):
            x = self._norm(h, layer.norm1)
            q, k, v = (x @ layer.qkv.T).split((q_size, kv_size, kv_size), dim=-1)
            q = self._rope(q.view(n, s.heads, s.head_size), positions)
            k = self._rope(k.view(n, s.kv_heads, s.head_size), positions)
            if hooks is not None:
                hooks.before_attention(i)
            cache = kv_caches[i]
            # The view is logically [NB, H, BS, C] and stored [NB, BS, H, C]: slots are rows.
            stored = cache.permute(0, 2, 1, 3)
            if not stored.is_contiguous():
                raise ValueError(
                    f"layer {i}: KV cache of shape {tuple(cache.shape)} strides {cache.stride()} is not "
                    f"stored [blocks, slots, heads, 2*head_size] (vLLM's LBNHC view)"
                )
            flat = stored.view(-1, s.kv_heads, 2 * s.head_size)
            flat[new_slots] = torch.cat((k, v.view(n, s.kv_heads, s.head_size)), dim=-1)
            ctx = flat[ctx_slots]
            keys = ctx[..., : s.head_size].transpose(0, 1)[None]
            values = ctx[..., s.head_size :].transpose(0, 1)[None]
            gqa = True
            if mask is not None and self.device.type == "cuda":
                # A masked tail on CUDA: the memory-efficient kernel takes a mask but not enable_gqa
                # (torch would fall back to the math kernel), so repeat the KV heads instead.
                # Unmeasured so far (no GPU in the session that wrote it).
                rep = s.heads // s.kv_heads
                keys, values, gqa = keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1), False
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], keys, values, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa
            )
            if hooks is not None:
                hooks.after_attention(i, cache)
            h = h + out[0].transpose(0, 1).reshape(n, q_size) @ layer.o.T
            x = self._norm(h, layer.norm2)
            gate, up = (x @ layer.gate_up.T).chunk(2, dim=-1)
            h = h + (F.silu(gate) * up) @ layer.down.T
        return (self._norm(h[-1:], self.final_norm) @ self.lm_head.T)[0].float()
