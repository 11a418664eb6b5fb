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
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import grpc

from kvgrid.common.agent_results import StoreResult
from kvgrid.connector.config import ConnectorIdentity, KVGridConnectorConfig
from kvgrid.connector.engine_copies import EngineCopier
from kvgrid.connector.metadata import KVGridConnectorMetadata, StoreOrder
from kvgrid.connector.scheduler import rpc_text
from kvgrid.connector.tracing import agent_call_span
from kvgrid.connector.worker_loads import LoadOutcome, WorkerLoads, agent_block_ids
from kvgrid.connector.worker_registration import WorkerStats

__all__ = ["ConnectorWorker", "LoadOutcome", "WorkerStats", "agent_block_ids"]

log = logging.getLogger(__name__)


class ConnectorWorker(WorkerLoads):
    """Worker-side transfers and the agent registration (module docstring): the registration
    (:class:`~kvgrid.connector.worker_registration.WorkerRegistration`), the loads
    (:class:`~kvgrid.connector.worker_loads.WorkerLoads`) and, here, the stores and the step's
    report to vLLM."""

    def __init__(self, identity: ConnectorIdentity, config: KVGridConnectorConfig) -> None:
        super().__init__(identity, config)
        self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvgrid-store")
        self._saving: Future[None] | None = None
        self._stores_in_flight: dict[str, Future[None]] = {}
        """Request id -> the latest background store covering it (async_store)."""
        self._sending: set[str] = set()
        """Finished requests whose blocks vLLM holds until reported sent (their stores landed)."""

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

    def layer_saved(self, layer_name: str, meta: KVGridConnectorMetadata) -> None:
        """Layer-wise: once the last layer's KV is written, start the step's stores in the
        background while the rest of the forward runs; ``store`` waits for them."""
        reg = self._registration
        if meta.stores and reg is not None and layer_name == reg.last_layer and self._saving is None:
            self._fence_engine_stream()
            self._saving = self._saver.submit(self._store_all, meta)
            self.stats.stores_from_last_layer += 1

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
