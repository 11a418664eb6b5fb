"""The agent's Store: gather an engine's blocks into reserved L1 chunks and commit them, or, with
engine copies, reserve the room, answer its offsets and a store id, and commit (or drop) at the
engine's second Store. Part of :class:`~kvgrid.agent.core.AgentCore`.

An engine-copies reservation (``_engine_stores``, by (instance_id, store id)) outlives a
re-registration (the engine may still be writing into the reserved pages) and ends with the Store
that finishes it, with unregister, or with the engine's exit.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from opentelemetry import trace

from kvgrid.agent.cache import ChunkCache, StoreReservation
from kvgrid.agent.instances import EngineInstance, TransferTotals
from kvgrid.agent.l1 import Chunk
from kvgrid.agent.metrics import AgentMetrics
from kvgrid.common.agent_results import StoreResult
from kvgrid.common.errors import InvalidArgument, client_input
from kvgrid.common.hashing import check_chunk_keys
from kvgrid.common.rpc import after_reply
from kvgrid.common.tracing import local_span

__all__ = ["StorePath"]


class StorePath:
    """Store (copied by the agent or by the engine) and the engine-copies reservations."""

    cache: ChunkCache
    tracer: trace.Tracer
    metrics: AgentMetrics
    totals: TransferTotals
    _totals_lock: threading.Lock
    _lock: threading.Lock
    _engine_stores: dict[tuple[str, int], tuple[StoreReservation, int]]
    """(instance_id, store id) -> an engine_copies Store's reservation and its key count, until the
    Store that finishes it."""
    _store_ids: itertools.count[int]

    if TYPE_CHECKING:

        def instance(self, instance_id: str) -> EngineInstance: ...
        def _offsets(self, chunks: Sequence[Chunk]) -> list[int]: ...
        def _check_engine_copies(self, after_fence: bool, signal_done: bool, what: str) -> None: ...
        def _record_transfer(self, direction: str, nbytes: int, seconds: float) -> None: ...
        def _ids_per_chunk(
            self,
            inst: EngineInstance,
            block_ids: Sequence[Sequence[int]],
            chunks: range,
            skip_first_n_tokens: int = 0,
            *,
            allow_holes: bool = False,
        ) -> list[list[np.ndarray]]: ...

    def store(
        self,
        instance_id: str,
        keys: Sequence[bytes],
        block_ids: Sequence[Sequence[int]],
        skip_first_n_chunks: int = 0,
        after_fence: bool = False,
        *,
        engine_copies: bool = False,
        store_id: int = 0,
        copy_failed: bool = False,
    ) -> StoreResult:
        """Gather the engine's blocks into L1 chunks. All-or-nothing per chunk across every group:
        ids must cover every chunk of every group (else ValueError and nothing is stored), and a
        failed copy commits nothing. Under memory pressure a prefix is kept (see partial_reason).

        ``engine_copies``: reserve the new chunks' room and answer their offsets and a store id;
        the engine gathers its blocks there itself, then a Store naming ``store_id`` makes them
        visible (``copy_failed``: drops them)."""
        if store_id:
            return self._finish_engine_store(instance_id, store_id, copy_failed)
        inst = self.instance(instance_id)
        if engine_copies:
            self._check_engine_copies(after_fence, False, "Store")
        fence = inst.wait_event(after_fence)
        with client_input():
            keys = check_chunk_keys(keys)
        if skip_first_n_chunks > len(keys):
            raise InvalidArgument(
                f"skip_first_n_chunks={skip_first_n_chunks}: expected <= {len(keys)} (chunk_keys)"
            )
        with local_span(
            self.tracer, "agent.store", {"instance_id": instance_id, "chunks": len(keys)}
        ) as span:
            # Engine copies gather nothing here: the engine checks its ids itself.
            ids = [] if engine_copies else self._ids_per_chunk(inst, block_ids, range(len(keys)))
            res = self.cache.reserve_store(
                keys,
                namespace_id=inst.namespace_id,
                layout_id=inst.layout_id,
                nbytes=inst.bytes_per_chunk,
                skip_first_n=skip_first_n_chunks,
            )
            new = res.new_chunks
            if engine_copies and new:
                span.set_attribute("engine_copies", len(new))
                return self._reserve_engine_store(instance_id, res, len(keys))
            t0 = time.perf_counter()
            try:
                if new:
                    inst.mover.store(
                        [c.buffer for _, c in new],
                        [[per_chunk[i] for i, _ in new] for per_chunk in ids],
                        wait_event=fence,
                    )
            except BaseException:
                self.cache.abort(res)
                raise
            dt = time.perf_counter() - t0
            held, present = self.cache.commit(res)
            nbytes = len(new) * inst.bytes_per_chunk
            span.set_attribute("stored_chunks", held)
            span.set_attribute("bytes", nbytes)
            if res.reason:
                span.set_attribute("partial_reason", res.reason)
        with self._totals_lock:
            self.totals.stored_chunks += len(new)
        after_reply(self._count_store, len(new), present, len(keys) - held, res.reason, nbytes, dt)
        return StoreResult(
            num_stored_chunks=held, num_already_present=present, bytes_moved=nbytes, partial_reason=res.reason
        )

    def _reserve_engine_store(self, instance_id: str, res: StoreReservation, num_keys: int) -> StoreResult:
        """The first Store of an engine_copies store: keep the reservation until the second and
        answer where the engine gathers each new chunk."""
        new = res.new_chunks
        sid = next(self._store_ids)
        with self._lock:
            self._engine_stores[(instance_id, sid)] = (res, num_keys)
        return StoreResult(
            num_stored_chunks=0,
            num_already_present=0,
            bytes_moved=0,
            partial_reason=res.reason,
            store_id=sid,
            copy_chunk_indices=[i for i, _ in new],
            chunk_offsets=self._offsets([c for _, c in new]),
        )

    def _finish_engine_store(self, instance_id: str, store_id: int, copy_failed: bool) -> StoreResult:
        """The second Store of an engine_copies store: the engine's gather landed (commit) or
        failed (drop)."""
        with self._lock:
            pending = self._engine_stores.pop((instance_id, store_id), None)
        if pending is None:
            self.instance(instance_id)  # an unknown instance says so first
            raise InvalidArgument(
                f"store_id={store_id}: no engine_copies store of instance {instance_id!r} is waiting "
                "(finished already, never reserved, or its engine unregistered); expected the "
                "store_id a Store with engine_copies answered"
            )
        res, num_keys = pending
        if copy_failed:
            self.cache.abort(res)
            return StoreResult(
                num_stored_chunks=0,
                num_already_present=0,
                bytes_moved=0,
                partial_reason="copy_failed: the engine's copy into L1 failed; nothing stored",
            )
        n_new = len(res.new_chunks)
        held, present = self.cache.commit(res)
        with self._totals_lock:
            self.totals.stored_chunks += n_new
        after_reply(self._count_store, n_new, present, num_keys - held, res.reason, 0, 0.0)
        return StoreResult(
            num_stored_chunks=held, num_already_present=present, bytes_moved=0, partial_reason=res.reason
        )

    def _count_store(
        self, stored: int, present: int, not_held: int, reason: str, nbytes: int, seconds: float
    ) -> None:
        m = self.metrics.stored_chunks
        if stored:
            m.add(stored, {"result": "stored"})
        if present:
            m.add(present, {"result": "present"})
        if not_held:
            m.add(not_held, {"result": "dropped" if reason else "skipped"})
        self._record_transfer("store", nbytes, seconds)

    def _drop_engine_stores(self, instance_id: str) -> None:
        """The engine is gone (unregistered after its stores finished, or its process exited):
        its unfinished engine_copies stores are dropped. Not at a re-registration: the engine lives
        and may still be copying into the reserved pages."""
        with self._lock:
            mine = [k for k in self._engine_stores if k[0] == instance_id]
            reservations = [self._engine_stores.pop(k) for k in mine]
        for res, _ in reservations:
            self.cache.abort(res)
