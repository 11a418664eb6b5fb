"""``KVGridConnector``: vLLM's v1 KV connector (``KVConnectorBase_V1`` + ``SupportsHMA``) backed by
the per-GPU kvgrid agent. vLLM loads it with ``kv_connector_module_path: kvgrid.connector.vllm``.

vLLM builds two instances (docs/vllm-connector.md): with role SCHEDULER in the engine-core process,
which decides (:class:`~kvgrid.connector.scheduler.ConnectorScheduler`), and with role WORKER in
every worker process, which moves bytes (:class:`~kvgrid.connector.worker.ConnectorWorker`). They
share only the per-step :class:`~kvgrid.connector.metadata.KVGridConnectorMetadata`. This class maps
vLLM's hooks onto the half its role owns; the logic lives in the halves.

Configuration: ``kv_connector_extra_config`` keys, :class:`~kvgrid.connector.config.KVGridConnectorConfig`.
The spec helpers other code imports from here (``create_engine_group_infos_from_vllm``,
``validate_kv_cache_groups``, ``apply_kv_cache_group_edits``) live in :mod:`kvgrid.connector.vllm_specs`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvgrid.connector.config import KVGridConnectorConfig, connector_identity, parse_connector_config
from kvgrid.connector.metadata import KVGridConnectorMetadata, LoadOrder, StoreOrder
from kvgrid.connector.scheduler import ConnectorScheduler
from kvgrid.connector.shm import SharedMemoryAllocation, remove_stale_files
from kvgrid.connector.vllm_specs import (
    apply_kv_cache_group_edits,
    create_engine_group_infos_from_vllm,
    validate_kv_cache_groups,
)
from kvgrid.connector.worker import ConnectorWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

__all__ = [
    "KVGridConnector",
    "KVGridConnectorConfig",
    "KVGridConnectorMetadata",
    "LoadOrder",
    "StoreOrder",
    "apply_kv_cache_group_edits",
    "create_engine_group_infos_from_vllm",
    "parse_connector_config",
    "validate_kv_cache_groups",
]


def _refuse_recurrent_state(kv_cache_config: KVCacheConfig | None) -> None:
    """Mamba (recurrent state) groups are refused: vLLM hands a connector the exact block-boundary
    states of ``align`` mode only through ``SchedulerOutput.kv_connector_block_state``, which kvgrid
    does not read yet; states copied from the block table could be the wrong snapshots."""
    from vllm.v1.kv_cache_interface import MambaSpec

    groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
    bad = [g for g, group in enumerate(groups) if isinstance(group.kv_cache_spec, MambaSpec)]
    if bad:
        raise ValueError(
            f"KVGridConnector: KV cache groups {bad} hold Mamba state (MambaSpec); kvgrid does not "
            f"cache recurrent state yet (its exact boundary states come through "
            f"kv_connector_block_state, which kvgrid does not read). Run this model without "
            f"--kv-transfer-config KVGridConnector"
        )


def _can_prefill_on_loaded_kv(vllm_config: VllmConfig) -> bool:
    """Whether the engine's attention can compute a prompt's tail on top of KV it did not compute
    in the same pass. vLLM's reference MLA kernels outside GPUs cannot (vLLM turns its own prefix
    cache and chunked prefill off for them), so such an engine stores chunks but never loads."""
    from vllm.platforms import current_platform

    model = vllm_config.model_config
    if model is not None and model.use_mla and not current_platform.is_cuda_alike():
        log.warning(
            "kvgrid: MLA on %s: vLLM's attention here cannot prefill on top of loaded KV (vLLM turns "
            "its own prefix cache off for it), so this engine stores chunks but does not load them",
            current_platform.device_type,
        )
        return False
    return True


class KVGridConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector that caches prompt chunks in the kvgrid agent (module docstring)."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _refuse_recurrent_state(kv_cache_config)
        self.config = parse_connector_config(self._kv_transfer_config.kv_connector_extra_config)
        self.identity = connector_identity(
            vllm_config,
            kv_cache_config,
            self.config,
            is_worker=role == KVConnectorRole.WORKER,
            engine_id=self._kv_transfer_config.engine_id or "",
        )
        self._scheduler: ConnectorScheduler | None = None
        self._worker: ConnectorWorker | None = None
        self._shm: SharedMemoryAllocation | None = None
        if role == KVConnectorRole.SCHEDULER:
            events = vllm_config.kv_events_config
            event_block_size = 0
            if events is not None and events.enable_kv_cache_events and kv_cache_config is not None:
                # The token span of one of vLLM's block hashes (what its own events carry).
                _, event_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
            self._scheduler = ConnectorScheduler(
                self.identity,
                self.config,
                is_consumer=bool(self._kv_transfer_config.is_kv_consumer)
                and _can_prefill_on_loaded_kv(vllm_config),
                is_producer=bool(self._kv_transfer_config.is_kv_producer),
                event_block_size=event_block_size,
                # Only where the workers copy (ConnectorWorker._swap_copier's choice); one without
                # a copier after all Retrieves the chunks and ends the lease.
                lease_at_lookup=self.config.lease_at_lookup
                and self.config.engine_copies_on(vllm_config.device_config.device_type == "cuda"),
                async_stores=self.config.async_store_on(vllm_config.device_config.device_type == "cuda"),
            )
        else:
            self._worker = ConnectorWorker(self.identity, self.config)

    @property
    def scheduler(self) -> ConnectorScheduler:
        if self._scheduler is None:
            raise RuntimeError("KVGridConnector: a scheduler hook was called on the worker-side instance")
        return self._scheduler

    @property
    def worker(self) -> ConnectorWorker:
        if self._worker is None:
            raise RuntimeError("KVGridConnector: a worker hook was called on the scheduler-side instance")
        return self._worker

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Layer-wise hooks run Python between layers, which a full CUDA graph would skip."""
        return parse_connector_config(extra_config).layerwise

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is only a future miss

    # ==== scheduler side ==========================================================================

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler.lookup(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.scheduler.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_meta(scheduler_output)

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self.scheduler.take_events()

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler.note_output(connector_output)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.finished(request)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.finished(request)

    # ==== worker side =============================================================================

    def get_mem_pool_context(self) -> AbstractContextManager[Any] | None:
        """CPU engines: allocate the KV cache in shared-memory files the agent can map (GPU KV
        caches go to the agent by CUDA IPC handle and need no special allocation)."""
        if self._worker is None or self._vllm_config.device_config.device_type != "cpu":
            return None
        remove_stale_files(self.config.shm_dir)
        self._shm = SharedMemoryAllocation(self.config.shm_dir)
        return self._shm

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Register every layer's KV tensor with this worker's agent."""
        self.worker.register(self._kv_cache_config, kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before the step writes any block: wait for the stores still in flight of the requests
        whose blocks vLLM freed (finished or preempted) since the last step."""
        assert isinstance(kv_connector_metadata, KVGridConnectorMetadata)
        if kv_connector_metadata.flush_stores:
            self.worker.flush_stores(kv_connector_metadata.flush_stores)

    def flush_stores(self) -> None:
        """kvgrid's own (not vLLM's API): wait until every store issued so far has landed in the
        agent -- for benches, tests and callers that want the prefix findable at once."""
        self.worker.flush_stores()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Hand this step's loads to the background loader (loads are asynchronous)."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVGridConnectorMetadata)
        self.worker.start_loads(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Layer-wise (``layerwise``): wait until this layer's KV is loaded. Asynchronous loads
        end between steps, so without in-step loads there is nothing to wait for."""
        self.worker.wait_for_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        """Layer-wise: after the last layer's attention, start the step's stores in the background."""
        if self.config.layerwise:
            meta = self._get_connector_metadata()
            assert isinstance(meta, KVGridConnectorMetadata)
            self.worker.layer_saved(layer_name, meta)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVGridConnectorMetadata)
        self.worker.store(meta)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sent, finished, failed = self._transfer_results()
        return KVConnectorTransferResults(
            finished_sending=sent, finished_recving=finished, failed_recving=failed
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sent, finished, _ = self._transfer_results()
        return sent or None, finished or None

    def _transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        # vLLM asks with the step's metadata bound; a caller between steps has none (nothing sent).
        meta = getattr(self, "_connector_metadata", None)
        return self.worker.transfer_results(meta.sending if isinstance(meta, KVGridConnectorMetadata) else ())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()
        if self._shm is not None:
            self._shm.remove()
