"""The agent's store/retrieve/lookup engine, independent of gRPC.

``AgentCore`` owns the L1 cache and the registered engine instances. Each instance is one engine
worker's KV tensors (opened from IPC handles by the service) plus the kernel groups rebuilt from
them; its :class:`~kvgrid.agent.transfer.ChunkMover` copies between those tensors and L1 chunks.

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
``engine_copies`` copies nothing; it holds the leading ready chunks for the request (a lease: they
cannot be evicted or rewritten) and answers their offsets in the file; the engine scatters them
with the same kernels in its own CUDA context and ends the lease with Release. A registration that
goes (unregister, re-registration, the engine's exit) ends its leases. A Store with ``engine_copies``
reserves the new chunks' pages and answers their offsets and a store id; the engine gathers its
blocks there and a second Store naming the id makes them visible (or drops them after a failed
copy). The reservation outlives a re-registration (the engine may still be writing) and ends with
unregister or the engine's exit.

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
from dataclasses import dataclass, field

import numpy as np
import torch
from opentelemetry import metrics, trace

from kvgrid.agent.cache import CacheListener, ChunkCache, MissCause, StoreReservation
from kvgrid.agent.config import AgentConfig
from kvgrid.agent.eviction import make_policy
from kvgrid.agent.l1 import Chunk, L1Pool
from kvgrid.agent.metrics import AgentMetrics
from kvgrid.agent.peers.fetcher import PeerFetcher
from kvgrid.agent.peers.metrics import PeerMetrics
from kvgrid.agent.promotion import Promoter, Promotion
from kvgrid.agent.results import LookupResult, RetrieveResult, StoreResult
from kvgrid.agent.tiers.build import build_tier_chain
from kvgrid.agent.tiers.metrics import TierMetrics
from kvgrid.agent.transfer import ChunkMover, DoneSignal, build_mover, chunk_block_ids
from kvgrid.common.errors import InvalidArgument, client_input
from kvgrid.common.groups import EngineGroupInfo
from kvgrid.common.hashing import KeyNamespace, check_chunk_keys
from kvgrid.common.identity import PodIdentity
from kvgrid.common.rpc import after_reply
from kvgrid.common.tracing import local_span
from kvgrid_kernels import TransferHandle

__all__ = [
    "AgentCore",
    "EngineInstance",
    "UnknownInstanceError",
    "process_start_time",
]

log = logging.getLogger(__name__)


class UnknownInstanceError(InvalidArgument):
    """The request names an instance id that is not registered (never was, or was cleaned up);
    INVALID_ARGUMENT on the wire (the engine passed an id it never registered)."""


def process_start_time(pid: int) -> int | None:
    """Start time of ``pid`` (clock ticks since boot) or None if it is not visible or a zombie.

    Comparing it with the value seen at registration tells a live engine from a reused pid.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # Fields after the parenthesised command name (which may contain spaces): state is field 3,
    # starttime field 22.
    rest = stat[stat.rfind(b")") + 2 :].split()
    if not rest or rest[0] in (b"Z", b"X"):
        return None
    return int(rest[19])


@dataclass
class TransferTotals:
    """Chunks moved since start (Health reports them; the metrics carry the detail)."""

    retrieved_chunks: int = 0
    stored_chunks: int = 0


@dataclass
class EngineInstance:
    instance_id: str
    engine_pid: int
    pid_start_time: int | None
    namespace: KeyNamespace
    namespace_id: str
    groups: list[EngineGroupInfo]
    tensors: list[torch.Tensor]
    mover: ChunkMover
    registered_at: float = field(default_factory=time.time)
    fence: torch.cuda.Event | None = None
    """The engine's interprocess fence event (CUDA engines that sent one): transfers sent with
    ``after_fence`` start on the GPU once the engine's stream has passed its last record."""
    done: DoneSignal | None = None
    """The engine's done event: a Retrieve with ``signal_done`` answers once its copies are queued
    and records it after them."""

    def wait_event(self, after_fence: bool) -> torch.cuda.Event | None:
        """The event a transfer waits for; InvalidArgument when the engine asks for a fence it
        never registered."""
        if not after_fence:
            return None
        if self.fence is None:
            raise InvalidArgument(
                f"after_fence=true but instance {self.instance_id!r} registered no fence_event; "
                "expected RegisterKVCaches with an interprocess CUDA event first"
            )
        return self.fence

    @property
    def layout_id(self) -> str:
        return self.mover.layout_id

    @property
    def bytes_per_chunk(self) -> int:
        return self.mover.bytes_per_chunk

    @property
    def tokens_per_chunk(self) -> int:
        return self.namespace.tokens_per_chunk

    def alive(self) -> bool:
        if self.pid_start_time is None:
            return True  # not tracked (pid not visible from the agent)
        return process_start_time(self.engine_pid) == self.pid_start_time


