"""Piecewise CUDA graphs for :class:`~kvgrid.bench.ttft.model.PagedLlama`'s short forwards (vLLM's scheme).

A forward of ``n`` tokens (``n <= graph_max_tokens``) is cut at every attention: ``layers + 1``
graphs, captured the first time ``n`` is seen, replayed from then on, with the attention of each
layer eager between them (it depends on the slots and the context length, and the connector's
hooks wait on events and start copies there):

* piece 0: embedding of the static token ids, RoPE tables of the static positions, layer 0's norm,
  QKV projection and RoPE;
* piece ``i`` (``1 <= i < layers``): layer ``i - 1``'s o-proj, residual, norm, MLP, residual, then
  layer ``i``'s norm, QKV projection and RoPE;
* piece ``layers``: the last layer's rest, the final norm and the last row's logits.

Invariants:

* Static inputs live outside the graph pool and are written only by copies on the current stream
  before the replay that reads them: the token ids and positions (so one ``n`` serves every
  ``start``), the attention output of the layer before. Each piece but the last ends by copying its
  q and new KV into static outputs that the eager attention reads. Nothing else crosses a piece
  boundary except the hidden state and the RoPE tables, which are pool tensors written and read by
  the pieces of one forward, in capture order.
* One pool serves every piece of every ``n``: pool memory carries nothing from one forward to the
  next (the logits are copied out by the caller's ``.float()`` before another replay can run, all on
  one stream), so captures may reuse each other's blocks; forwards run one at a time.
* Capture runs on the model's own side stream in ``thread_local`` error mode: the connector's
  threads (loads, stores, leases) keep launching copies, querying events and allocating on their
  streams meanwhile, which ``global`` mode would forbid them; the capturing thread itself makes no
  synchronising call. Each piece runs once eagerly on the side stream before its capture (cuBLAS
  handles and workspaces are created outside any capture), then the current stream waits for the
  side stream. No ``torch.cuda.synchronize`` or ``empty_cache`` (``torch.cuda.graph`` does both):
  loads in flight on other streams are neither waited for nor disturbed.
* A replay runs the kernels the eager path runs on the same shapes (the model's piece methods are
  what gets captured), so its results equal an eager forward's bit for bit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

    from kvgrid.bench.ttft.model import PagedLlama

__all__ = ["Attention", "GraphCache", "PiecewiseGraphs"]

Attention = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]
"""Layer ``i``'s eager attention: (i, q ``[n, heads, head_size]``, new KV) -> ``[n, heads, head_size]``."""


def _capture(
    fn: Callable[[], tuple[torch.Tensor, ...]], pool: _POOL_HANDLE, what: str
) -> tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]:
    """Warm ``fn`` up eagerly, then capture it into a new graph from ``pool``; the current stream
    must be the capture stream. Returns the graph and the (pool) tensors it writes."""
    fn()
    graph = torch.cuda.CUDAGraph()
    graph.capture_begin(pool=pool, capture_error_mode="thread_local")
    try:
        out = fn()
    except BaseException as e:
        # End the capture so the stream is usable again; the original error is the one to see.
        with contextlib.suppress(RuntimeError):
            graph.capture_end()
        raise RuntimeError(
            f"CUDA graph capture of {what} failed ({e}); PagedLlama(cuda_graphs=False) or "
            f"'kvgrid bench ttft --cuda-graphs false' runs every forward eager"
        ) from e
    graph.capture_end()
    return graph, out


