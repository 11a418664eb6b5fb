"""One engine of ``kvgrid bench ttft``: vLLM's scheduler and ``KVGridConnector``'s worker half around
a :class:`~kvgrid.bench.ttft.model.PagedLlama`, stepped in vLLM 0.32's model-runner order.

No vLLM engine runs: this module plays the model runner with vLLM's real classes. What it builds:

* a ``VllmConfig`` (``ModelConfig`` over a ``config.json`` of the model's shape -- no weights are
  read -- plus ``CacheConfig``, ``SchedulerConfig`` and a ``KVTransferConfig`` naming
  ``kvgrid.connector.vllm``);
* a ``KVCacheConfig`` with one ``KVCacheTensor`` per layer in one layer-outermost buffer and the
  per-layer views from ``create_kv_cache_views`` (``KVCacheLayout.LBNHC``), the buffer on the GPU
  (the agent opens it by CUDA IPC handle) or in a shared-memory file (CPU);
* vLLM's ``Scheduler``, which builds the connector's scheduler half itself through
  ``KVConnectorFactory``; the worker half is built by the same factory with role WORKER;
* per step a ``ForwardContext`` with empty metadata (the connector's ``start_load_kv`` does not read
  it) and ``None`` as ``save_kv_layer``'s attention metadata (not read either), a
  ``ModelRunnerOutput`` with the sampled token and a ``KVConnectorOutput``.

Step order (``vllm/v1/worker/kv_connector_model_runner_mixin.py``): ``schedule`` -> the step's
inputs go up (the cache slots, pinned, without blocking: vLLM's ``_prepare_inputs`` runs before the
connector's context) -> ``bind_connector_metadata`` -> ``handle_preemptions`` -> ``start_load_kv``
before the forward when the step has synchronous (in-step, layer-wise) loads -> forward, per layer
``wait_for_layer_load`` ... ``save_kv_layer`` -> ``start_load_kv`` after the forward otherwise ->
``wait_for_save`` -> ``get_transfer_results`` (vLLM 0.32's form of ``get_finished``; the connector
answers both from the same state, so only one is called) -> ``get_block_ids_with_load_errors`` ->
``clear_connector_metadata`` -> ``update_from_output``.

The scheduler side (:class:`TTFTEngine`: vLLM's ``Scheduler``, one request's loop) and one rank's
worker side (:class:`RankWorker`: its KV cache, the connector's worker half, the step above from
``bind_connector_metadata`` to ``clear_connector_metadata``) are separate, joined by a
:class:`StepPlan` (the parts of a ``SchedulerOutput`` the runner reads). With TP=1 the engine calls
its one worker directly; with tensor parallelism :mod:`kvgrid.bench.ttft.tp` sends each plan to every
rank's worker and aggregates their ``KVConnectorOutput`` as vLLM's executor does.

Invariant: one request runs at a time and :meth:`TTFTEngine.run` returns once it has its first token;
the time it reports runs from ``add_request`` to that token (device synchronised), so a hit's time
includes the lookup, the load (asynchronous: steps with nothing scheduled until the worker reports
it) and the tail's prefill, and a miss's includes the store when stores are synchronous
(``wait_for_save`` returns when the agent holds the chunks). With asynchronous stores ``run`` still
returns only once they landed (``RunResult.stored_s``), so the next request finds the prefix.

Without a connector (:meth:`TTFTEngine.without_connector`, ``agent_socket=None``): the same model,
options and KV cache buffer (the other engine's views, not a second allocation), a ``VllmConfig``
without ``kv_transfer_config``, so vLLM's ``Scheduler`` builds no connector half
(``kv_connector_metadata`` is None) and the step is what vLLM's runner does without a KV transfer
group: no connector call, no layer hooks, no ``KVConnectorOutput`` -- ``schedule`` -> forward ->
``update_from_output``. It is what a miss costs vLLM alone (the bench's ``plain miss``). vLLM's own
prefix caching is off in every engine (``enable_prefix_caching=False``), so a prompt is a miss to
it however often it ran. Sharing the buffer is safe because requests run one at a time and ``run``
returns only once every store landed: neither engine's blocks hold anything the other still needs
between requests (a hit reads only what it loads or computes). Only with TP=1: the
tensor-parallel ranks (:mod:`kvgrid.bench.ttft.tp`) build connector workers only.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast

import torch

from kvgrid.bench.ttft.model import LayerHooks, ModelShape, PagedLlama, layer_name

if TYPE_CHECKING:
    from kvgrid.connector.vllm import KVGridConnector

_T = TypeVar("_T")

__all__ = [
    "AgentProcess",
    "EngineOptions",
    "RankWorker",
    "RunResult",
    "StepPlan",
    "StepResult",
    "TTFTEngine",
    "kv_buffer",
    "slots_of",
    "vllm_config",
]


class AgentProcess:
    """A ``kvgrid agent`` process on a Unix socket in ``directory`` (CPU KV files allowed there)."""

    def __init__(self, directory: Path, l1_size: int, *, l1_shared_dir: str = "", spin_us: int = 0) -> None:
        """``l1_shared_dir``: the agent keeps L1 in a file there (engines copy themselves);
        ``spin_us``: its ``hot_path_spin_us``."""
        self.uds_path = str(directory / "agent.sock")
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVGRID_")}
        env["OTEL_SDK_DISABLED"] = "true"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvgrid.cli", "agent", "--uds-path", self.uds_path, "--tcp-port", "-1",
             "--l1-size", str(l1_size), "--shm-allowed-dirs", str(directory), "--log-level", "warning",
             "--l1-shared-dir", l1_shared_dir, "--hot-path-spin-us", str(spin_us)],
            stdout=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("{"):
            self.stop()
            raise RuntimeError(f"kvgrid agent did not start (exit {self.proc.poll()}, said {line!r})")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)


def slots_of(block_ids: list[int], block_size: int, num_tokens: int, device: torch.device) -> torch.Tensor:
    """The cache slot of every token position [0, num_tokens) of a request with these blocks."""
    ids = torch.tensor(block_ids, dtype=torch.int64)
    slots = (ids[:, None] * block_size + torch.arange(block_size)[None, :]).flatten()
    if slots.numel() < num_tokens:
        raise ValueError(f"{len(block_ids)} blocks of {block_size} hold fewer than {num_tokens} tokens")
    if device.type != "cuda":
        return slots[:num_tokens].to(device)
    # From pinned memory without blocking, as vLLM's runner copies its inputs: a copy from pageable
    # memory waits for the stream, which after a GPU-side wait for a load means for the whole load.
    return slots[:num_tokens].pin_memory().to(device, non_blocking=True)


def kv_buffer(
    shape: ModelShape, num_blocks: int, block_size: int, dtype: torch.dtype, device: str, directory: Path
) -> tuple[Any, dict[str, torch.Tensor], torch.Tensor, Path | None]:
    """(KVCacheConfig, per-layer views by name, the raw buffer, its shared-memory file on CPU), laid
    out as vLLM's runner does."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from kvgrid.engine.tensors import allocate_shared_tensor

    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=shape.kv_heads, head_size=shape.head_size, dtype=dtype
    )
    names = [layer_name(i) for i in range(shape.layers)]
    page = spec.page_size_bytes
    tensors = [
        KVCacheTensor(
            size=page * num_blocks, layers=[n], layer_stride=page * num_blocks, block_stride=page,
            offset=i * page * num_blocks,
        )
        for i, n in enumerate(names)
    ]  # fmt: skip
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
        kv_cache_layout=KVCacheLayout.LBNHC.name,
    )
    total = page * num_blocks * len(names)
    path: Path | None = None
    if device == "cpu":
        fd, name = tempfile.mkstemp(prefix="kv-", suffix=".bin", dir=directory)
        os.close(fd)
        path = Path(name)
        raw = allocate_shared_tensor(path, (total,), torch.int8)
    else:
        raw = torch.zeros(total, dtype=torch.int8, device=device)
    views = {}
    for name, t in zip(names, tensors, strict=True):
        (views[name],) = create_kv_cache_views(raw, spec, num_blocks, KVCacheLayout.LBNHC, t)
    return config, views, raw, path