class AgentCore:
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
        # (instance_id, request_id) -> {lease id: chunks} of its engine_copies Retrieves until Release.
        self._leases: dict[tuple[str, str], dict[int, list[Chunk]]] = {}
        self._lease_ids = itertools.count(1)
        # (instance_id, store id) -> an engine_copies Store's reservation and its key count, until
        # the Store that finishes it.
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
                    self.cache.unpin_instance(instance_id)
            if old is not None:
                self._end_leases(instance_id)
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
            released = self.cache.unpin_instance(instance_id)
        self._end_leases(instance_id)
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
                n = self.cache.unpin_instance(iid)
            self._end_leases(iid)
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

    def lookup(
        self,
        instance_id: str,
        request_id: str,
        keys: Sequence[bytes],
        pin_ttl_ms: int = 0,
        *,
        peer_address: str = "",
        lease: bool = False,
    ) -> LookupResult:
        """Leading chunks available: held here, then fetched from a peer -- the one at
        ``peer_address`` when the engine names it (P/D: its producer's agent), else (peer fetch on)
        the holder the controller names. With ``request_id`` they stay pinned until
        Retrieve/Release or the TTL. A failing peer never fails the lookup: it answers what it has,
        with cause ``peer_failed`` (also when an asynchronous fetch's chunks failed before the
        answer). ``lease`` (engine copies, shared L1): lease the hits to the request instead of
        pinning them when all their bytes are here already, so the engine copies without a
        Retrieve (:meth:`_lease_ready`)."""
        inst = self.instance(instance_id)
        with client_input():
            keys = check_chunk_keys(keys)
        # Clamped: a pin only protects chunks from eviction until Retrieve; no client may hold L1 longer.
        ttl = min(pin_ttl_ms or self.config.pin_ttl_ms, self.config.pin_ttl_max_ms) / 1000.0
        owner = (instance_id, request_id)
        with local_span(
            self.tracer, "agent.lookup", {"instance_id": instance_id, "chunks": len(keys)}
        ) as span:
            # Local hits stay referenced while a peer fetch runs: its reservations may evict, and
            # must not evict the prefix it extends.
            held: list[Chunk] = []
            if request_id:
                n, cause = self.cache.pin(owner, keys, inst.layout_id, ttl, namespace_id=inst.namespace_id)
            else:
                held, cause = self.cache.acquire_prefix(keys, inst.layout_id, namespace_id=inst.namespace_id)
                n = len(held)
            local = n
            tier = 0
            try:
                if (
                    cause == MissCause.NOT_FOUND
                    and self.tiers is not None
                    and self._from_tiers(inst, keys[n:], owner)
                ):
                    if request_id:
                        n, cause = self.cache.pin(
                            owner, keys, inst.layout_id, ttl, namespace_id=inst.namespace_id
                        )
                    else:
                        n, cause = self.cache.prefix_length(
                            keys, inst.layout_id, namespace_id=inst.namespace_id
                        )
                tier = n - local
                if cause == MissCause.NOT_FOUND and (peer_address or self.config.peer_fetch_enabled):
                    walked = n
                    fetched = self.peers.fetch(
                        keys[n:],
                        namespace_id=inst.namespace_id,
                        layout_id=inst.layout_id,
                        bytes_per_chunk=inst.bytes_per_chunk,
                        peer_address=peer_address,
                    )
                    if fetched.chunks:
                        if request_id:
                            n, cause = self.cache.pin(
                                owner, keys, inst.layout_id, ttl, namespace_id=inst.namespace_id
                            )
                        else:
                            n, cause = self.cache.prefix_length(
                                keys, inst.layout_id, namespace_id=inst.namespace_id
                            )
                    # An asynchronous fetch's pending chunks may have failed already (a forged
                    # stream arrives whole at once): fewer than fetched are there, and the peer is why.
                    if n < len(keys) and (fetched.error or n < walked + fetched.chunks):
                        cause = MissCause.PEER_FAILED
            finally:
                if held:
                    self.cache.release(held)
            peer = max(0, n - local - tier)
            span.set_attribute("hit_chunks", n)
            span.set_attribute("tier_chunks", tier)
            span.set_attribute("peer_chunks", peer)
            offsets, lease_id = (
                self._lease_ready(owner) if lease and request_id and n and self.pool.shared_file else ([], 0)
            )
        after_reply(self._count_hits, self.metrics.lookup_chunks, len(keys), n, cause, peer, tier)
        return LookupResult(
            num_hit_chunks=n,
            miss_cause=cause,
            num_peer_chunks=peer,
            chunk_offsets=offsets,
            lease_id=lease_id,
            l1_file=self.pool.shared_file if lease_id else "",
        )

    def _lease_ready(self, owner: tuple[str, str]) -> tuple[list[int], int]:
        """Turn the pins this Lookup took into a lease of ``owner`` when each chunk's bytes are
        final in L1: (their offsets, the lease id). Else ([], 0) and the pins stay: a chunk still
        being read from a lower tier (or whose read failed) is served by a Retrieve, which waits."""
        chunks = self.cache.take_ready_pins(owner)
        if not chunks:
            return [], 0
        with self._totals_lock:  # no Retrieve follows: the engine copies these itself
            self.totals.retrieved_chunks += len(chunks)
        return self._lease(owner, chunks)

    def _lease(self, owner: tuple[str, str], chunks: list[Chunk]) -> tuple[list[int], int]:
        """Hand ``chunks`` (referenced) to a new lease of ``owner``: their offsets in the shared L1
        file and the lease id. Release of the id (or of the whole request) drops the references."""
        lease_id = next(self._lease_ids)
        with self._lock:
            self._leases.setdefault(owner, {})[lease_id] = chunks
        return self._offsets(chunks), lease_id

    def _offsets(self, chunks: Sequence[Chunk]) -> list[int]:
        """Each chunk's byte offset in the shared L1 file (= pool.file_offset(c.buffer), without
        two tensor calls per chunk)."""
        page, base = self.pool.page_bytes, self._l1_base
        return [base + c.start_page * page for c in chunks]

    def _from_tiers(self, inst: EngineInstance, keys: Sequence[bytes], owner: tuple[str, str]) -> int:
        """Bring the leading ``keys`` back into L1: those still waiting for the tier writer (no
        I/O), then those the tiers hold (a promotion; waited for in ``sync`` mode). Returns how many
        leading keys are now in L1, pending or not."""
        back = self.cache.rescue_spilling(keys, inst.layout_id, namespace_id=inst.namespace_id)
        promotion = self._promote(inst, keys[back:], owner)
        return back + (promotion.leading if promotion is not None else 0)

    def _promote(
        self, inst: EngineInstance, keys: Sequence[bytes], owner: tuple[str, str]
    ) -> Promotion | None:
        assert self.promoter is not None
        promotion = self.promoter.start(
            owner,
            keys,
            namespace_id=inst.namespace_id,
            layout_id=inst.layout_id,
            nbytes=inst.bytes_per_chunk,
        )
        if promotion is not None and self.config.tier_promotion == "sync":
            promotion.done.wait()  # failed chunks left the index: the re-pin does not count them
        return promotion

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

    def release(self, instance_id: str, request_id: str) -> int:
        """Drop the request's lookup pins and end its engine-copies lease; the pins dropped."""
        return self.release_request(instance_id, request_id)[0]

    def release_request(self, instance_id: str, request_id: str, lease_id: int = 0) -> tuple[int, int]:
        """:meth:`release`, answering (pins dropped, leased chunks released). ``lease_id``: end only
        that lease of the request (an unknown one ends nothing) and leave its pins."""
        self.instance(instance_id)
        owner = (instance_id, request_id)
        if lease_id:
            with self._lock:
                leases = self._leases.get(owner, {})
                chunks = leases.pop(lease_id, [])
                if not leases:
                    self._leases.pop(owner, None)
            self.cache.release(chunks)
            return 0, len(chunks)
        released = self.cache.unpin(owner)
        if self.promoter is not None and request_id:
            self.promoter.cancel(owner)  # after the unpin: nobody wants its chunks
        with self._lock:
            chunks = [c for lease in self._leases.pop(owner, {}).values() for c in lease]
        self.cache.release(chunks)
        return released, len(chunks)

    def leased_chunks(self) -> int:
        """Chunks held for engines that copy themselves: leased to loads, or reserved for stores
        not finished yet."""
        with self._lock:
            return sum(len(c) for leases in self._leases.values() for c in leases.values()) + sum(
                len(res.new_chunks) for res, _ in self._engine_stores.values()
            )

    def _drop_engine_stores(self, instance_id: str) -> None:
        """The engine is gone (unregistered after its stores finished, or its process exited):
        its unfinished engine_copies stores are dropped. Not at a re-registration: the engine lives
        and may still be copying into the reserved pages."""
        with self._lock:
            mine = [k for k in self._engine_stores if k[0] == instance_id]
            reservations = [self._engine_stores.pop(k) for k in mine]
        for res, _ in reservations:
            self.cache.abort(res)

    def _end_leases(self, instance_id: str) -> None:
        with self._lock:
            owners = [o for o in self._leases if o[0] == instance_id]
            chunks = [c for o in owners for lease in self._leases.pop(o).values() for c in lease]
        self.cache.release(chunks)

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
        if engine_copies:
            self._check_engine_copies(after_fence, signal_done, "Retrieve")
            if not request_id:
                raise InvalidArgument(
                    "engine_copies=true needs a request_id: Release(request_id) ends the lease"
                )
        fence = inst.wait_event(after_fence)
        if signal_done and inst.done is None:
            raise InvalidArgument(
                f"signal_done=true but instance {instance_id!r} registered no done_event; expected "
                "RegisterKVCaches with an interprocess CUDA event first"
            )
        with client_input():
            keys = check_chunk_keys(keys)
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
            t0 = time.perf_counter()
            handle = None
            offsets: list[int] = []
            lease_id = 0
            try:
                if engine_copies:
                    offsets, lease_id = self._lease((instance_id, request_id), chunks)
                    chunks = []
                elif n:
                    handle = inst.mover.retrieve_async(
                        [c.buffer for c in chunks], [per_chunk[:n] for per_chunk in ids], wait_event=fence
                    )
                if signal_done:
                    assert inst.done is not None
                    inst.done.after(handle)
                    if handle is not None:  # the completer releases the chunks once they landed
                        self._completer.submit(
                            self._release_landed, handle, chunks, t0, n * inst.bytes_per_chunk
                        )
                        chunks = []
                elif handle is not None:
                    handle.wait()
                dt = time.perf_counter() - t0
            finally:
                if chunks:  # leased or handed to the completer otherwise
                    self.cache.release(chunks)
            if request_id:
                self.cache.unpin((instance_id, request_id))
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
                sid = next(self._store_ids)
                with self._lock:
                    self._engine_stores[(instance_id, sid)] = (res, len(keys))
                span.set_attribute("engine_copies", len(new))
                return StoreResult(
                    num_stored_chunks=0,
                    num_already_present=0,
                    bytes_moved=0,
                    partial_reason=res.reason,
                    store_id=sid,
                    copy_chunk_indices=[i for i, _ in new],
                    chunk_offsets=self._offsets([c for _, c in new]),
                )
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
