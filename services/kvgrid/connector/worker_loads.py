"""The connector worker's loads (a layer of :class:`kvgrid.connector.worker.ConnectorWorker`; the
overview, fences included, is that module's docstring).

``start_loads``
    hands the step's :class:`LoadOrder` s to one background thread (Retrieve calls) and returns.
    A load the agent copies is ordered with the engine by interprocess CUDA events (the fence
    before, the load-done event after); an engine-side load (:mod:`kvgrid.connector.engine_copies`)
    scatters the chunks leased to the request -- by the scheduler's Lookup with ``lease_at_lookup``,
    else by a Retrieve here -- and Release ends the lease once the bytes landed. Layer-wise loads
    are copied stage by stage (:mod:`kvgrid.connector.staged_loads`), each layer waiting only for
    its own stage.
Reporting
    every load that ended is reported exactly once (``transfer_results``); a partial load precisely:
    on a one-group model the blocks of the chunks that did not arrive (:meth:`take_load_errors`,
    vLLM recomputes from there); on a hybrid model, where block ids repeat across groups and cannot
    be mapped back, the request is reported failed. The engine never stops.

Invariant: vLLM frees the blocks of a request with a load in flight only after the load is
reported, so no load writes into freed blocks (the thread never outlives its report).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass

import grpc
import torch

from kvgrid.connector.chunk_policy import NULL_BLOCK_ID, failed_block_ids
from kvgrid.connector.config import ConnectorIdentity, KVGridConnectorConfig
from kvgrid.connector.engine_copies import EngineCopier
from kvgrid.connector.metadata import KVGridConnectorMetadata, Lease, LoadOrder
from kvgrid.connector.scheduler import end_lease
from kvgrid.connector.staged_loads import StagedLoad
from kvgrid.connector.tracing import agent_call_span
from kvgrid.connector.worker_registration import WorkerRegistration

__all__ = ["LoadOutcome", "WorkerLoads", "agent_block_ids"]

log = logging.getLogger("kvgrid.connector.worker")  # the worker's one logger, whichever module logs


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


class WorkerLoads(WorkerRegistration):
    """The worker's loads on top of its registration (module docstring)."""

    def __init__(self, identity: ConnectorIdentity, config: KVGridConnectorConfig) -> None:
        super().__init__(identity, config)
        self._loading: dict[str, Future[LoadOutcome]] = {}
        self._invalid_block_ids: set[int] = set()
        self._step_loads: list[Future[LoadOutcome]] = []
        self._staged: list[StagedLoad] = []
        """This step's layer-wise engine-side loads (settled, still landing stage by stage)."""

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
