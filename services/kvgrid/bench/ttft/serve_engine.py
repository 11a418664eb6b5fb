"""An engine that serves many requests at once: vLLM's scheduler (continuous batching, chunked
prefill, decode, preemption) around a :class:`~kvgrid.bench.ttft.model.PagedLlama`, one forward per step
over every scheduled request, with or without ``KVGridConnector``.

It is :class:`~kvgrid.bench.ttft.engine.TTFTEngine`'s runner generalised from one request to a batch; the
vLLM config, KV cache buffer and connector worker are the same :class:`~kvgrid.bench.ttft.engine.RankWorker`,
and each step calls the connector in the same order (:meth:`RankWorker.connector_step`). What a step
does, as vLLM's GPU model runner does it:

* ``schedule()``; the runner's per-request state follows the output: new requests bring their
  prompt and blocks, cached ones their new blocks (a resumed request's replace its old ones), and
  a preempted request's state is dropped (it comes back as resumed, from its recomputed position);
* copy-on-write block copies the scheduler asks for run before the forward;
* the step's tokens are packed (:class:`~kvgrid.bench.ttft.model.PackedBatch`): per request its
  scheduled positions, their cache slots and its block table; a request whose scheduled tokens
  reach the end of its known tokens samples one token (greedy), others (a prefill chunk) none;
* ``update_from_output`` with the sampled tokens and the connector's output.

Invariants:

* Greedy sampling: a request's tokens depend only on its prompt and the model, never on which other
  requests share its steps beyond the rounding of batched matmuls (the bench's CPU test checks the
  tokens with and without kvgrid are equal).
* A token is a position's input exactly once it is known: the prompt, then each sampled token. A
  request's next-turn prompt is built by the workload, not from these tokens.
* With ``prefix_caching`` vLLM's own GPU prefix cache is on (requests carry vLLM's block hashes).
* :meth:`ServeEngine.step` returns only once the step's tokens are on the host (the forward is
  synchronised by reading them), so a time taken after it is when the tokens exist.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvgrid.bench.ttft.engine import EngineOptions, RankWorker
from kvgrid.bench.ttft.model import PackedBatch, PagedLlama

__all__ = ["GRAPH_SIZES", "RowSpan", "ServeEngine", "StepEvents", "graph_size", "pack_batch"]

GRAPH_SIZES = (1, 2, 4, 8, *range(16, 513, 16))
"""Token counts whose piecewise graphs are captured (vLLM pads a batch to the next capture size)."""


def graph_size(n: int, limit: int) -> int:
    """The captured size a batch of ``n`` rows is padded to, or ``n`` past ``limit`` (eager)."""
    size = next((size for size in GRAPH_SIZES if size >= n), n)
    return size if size <= limit else n


@dataclass(frozen=True)
class RowSpan:
    """One request's part of a step: positions ``[start, start + count)`` of ``tokens`` over ``blocks``."""

    tokens: list[int]
    blocks: list[int]
    start: int
    count: int

    @property
    def samples(self) -> bool:
        """The step reaches the end of the known tokens: it samples the next one."""
        return self.start + self.count == len(self.tokens)


