"""``KVGridConnector``: vLLM's v1 KV connector backed by the per-GPU kvgrid agent.

vLLM builds two instances (seed 004, vllm.md §1): the **scheduler** one decides, the **worker**
one moves bytes, and they share only the per-step :class:`KVGridConnectorMetadata`.

Scheduler side (engine-core process)
  ``get_num_new_matched_tokens`` hashes the prompt into chained chunk keys and asks the agent of
  rank 0 how many leading chunks it holds (that Lookup pins them); ``update_state_after_alloc``
  turns a hit into a load plan over the request's blocks; ``build_connector_meta`` emits load
  orders and store orders (prompt chunks that this step completes); ``request_finished_all_groups``
  drops the request's pins.
Worker side (one per GPU)
  ``register_kv_caches`` registers the layer tensors (CUDA IPC handles, or shared-memory files
  for CPU tensors) with the agent; ``start_load_kv`` issues Retrieves (whole-request, before the
  forward: loads are synchronous); ``wait_for_save`` issues Stores after the forward;
  ``get_block_ids_with_load_errors`` reports the blocks of chunks that did not load.

Configuration: ``kv_connector_extra_config`` keys, see :class:`KVGridConnectorConfig` and
docs/vllm-connector.md.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

import grpc
import msgspec
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvgrid.agent.client import AgentClient
from kvgrid.common.groups import EngineGroupInfo
from kvgrid.common.hashing import KeyNamespace, chunk_keys
from kvgrid.connector.plan import (
    failed_block_ids,
    kv_identity,
    loadable_chunks,
    new_tokens_to_load,
    storable_chunks,
)
from kvgrid.connector.shm import shared_memory_file
from kvgrid.connector.vllm import (
    _hints_per_layer,
    _tokens_per_block,
    apply_kv_cache_group_edits,
    create_engine_group_infos_from_vllm,
    ordered_layer_names,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = [
    "KVGridConnector",
    "KVGridConnectorConfig",
    "KVGridConnectorMetadata",
    "LoadOrder",
    "StoreOrder",
    "parse_connector_config",
]

log = logging.getLogger(__name__)


def _d(text: str) -> msgspec.Meta:
    return msgspec.Meta(description=text)


class KVGridConnectorConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The keys of ``kv_connector_extra_config`` (every one optional)."""

    agent_socket: Annotated[
        str,
        _d(
            "The kvgrid agent's Unix socket (or host:port). '{rank}' and '{dp_rank}' are replaced by "
            "the worker's rank and the engine's data-parallel rank (one agent per GPU); the "
            "scheduler uses rank 0's"
        ),
    ] = "/run/kvgrid/agent.sock"
    chunk_size: Annotated[
        int,
        _d("Tokens per cached chunk; a multiple of every KV cache group's block size"),
        msgspec.Meta(gt=0),
    ] = 256
    pin_ttl_ms: Annotated[
        int,
        _d("How long a Lookup pins the chunks it found until they are loaded (ms); 0 = the agent's default"),
        msgspec.Meta(ge=0),
    ] = 0
    rpc_timeout_s: Annotated[float, _d("Deadline of each agent call (s)"), msgspec.Meta(gt=0)] = 30.0
    model_name: Annotated[
        str, _d("Model name in the key namespace; empty = vLLM's --model (the weights path or id)")
    ] = ""
    instance_id: Annotated[
        str,
        _d("This engine worker's id at the agent; '{engine_id}', '{dp_rank}' and '{rank}' are replaced"),
    ] = "{engine_id}-dp{dp_rank}-r{rank}"
    kv_identity: Annotated[
        str, _d("Extra text folded into the key namespace (anything else that changes KV bytes)")
    ] = ""
    layout_hints: Annotated[
        dict[str, str | int],
        _d('Layout hints for every layer (kvgrid.common.layouts), e.g. {"backend": "FLASHINFER"}'),
    ] = msgspec.field(default_factory=dict)


