"""The connector worker's state and its registration with the agent (the base of
:class:`kvgrid.connector.worker.ConnectorWorker`; the overview is that module's docstring).

``register``
    registers every layer's KV tensor with the agent (CUDA IPC handles, or the shared-memory file
    of a CPU tensor -- see :mod:`kvgrid.connector.shm`) and keeps what it sent, to send it again.
    On CUDA it also sends the IPC handles of the two interprocess events that order the agent's
    copies with the engine's stream (``fence_event``, ``done_event``; kept across
    re-registrations), and opens the engine-side copier when the agent shares its L1
    (:mod:`kvgrid.connector.engine_copies`).
Agent restarts
    a call that fails because the agent is away or forgot this instance marks the registration
    stale; the worker registers the same KV memory again (at most every
    ``reregister_interval_s``, in the background) and hits resume.

Invariant: the copier is swapped only on the loader thread, between loads, so no load is queueing
on a copier being closed; a registration with the same L1 file keeps the mapping.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import torch

from kvgrid.common.groups import EngineGroupInfo
from kvgrid.connector.config import ConnectorIdentity, KVGridConnectorConfig
from kvgrid.connector.engine_copies import EngineCopier, open_engine_copier
from kvgrid.connector.scheduler import rpc_text
from kvgrid.connector.shm import shared_memory_file
from kvgrid.connector.vllm_specs import (
    apply_kv_cache_group_edits,
    create_engine_group_infos_from_vllm,
    hints_per_layer,
    ordered_layer_names,
)
from kvgrid.engine.client import AgentClient

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["Registration", "WorkerRegistration", "WorkerStats"]

log = logging.getLogger("kvgrid.connector.worker")  # the worker's one logger, whichever module logs

# Codes that mean "the agent is away or no longer knows this instance": register again.
_STALE_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DEADLINE_EXCEEDED}
)


@dataclass
class WorkerStats:
    """Counters since start (read by tests and the demo; vLLM's own metrics come later)."""

    chunks_loaded: int = 0
    chunks_load_failed: int = 0
    chunks_stored: int = 0
    """Chunks newly copied into L1 by this worker's stores (not those already there)."""
    registrations: int = 0
    loads_in_step: int = 0
    """Layer-wise loads waited for inside a step (by the first layer or at the step's end)."""
    stores_from_last_layer: int = 0
    """Layer-wise: steps whose stores started when the last layer's KV was written."""
    stores_skipped: int = 0
    """Store orders dropped while the agent was away (registration stale)."""
    flushed_requests: int = 0
    """Requests ``handle_preemptions`` named (vLLM freed their blocks with stores ordered)."""
    requests_sent: int = 0
    """Finished requests reported in ``finished_sending`` (vLLM held their blocks for their stores)."""
    chunks_engine_copied: int = 0
    """Chunks loaded by the engine's own kernels over the agent's shared L1 (engine_copies)."""
    chunks_engine_stored: int = 0
    """Chunks the engine's own kernels gathered into the agent's shared L1 (engine_copies)."""
    loads_staged: int = 0
    """Layer-wise engine-side loads copied stage by stage (each layer waited for its own stage)."""


@dataclass
class Registration:
    """What the worker registered, kept to register it again."""

    names: list[str]
    tensors: list[torch.Tensor]
    infos: list[EngineGroupInfo]
    shm_paths: list[str] | None
    hints: Sequence[Any]
    last_layer: str
    """The layer whose attention runs last in a forward (layers run in registration order)."""


class WorkerRegistration:
    """The worker's agent, state and registration (module docstring)."""

    def __init__(self, identity: ConnectorIdentity, config: KVGridConnectorConfig) -> None:
        self.identity = identity
        self.config = config
        self.agent = AgentClient(identity.agent_address, timeout_s=config.rpc_timeout_s)
        self._registration: Registration | None = None
        self._stale = False
        self._bytes_per_chunk = 1  # the agent's, from the registration (counts stored chunks)
        self._last_attempt = 0.0
        self._cuda = False
        self._transfer_groups: tuple[int, ...] = ()
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvgrid-load")
        """Runs the loads, one at a time, and the copier swaps between them."""
        self._lock = threading.Lock()
        self._registrar = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvgrid-register")
        self._reregistering: Future[None] | None = None
        self._async_store = False
        self._fence: torch.cuda.Event | None = None
        self._loaded: torch.cuda.Event | None = None
        self._copier: EngineCopier | None = None
        """Engine-side loads over the agent's shared L1 (None: the agent copies)."""
        self._stage_of: dict[str, int] = {}
        """Layer name -> its stage of the copier's layer-wise loads."""
        self.stats = WorkerStats()

    # ---- registration ---------------------------------------------------------------------------

    def register(self, kv_cache_config: KVCacheConfig | None, kv_caches: dict[str, torch.Tensor]) -> None:
        edited = apply_kv_cache_group_edits(kv_cache_config, kv_caches)
        hints_arg = dict(self.config.layout_hints) or None
        infos = create_engine_group_infos_from_vllm(
            kv_cache_config, edited, layout_hints=hints_arg, dcp_size=self.identity.dcp_size
        )
        names = ordered_layer_names(edited)
        tensors = [edited[n] for n in names]
        shm_paths: list[str] | None = None
        if any(not t.is_cuda for t in tensors):
            shm_paths = [shared_memory_file(t, f"layer {n!r}") for n, t in zip(names, tensors, strict=True)]
        if kv_cache_config is not None and kv_cache_config.kv_cache_groups:
            hints: Sequence[Any] = hints_per_layer(names, hints_arg, kv_cache_config, tensors)
        else:
            hints = [hints_arg] * len(names)
        if not self.identity.tokens_per_block:
            raise ValueError("KVGridConnector: no KV cache config and no cache_config.block_size")
        self._transfer_groups = tuple(sorted({i.engine_group_id for i in infos})) if infos else (0,)
        self._cuda = any(t.is_cuda for t in tensors)
        self._async_store = self._cuda if self.config.async_store is None else self.config.async_store
        if self._cuda and self._fence is None:  # both kept across re-registrations
            self._fence = torch.cuda.Event(interprocess=True)
            self._loaded = torch.cuda.Event(interprocess=True)
        self._registration = Registration(names, tensors, infos, shm_paths, hints, names[-1])
        try:
            self._send_registration()
        except grpc.RpcError as e:
            raise ConnectionError(
                f"kvgrid agent at {self.identity.agent_address!r} refused or did not answer "
                f"RegisterKVCaches for instance {self.identity.instance_id!r}: {rpc_text(e)} (is `kvgrid "
                f"agent` running with --uds-path pointing there?)"
            ) from None
        log.info(
            "kvgrid: registered %d layers (%d engine-group infos) as %s at %s",
            len(tensors),
            len(infos),
            self.identity.instance_id,
            self.identity.agent_address,
        )

    def _send_registration(self) -> None:
        reg = self._registration
        assert reg is not None
        resp = self.agent.register_kv_caches(
            self.identity.instance_id,
            reg.tensors,
            namespace=self.identity.namespace(self.identity.rank),
            engine_groups=reg.infos,
            shm_paths=reg.shm_paths,
            layout_hints=reg.hints,
            engine_pid=os.getpid(),
            fence_event=self._fence,
            done_event=self._loaded,
        )
        self._stale = False
        self._bytes_per_chunk = max(1, int(resp.bytes_per_chunk))
        self.stats.registrations += 1
        self._open_copier(resp, reg)

    def _open_copier(self, resp: Any, reg: Registration) -> None:
        """Engine-side copies when configured (unset: CUDA engines) and the agent shares its L1. A
        registration with the same file keeps the mapping (the agent did not restart). The swap
        runs on the loader thread, between loads: no load is queueing on a copier being closed."""
        self._loader.submit(self._swap_copier, resp, reg).result()

    def _swap_copier(self, resp: Any, reg: Registration) -> None:
        want = self.config.engine_copies_on(self._cuda)
        old = self._copier
        if old is not None and want and old.l1_file == resp.l1_file:
            return
        self._copier = None  # on the loader thread: no load reads it meanwhile
        if old is not None:
            old.close()  # its copies land and their leases end first
        if want:
            stages = self.config.layerwise_stages if self.config.layerwise else 0
            copier = open_engine_copier(resp, reg.tensors, reg.infos, reg.hints, self._loaded, stages=stages)
            if copier is not None:
                stage_of = copier.stage_of_layer
                # A layer missing here waits for every stage of the step's loads (StagedLoad.finish).
                self._stage_of = {n: stage_of[i] for i, n in enumerate(reg.names) if i in stage_of}
            self._copier = copier

    def _note_failure(self, what: str, request_id: str, e: grpc.RpcError) -> None:
        code = e.code() if isinstance(e, grpc.Call) else None
        text = rpc_text(e)
        if code in _STALE_CODES or "is not registered" in text:
            self._stale = True
        log.warning("kvgrid %s for request %s failed: %s", what, request_id, text)

    def maybe_reregister(self) -> None:
        """Register again if a call showed the agent lost this instance: in the background,
        at most every ``reregister_interval_s``, so a hung agent never holds up the engine's step."""
        if not self._stale or self._registration is None:
            return
        if self._reregistering is not None and not self._reregistering.done():
            return
        now = time.monotonic()
        if now - self._last_attempt < self.config.reregister_interval_s:
            return
        self._last_attempt = now
        self._reregistering = self._registrar.submit(self._reregister)

    def _reregister(self) -> None:
        try:
            self._send_registration()
        except grpc.RpcError as e:
            log.info("kvgrid: agent at %s not back yet: %s", self.identity.agent_address, rpc_text(e))
            return
        log.warning("kvgrid: registered %s again (the agent had restarted)", self.identity.instance_id)

    def _my_keys(self, keys: list[list[bytes]]) -> list[bytes]:
        return keys[self.identity.rank] if len(keys) > self.identity.rank else keys[0]

    def _fence_engine_stream(self) -> None:
        """Mark the work queued so far on the engine's stream (zeroing, the forward's KV writes):
        the agent's next copies wait for it on the GPU (:mod:`kvgrid.connector.worker`, Fences)."""
        if self._fence is not None:
            self._fence.record()