def pack_batch(parts: Sequence[RowSpan], block_size: int, model: PagedLlama) -> PackedBatch:
    """The :class:`PackedBatch` of ``parts`` (one per request, in order), padded to a captured graph
    size where the model replays graphs; the logit rows are the sampling parts' last rows."""
    dev = model.device
    tokens: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    ctx, rows = [], []
    for p in parts:
        end = p.start + p.count
        blocks = torch.tensor(p.blocks, dtype=torch.int64)
        all_slots = (blocks[:, None] * block_size + torch.arange(block_size)[None, :]).flatten()[:end]
        if all_slots.numel() < end:
            raise ValueError(f"{len(p.blocks)} blocks of {block_size} hold fewer than {end} tokens")
        tokens += p.tokens[p.start : end]
        positions += range(p.start, end)
        slots += all_slots[p.start :].tolist()
        ctx.append(all_slots)
        if p.samples:
            rows.append(len(tokens) - 1)
    real = len(tokens)
    padded = graph_size(real, model.graph_max_tokens) if model.cuda_graphs else real
    pad = padded - real  # padding rows write slot 0 (vLLM's null block) at position 0
    table = torch.zeros(len(parts), max((len(p.blocks) for p in parts), default=1) or 1, dtype=torch.int32)
    for i, p in enumerate(parts):
        table[i, : len(p.blocks)] = torch.tensor(p.blocks, dtype=torch.int32)
    counts = [p.count for p in parts]
    starts = [p.start for p in parts]
    qs = torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int32)
    lens = torch.tensor([a + b for a, b in zip(starts, counts, strict=True)], dtype=torch.int32)

    def up(t: torch.Tensor) -> torch.Tensor:  # pinned and non-blocking, as vLLM's runner uploads
        return t.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else t.to(dev)

    return PackedBatch(
        token_ids=up(torch.tensor(tokens + [0] * pad, dtype=torch.int64)),
        positions=up(torch.tensor(positions + [0] * pad, dtype=torch.int64)),
        new_slots=up(torch.tensor(slots + [0] * pad, dtype=torch.int64)),
        starts=tuple(starts),
        counts=tuple(counts),
        query_start=up(qs),
        seq_lens=up(lens),
        block_table=up(table),
        ctx_slots=tuple(up(c) for c in ctx) if dev.type != "cuda" else (),
        logit_rows=up(torch.tensor(rows, dtype=torch.int64)),
    )


@dataclass
class _ReqState:
    tokens: list[int]
    blocks: list[int]


@dataclass
class StepEvents:
    """What one step produced."""

    sampled: dict[str, int] = field(default_factory=dict)
    """Request id -> the token sampled for it this step."""
    finished: list[str] = field(default_factory=list)
    """Requests that completed (max_tokens reached) this step."""
    first_schedule: dict[str, int] = field(default_factory=dict)
    """Request id -> its computed tokens when first scheduled (its prefix hit, GPU cache and kvgrid)."""
    first_external: dict[str, int] = field(default_factory=dict)
    """Request id -> of those, the tokens the connector supplied (kvgrid's hit)."""
    preempted: int = 0
    logits: dict[str, torch.Tensor] = field(default_factory=dict)
    """With ``ServeEngine.keep_logits``: each sampled request's logits (float32, on the CPU)."""