@dataclass(frozen=True)
class RunResult:
    logits: torch.Tensor
    """The first token's logits (float32, on the CPU)."""
    ttft_s: float
    loaded_tokens: int
    """Prompt tokens the engine did not compute (they came from the agent)."""
    steps: int
    """Scheduler steps from arrival to the first token (an asynchronous load adds steps that schedule
    nothing while it runs)."""
    stored_s: float
    """From arrival until every store issued while serving it landed in the agent (``ttft_s`` when
    stores are synchronous)."""


@dataclass(frozen=True)
class EngineOptions:
    """What an engine is built with besides its model, agent and directory (the same on every rank)."""

    max_prompt_tokens: int
    block_size: int = 16
    chunk_size: int = 256
    layerwise: bool = False
    async_store: bool | None = None
    engine_copies: bool = False
    layerwise_stages: int = 8
    engine_id: str = "ttft"
    lease_at_lookup: bool = True  # the connector's default
    # Serving many requests at once (kvgrid.bench.ttft.serve_engine); the defaults fit one request at a time.
    num_blocks: int = 0
    """KV blocks (0: room for one request of the longest prompt plus one chunk)."""
    max_num_seqs: int = 4
    max_num_batched_tokens: int = 0
    """Tokens per step (0: a whole prompt in one step, no chunked prefill)."""
    prefix_caching: bool = False
    """vLLM's own GPU prefix cache."""
    kv_role: Literal["kv_both", "kv_consumer"] = "kv_both"
    """The connector's role: ``kv_consumer`` loads and never stores."""