def parse_connector_config(extra: Mapping[str, Any] | None) -> KVGridConnectorConfig:
    """``kv_connector_extra_config`` -> config; ValueError naming the bad key or value."""
    try:
        return msgspec.convert(dict(extra or {}), KVGridConnectorConfig, strict=False)
    except msgspec.ValidationError as e:
        raise ValueError(
            f"kv_connector_extra_config {dict(extra or {})!r}: {e}; expected keys "
            f"{list(KVGridConnectorConfig.__struct_fields__)}"
        ) from None


# ---- metadata (scheduler -> workers, once per step; pickled across processes) -------------------


@dataclass
class LoadOrder:
    """Scatter the leading held chunks of ``keys`` into the request's blocks."""

    request_id: str
    keys: list[list[bytes]]
    """Per worker rank: the chunk keys to load (rank r hashes with its own namespace)."""
    block_ids: list[list[int]]
    """One list per KV cache group, from token 0."""
    skip_first_n_tokens: int
    """The engine's own prefix-cache hit: blocks wholly inside it are not written."""


@dataclass
class StoreOrder:
    """Gather the request's chunks ``[skip_first_n_chunks, len(keys))`` into the agent's L1."""

    request_id: str
    keys: list[list[bytes]]
    block_ids: list[list[int]]
    skip_first_n_chunks: int


@dataclass
class KVGridConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadOrder] = field(default_factory=list)
    stores: list[StoreOrder] = field(default_factory=list)


# ---- scheduler-side per-request state ----------------------------------------------------------


@dataclass
class _Lookup:
    """What get_num_new_matched_tokens found, for update_state_after_alloc to act on."""

    hit_chunks: int
    num_computed_tokens: int


@dataclass
class _RequestState:
    request_id: str
    num_prompt_tokens: int
    keys: list[list[bytes]]
    block_ids: list[list[int]] = field(default_factory=list)
    num_stored_chunks: int = 0
    """Leading chunks known to be in the agent (loaded from it or already stored)."""
    load: LoadOrder | None = None
    pinned: bool = False


def _format(template: str, what: str, **values: object) -> str:
    try:
        return template.format(**values)
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(
            f"kv_connector_extra_config {what}={template!r}: bad placeholder ({e}); expected only "
            f"{['{' + k + '}' for k in values]}"
        ) from None


class KVGridConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector that caches prompt chunks in the kvgrid agent (module docstring)."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.config = parse_connector_config(self._kv_transfer_config.kv_connector_extra_config)
        par = vllm_config.parallel_config
        self.world_size = int(par.world_size)
        self.rank = int(par.rank) if role == KVConnectorRole.WORKER else 0
        dp_rank = int(getattr(par, "data_parallel_rank", 0) or 0)
        self.dcp_size = int(getattr(par, "decode_context_parallel_size", 1) or 1)
        engine_id = self._kv_transfer_config.engine_id or ""
        self.instance_id = _format(
            self.config.instance_id, "instance_id", engine_id=engine_id, dp_rank=dp_rank, rank=self.rank
        )
        self.agent_address = _format(
            self.config.agent_socket, "agent_socket", dp_rank=dp_rank, rank=self.rank
        )
        self.tokens_per_chunk = self.config.chunk_size
        self.tokens_per_block = self._group_tokens_per_block(kv_cache_config, self.dcp_size)
        for g, tpb in enumerate(self.tokens_per_block):
            if self.tokens_per_chunk % tpb:
                raise ValueError(
                    f"kv_connector_extra_config chunk_size={self.tokens_per_chunk}: expected a multiple of "
                    f"KV cache group {g}'s {tpb} tokens per block"
                )
        self.model_name = self.config.model_name or self._model_name(vllm_config)
        self.kv_identities = [
            self._kv_identity(vllm_config, kv_cache_config, r) for r in range(self.world_size)
        ]
        self.agent = AgentClient(self.agent_address, timeout_s=self.config.rpc_timeout_s)
        # Scheduler side.
        self._lookups: dict[str, _Lookup] = {}
        self._keys: dict[str, list[list[bytes]]] = {}
        self._requests: dict[str, _RequestState] = {}
        # Worker side.
        self._registered = False
        self._transfer_groups: tuple[int, ...] = ()
        self._invalid_block_ids: set[int] = set()
        self._cuda = False

    # ---- identity ----------------------------------------------------------------------------

    def _group_tokens_per_block(self, kv_cache_config: KVCacheConfig | None, dcp_size: int) -> list[int]:
        """Tokens one block id covers, per KV cache group (the legacy no-config form: one group of
        ``cache_config.block_size``)."""
        if kv_cache_config is not None and kv_cache_config.kv_cache_groups:
            return [_tokens_per_block(g.kv_cache_spec, dcp_size) for g in kv_cache_config.kv_cache_groups]
        block_size = int(self._vllm_config.cache_config.block_size or 0)
        return [block_size] if block_size > 0 else []

    @staticmethod
    def _model_name(vllm_config: VllmConfig) -> str:
        model_config = vllm_config.model_config
        if model_config is None or not model_config.model:
            raise ValueError(
                "KVGridConnector: vLLM has no model config; set kv_connector_extra_config "
                "model_name to name the model in the chunk-key namespace"
            )
        return str(model_config.model)

    def _kv_identity(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None, rank: int) -> str:
        dtype = str(vllm_config.cache_config.cache_dtype)
        if dtype == "auto" and vllm_config.model_config is not None:
            dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
        layout = (kv_cache_config.kv_cache_layout if kv_cache_config is not None else None) or ""
        par = vllm_config.parallel_config
        return kv_identity(
            dtype=dtype,
            layout=layout,
            rank=rank,
            world_size=self.world_size,
            tp_size=int(par.tensor_parallel_size),
            pp_size=int(par.pipeline_parallel_size),
            extra=self.config.kv_identity,
        )

    def namespace(self, rank: int, cache_salt: str = "", lora_name: str = "") -> KeyNamespace:
        """The key namespace of worker ``rank`` for a request with this salt and LoRA adapter."""
        return KeyNamespace(
            model=self.model_name,
            cache_salt=cache_salt,
            lora_name=lora_name,
            tokens_per_chunk=self.tokens_per_chunk,
            kv_identity=self.kv_identities[rank],
        )

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is only a future miss

    # ==== scheduler side ==========================================================================

    def _request_keys(self, request: Request) -> list[list[bytes]] | None:
        """Per worker rank, the keys of the prompt's full chunks; None if the request is not cacheable."""
        keys = self._keys.get(request.request_id)
        if keys is not None:
            return keys
        if (
            request.prompt_token_ids is None
            or getattr(request, "prompt_embeds", None) is not None
            or getattr(request, "mm_features", None)
        ):
            # Prompt embeddings and multimodal inputs: the KV is not a function of token ids alone.
            return None
        lora = request.lora_request.lora_name if request.lora_request is not None else ""
        salt = request.cache_salt or ""
        keys = [
            chunk_keys(request.prompt_token_ids, self.namespace(r, salt, lora))
            for r in range(self.world_size)
        ]
        self._keys[request.request_id] = keys
        return keys

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self._lookups.pop(request.request_id, None)
        if not self._kv_transfer_config.is_kv_consumer:
            return 0, False
        keys = self._request_keys(request)
        if keys is None:
            return 0, False
        limit = min(loadable_chunks(request.num_prompt_tokens, self.tokens_per_chunk), len(keys[0]))
        if limit * self.tokens_per_chunk <= num_computed_tokens:
            return 0, False
        try:
            res = self.agent.lookup(
                self.instance_id, request.request_id, keys[0][:limit], pin_ttl_ms=self.config.pin_ttl_ms
            )
        except grpc.RpcError as e:
            log.warning("kvgrid lookup for request %s failed: %s", request.request_id, _rpc_text(e))
            return 0, False
        n = new_tokens_to_load(res.num_hit_chunks, self.tokens_per_chunk, num_computed_tokens)
        self._lookups[request.request_id] = _Lookup(res.num_hit_chunks, num_computed_tokens)
        return n, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        found = self._lookups.pop(request.request_id, None)
        keys = self._request_keys(request)
        if keys is None:
            return
        state = _RequestState(request.request_id, request.num_prompt_tokens, keys)
        state.pinned = found is not None and found.hit_chunks > 0
        state.block_ids = [list(ids) for ids in blocks.get_block_ids()]
        if found is not None and num_external_tokens > 0:
            end = found.num_computed_tokens + num_external_tokens
            n = min(-(-end // self.tokens_per_chunk), found.hit_chunks)
            state.load = LoadOrder(
                request_id=request.request_id,
                keys=[k[:n] for k in keys],
                block_ids=state.block_ids,
                skip_first_n_tokens=found.num_computed_tokens,
            )
            state.num_stored_chunks = n
        elif state.pinned:
            self._release(request.request_id)
            state.pinned = False
        self._requests[request.request_id] = state

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVGridConnectorMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        progress: list[tuple[_RequestState, int]] = []
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            state.block_ids = [list(ids) for ids in new.block_ids]
            progress.append((state, new.num_computed_tokens + scheduled.get(new.req_id, 0)))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = [list(ids) for ids in new_ids or ()]
            elif new_ids is not None:
                for ids, more in zip(state.block_ids, new_ids, strict=True):
                    ids.extend(more)
            progress.append((state, cached.num_computed_tokens[i] + scheduled.get(req_id, 0)))
        for state, computed_after_step in progress:
            if state.load is not None:
                state.load.block_ids = [list(ids) for ids in state.block_ids]
                meta.loads.append(state.load)
                state.load = None
            if not self._kv_transfer_config.is_kv_producer:
                continue
            done = min(
                storable_chunks(computed_after_step, state.num_prompt_tokens, self.tokens_per_chunk),
                len(state.keys[0]),
            )
            if done > state.num_stored_chunks:
                meta.stores.append(
                    StoreOrder(
                        request_id=state.request_id,
                        keys=[k[:done] for k in state.keys],
                        block_ids=[list(ids) for ids in state.block_ids],
                        skip_first_n_chunks=state.num_stored_chunks,
                    )
                )
                state.num_stored_chunks = done
        return meta

    def _release(self, request_id: str) -> None:
        try:
            self.agent.release(self.instance_id, request_id)
        except grpc.RpcError as e:
            log.warning("kvgrid release for request %s failed: %s", request_id, _rpc_text(e))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Drop the request's state and pins. Saves finish inside ``wait_for_save``, so the blocks
        may be freed at once (False)."""
        rid = request.request_id
        self._keys.pop(rid, None)
        found = self._lookups.pop(rid, None)
        state = self._requests.pop(rid, None)
        if (state is not None and state.pinned) or (found is not None and found.hit_chunks):
            self._release(rid)
        return False, None

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    # ==== worker side =============================================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Register every layer's KV tensor with this GPU's agent (CUDA IPC handles, or the
        shared-memory file of a CPU tensor)."""
        kvc = self._kv_cache_config
        edited = apply_kv_cache_group_edits(kvc, kv_caches)
        hints_arg = dict(self.config.layout_hints) or None
        infos: list[EngineGroupInfo] = create_engine_group_infos_from_vllm(
            kvc, edited, layout_hints=hints_arg, dcp_size=self.dcp_size
        )
        names = ordered_layer_names(edited)
        tensors = [edited[n] for n in names]
        shm_paths: list[str] | None = None
        if any(not t.is_cuda for t in tensors):
            shm_paths = [shared_memory_file(t, f"layer {n!r}") for n, t in zip(names, tensors, strict=True)]
        if kvc is not None and kvc.kv_cache_groups:
            hints = _hints_per_layer(names, hints_arg, kvc)
        else:
            hints = [hints_arg] * len(names)
        self._transfer_groups = tuple(sorted({i.engine_group_id for i in infos})) if infos else (0,)
        if not self.tokens_per_block:
            raise ValueError("KVGridConnector: no KV cache config and no cache_config.block_size")
        try:
            self.agent.register_kv_caches(
                self.instance_id,
                tensors,
                namespace=self.namespace(self.rank),
                engine_groups=infos,
                shm_paths=shm_paths,
                layout_hints=hints,
                engine_pid=os.getpid(),
            )
        except grpc.RpcError as e:
            raise ConnectionError(
                f"kvgrid agent at {self.agent_address!r} refused or did not answer RegisterKVCaches for "
                f"instance {self.instance_id!r}: {_rpc_text(e)} (is `kvgrid agent` running with "
                f"--uds-path pointing there?)"
            ) from None
        self._registered = True
        self._cuda = any(t.is_cuda for t in tensors)
        log.info(
            "kvgrid: registered %d layers (%d engine-group infos) as %s at %s",
            len(tensors),
            len(infos),
            self.instance_id,
            self.agent_address,
        )

    def _my_keys(self, keys: list[list[bytes]]) -> list[bytes]:
        return keys[self.rank] if len(keys) > self.rank else keys[0]

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Issue this step's Retrieves; returns when the blocks are written (synchronous loads)."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVGridConnectorMetadata)
        if meta.loads:
            self._sync_engine_stream()  # the runner's zeroing of fresh blocks must land first
        for order in meta.loads:
            keys = self._my_keys(order.keys)
            try:
                res = self.agent.retrieve(
                    self.instance_id,
                    order.request_id,
                    keys,
                    order.block_ids,
                    skip_first_n_tokens=order.skip_first_n_tokens,
                )
                loaded = res.num_retrieved_chunks
            except grpc.RpcError as e:
                log.warning("kvgrid retrieve for request %s failed: %s", order.request_id, _rpc_text(e))
                loaded = 0
            if loaded < len(keys):
                failed = failed_block_ids(
                    order.block_ids,
                    self.tokens_per_block,
                    start_token=loaded * self.tokens_per_chunk,
                    end_token=len(keys) * self.tokens_per_chunk,
                    skip_first_n_tokens=order.skip_first_n_tokens,
                    groups=[g for g in self._transfer_groups if g < len(order.block_ids)],
                )
                log.warning(
                    "kvgrid: request %s loaded %d of %d chunks; %d blocks failed",
                    order.request_id,
                    loaded,
                    len(keys),
                    len(failed),
                )
                if len(self.tokens_per_block) > 1 and failed:
                    # vLLM 0.32 maps invalid block ids back to requests only with one KV cache group
                    # (ids repeat across groups) and takes failed_recving only for async loads:
                    # fail closed rather than let the forward read blocks that were never written.
                    raise RuntimeError(
                        f"kvgrid: request {order.request_id!r} loaded {loaded} of {len(keys)} chunks and "
                        f"vLLM cannot recompute the rest of a hybrid ({len(self.tokens_per_block)}-group) "
                        f"KV cache from block ids"
                    )
                self._invalid_block_ids |= failed

    def _sync_engine_stream(self) -> None:
        # The agent copies on its own CUDA stream; kernels queued on the engine's stream (zeroing,
        # the forward) are invisible to it until they finish. A whole-stream sync is the simple,
        # coarse fence (an interprocess CUDA event per request would be finer).
        if self._cuda:
            torch.cuda.current_stream().synchronize()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # whole-request loads finish in start_load_kv

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return  # whole-request stores run in wait_for_save

    def wait_for_save(self) -> None:
        """Issue this step's Stores; returns when the agent holds the chunks (best effort)."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVGridConnectorMetadata)
        if meta.stores:
            self._sync_engine_stream()  # the forward's KV writes must land before the agent reads
        for order in meta.stores:
            try:
                res = self.agent.store(
                    self.instance_id,
                    self._my_keys(order.keys),
                    order.block_ids,
                    skip_first_n_chunks=order.skip_first_n_chunks,
                )
            except grpc.RpcError as e:
                log.warning("kvgrid store for request %s failed: %s", order.request_id, _rpc_text(e))
                continue
            if res.partial_reason:
                log.info(
                    "kvgrid store for request %s kept %d chunks: %s",
                    order.request_id,
                    res.num_stored_chunks,
                    res.partial_reason,
                )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None  # nothing is asynchronous

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._invalid_block_ids = self._invalid_block_ids, set()
        return out

    def shutdown(self) -> None:
        if self._registered:
            try:
                self.agent.unregister_kv_caches(self.instance_id)
            except grpc.RpcError as e:
                log.info("kvgrid unregister of %s failed: %s", self.instance_id, _rpc_text(e))
            self._registered = False
        self.agent.close()


def _rpc_text(e: grpc.RpcError) -> str:
    code = e.code() if hasattr(e, "code") else None
    details = e.details() if hasattr(e, "details") else str(e)
    return f"{getattr(code, 'name', code)}: {details}"
