"""The worker half of the connector (one per GPU / CPU worker): moves bytes through its agent.

``register``
    registers every layer's KV tensor with the agent (CUDA IPC handles, or the shared-memory file
    of a CPU tensor -- see :mod:`kvgrid.connector.shm`) and keeps what it sent, to send it again.
``start_loads``
    hands the step's :class:`LoadOrder` s to one background thread (Retrieve calls) and returns.
``transfer_results``
    reports every load that ended -- succeeded, partly failed or failed -- exactly once in
    ``finished_recving``. A partial load is reported precisely: on a one-group model the blocks of
    the chunks that did not arrive (vLLM recomputes from there); on a hybrid model, where block
    ids repeat across groups and cannot be mapped back, the request in ``failed_recving`` (vLLM
    recomputes or fails that request only, per ``kv_load_failure_policy``). The engine never stops.
``store``
    issues the step's Stores after the forward (``wait_for_save``); best effort, a failure is a
    future miss. With ``async_store`` (the default on CUDA) it returns at once: the Stores run on a
    background thread. vLLM keeps a finished request's blocks until ``transfer_results`` reports it
    in ``finished_sending``, which it does once the request's stores landed (the metadata's
    ``sending`` names such requests); ``flush_stores`` (vLLM's ``handle_preemptions``, before the
    next step writes any block) waits only for those of requests whose blocks vLLM freed
    (preempted).
Fences (CUDA)
    the agent copies on its own stream in another process, blind to the engine's queued kernels.
    At registration the worker sends the IPC handle of an interprocess CUDA event; before a
    Retrieve or Store it records that event on the engine's stream and the agent's copy waits for
    it on the GPU (``after_fence``), so the engine's host never synchronizes its stream. A copy that
    sees a later record of the event only waits longer, never too little. The other way round, a
    second interprocess event (``done_event``): a Retrieve with ``signal_done`` answers once the
    agent queued its copies and records that event after them; before anything reads the loaded
    blocks (the first layer of an in-step load, or the step after an asynchronous load is
    reported) the engine's stream waits for the event -- on the GPU, so the host goes on queueing
    the forward while the bytes move. Loads run one at a time on the loader thread, so the event's
    last record covers every load reported so far.
Engine-side copies (``engine_copies``)
    when the agent shares its L1 file, loads run the same kernels in the engine's own process and
    CUDA context (:mod:`kvgrid.connector.engine_copies`): the chunks are leased to the request -- by
    the scheduler's Lookup with ``lease_at_lookup`` (the load order carries it), else by a Retrieve
    here -- the worker queues the scatter from their offsets after the fence and records the
    load-done event after it, and Release ends the lease once the bytes landed. Stores too: the
    agent reserves the new chunks' room, the saver thread gathers into it after the fence, and a
    second Store makes them visible (a failed copy drops them). Layer-wise loads are copied in
    ``layerwise_stages`` stages of consecutive layers, each layer waiting only for its own stage (on
    the GPU, on a per-stage event; no load-done record, the step's end waits for every stage):
    loading stage s+1 overlaps the compute of stage s, and the request costs one Release (and a
    Retrieve only when its Lookup could not lease) whatever the number of layers.
Agent restarts
    a call that fails because the agent is away or forgot this instance marks the registration
    stale; the worker registers the same KV memory again (at most every
    ``reregister_interval_s``) and hits resume. Nothing fails meanwhile: lookups miss, loads are
    reported failed (recomputed), stores are dropped.

Invariants: vLLM frees the blocks of a request with a load in flight only after the load is
reported, so no load writes into freed blocks (the thread never outlives its report). A store
reads its blocks before anything else writes them: the blocks of a running request are not
rewritten (stored chunks are full), a finished request's blocks are freed only once it is
reported sent (after its stores), and other freed blocks are written only by a later step, whose
``handle_preemptions`` waits for the stores of the requests that held them.
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

from kvgrid.agent.client import AgentClient
from kvgrid.agent.results import StoreResult
from kvgrid.common.groups import EngineGroupInfo
from kvgrid.connector.chunk_policy import NULL_BLOCK_ID, failed_block_ids
from kvgrid.connector.config import ConnectorIdentity, KVGridConnectorConfig
from kvgrid.connector.engine_copies import EngineCopier, StagedLoad, open_engine_copier
from kvgrid.connector.metadata import KVGridConnectorMetadata, Lease, LoadOrder, StoreOrder
from kvgrid.connector.scheduler import end_lease, rpc_text
from kvgrid.connector.shm import shared_memory_file
from kvgrid.connector.tracing import agent_call_span
from kvgrid.connector.vllm_specs import (
    apply_kv_cache_group_edits,
    create_engine_group_infos_from_vllm,
    hints_per_layer,
    ordered_layer_names,
)

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["ConnectorWorker", "LoadOutcome", "WorkerStats", "agent_block_ids"]

log = logging.getLogger(__name__)

# Codes that mean "the agent is away or no longer knows this instance": register again.
_STALE_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DEADLINE_EXCEEDED}
)


def agent_block_ids(block_ids: list[list[int]]) -> list[list[int]]:
    """vLLM's block ids as the agent takes them: vLLM's null block (where a sliding-window group
    keeps no block for tokens outside its window) becomes -1, "no block here"."""
    return [[-1 if b == NULL_BLOCK_ID else b for b in ids] for ids in block_ids]


@dataclass(frozen=True)
class LoadOutcome:
    """How one load ended: ``loaded`` of ``wanted`` leading chunks arrived."""

    order: LoadOrder
    loaded: int
    wanted: int
    staged: StagedLoad | None = None
    """A layer-wise engine-side load still landing stage by stage (the layers wait for it)."""


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
class _Registration:
    names: list[str]
    tensors: list[torch.Tensor]
    infos: list[EngineGroupInfo]
    shm_paths: list[str] | None
    hints: Sequence[Any]
    last_layer: str
    """The layer whose attention runs last in a forward (layers run in registration order)."""


class ConnectorWorker:
    """Worker-side transfers and the agent registration (module docstring)."""

    def __init__(self, identity: ConnectorIdentity, config: KVGridConnectorConfig) -> None:
        self.identity = identity
        self.config = config
        self.agent = AgentClient(identity.agent_address, timeout_s=config.rpc_timeout_s)
        self._registration: _Registration | None = None
        self._stale = False
        self._bytes_per_chunk = 1  # the agent's, from the registration (counts stored chunks)
        self._last_attempt = 0.0
        self._cuda = False
        self._transfer_groups: tuple[int, ...] = ()
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvgrid-load")
        self._lock = threading.Lock()
        self._loading: dict[str, Future[LoadOutcome]] = {}
        self._invalid_block_ids: set[int] = set()
        self._step_loads: list[Future[LoadOutcome]] = []
        self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvgrid-store")
        self._registrar = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvgrid-register")
        self._reregistering: Future[None] | None = None
        self._saving: Future[None] | None = None
        self._async_store = False
        self._fence: torch.cuda.Event | None = None
        self._loaded: torch.cuda.Event | None = None
        self._stores_in_flight: dict[str, Future[None]] = {}
        """Request id -> the latest background store covering it (async_store)."""
        self._sending: set[str] = set()
        """Finished requests whose blocks vLLM holds until reported sent (their stores landed)."""
        self._copier: EngineCopier | None = None
        """Engine-side loads over the agent's shared L1 (None: the agent copies)."""
        self._stage_of: dict[str, int] = {}
        """Layer name -> its stage of the copier's layer-wise loads."""
        self._staged: list[StagedLoad] = []
        """This step's layer-wise engine-side loads (settled, still landing stage by stage)."""
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
        self._registration = _Registration(names, tensors, infos, shm_paths, hints, names[-1])
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

    def _open_copier(self, resp: Any, reg: _Registration) -> None:
        """Engine-side copies when configured (unset: CUDA engines) and the agent shares its L1. A
        registration with the same file keeps the mapping (the agent did not restart). The swap
        runs on the loader thread, between loads: no load is queueing on a copier being closed."""
        self._loader.submit(self._swap_copier, resp, reg).result()

    def _swap_copier(self, resp: Any, reg: _Registration) -> None:
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

    # ---- loads ----------------------------------------------------------------------------------

    def start_loads(self, meta: KVGridConnectorMetadata) -> None:
        self.maybe_reregister()
        if not meta.loads:
            return
        self._fence_engine_stream()  # the runner's zeroing of fresh blocks must land first
        with self._lock:
            for order in meta.loads:
                future = self._loader.submit(self._load, order)
                if order.in_step:
                    self._step_loads.append(future)
                else:
                    self._loading[order.request_id] = future

    def wait_for_layer(self, layer_name: str) -> None:
        """Layer-wise: return once the step's loads have written ``layer_name``'s KV (on CUDA: once
        the engine's stream waits for it). A load the agent copies moves every layer in one call,
        so the first layer waits for all of them; an engine-side load waits for the layer's stage."""
        if self._step_loads:
            self._settle_step_loads()
        stage = self._stage_of.get(layer_name)
        for load in self._staged:
            if stage is None:
                load.finish()
            else:
                load.wait(stage)

    def _settle_step_loads(self) -> None:
        """Wait for the step's in-step loads to be answered (and queued); their missing blocks are
        reported this step. Loads not staged: the engine's stream waits for them to land."""
        loads, self._step_loads = self._step_loads, []
        whole = False
        for future in loads:
            self.stats.loads_in_step += 1
            out = future.result()
            self._settle(out)  # in-step loads are one-group only: never "failed"
            if out.staged is not None:
                self._staged.append(out.staged)
            else:
                whole = True
        if whole:
            self._wait_loaded()

    def _finish_step_loads(self) -> None:
        """The step's end: every in-step load has landed before the next step reads its blocks."""
        if self._step_loads:
            self._settle_step_loads()
        staged, self._staged = self._staged, []
        for load in staged:
            load.finish()

    def _wait_loaded(self) -> None:
        """The engine's stream waits (on the GPU) for the loads answered so far to land."""
        if self._loaded is not None:
            torch.cuda.current_stream().wait_event(self._loaded)

    def layer_saved(self, layer_name: str, meta: KVGridConnectorMetadata) -> None:
        """Layer-wise: once the last layer's KV is written, start the step's stores in the
        background while the rest of the forward runs; ``store`` waits for them."""
        reg = self._registration
        if meta.stores and reg is not None and layer_name == reg.last_layer and self._saving is None:
            self._fence_engine_stream()
            self._saving = self._saver.submit(self._store_all, meta)
            self.stats.stores_from_last_layer += 1

    def _my_keys(self, keys: list[list[bytes]]) -> list[bytes]:
        return keys[self.identity.rank] if len(keys) > self.identity.rank else keys[0]

    def _my_lease(self, order: LoadOrder) -> Lease | None:
        leases = order.leases
        return leases[self.identity.rank] if len(leases) > self.identity.rank else None

    def _load(self, order: LoadOrder) -> LoadOutcome:
        keys = self._my_keys(order.keys)
        copier = self._copier
        lease = self._my_lease(order)
        if copier is not None:
            return self._load_here(
                order, keys, copier, lease if lease and lease.l1_file == copier.l1_file else None
            )
        try:
            with agent_call_span("kvgrid.connector.retrieve", order.request_id):
                res = self.agent.retrieve(
                    self.identity.instance_id,
                    order.request_id,
                    keys,
                    agent_block_ids(order.block_ids),
                    skip_first_n_tokens=order.skip_first_n_tokens,
                    after_fence=self._fence is not None,
                    signal_done=self._loaded is not None,
                )
            loaded = res.num_retrieved_chunks
        except grpc.RpcError as e:
            self._note_failure("retrieve", order.request_id, e)
            loaded = 0
        except Exception:  # a bug must not leave the request waiting forever: report it failed
            log.exception("kvgrid retrieve for request %s raised", order.request_id)
            loaded = 0
        finally:
            if lease is not None:  # taken for a copier that failed to open: the agent copied instead
                self._release_lease(order.request_id, lease.lease_id)
        return LoadOutcome(order, loaded, len(keys))

    def _load_here(
        self, order: LoadOrder, keys: list[bytes], copier: EngineCopier, lease: Lease | None
    ) -> LoadOutcome:
        """Engine-side load: scatter the leased chunks here, Release the lease once they landed.
        The lease is the one the scheduler's Lookup took, else a Retrieve takes it now."""
        block_ids = agent_block_ids(order.block_ids)
        loaded = 0
        staged: StagedLoad | None = None
        try:
            if lease is not None:
                offsets, lease_id = lease.chunk_offsets[: len(keys)], lease.lease_id
            else:
                with agent_call_span("kvgrid.connector.retrieve", order.request_id):
                    res = self.agent.retrieve(
                        self.identity.instance_id, order.request_id, keys, block_ids,
                        skip_first_n_tokens=order.skip_first_n_tokens, engine_copies=True,
                    )  # fmt: skip
                offsets, lease_id = res.chunk_offsets, res.lease_id

            def release() -> None:
                self._release_lease(order.request_id, lease_id)

            def failed() -> None:  # on the engine's thread: a stage failed to queue, or the copier closed
                self._load_failed_late(order, len(offsets), len(keys))

            args = (offsets, block_ids, order.skip_first_n_tokens)
            if order.in_step and copier.num_stages:
                staged = copier.scatter_staged(*args, fence=self._fence, release=release, failed=failed)
                self.stats.loads_staged += 1
            else:
                copier.scatter(*args, fence=self._fence, release=release)
            loaded = len(offsets)
            self.stats.chunks_engine_copied += loaded
        except grpc.RpcError as e:
            self._note_failure("retrieve", order.request_id, e)
        except Exception:  # a bug must not leave the request waiting forever: report it failed
            log.exception("kvgrid engine-side load for request %s raised", order.request_id)
        return LoadOutcome(order, loaded, len(keys), staged)

    def _release_lease(self, request_id: str, lease_id: int) -> None:
        """End this load's lease once its bytes landed (the completer thread). One-way on the hot
        path: nothing here needs the answer. By lease id, so it cannot end a later load's lease of
        the same request (another thread's Retrieve, unordered with this frame at the agent)."""
        end_lease(self.agent, self.identity.instance_id, request_id, lease_id)

    def transfer_results(self, sending: Sequence[str] = ()) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving): the finished requests held for
        their stores (``sending``, this step's and earlier ones) whose stores landed, and the loads
        that ended since the last call."""
        with self._lock:
            self._sending.update(sending)
            sent = {r for r in self._sending if (f := self._stores_in_flight.get(r)) is None or f.done()}
            self._sending -= sent
            self.stats.requests_sent += len(sent)
            stored = [f for r in sent if (f := self._stores_in_flight.pop(r, None)) is not None]
            done = [rid for rid, f in self._loading.items() if f.done()]
            outcomes = [self._loading.pop(rid).result() for rid in done]
        for f in stored:
            if (e := f.exception()) is not None:  # a bug: stores are best effort, the engine goes on
                log.error("kvgrid background store raised", exc_info=e)
        if outcomes:
            self._wait_loaded()  # before the next step computes on the loaded blocks
        finished: set[str] = set()
        failed: set[str] = set()
        for out in outcomes:
            finished.add(out.order.request_id)
            if self._settle(out):
                failed.add(out.order.request_id)
        return sent, finished, failed

    def _settle(self, out: LoadOutcome) -> bool:
        """Count a load that ended and report the blocks it missed (one KV cache group). True when
        the request must be reported failed instead: with several groups block ids repeat across
        groups, so vLLM cannot map them back to the request."""
        self.stats.chunks_loaded += out.loaded
        self.stats.chunks_load_failed += out.wanted - out.loaded
        if out.loaded >= out.wanted:
            return False
        log.warning(
            "kvgrid: request %s loaded %d of %d chunks; vLLM recomputes the rest",
            out.order.request_id,
            out.loaded,
            out.wanted,
        )
        if len(self.identity.tokens_per_block) > 1:
            return True
        self._invalid_block_ids |= self._failed_blocks(out)
        return False

    def _load_failed_late(self, order: LoadOrder, loaded: int, wanted: int) -> None:
        """A staged load counted as ``loaded`` chunks failed inside its step: the blocks of all
        ``wanted`` chunks are reported for recomputation (every group's, a hybrid model's too: vLLM
        recomputes from the first)."""
        log.warning(
            "kvgrid: request %s: a layer-wise load failed in its step; vLLM recomputes it", order.request_id
        )
        self.stats.chunks_loaded -= loaded
        self.stats.chunks_engine_copied -= loaded
        self.stats.chunks_load_failed += loaded
        self._invalid_block_ids |= self._failed_blocks(LoadOutcome(order, 0, wanted))

    def _failed_blocks(self, out: LoadOutcome) -> set[int]:
        tpc = self.identity.tokens_per_chunk
        order = out.order
        return failed_block_ids(
            order.block_ids,
            self.identity.tokens_per_block,
            start_token=out.loaded * tpc,
            end_token=out.wanted * tpc,
            skip_first_n_tokens=order.skip_first_n_tokens,
            groups=[g for g in self._transfer_groups if g < len(order.block_ids)],
        )

    def take_load_errors(self) -> set[int]:
        out, self._invalid_block_ids = self._invalid_block_ids, set()
        return out

    def loads_in_flight(self) -> int:
        with self._lock:
            return len(self._loading)

    def wait_loads(self, timeout_s: float | None = None) -> None:
        """Block until every load submitted so far has ended (tests; shutdown)."""
        with self._lock:
            pending = list(self._loading.values())
        for f in pending:
            f.exception(timeout=timeout_s)

    # ---- stores ---------------------------------------------------------------------------------

    def store(self, meta: KVGridConnectorMetadata) -> None:
        """End of the step (``wait_for_save``): finish in-step loads that no layer waited for, then
        issue this step's Stores (or take those the last layer started). Synchronous: return when
        the agent holds the chunks (best effort). ``async_store``: return at once."""
        self._finish_step_loads()
        saving, self._saving = self._saving, None  # started by the last layer (layer-wise)
        if saving is None and meta.stores:
            self._fence_engine_stream()  # the forward's KV writes must land before the agent reads
            saving = self._saver.submit(self._store_all, meta)
        if saving is not None and not self._async_store:
            saving.result()
        elif saving is not None:
            with self._lock:
                self._stores_in_flight = {r: f for r, f in self._stores_in_flight.items() if not f.done()}
                self._stores_in_flight.update((order.request_id, saving) for order in meta.stores)
        self.maybe_reregister()

    def flush_stores(self, request_ids: Sequence[str] | None = None) -> None:
        """Wait for the background stores covering ``request_ids`` (every store so far when None).
        The saver thread runs stores in order, so waiting for a request's latest one is enough."""
        if request_ids is not None:
            self.stats.flushed_requests += len(request_ids)
        with self._lock:
            if request_ids is None:
                pending = list(self._stores_in_flight.values())
                self._stores_in_flight.clear()
            else:
                pending = [f for r in request_ids if (f := self._stores_in_flight.pop(r, None)) is not None]
        for f in pending:
            if (e := f.exception()) is not None:  # a bug: stores are best effort, the engine goes on
                log.error("kvgrid background store raised", exc_info=e)

    def _store_all(self, meta: KVGridConnectorMetadata) -> None:
        """With replicated KV (MLA under TP) only rank 0 stores: the other ranks' bytes are the same.
        While the registration is stale the agent would refuse (or not answer): skip, a future miss."""
        if self.identity.replicated_kv and self.identity.rank != 0:
            return
        if self._stale and meta.stores:
            self.stats.stores_skipped += len(meta.stores)
            return
        for order in meta.stores:
            copier = self._copier
            try:
                with agent_call_span("kvgrid.connector.store", order.request_id):
                    if copier is not None:
                        res, new = self._store_here(order, copier)
                    else:
                        res = self.agent.store(
                            self.identity.instance_id,
                            self._my_keys(order.keys),
                            agent_block_ids(order.block_ids),
                            skip_first_n_chunks=order.skip_first_n_chunks,
                            after_fence=self._fence is not None,
                        )
                        new = res.bytes_moved // self._bytes_per_chunk  # what the agent copied
            except grpc.RpcError as e:
                self._note_failure("store", order.request_id, e)
                continue
            self.stats.chunks_stored += new
            if res.partial_reason:
                log.info(
                    "kvgrid store for request %s kept %d chunks: %s",
                    order.request_id,
                    res.num_stored_chunks,
                    res.partial_reason,
                )

    def _store_here(self, order: StoreOrder, copier: EngineCopier) -> tuple[StoreResult, int]:
        """A store the engine copies itself (module docstring): reserve in the agent, gather into
        the reserved room, finish the store (or drop it when the copy failed). Returns the final
        answer and the chunks copied."""
        iid = self.identity.instance_id
        block_ids = agent_block_ids(order.block_ids)
        res = self.agent.store(
            iid,
            self._my_keys(order.keys),
            block_ids,
            skip_first_n_chunks=order.skip_first_n_chunks,
            engine_copies=True,
        )
        if not res.store_id:
            return res, 0  # nothing new to copy: final
        try:
            copier.gather(res.chunk_offsets, block_ids, res.copy_chunk_indices, fence=self._fence)
        except Exception as e:  # a bad offset or a CUDA error: nothing of it may become visible
            log.warning("kvgrid engine-side store for request %s failed: %s", order.request_id, e)
            return self.agent.finish_store(iid, res.store_id, copy_failed=True), 0
        copied = len(res.copy_chunk_indices)
        self.stats.chunks_engine_stored += copied
        return self.agent.finish_store(iid, res.store_id), copied

    def _fence_engine_stream(self) -> None:
        """Mark the work queued so far on the engine's stream (zeroing, the forward's KV writes):
        the agent's next copies wait for it on the GPU (module docstring, Fences)."""
        if self._fence is not None:
            self._fence.record()

    def close(self) -> None:
        # A re-registration in flight ends first (it swaps the copier on the loader thread).
        self._registrar.shutdown(wait=True)
        # Loads still running finish (their blocks are still held by vLLM until reported).
        self.flush_stores()
        self._loader.shutdown(wait=True)
        if self._copier is not None:
            self._copier.close()  # copies queued so far land, leases end (staged loads: abandoned)
            self._copier = None
        self._saver.shutdown(wait=True)
        if self._registration is not None:
            try:
                self.agent.unregister_kv_caches(self.identity.instance_id)
            except grpc.RpcError as e:
                log.info("kvgrid unregister of %s failed: %s", self.identity.instance_id, rpc_text(e))
            self._registration = None
        self.agent.close()