@dataclass(frozen=True)
class StepPlan:
    """The parts of one ``SchedulerOutput`` a worker reads (what rank 0 sends the other ranks)."""

    metadata: Any
    """The connector's metadata for the step."""
    has_sync_kv_loads: bool
    finished_req_ids: set[str]
    request_id: str | None
    """The request the step computes; None when it schedules nothing (an asynchronous load runs)."""
    start: int
    """Its first computed position (tokens before it are cached or loaded)."""
    num_tokens: int
    blocks: list[int]
    """Its KV blocks, in order, as the worker's input batch tracks them."""


@dataclass(frozen=True)
class StepResult:
    logits: torch.Tensor | None
    """The last prompt token's logits when the step computed it."""
    sampled: list[list[int]]
    kv_output: Any
    """The rank's ``KVConnectorOutput`` (None without a connector)."""


class _ConnectorHooks:
    """The connector's per-layer hooks where vLLM's attention layer calls them."""

    def __init__(self, connector: Any) -> None:
        self.connector = connector

    def before_attention(self, layer: int) -> None:
        self.connector.wait_for_layer_load(layer_name(layer))

    def after_attention(self, layer: int, kv: torch.Tensor) -> None:
        self.connector.save_kv_layer(layer_name(layer), kv, cast(Any, None))