class ServeEngine:
    """vLLM's scheduler + one rank's worker over a batch (module docstring). ``agent_socket=None``:
    no KV connector; ``kv_cache_of``: run over that engine's KV cache buffer (same options)."""

    def __init__(
        self,
        model: PagedLlama,
        agent_socket: str | None,
        directory: Path,
        opts: EngineOptions,
        *,
        kv_cache_of: ServeEngine | None = None,
    ) -> None:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        if model.tp_size != 1:
            raise ValueError(f"ServeEngine on tp_size={model.tp_size}; expected 1")
        self.model, self.options = model, opts
        self.rank: RankWorker = RankWorker(
            model, agent_socket, directory, opts, kv_cache_of=kv_cache_of.rank if kv_cache_of else None
        )
        cfg = self.rank.vllm_config
        self.scheduler = Scheduler(
            cfg, self.rank.kv_config, StructuredOutputManager(cfg), block_size=opts.block_size
        )
        hash_fn = get_hash_fn_by_name(cfg.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self._hasher = get_request_block_hasher(opts.block_size, hash_fn)
        self._states: dict[str, _ReqState] = {}
        self._seen: set[str] = set()
        self._external: dict[str, int] = {}
        connector = self.scheduler.connector
        if connector is not None:  # what the connector answers the scheduler, per request (latest)
            matched = connector.get_num_new_matched_tokens

            def recording(request: Any, num_computed_tokens: int) -> Any:
                answer = matched(request, num_computed_tokens)
                if answer[0] is not None:
                    self._external[request.request_id] = answer[0]
                return answer

            connector.get_num_new_matched_tokens = recording  # type: ignore[method-assign]
        self.keep_logits = False
        """Return each sampled request's logits in :attr:`StepEvents.logits` (the bench's checks)."""

    def add(self, request_id: str, prompt: Sequence[int], max_tokens: int) -> None:
        """Queue a request: greedy, exactly ``max_tokens`` tokens (no stop token)."""
        from vllm import SamplingParams
        from vllm.v1.request import Request

        if max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens}; expected >= 1")
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.scheduler.add_request(Request(request_id, list(prompt), params, None, block_hasher=self._hasher))

    def has_work(self) -> bool:
        return self.scheduler.has_requests()

    def step(self) -> StepEvents:
        """One scheduler step over every scheduled request (module docstring)."""
        from vllm.v1.outputs import ModelRunnerOutput

        sched, events = self.scheduler, StepEvents()
        out = sched.schedule()
        for rid in out.preempted_req_ids or ():
            self._states.pop(rid, None)
            events.preempted += 1
        for new in out.scheduled_new_reqs:
            self._states[new.req_id] = _ReqState(list(new.prompt_token_ids or ()), list(new.block_ids[0]))
            if new.req_id not in self._seen:
                self._seen.add(new.req_id)
                events.first_schedule[new.req_id] = new.num_computed_tokens
                events.first_external[new.req_id] = self._external.pop(new.req_id, 0)
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            more = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                self._states[rid] = _ReqState(list(cached.all_token_ids[rid]), list(more[0]) if more else [])
            elif more:
                self._states[rid].blocks.extend(more[0])
        computed = {n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs}
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        req_ids = list(out.num_scheduled_tokens)
        if out.kv_cache_block_copies:
            self._copy_blocks([(c.src_block_id, c.dst_block_id) for c in out.kv_cache_block_copies])
        batch, samplers = self._pack(req_ids, computed, out.num_scheduled_tokens)

        def forward() -> list[int]:
            if batch is None:  # nothing runnable (loads or stores in flight): let their threads run
                time.sleep(0)
                return []
            logits = self.model.forward_batch(batch, self.rank.kv_list, self.rank.hooks)
            if self.keep_logits:
                events.logits.update(zip(samplers, logits.cpu(), strict=True))
            return logits.argmax(dim=-1).tolist() if samplers else []  # waits for the device

        tokens, kv_output = self.rank.connector_step(
            out.kv_connector_metadata, out.has_sync_kv_loads, out.finished_req_ids, forward
        )
        by_req = dict(zip(samplers, tokens, strict=True))
        sampled: list[list[int]] = []
        for rid in req_ids:
            tok = by_req.get(rid)
            sampled.append([] if tok is None else [tok])
            if tok is not None:
                self._states[rid].tokens.append(tok)
                events.sampled[rid] = tok
        outputs = sched.update_from_output(
            out,
            ModelRunnerOutput(
                req_ids=req_ids,
                req_id_to_index={r: i for i, r in enumerate(req_ids)},
                sampled_token_ids=sampled,
                kv_connector_output=kv_output,
            ),
        )
        for eco in outputs.values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    events.finished.append(o.request_id)
                    self._states.pop(o.request_id, None)
        for rid in out.finished_req_ids:
            self._states.pop(rid, None)
        return events

    def _pack(
        self, req_ids: list[str], computed: dict[str, int], scheduled: dict[str, int]
    ) -> tuple[PackedBatch | None, list[str]]:
        """The step's :class:`PackedBatch` and the requests that sample (in its logit row order)."""
        if not req_ids:
            return None, []
        parts = [
            RowSpan(self._states[r].tokens, self._states[r].blocks, computed[r], scheduled[r])
            for r in req_ids
        ]
        for rid, part in zip(req_ids, parts, strict=True):
            if part.start + part.count > len(part.tokens):
                end = part.start + part.count
                raise RuntimeError(f"{rid!r}: scheduled to position {end} of {len(part.tokens)} known")
        batch = pack_batch(parts, self.options.block_size, self.model)
        return batch, [r for r, p in zip(req_ids, parts, strict=True) if p.samples]

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """vLLM's copy-on-write block copies, in every layer's cache."""
        src = torch.tensor([a for a, _ in pairs], device=self.model.device)
        dst = torch.tensor([b for _, b in pairs], device=self.model.device)
        for view in self.rank.kv_list:
            view[dst] = view[src]

    def leftovers(self) -> dict[str, int]:
        """What a drained engine still holds: requests, used blocks, connector pins (all 0 when clean)."""
        pool = self.scheduler.kv_cache_manager.block_pool
        used = pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()  # block 0 is vLLM's null block
        return {
            "requests": len(self.scheduler.requests),
            "used_blocks": used,
            "runner_states": len(self._states),
        }

    def close(self) -> None:
        self.rank.close()
        self.scheduler.shutdown()
