"""The agent's store/retrieve/lookup engine, independent of gRPC.

``AgentCore`` owns the L1 cache and the registered engine instances (``kvgrid.agent.instances``):
each one engine worker's KV tensors (opened from IPC handles by the service) plus the kernel groups
rebuilt from them. Lookup is ``kvgrid.agent.lookup_path``, Store ``kvgrid.agent.store_path``;
what a request holds (pins, leases) is the table in ``kvgrid.agent.holds``, which Release empties.

Locking: the cache has its own lock; copies run outside it on chunks that are either reserved
(store: invisible to everyone else) or referenced (retrieve: eviction skips them), so several
clients store and retrieve at once.

Lower tiers (optional, ``kvgrid.agent.tiers``): chunks evicted from L1 go to disk and then an
object store through a background writer; a Lookup whose walk stops at a chunk a tier holds
promotes the following tier chunks back into L1 (``kvgrid.agent.promotion``: committed pending
and counted at once, read and verified by a worker pool; ``tier_promotion: sync`` waits for the
reads instead) before any peer fetch. Retrieve waits for pending chunks and stops before one whose
read failed (the engine recomputes it); Release cancels what is not read yet. Local hits stay
pinned or referenced meanwhile, so bringing chunks back never evicts the prefix it extends.

Engine-side copies (``l1_shared_dir``): the pool is a shared file the engine maps. A Retrieve with
``engine_copies`` copies nothing; it leases the leading ready chunks to the request (they cannot be
evicted or rewritten) and answers their offsets in the file; the engine scatters them in its own
CUDA context and ends the lease with Release. A registration that goes (unregister,
re-registration, the engine's exit) ends its pins and leases. A Store with ``engine_copies``
reserves the new chunks' pages for the engine to gather into (``kvgrid.agent.store_path``).

Metrics of lookup, retrieve and store are updated through ``common.rpc.after_reply``: on the hot
path after the engine has its answer (a Prometheus reader costs ~6 us an update), at once
otherwise.

Isolation and bounds: every read (lookup, its pins and peer fetch, retrieve) sees only chunks stored
in the instance's own namespace and layout (the cache indexes chunks by namespace); a lookup pin
lasts at most ``pin_ttl_max_ms`` (a longer request is clamped); store and retrieve take exactly one
block-id list per registered engine group.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from opentelemetry import metrics, trace

from kvgrid.agent.cache import CacheListener, ChunkCache, MissCause, StoreReservation
from kvgrid.agent.config import AgentConfig
from kvgrid.agent.eviction import make_policy
from kvgrid.agent.instances import EngineInstance, TransferTotals, UnknownInstanceError, process_start_time
from kvgrid.agent.l1 import Chunk, L1Pool
from kvgrid.agent.lookup_path import LookupPath
from kvgrid.agent.metrics import AgentMetrics
from kvgrid.agent.peers.fetcher import PeerFetcher
from kvgrid.agent.peers.metrics import PeerMetrics
from kvgrid.agent.promotion import Promoter
from kvgrid.agent.store_path import StorePath
from kvgrid.agent.tiers.build import build_tier_chain
from kvgrid.agent.tiers.metrics import TierMetrics
from kvgrid.agent.transfer import DoneSignal, build_mover, chunk_block_ids
from kvgrid.common.agent_results import RetrieveResult
from kvgrid.common.errors import InvalidArgument, client_input
from kvgrid.common.groups import EngineGroupInfo
from kvgrid.common.hashing import KeyNamespace, check_chunk_keys
from kvgrid.common.identity import PodIdentity
from kvgrid.common.rpc import after_reply
from kvgrid.common.tracing import local_span
from kvgrid_kernels import TransferHandle

__all__ = ["AgentCore", "EngineInstance", "UnknownInstanceError", "process_start_time"]

log = logging.getLogger(__name__)


class AgentCore(LookupPath, StorePath):
    """Registered instances + the L1 cache. Thread-safe."""

    def __init__(
        self,
        config: AgentConfig,
        pod: PodIdentity,
        *,
        listener: CacheListener | None = None,
        meter: metrics.Meter | None = None,
        tracer: trace.Tracer | None = None,
    ) -> None:
        self.config = config
        self.pod = pod
        self.pool = L1Pool(
            config.l1_size,
            page_bytes=config.l1_page_size,
            pin=config.pin_memory,
            shared_dir=config.l1_shared_dir or None,
        )
        # A chunk's offset in the shared file is this plus start_page * page_bytes (every chunk's
        # buffer is its pages' view of pool.tensor).
        self._l1_base = self.pool.file_offset(self.pool.tensor)
        self._engine_stores: dict[tuple[str, int], tuple[StoreReservation, int]] = {}
        self._store_ids = itertools.count(1)
        # Lower tiers (None when off): L1 evictions spill into them, lookups read them back.
        self.tiers = build_tier_chain(config)
        self.cache = ChunkCache(
            self.pool,
            make_policy(config.eviction_policy),
            high_watermark=config.high_watermark,
            low_watermark=config.low_watermark,
            listener=listener,
            spill=self.tiers,
        )
        # Pins and leases of engine requests (kvgrid.agent.holds).
        self.holds = self.cache.holds
        if self.tiers is not None:
            self.tiers.begin, self.tiers.end = self.cache.begin_spill, self.cache.end_spill
            TierMetrics(
                meter or metrics.get_meter("kvgrid.agent"), self.tiers, lambda: self.cache.dropped_spills
            )
            # Records a previous run left on disk serve again (after every tier callback is wired).
            self.tiers.reindex()
            # The controller learns what the tiers hold (TIER_L2 events, agent/events.py), the
            # records just indexed again included.
            attach = getattr(listener, "attach_lower_tiers", None)
            if attach is not None:
                attach(self.tiers)
        self._instances: dict[str, EngineInstance] = {}
        self._lock = threading.Lock()
        self.tracer = tracer or trace.get_tracer("kvgrid.agent")
        self.promoter = (
            None
            if self.tiers is None
            else Promoter(
                self.cache,
                self.tiers,
                workers=config.tier_promotion_workers,
                meter=meter or metrics.get_meter("kvgrid.agent"),
                tracer=self.tracer,
            )
        )
        self.metrics = AgentMetrics(
            meter or metrics.get_meter("kvgrid.agent"), self.cache.stats, lambda: len(self._instances)
        )
        self.peer_metrics = PeerMetrics(meter or metrics.get_meter("kvgrid.agent"))
        # Fetches from the holder the controller names (peer fetch on) or from a peer the engine
        # names (P/D); with neither, a lookup never reaches it.
        self.peers = PeerFetcher(self.cache, config, pod.pod_uid, self.peer_metrics, self.tracer)
        self.on_instances_changed: Callable[[], None] | None = None
        self.totals = TransferTotals()
        # Releases the chunks of signalled Retrieves once their copies landed (in order).
        self._completer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvgrid-landed")
        self._totals_lock = threading.Lock()

    # ---- registration ----------------------------------------------------------------------

    def register(
        self,
        instance_id: str,
        *,
        engine_groups: Sequence[EngineGroupInfo],
        tensors: Sequence[torch.Tensor],
        namespace: KeyNamespace,
        engine_pid: int = 0,
        layout_hints: Sequence[Mapping[str, object] | None] | None = None,
        fence: torch.cuda.Event | None = None,
        done: torch.cuda.Event | None = None,
    ) -> EngineInstance:
        """Rebuild kernel groups from ``tensors`` and check them against ``engine_groups``.

        Raises InvalidArgument (a ValueError) naming what disagrees. A second registration with the
        same id replaces the first (its pins are dropped).
        """
        if not instance_id:
            raise InvalidArgument("instance_id='': expected a non-empty id chosen by the engine")
        if not tensors:
            raise InvalidArgument("layers is empty: expected one tensor per KV cache layer")
        with local_span(self.tracer, "agent.register", {"instance_id": instance_id}):
            with client_input():  # the layers do not fit the groups (or each other)
                mover = build_mover(
                    list(tensors), list(engine_groups), namespace.tokens_per_chunk, layout_hints=layout_hints
                )
            start_time = None
            if engine_pid > 0:
                start_time = process_start_time(engine_pid)
                if start_time is None:
                    log.warning(
                        "instance %s: engine pid %d is not visible from the agent (separate pid "
                        "namespace?); its registration is not cleaned up automatically",
                        instance_id,
                        engine_pid,
                    )
            inst = EngineInstance(
                instance_id=instance_id,
                engine_pid=engine_pid,
                pid_start_time=start_time,
                namespace=namespace,
                namespace_id=namespace.namespace_id(),
                groups=list(engine_groups),
                tensors=list(tensors),
                mover=mover,
                fence=fence,
                done=DoneSignal(done, tensors[0].device) if done is not None else None,
            )
            with self._lock:
                old = self._instances.get(instance_id)
                self._instances[instance_id] = inst
                if old is not None:
                    # Under the lock: a lookup that sees the new registration pins only after this.
                    self.holds.end_instance(instance_id)
            if old is not None:
                log.info("instance %s re-registered; dropped the old registration's pins", instance_id)
            log.info(
                "registered instance %s: %d layers, %d kernel groups, %d bytes per %d-token chunk, pid %d",
                instance_id,
                len(tensors),
                mover.manager.num_kernel_groups,
                mover.bytes_per_chunk,
                namespace.tokens_per_chunk,
                engine_pid,
            )
            self._changed()
            return inst

    def unregister(self, instance_id: str) -> int:
        with self._lock:
            inst = self._instances.pop(instance_id, None)
            if inst is None:
                raise UnknownInstanceError(f"instance_id={instance_id!r} is not registered")
            released = self.holds.end_instance(instance_id)
        self._drop_engine_stores(instance_id)
        if self.promoter is not None:
            self.promoter.cancel_instance(instance_id)
        self._changed()
        return released

    def _changed(self) -> None:
        if self.on_instances_changed is not None:
            self.on_instances_changed()

    def instance(self, instance_id: str) -> EngineInstance:
        with self._lock:
            inst = self._instances.get(instance_id)
        if inst is None:
            raise UnknownInstanceError(
                f"instance_id={instance_id!r} is not registered (RegisterKVCaches first; registrations "
                f"of engines that exited are dropped)"
            )
        return inst

    def instances(self) -> list[EngineInstance]:
        with self._lock:
            return list(self._instances.values())

    def namespaces(self) -> list[str]:
        return sorted({i.namespace_id for i in self.instances()})

    def reap(self) -> list[str]:
        """Drop registrations (and pins) of engines whose process is gone; expire old pins."""
        gone: list[str] = []
        for iid in [i.instance_id for i in self.instances() if not i.alive()]:
            with self._lock:
                inst = self._instances.get(iid)
                if inst is None or inst.alive():
                    continue
                del self._instances[iid]
                # Under the lock: a re-registration under the same id must not lose its new pins.
                n = self.holds.end_instance(iid)
            self._drop_engine_stores(iid)
            if self.promoter is not None:
                self.promoter.cancel_instance(iid)
            gone.append(iid)
            log.warning(
                "engine pid %d of instance %s exited; dropped its registration and %d pins",
                inst.engine_pid,
                iid,
                n,
            )
        if gone:
            self._changed()
        self.cache.expire_pins()
        return gone

    # ---- block ids ---------------------------------------------------------------------------

    def _ids_per_chunk(
        self,
        inst: EngineInstance,
        block_ids: Sequence[Sequence[int]],
        chunks: range,
        skip_first_n_tokens: int = 0,
        *,
        allow_holes: bool = False,
    ) -> list[list[np.ndarray]]:
        return chunk_block_ids(
            inst.mover,
            inst.groups,
            block_ids,
            chunks,
            skip_first_n_tokens,
            allow_holes=allow_holes,
            who=f"instance {inst.instance_id!r}",
        )

    # ---- lookup / retrieve / store / release -----------------------------------------------

    def _offsets(self, chunks: Sequence[Chunk]) -> list[int]:
        """Each chunk's byte offset in the shared L1 file (= pool.file_offset(c.buffer), without
        two tensor calls per chunk)."""
        page, base = self.pool.page_bytes, self._l1_base
        return [base + c.start_page * page for c in chunks]

    def _count_hits(
        self, counter: metrics.Counter, asked: int, hits: int, cause: MissCause, peer: int = 0, tier: int = 0
    ) -> None:
        if hits > peer + tier:
            counter.add(hits - peer - tier, {"result": "hit"})
        if tier:
            counter.add(tier, {"result": "hit_tier"})
        if peer:
            counter.add(peer, {"result": "hit_peer"})
        if asked > hits:
            counter.add(asked - hits, {"result": f"miss_{cause}" if cause != MissCause.NONE else "miss"})

    def release(self, instance_id: str, request_id: str, lease_id: int = 0) -> tuple[int, int]:
        """Release (the RPC): drop the request's holds, its lookup pin and every lease, and cancel
        what its promotion has not read yet. ``lease_id``: end only that lease of the request (an
        unknown one ends nothing) and leave its pin. Answers (pinned chunks released, leased chunks
        released)."""
        self.instance(instance_id)
        owner = (instance_id, request_id)
        released = self.holds.release(owner, lease_id)
        if not lease_id and self.promoter is not None and request_id:
            self.promoter.cancel(owner)  # after the unpin: nobody wants its chunks
        return released

    def leased_chunks(self) -> int:
        """Chunks held for engines that copy themselves: leased to loads, or reserved for stores
        not finished yet."""
        with self._lock:
            reserved = sum(len(res.new_chunks) for res, _ in self._engine_stores.values())
        return self.holds.leased_chunks() + reserved

    def retrieve(
        self,
        instance_id: str,
        request_id: str,
        keys: Sequence[bytes],
        block_ids: Sequence[Sequence[int]],
        skip_first_n_tokens: int = 0,
        after_fence: bool = False,
        signal_done: bool = False,
        engine_copies: bool = False,
    ) -> RetrieveResult:
        """Scatter the leading held chunks into the engine's blocks (prefix semantics). With
        ``signal_done`` answer once the copies are queued: the chunks stay referenced until they
        landed, and the engine's done event is recorded after them. With ``engine_copies`` copy
        nothing: lease the chunks to the request and answer their offsets (module docstring)."""
        inst = self.instance(instance_id)
        fence = self._check_retrieve(inst, request_id, after_fence, signal_done, engine_copies)
        with client_input():
            keys = check_chunk_keys(keys)
        owner = (instance_id, request_id)
        with local_span(
            self.tracer, "agent.retrieve", {"instance_id": instance_id, "chunks": len(keys)}
        ) as span:
            # Ids of every requested chunk, checked up front: a bad request fails the same way
            # whether or not its chunks happen to be cached. Engine copies write nothing here: the
            # engine checks its ids itself (the same chunk_block_ids).
            ids = (
                []
                if engine_copies
                else self._ids_per_chunk(
                    inst, block_ids, range(len(keys)), skip_first_n_tokens, allow_holes=True
                )
            )
            # Waits for chunks still being promoted; stops before one whose promotion failed.
            chunks, cause = self.cache.acquire_ready_prefix(
                keys, inst.layout_id, namespace_id=inst.namespace_id
            )
            n = len(chunks)
            offsets: list[int] = []
            lease_id, dt = 0, 0.0
            if engine_copies:  # the lease owns the chunks' references now
                lease_id = self.holds.lease(owner, chunks)
                offsets = self._offsets(chunks)
            else:
                dt = self._scatter(inst, chunks, ids, fence, signal_done)
            if request_id:
                self.holds.unpin(owner)
            nbytes = n * inst.bytes_per_chunk
            span.set_attribute("hit_chunks", n)
            span.set_attribute("bytes", nbytes)
        after_reply(self._count_hits, self.metrics.retrieve_chunks, len(keys), n, cause)
        with self._totals_lock:
            self.totals.retrieved_chunks += n
        if not signal_done and not engine_copies:
            after_reply(self._record_transfer, "retrieve", nbytes, dt)
        return RetrieveResult(
            hit_mask=[i < n for i in range(len(keys))],
            num_retrieved_chunks=n,
            bytes_moved=0 if engine_copies else nbytes,
            miss_cause=cause,
            chunk_offsets=offsets,
            lease_id=lease_id,
        )

    def _check_retrieve(
        self, inst: EngineInstance, request_id: str, after_fence: bool, signal_done: bool, engine_copies: bool
    ) -> torch.cuda.Event | None:
        """InvalidArgument for a Retrieve the instance cannot serve; else the event its copies wait
        for."""
        if engine_copies:
            self._check_engine_copies(after_fence, signal_done, "Retrieve")
            if not request_id:
                raise InvalidArgument(
                    "engine_copies=true needs a request_id: Release(request_id) ends the lease"
                )
        fence = inst.wait_event(after_fence)
        if signal_done and inst.done is None:
            raise InvalidArgument(
                f"signal_done=true but instance {inst.instance_id!r} registered no done_event; "
                "expected RegisterKVCaches with an interprocess CUDA event first"
            )
        return fence

    def _scatter(
        self,
        inst: EngineInstance,
        chunks: list[Chunk],
        ids: list[list[np.ndarray]],
        fence: torch.cuda.Event | None,
        signal_done: bool,
    ) -> float:
        """Copy the referenced ``chunks`` into the engine's blocks and release them: at once, or
        with ``signal_done`` once the copies landed (the completer; the engine's done event is
        recorded after them). Returns the seconds until the copies were done (or queued)."""
        n = len(chunks)
        t0 = time.perf_counter()
        try:
            handle = None
            if n:
                handle = inst.mover.retrieve_async(
                    [c.buffer for c in chunks], [per_chunk[:n] for per_chunk in ids], wait_event=fence
                )
            if signal_done:
                assert inst.done is not None
                inst.done.after(handle)
                if handle is not None:  # the completer releases the chunks once they landed
                    self._completer.submit(self._release_landed, handle, chunks, t0, n * inst.bytes_per_chunk)
                    chunks = []
            elif handle is not None:
                handle.wait()
            return time.perf_counter() - t0
        finally:
            if chunks:  # handed to the completer otherwise
                self.cache.release(chunks)

    def _check_engine_copies(self, after_fence: bool, signal_done: bool, what: str) -> None:
        if not self.pool.shared_file:
            raise InvalidArgument(
                f"{what} with engine_copies=true but this agent's L1 is private; expected an agent "
                "started with l1_shared_dir (e.g. --l1-shared-dir /dev/shm)"
            )
        if signal_done or after_fence:
            raise InvalidArgument(
                f"{what} with engine_copies=true and signal_done or after_fence: the engine copies "
                "itself, so there is nothing for the agent to wait for or signal"
            )

    def _release_landed(self, handle: TransferHandle, chunks: list[Chunk], t0: float, nbytes: int) -> None:
        """A signalled Retrieve's copies landed: release its chunks and record the transfer."""
        try:
            handle.wait()
        finally:
            self.cache.release(chunks)
        self._record_transfer("retrieve", nbytes, time.perf_counter() - t0)

    def _record_transfer(self, direction: str, nbytes: int, seconds: float) -> None:
        if not nbytes:
            return
        attrs = {"direction": direction}
        self.metrics.bytes_moved.add(nbytes, attrs)
        self.metrics.latency.record(seconds, attrs)
        if seconds > 0:
            self.metrics.throughput.record(nbytes / seconds / 1e9, attrs)

    def close(self) -> None:
        self._completer.shutdown(wait=True)
        with self._lock:
            self._instances.clear()
        self.pool.close()
        self.peers.close()
        if self.promoter is not None:
            self.promoter.close()
        if self.tiers is not None:
            self.tiers.close()