def vllm_config(
    model: PagedLlama, agent_socket: str | None, model_dir: Path, opts: EngineOptions, *, rank: int = 0
) -> tuple[Any, int]:
    """(``VllmConfig`` of rank ``rank`` of ``model.tp_size``, KV blocks per rank); writes the model's
    ``config.json`` (the full model's shape: vLLM derives the per-rank heads itself) into ``model_dir``.
    ``agent_socket=None``: no ``kv_transfer_config`` (vLLM without a KV connector)."""
    from vllm.config import (
        CacheConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    if opts.max_prompt_tokens < 1:
        raise ValueError(f"max_prompt_tokens={opts.max_prompt_tokens}; expected >= 1")
    s, block_size = model.shape, opts.block_size
    max_len = opts.max_prompt_tokens + block_size
    (model_dir / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": s.hidden,
                "intermediate_size": s.intermediate,
                "num_attention_heads": s.heads,
                "num_key_value_heads": s.kv_heads,
                "head_dim": s.head_size,
                "num_hidden_layers": s.layers,
                "vocab_size": s.vocab,
                "max_position_embeddings": max_len,
                "rope_theta": s.rope_theta,
                "torch_dtype": str(model.dtype).removeprefix("torch."),
                "rms_norm_eps": 1e-5,
            }
        )
    )
    # Room for one request of the longest prompt, plus one chunk of slack, unless given.
    num_blocks = opts.num_blocks or -(-max_len // block_size) + opts.chunk_size // block_size + 1
    transfer = None
    if agent_socket is not None:
        transfer = KVTransferConfig(
            kv_connector="KVGridConnector",
            kv_connector_module_path="kvgrid.connector.vllm",
            kv_role=opts.kv_role,
            engine_id=opts.engine_id,
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={
                "agent_socket": agent_socket,
                "chunk_size": opts.chunk_size,
                "layerwise": opts.layerwise,
                "async_store": opts.async_store,
                "engine_copies": opts.engine_copies,
                "layerwise_stages": opts.layerwise_stages,
                "lease_at_lookup": opts.lease_at_lookup,
                "rpc_timeout_s": 600.0,
            },
        )
    cfg = VllmConfig(
        model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True, max_model_len=max_len),
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=opts.prefix_caching),
        # The connector's identity (its rank, the world size, '{rank}' in agent_socket) comes from here.
        parallel_config=ParallelConfig(
            tensor_parallel_size=model.tp_size, rank=rank, distributed_executor_backend="mp"
        ),
        scheduler_config=SchedulerConfig(
            max_model_len=max_len,
            is_encoder_decoder=False,
            max_num_batched_tokens=opts.max_num_batched_tokens or max_len,  # max_len: no chunked prefill
            max_num_seqs=opts.max_num_seqs,
            enable_chunked_prefill=True,
        ),
        kv_transfer_config=transfer,
    )
    cfg.cache_config.num_gpu_blocks = num_blocks
    return cfg, num_blocks