class PiecewiseGraphs:
    """The ``layers + 1`` graphs of a forward of ``n`` tokens and their static buffers (module
    docstring)."""

    def __init__(
        self, model: PagedLlama, n: int, pool: _POOL_HANDLE, stream: torch.cuda.Stream, all_rows: bool = False
    ) -> None:
        """``all_rows``: the last piece ends at the last layer's output for every row (a batch's
        logits are taken from several rows, eagerly); else at the last row's logits."""
        s, dev = model.shape, model.device
        self.n = n
        # Static inputs and outputs, allocated on the current stream outside the pool.
        self.tokens = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.arange(n, dtype=torch.int64, device=dev)
        self.attn = torch.zeros(n, s.heads * s.head_size, dtype=model.dtype, device=dev)
        self.q = torch.zeros(n, s.heads, s.head_size, dtype=model.dtype, device=dev)
        self.kv = torch.zeros(n, s.kv_heads, 2 * s.head_size, dtype=model.dtype, device=dev)
        self.graphs: list[torch.cuda.CUDAGraph] = []

        def first() -> tuple[torch.Tensor, ...]:
            cos, sin = model.rope_tables(self.positions)
            h = model.embed_tokens(self.tokens)
            q, kv = model.project(0, h, cos, sin)
            self.q.copy_(q)
            self.kv.copy_(kv)
            return h, cos, sin

        def middle(i: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
            h = model.mlp(i - 1, h, self.attn)
            q, kv = model.project(i, h, cos, sin)
            self.q.copy_(q)
            self.kv.copy_(kv)
            return (h,)

        def final(h: torch.Tensor) -> tuple[torch.Tensor, ...]:
            out = model.mlp(s.layers - 1, h, self.attn)
            return (out if all_rows else model.head(out),)

        stream.wait_stream(torch.cuda.current_stream())  # the static buffers' initialisation
        with torch.cuda.stream(stream):
            graph, (h, cos, sin) = _capture(first, pool, f"piece 0 of {n} tokens")
            self.graphs.append(graph)
            for i in range(1, s.layers):
                graph, (h,) = _capture(partial(middle, i, h, cos, sin), pool, f"piece {i} of {n} tokens")
                self.graphs.append(graph)
            graph, (self.logits,) = _capture(partial(final, h), pool, f"piece {s.layers} of {n} tokens")
            self.graphs.append(graph)
        # The warm-ups wrote the static buffers on the side stream: replays come after them.
        torch.cuda.current_stream().wait_stream(stream)

    def run(self, token_ids: torch.Tensor, positions: torch.Tensor, attention: Attention) -> torch.Tensor:
        """One forward: copy the inputs in, replay piece by piece with ``attention`` between; the last
        row's logits, or every row's output with ``all_rows`` (a pool tensor the next replay
        overwrites: use it before another forward)."""
        if token_ids.shape != self.tokens.shape or positions.shape != self.positions.shape:
            raise ValueError(
                f"graphs of {self.n} tokens: got {tuple(token_ids.shape)} token ids and "
                f"{tuple(positions.shape)} positions; expected ({self.n},) each"
            )
        self.tokens.copy_(token_ids)
        self.positions.copy_(positions)
        attn = self.attn.view(self.q.shape)
        self.graphs[0].replay()
        for i, graph in enumerate(self.graphs[1:]):
            attn.copy_(attention(i, self.q, self.kv))
            graph.replay()
        return self.logits


class GraphCache:
    """A model's :class:`PiecewiseGraphs` by token count, captured lazily, one pool and one capture
    stream for all."""

    def __init__(self, model: PagedLlama) -> None:
        self.model = model
        self._by_n: dict[tuple[int, bool], PiecewiseGraphs] = {}
        self._pool: _POOL_HANDLE | None = None
        self._stream: torch.cuda.Stream | None = None

    def sizes(self) -> tuple[int, ...]:
        return tuple(sorted({n for n, _ in self._by_n}))

    def get(self, n: int, all_rows: bool = False) -> PiecewiseGraphs:
        graphs = self._by_n.get((n, all_rows))
        if graphs is None:
            if self._pool is None or self._stream is None:
                self._pool = torch.cuda.graph_pool_handle()
                self._stream = torch.cuda.Stream(device=self.model.device)
            graphs = self._by_n[(n, all_rows)] = PiecewiseGraphs(
                self.model, n, self._pool, self._stream, all_rows
            )
        return graphs