class RankWorker:
    """One rank's worker side: its KV cache (its shard's KV heads), the connector's worker half, and
    one step of the model runner (module docstring's order, from ``bind_connector_metadata`` to
    ``clear_connector_metadata``). Rank 0's lives in :class:`TTFTEngine`; the other ranks' in
    :mod:`kvgrid.bench.ttft.tp`'s rank processes.

    ``agent_socket=None``: no connector (module docstring): the step runs the forward alone.
    ``kv_cache_of``: use that worker's KV cache (config, views, buffer) instead of allocating one;
    it must be of the same model and block count, and outlive this worker."""

    def __init__(
        self,
        model: PagedLlama,
        agent_socket: str | None,
        directory: Path,
        opts: EngineOptions,
        *,
        rank: int = 0,
        kv_cache_of: RankWorker | None = None,
    ) -> None:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        from kvgrid.connector.vllm import KVGridConnector

        self.model = model
        self.block_size = opts.block_size
        self._model_dir = Path(tempfile.mkdtemp(prefix="kvgrid-ttft-model-", dir=directory))
        try:
            self.vllm_config, num_blocks = vllm_config(model, agent_socket, self._model_dir, opts, rank=rank)
            if kv_cache_of is None:
                self.kv_config, self.caches, self._raw, self._raw_path = kv_buffer(
                    model.shard, num_blocks, opts.block_size, model.dtype, model.device.type, directory
                )
            else:
                other = kv_cache_of
                if other.model is not model or (other.kv_config.num_blocks, other.block_size) != (
                    num_blocks,
                    opts.block_size,
                ):
                    raise ValueError(
                        f"kv_cache_of: a cache of {other.kv_config.num_blocks} blocks of {other.block_size} "
                        f"tokens{'' if other.model is model else ' of another model'}; expected {num_blocks} "
                        f"blocks of {opts.block_size} of this model"
                    )
                # The other worker's buffer: its owner frees it (no file of ours to unlink).
                self.kv_config, self.caches, self._raw, self._raw_path = (
                    other.kv_config, other.caches, other._raw, None
                )  # fmt: skip
        except BaseException:
            shutil.rmtree(self._model_dir, ignore_errors=True)
            raise
        self.kv_list = [self.caches[layer_name(i)] for i in range(model.shape.layers)]
        self._connector: KVGridConnector | None = None
        self.hooks: LayerHooks | None = None
        if agent_socket is not None:
            self._connector = cast(
                KVGridConnector,
                KVConnectorFactory.create_connector(self.vllm_config, KVConnectorRole.WORKER, self.kv_config),
            )
            self._connector.register_kv_caches(self.caches)
            self.hooks = _ConnectorHooks(self._connector)
        self.after_load: Callable[[str, list[int]], None] | None = None
        """Test hook: called with (request id, block ids) before the step that computes a request
        whose prompt was partly loaded (the loaded KV is in the cache then)."""

    @property
    def has_connector(self) -> bool:
        return self._connector is not None

    @property
    def connector(self) -> KVGridConnector:
        """The connector's worker half (a worker built without one has none: RuntimeError)."""
        if self._connector is None:
            raise RuntimeError("this worker was built without a KV connector (agent_socket=None)")
        return self._connector

    def poison(self) -> None:
        """Fill the whole KV cache with NaN: a position the engine neither computes nor loads shows."""
        for view in self.kv_list:
            view.fill_(float("nan"))

    def step(self, plan: StepPlan, tokens: torch.Tensor) -> StepResult:
        """One scheduler step's work on this rank; ``tokens``: the request's prompt on the model's device."""
        slots: torch.Tensor | None = None
        if plan.request_id is not None:  # before the connector's loads, as in vLLM's runner: a pinned
            # upload queued after a load's first DMA waits behind the whole DMA train (benchmarks.md)
            slots = slots_of(plan.blocks, self.block_size, plan.start + plan.num_tokens, self.model.device)

        def forward() -> tuple[torch.Tensor | None, list[list[int]]]:
            w = self._connector
            if plan.request_id is None or slots is None:
                return None, []
            start, n = plan.start, plan.num_tokens
            if start and self.after_load is not None and w is not None:
                w.wait_for_layer_load(layer_name(0))  # in-step loads land first
                self.after_load(plan.request_id, plan.blocks)
            lg = self.model.forward(tokens[start : start + n], start, self.kv_list, slots, self.hooks)
            if start + n >= tokens.numel():
                return lg, [[int(lg.argmax())]]  # .item() waits for the device
            return None, [[]]

        (logits, sampled), output = self.connector_step(
            plan.metadata, plan.has_sync_kv_loads, plan.finished_req_ids, forward
        )
        return StepResult(logits, sampled, output)

    def connector_step(
        self, metadata: Any, has_sync_kv_loads: bool, finished_req_ids: set[str], forward: Callable[[], _T]
    ) -> tuple[_T, Any]:
        """``forward()`` between the connector's calls of one step (module docstring's order); returns
        its result and the rank's ``KVConnectorOutput`` (None without a connector: vLLM's runner
        without a KV transfer group makes no connector call)."""
        from vllm.forward_context import ForwardContext
        from vllm.v1.outputs import KVConnectorOutput

        w = self._connector
        ctx = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})
        if w is not None:
            w.bind_connector_metadata(metadata)
            w.handle_preemptions(metadata)
            if has_sync_kv_loads:
                w.start_load_kv(ctx)
        result = forward()
        if w is None:
            return result, None
        if not has_sync_kv_loads:
            w.start_load_kv(ctx)
        w.wait_for_save()
        results = w.get_transfer_results(finished_req_ids)
        invalid = w.get_block_ids_with_load_errors()
        w.clear_connector_metadata()
        output = KVConnectorOutput(
            finished_sending=results.finished_sending or None,
            finished_recving=results.finished_recving or None,
            failed_recving=results.failed_recving or set(),
            invalid_block_ids=invalid,
        )
        return result, output

    def reference(self, token_ids: torch.Tensor, start: int, slots: torch.Tensor) -> torch.Tensor:
        """The model over this rank's cache without the connector (the bench's limits and references)."""
        return self.model.forward(token_ids, start, self.kv_list, slots)

    def close(self) -> None:
        if self._connector is not None:
            self._connector.shutdown()
        if self._raw_path is not None:
            self._raw_path.unlink(missing_ok=True)
        shutil.rmtree(self._model_dir, ignore_errors=True)


class TTFTEngine:
    """vLLM's scheduler + rank 0's worker side (:class:`RankWorker`), one request at a time (module
    docstring). With tensor parallelism :class:`kvgrid.bench.ttft.tp.TPEngine` runs each step on
    every rank."""

    def __init__(
        self,
        model: PagedLlama,
        agent_socket: str | None,
        directory: Path,
        *,
        max_prompt_tokens: int,
        block_size: int = 16,
        chunk_size: int = 256,
        layerwise: bool = False,
        async_store: bool | None = None,
        engine_copies: bool = False,
        layerwise_stages: int = 8,
        engine_id: str = "ttft",
        kv_cache_of: TTFTEngine | None = None,
        lease_at_lookup: bool = True,
        num_blocks: int = 0,
        max_num_seqs: int = 4,
        max_num_batched_tokens: int = 0,
        prefix_caching: bool = False,
        kv_role: Literal["kv_both", "kv_consumer"] = "kv_both",
    ) -> None:
        """``agent_socket`` may contain '{rank}' (one agent per tensor-parallel rank); None: no KV
        connector (TP=1 only; :meth:`without_connector`). ``kv_cache_of``: run over that engine's KV
        cache instead of allocating one (:class:`RankWorker`)."""
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        if model.tp_rank != 0:
            raise ValueError(
                f"TTFTEngine on tp_rank={model.tp_rank}; expected rank 0 (it runs the scheduler)"
            )
        if agent_socket is None and model.tp_size > 1:
            raise ValueError(
                f"a TTFTEngine without a connector on tp_size={model.tp_size}; expected 1 (the "
                f"tensor-parallel ranks build connector workers only)"
            )
        self.options = EngineOptions(
            max_prompt_tokens=max_prompt_tokens, block_size=block_size, chunk_size=chunk_size,
            layerwise=layerwise, async_store=async_store, engine_copies=engine_copies,
            layerwise_stages=layerwise_stages, engine_id=engine_id, lease_at_lookup=lease_at_lookup,
            num_blocks=num_blocks, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            prefix_caching=prefix_caching, kv_role=kv_role,
        )  # fmt: skip
        self.model = model
        self.block_size = block_size
        self.directory = directory
        self.rank: RankWorker = RankWorker(
            model, agent_socket, directory, self.options,
            kv_cache_of=kv_cache_of.rank if kv_cache_of is not None else None,
        )  # fmt: skip
        self.kv_config, self.caches, self.kv_list = self.rank.kv_config, self.rank.caches, self.rank.kv_list
        cfg = self.rank.vllm_config
        self.scheduler = Scheduler(cfg, self.kv_config, StructuredOutputManager(cfg), block_size=block_size)

    @property
    def worker(self) -> KVGridConnector:
        """Rank 0's connector worker half (RuntimeError for an engine without a connector)."""
        return self.rank.connector

    def without_connector(self) -> TTFTEngine:
        """A TTFTEngine of the same model, options and KV cache buffer (this engine's, shared: no
        second allocation) whose vLLM config has no KV connector (module docstring): what a request
        costs vLLM alone. Close it before this engine. TP=1 only (ValueError otherwise)."""
        opts = dataclasses.asdict(self.options)
        opts["engine_id"] = f"{self.options.engine_id}-plain"
        return TTFTEngine(self.model, None, self.directory, **opts, kv_cache_of=self)

    @property
    def after_load(self) -> Callable[[str, list[int]], None] | None:
        """Rank 0's :attr:`RankWorker.after_load` (test hook)."""
        return self.rank.after_load

    @after_load.setter
    def after_load(self, hook: Callable[[str, list[int]], None] | None) -> None:
        self.rank.after_load = hook

    @property
    def _hooks(self) -> LayerHooks | None:  # scripts/profile_staged_hit.py wraps them
        return self.rank.hooks

    @_hooks.setter
    def _hooks(self, hooks: LayerHooks | None) -> None:
        self.rank.hooks = hooks

    def poison(self) -> None:
        """Fill the whole KV cache with NaN (every rank's): what is neither computed nor loaded shows."""
        self.rank.poison()

    def reference(self, token_ids: torch.Tensor, start: int, slots: torch.Tensor) -> torch.Tensor:
        """The model over the engine's cache without the connector (on every rank), rank 0's logits."""
        return self.rank.reference(token_ids, start, slots)

    def _begin(self, prompt: list[int]) -> torch.Tensor:
        """The prompt on the model's device, before the clock starts (every rank's copy with TP)."""
        return torch.tensor(prompt, dtype=torch.int64, device=self.model.device)

    def _execute(self, plan: StepPlan, tokens: torch.Tensor) -> StepResult:
        """One step on every rank; the ranks' connector outputs aggregated as vLLM's executor does."""
        return self.rank.step(plan, tokens)

    def run(self, request_id: str, prompt: list[int]) -> RunResult:
        """Serve one request to its first token (module docstring)."""
        from vllm import SamplingParams
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.request import Request

        sched = self.scheduler
        tokens = self._begin(prompt)
        t0 = time.perf_counter()
        sched.add_request(Request(request_id, prompt, SamplingParams(max_tokens=1), None))
        blocks: list[int] = []
        logits: torch.Tensor | None = None
        loaded = steps = 0
        # Until vLLM accepts the first token (a load that failed inside the step makes it discard
        # the step's token and recompute from the failed blocks), then until vLLM freed the
        # request's blocks: with asynchronous stores they are held until the stores are reported.
        ttft = stored = 0.0
        while request_id in sched.requests:
            steps += 1
            out = sched.schedule()
            for new in out.scheduled_new_reqs:
                if new.req_id == request_id:
                    blocks = list(new.block_ids[0])
            cached = out.scheduled_cached_reqs
            computed = {n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs}
            for i, rid in enumerate(cached.req_ids):
                computed[rid] = cached.num_computed_tokens[i]
                more = cached.new_block_ids[i]
                if rid == request_id and more:
                    blocks = list(more[0]) if rid in cached.resumed_req_ids else blocks + list(more[0])
            req_ids = list(out.num_scheduled_tokens)
            for rid in req_ids:
                if rid != request_id:
                    raise RuntimeError(
                        f"scheduled {rid!r} while serving {request_id!r}: one request at a time"
                    )
            if (out.kv_connector_metadata is None) == self.rank.has_connector:
                raise RuntimeError(
                    f"step of {request_id!r}: connector metadata {out.kv_connector_metadata!r} from an "
                    f"engine {'with' if self.rank.has_connector else 'without'} a connector"
                )
            scheduled = request_id if req_ids else None
            start = computed[request_id] if scheduled else 0
            plan = StepPlan(
                metadata=out.kv_connector_metadata,
                has_sync_kv_loads=out.has_sync_kv_loads,
                finished_req_ids=out.finished_req_ids,
                request_id=scheduled,
                start=start,
                num_tokens=out.num_scheduled_tokens[request_id] if scheduled else 0,
                blocks=blocks,
            )
            res = self._execute(plan, tokens)
            if scheduled:
                loaded = start
            if res.logits is not None:
                logits = res.logits
            sched.update_from_output(
                out,
                ModelRunnerOutput(
                    req_ids=req_ids,
                    req_id_to_index={r: i for i, r in enumerate(req_ids)},
                    sampled_token_ids=res.sampled,
                    kv_connector_output=res.kv_output,
                ),
            )
            if not ttft and ((r := sched.requests.get(request_id)) is None or r.is_finished()):
                ttft = time.perf_counter() - t0
                self._flush_stores()
                stored = time.perf_counter() - t0
            elif not req_ids:
                time.sleep(0)  # an asynchronous load in flight: let the loader thread run
        if logits is None:
            raise RuntimeError(f"request {request_id!r} finished without computing its last prompt token")
        return RunResult(logits.cpu(), ttft, loaded, steps, stored)

    def _flush_stores(self) -> None:
        """Wait until every store issued so far landed in the agent (every rank's); none without a
        connector."""
        if self.rank.has_connector:
            self.worker.flush_stores()

    def close(self) -> None:
        self.rank.close()
        self.scheduler.shutdown()
