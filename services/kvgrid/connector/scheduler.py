"""The scheduler half of the connector (vLLM's engine-core process): decides, never moves bytes.

Per request, in vLLM's order:

``lookup`` (``get_num_new_matched_tokens``)
    hashes the prompt into chained chunk keys (per worker rank), asks every rank's agent how many
    leading chunks it holds for that rank (each agent pins them for the request) and offers the
    tokens beyond the engine's own prefix-cache hit -- the minimum over the ranks, since every
    rank must load its shard -- as an asynchronous load.
``after_alloc`` (``update_state_after_alloc``)
    turns a hit into a :class:`LoadOrder` over the blocks vLLM allocated; an unused hit releases
    its pins at once. With ``lease_at_lookup`` (engine copies) each rank's Lookup turned its pins
    into a lease when it could, and the order carries the leases: the worker needs no Retrieve.
    vLLM calls it again when the request is scheduled after its load: the state is kept, only the
    block ids are refreshed.
``build_meta`` (``build_connector_meta``)
    emits the pending loads and a :class:`StoreOrder` for every prompt chunk this step completes
    (with chunked prefill, each step stores the chunks it completed; a partial chunk is never
    stored). With ``save_decode_tokens`` also chunks filled by generated tokens, one step after
    their KV is complete: tokens scheduled in a step may be speculative and rolled back, tokens
    computed before it are final.
``finished`` (``request_finished_all_groups``)
    drops the request's state and pins. With asynchronous stores in flight it asks vLLM to keep the
    request's blocks (delay-free) and names it in the next step's ``sending``; the workers report it
    in ``finished_sending`` once its stores landed, and vLLM frees the blocks then: no step waits
    for a store.

``take_events``
    with vLLM's KV events enabled, every store order is announced as a ``BlockStored`` event with
    ``medium="CPU"`` over vLLM's own block hashes of the stored chunks, so a router that reads
    vLLM's events learns kvgrid's tier without talking to kvgrid. (Evictions from the agent's L1
    are published by the agent to the controller, not as vLLM events: the scheduler never sees
    them.)
``note_output`` (``update_connector_output``)
    learns which loads failed (``failed_recving``, or blocks in ``invalid_block_ids``): such a
    request is never offered a hit again, so a load that keeps failing cannot loop.

Invariants: a load order is emitted once per lookup; ``num_stored_chunks`` only grows, so a chunk
is stored at most once per request; every pin taken is released by retrieve, by ``after_alloc``
(unused hit) or by ``finished`` -- whichever comes first; every lease a Lookup took is ended by the
load (by id, once its bytes landed), by the request's next Lookup (by id), or by ``after_alloc``
(unused hit) or ``finished`` (the whole request); a Lookup waits for a whole-request Release of its
request still queued, so that Release never ends the new lease; a request with stores ordered is
named once, in the next step's metadata, either in ``sending`` (finished, asynchronous stores, no
load in flight: vLLM holds its blocks until the workers report its stores) or in ``flush_stores``
(preempted, or finished otherwise: vLLM freed its blocks, so the worker waits for its stores before
the step writes any block). A request is never both delay-freed by kvgrid and waiting for a load
(vLLM frees those blocks itself when the load is reported).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import grpc
from vllm.distributed.kv_events import MEDIUM_CPU, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvgrid.common.hashing import chain_chunk_keys, chunk_keys, pack_token_ids
from kvgrid.connector.chunk_policy import loadable_chunks, new_tokens_to_load, storable_chunks
from kvgrid.connector.config import ConnectorIdentity, KVGridConnectorConfig
from kvgrid.connector.metadata import KVGridConnectorMetadata, Lease, LoadOrder, StoreOrder
from kvgrid.connector.tracing import agent_call_span
from kvgrid.engine.client import AgentClient

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["PEERS_PARAM", "SKIP_SAVE_PARAM", "ConnectorScheduler", "end_lease", "rpc_text"]

log = logging.getLogger(__name__)

SKIP_SAVE_PARAM = "kvgrid_skip_save"
"""``kv_transfer_params`` key: when true, the request's chunks are not stored (loads still happen)."""
PEERS_PARAM = "kvgrid_peers"
"""``kv_transfer_params`` key (P/D disaggregation): per worker rank, the ``host:port`` of the agent
that holds the request's prefix -- a producer engine returns it when its request finishes, the
proxy passes it on to the consumer engine, whose agents fetch the chunks from there."""
PEER_ADDRESS_REFRESH_S = 30.0
"""How old the agents' peer addresses may get before a finished request has them asked again, off
the scheduler's thread. An address changes only when its agent restarts."""


def _peers_of(request: Request, world_size: int) -> list[str]:
    """The producer agents named in the request's kv_transfer_params, one per rank ("" = none).
    A bad value is ignored with a warning: the request is served as if no peer were named."""
    raw = (request.kv_transfer_params or {}).get(PEERS_PARAM)
    if raw is None:
        return [""] * world_size
    if isinstance(raw, list) and len(raw) == world_size and all(isinstance(a, str) for a in raw):
        return list(raw)
    log.warning(
        "kvgrid: request %s has kv_transfer_params %s=%r; expected a list of %d host:port strings "
        "(one per worker rank); ignoring it",
        request.request_id,
        PEERS_PARAM,
        raw,
        world_size,
    )
    return [""] * world_size


def rpc_text(e: grpc.RpcError) -> str:
    code = e.code() if isinstance(e, grpc.Call) else None
    details = e.details() if isinstance(e, grpc.Call) else str(e)
    return f"{getattr(code, 'name', code)}: {details}"


def end_lease(agent: AgentClient, instance_id: str, request_id: str, lease_id: int) -> None:
    """End one lease of the request by id: one-way on the hot path (nothing needs the answer), and
    by id, so it never ends another load's lease of the same request."""
    try:
        agent.release_nowait(instance_id, request_id, lease_id)
    except grpc.RpcError as e:  # the agent went: its leases went with it
        log.info("kvgrid release of request %s's lease failed: %s", request_id, rpc_text(e))


@dataclass
class _Lookup:
    """What ``lookup`` found, for ``after_alloc`` to act on."""

    hit_chunks: int
    num_computed_tokens: int
    pinned: bool = False
    """Some rank's agent holds pins or a lease for the request (even when the minimum hit is 0)."""
    leases: list[Lease | None] = field(default_factory=list)
    """Per rank, the lease its agent took at Lookup (engine copies), for the load order."""


@dataclass
class _RequestState:
    request: Request
    request_id: str
    num_prompt_tokens: int
    keys: list[list[bytes]]
    save: bool
    block_ids: list[list[int]] = field(default_factory=list)
    num_stored_chunks: int = 0
    """Leading chunks known to be in the agent (loaded from it or already stored)."""
    load: LoadOrder | None = None
    """Set by after_alloc, taken (once) by build_meta."""
    loading: bool = False
    """A load was emitted and its outcome is not known yet."""
    pinned: bool = False
    stores_ordered: bool = False
    """A StoreOrder was emitted: its copy may still be in flight when vLLM frees the blocks."""


class ConnectorScheduler:
    """Scheduler-side state and decisions (module docstring)."""

    def __init__(
        self,
        identity: ConnectorIdentity,
        config: KVGridConnectorConfig,
        *,
        is_consumer: bool,
        is_producer: bool,
        event_block_size: int = 0,
        lease_at_lookup: bool = False,
        async_stores: bool = False,
    ) -> None:
        """``event_block_size``: tokens per vLLM block hash when vLLM's KV events are on (0: off).
        ``lease_at_lookup``: the workers copy loads themselves (engine copies), so each Lookup asks
        its agent to lease the hits at once, and the load needs no Retrieve round trip.
        ``async_stores``: the workers store in the background (``async_store``), so a finished
        request's blocks are held until its stores are reported sent."""
        self.identity = identity
        self.config = config
        self.is_consumer = is_consumer
        self.is_producer = is_producer
        self._agents = {
            address: AgentClient(address, timeout_s=config.lookup_timeout_s)
            for address in dict.fromkeys(identity.agent_addresses)
        }
        # An agent whose call failed is left alone until this time.monotonic() value: the
        # scheduler must not wait a deadline per request on an agent that is away or hung.
        self._agent_back_off: dict[str, float] = {}
        self._lookups: dict[str, _Lookup] = {}
        self._keys: dict[str, list[list[bytes]]] = {}
        self._requests: dict[str, _RequestState] = {}
        self._load_failed: set[str] = set()
        self._pending_loads: list[_RequestState] = []
        """Requests whose load order build_meta has yet to emit (after_alloc queues them)."""
        self._freed_with_stores: set[str] = set()
        """Finished or preempted requests with stores ordered, not yet named in a step's flush_stores."""
        self.async_stores = async_stores
        self._sending: set[str] = set()
        """Finished requests whose blocks vLLM holds for their stores, not yet named in ``sending``."""
        # Layer-wise loads run inside the step; vLLM maps a failed synchronous load back to its
        # request only with one KV cache group, so hybrid models keep asynchronous loads.
        self.in_step_loads = config.layerwise and len(identity.tokens_per_block) == 1
        self._own_peers: list[str] | None = None
        self._peers_asked_at: float | None = None
        """time.monotonic() of the last Health asked for ``_own_peers`` (None: never)."""
        self.lease_at_lookup = lease_at_lookup
        self._releaser = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvgrid-release")
        self._releasing_lock = threading.Lock()
        self._releasing: dict[str, Future[None]] = {}
        """Requests whose whole-request Release is queued: a new Lookup of one waits for it, so
        the late Release cannot end the lease that Lookup takes."""
        self.event_block_size = event_block_size
        self._events: list[KVCacheEvent] = []

    # ---- keys -----------------------------------------------------------------------------------

    def request_keys(self, request: Request) -> list[list[bytes]] | None:
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
        ident = self.identity
        tokens = request.prompt_token_ids
        by_namespace: dict[str, list[bytes]] = {}  # MLA under TP: every rank shares one namespace
        keys = []
        for r in range(ident.world_size):
            ns = ident.namespace(r, salt, lora)
            keys.append(by_namespace.setdefault(ns.namespace_id(), chunk_keys(tokens, ns)))
        self._keys[request.request_id] = keys
        return keys

    # ---- vLLM's scheduler hooks -----------------------------------------------------------------

    def lookup(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens the agent can supply beyond ``num_computed_tokens`` and whether the load is async."""
        previous = self._lookups.pop(request.request_id, None)
        if previous is not None:  # looked up again before it was scheduled: that lookup's leases go
            self._end_leases(request.request_id, previous.leases)
        with self._releasing_lock:
            queued = self._releasing.get(request.request_id)
        if queued is not None:
            queued.result()  # rare: a preempted request's release still queued (it logs its errors)
        if not self.is_consumer:
            return 0, False
        keys = self.request_keys(request)
        if keys is None or request.request_id in self._load_failed:
            return 0, False
        tpc = self.identity.tokens_per_chunk
        limit = min(loadable_chunks(request.num_prompt_tokens, tpc), len(keys[0]))
        if limit * tpc <= num_computed_tokens:
            return 0, False
        # One span for the agents' lookups, in the request's own trace when vLLM carries one.
        with agent_call_span(
            "kvgrid.connector.lookup",
            request.request_id,
            trace_headers=getattr(request, "trace_headers", None),
            attributes={"kvgrid.chunks": limit},
        ) as span:
            hit = limit
            ident = self.identity
            peers = _peers_of(request, ident.world_size)
            leases: list[Lease | None] = []
            for rank in range(ident.world_size):
                address = ident.agent_addresses[rank]
                if time.monotonic() < self._agent_back_off.get(address, 0.0):
                    hit = 0
                    break
                try:
                    res = self._agents[address].lookup(
                        ident.instance_ids[rank],
                        request.request_id,
                        keys[rank][:hit],
                        pin_ttl_ms=self.config.pin_ttl_ms,
                        peer_address=peers[rank],
                        lease=self.lease_at_lookup,
                    )
                except grpc.RpcError as e:
                    # An agent is away (restarting) or this rank is not registered (yet): a miss.
                    log.warning(
                        "kvgrid lookup for request %s on rank %d failed: %s",
                        request.request_id,
                        rank,
                        rpc_text(e),
                    )
                    self._agent_back_off[address] = time.monotonic() + self.config.reregister_interval_s
                    hit = 0
                else:
                    hit = min(hit, res.num_hit_chunks)
                    leases.append(
                        Lease(res.lease_id, res.chunk_offsets, res.l1_file) if res.lease_id else None
                    )
                if hit == 0:
                    break
            span.set_attribute("kvgrid.hit_chunks", hit)
        if rank > 0 or hit:
            # Pins were taken on some ranks; after_alloc or finished releases them.
            self._lookups[request.request_id] = _Lookup(hit, num_computed_tokens, pinned=True, leases=leases)
        n = new_tokens_to_load(hit, tpc, num_computed_tokens)
        return n, n > 0 and not self.in_step_loads

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        rid = request.request_id
        found = self._lookups.pop(rid, None)
        keys = self.request_keys(request)
        if keys is None:
            return
        state = self._requests.get(rid)
        if state is None:
            params = request.kv_transfer_params or {}
            save = not params.get(SKIP_SAVE_PARAM)
            state = _RequestState(request, rid, request.num_prompt_tokens, keys, save=save)
            self._requests[rid] = state
        state.block_ids = [list(ids) for ids in blocks.get_block_ids()]
        if found is not None and found.pinned:
            state.pinned = True
        if found is not None and num_external_tokens > 0:
            end = found.num_computed_tokens + num_external_tokens
            n = min(-(-end // self.identity.tokens_per_chunk), found.hit_chunks)
            state.load = LoadOrder(
                request_id=rid,
                keys=[k[:n] for k in keys],
                block_ids=state.block_ids,
                skip_first_n_tokens=found.num_computed_tokens,
                in_step=self.in_step_loads,
                leases=found.leases,
            )
            self._pending_loads.append(state)
            state.num_stored_chunks = max(state.num_stored_chunks, n)
        elif found is not None and state.pinned and state.load is None:
            self._release(rid)
            state.pinned = False

    def build_meta(self, scheduler_output: SchedulerOutput) -> KVGridConnectorMetadata:
        meta = KVGridConnectorMetadata()
        pending, self._pending_loads = self._pending_loads, []
        for waiting in pending:
            # A request that finished meanwhile (aborted) is gone from _requests: nothing to load.
            if self._requests.get(waiting.request_id) is waiting and waiting.load is not None:
                waiting.load.block_ids = [list(ids) for ids in waiting.block_ids]
                meta.loads.append(waiting.load)
                waiting.load = None
                waiting.loading = True
        if not self.is_producer:
            return meta
        for rid in scheduler_output.preempted_req_ids or ():
            if (preempted := self._requests.get(rid)) is not None and preempted.stores_ordered:
                self._freed_with_stores.add(rid)
        meta.flush_stores, self._freed_with_stores = sorted(self._freed_with_stores), set()
        meta.sending, self._sending = sorted(self._sending), set()
        scheduled = scheduler_output.num_scheduled_tokens
        progress: list[tuple[_RequestState, int, int]] = []  # (state, computed before, after the step)
        for new in scheduler_output.scheduled_new_reqs:
            if (fresh := self._requests.get(new.req_id)) is not None:
                fresh.block_ids = [list(ids) for ids in new.block_ids]
                before = new.num_computed_tokens
                progress.append((fresh, before, before + scheduled.get(new.req_id, 0)))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if (state := self._requests.get(req_id)) is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = [list(ids) for ids in new_ids or ()]
            elif new_ids is not None:
                for ids, more in zip(state.block_ids, new_ids, strict=True):
                    ids.extend(more)
            before = cached.num_computed_tokens[i]
            progress.append((state, before, before + scheduled.get(req_id, 0)))
        tpc = self.identity.tokens_per_chunk
        for state, computed_before, computed_after in progress:
            if not state.save:
                continue
            done = storable_chunks(computed_after, state.num_prompt_tokens, tpc)
            if self.config.save_decode_tokens and computed_before // tpc > done:
                done = computed_before // tpc
                self._extend_keys(state, done)
            done = min(done, len(state.keys[0]))
            if done > state.num_stored_chunks:
                meta.stores.append(
                    StoreOrder(
                        request_id=state.request_id,
                        keys=[k[:done] for k in state.keys],
                        block_ids=[list(ids) for ids in state.block_ids],
                        skip_first_n_chunks=state.num_stored_chunks,
                    )
                )
                self._announce(state.request, state.num_stored_chunks * tpc, done * tpc)
                state.num_stored_chunks = done
                state.stores_ordered = True
        return meta

    def _extend_keys(self, state: _RequestState, num_chunks: int) -> None:
        """Chain the keys of the request's chunks up to ``num_chunks`` over its generated tokens."""
        have = len(state.keys[0])
        if num_chunks <= have:
            return
        tpc = self.identity.tokens_per_chunk
        request = state.request
        packed = pack_token_ids(request.all_token_ids[have * tpc : num_chunks * tpc])
        lora = request.lora_request.lora_name if request.lora_request is not None else ""
        extended: dict[int, list[bytes]] = {}  # ranks sharing one key list (MLA) extend it once
        keys = []
        for rank, rank_keys in enumerate(state.keys):
            if id(rank_keys) not in extended:
                prev = (
                    rank_keys[-1]
                    if rank_keys
                    else self.identity.namespace(rank, request.cache_salt or "", lora).seed()
                )
                extended[id(rank_keys)] = rank_keys + chain_chunk_keys(prev, packed, tpc)
            keys.append(extended[id(rank_keys)])
        state.keys = keys

    def _announce(self, request: Request, start_token: int, end_token: int) -> None:
        """Queue a BlockStored event for the vLLM blocks of tokens [start_token, end_token)."""
        bs = self.event_block_size
        if bs <= 0 or start_token % bs or end_token % bs:
            return
        first, last = start_token // bs, end_token // bs
        hashes = request.block_hashes
        if len(hashes) < last:
            return  # vLLM hashed fewer blocks (prefix caching off): nothing a router could match
        lora = request.lora_request
        self._events.append(
            BlockStored(
                block_hashes=[maybe_convert_block_hash(h) for h in hashes[first:last]],
                parent_block_hash=maybe_convert_block_hash(hashes[first - 1]) if first else None,
                token_ids=list(request.all_token_ids[start_token:end_token]),
                block_size=bs,
                lora_id=lora.adapter_id if lora is not None else None,
                medium=MEDIUM_CPU,
                lora_name=lora.name if lora is not None else None,
            )
        )

    def take_events(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    def note_output(self, output: KVConnectorOutput) -> None:
        """Record the loads that ended this step and which of them failed."""
        failed = set(output.failed_recving or ())
        invalid = output.invalid_block_ids or set()
        # Async loads end when a worker reports them; in-step (layer-wise) loads end with their step.
        ended = set(output.finished_recving or ())
        ended |= {rid for rid, st in self._requests.items() if st.loading and self.in_step_loads}
        for rid in ended:
            state = self._requests.get(rid)
            if state is None:
                continue
            state.loading = False
            # One KV cache group: block ids are unique, so failed blocks name their request.
            if invalid and len(state.block_ids) == 1 and invalid.intersection(state.block_ids[0]):
                failed.add(rid)
        self._load_failed |= failed & self._requests.keys()

    def finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Drop the request's state and pins, and say whether vLLM must keep its blocks (module
        docstring): True only for asynchronous stores with no load in flight (an in-flight load
        holds the blocks through vLLM's own ``WAITING_FOR_REMOTE_KVS`` bookkeeping, which frees them
        when the load is reported); synchronous stores are waited for by the next step's
        ``handle_preemptions`` before anything writes the freed blocks."""
        rid = request.request_id
        self._keys.pop(rid, None)
        self._load_failed.discard(rid)
        found = self._lookups.pop(rid, None)
        state = self._requests.pop(rid, None)
        if (state is not None and state.pinned) or (found is not None and found.pinned):
            self._release(rid)
        hold = False
        if state is not None and state.stores_ordered:
            hold = self.async_stores and not state.loading
            (self._sending if hold else self._freed_with_stores).add(rid)
        if state is not None and state.num_stored_chunks and self.is_producer:
            peers = self._peer_addresses()
            if peers:
                return hold, {PEERS_PARAM: peers}  # where a consumer engine finds this prefix
        return hold, None

    def _peer_addresses(self) -> list[str] | None:
        """Every rank's agent's peer address (None while one has none). Asked on the scheduler's
        thread only the first time; afterwards the answer -- "none" too -- is kept and refreshed off
        that thread once it is older than :data:`PEER_ADDRESS_REFRESH_S`. (Asking on every finished
        request cost a blocking Health RPC per request on vLLM's scheduler thread: 0.7-4 ms of each
        request's time to first token while the agents serve no peers.)"""
        asked = self._peers_asked_at
        if asked is None:
            self._ask_peers()
        elif time.monotonic() - asked > PEER_ADDRESS_REFRESH_S:
            self._peers_asked_at = time.monotonic()  # one refresh at a time
            self._releaser.submit(self._ask_peers)
        return self._own_peers

    def _ask_peers(self) -> None:
        """Ask every rank's agent for its peer address; on failure keep the last answer."""
        self._peers_asked_at = time.monotonic()
        try:
            found = [
                self._agents[address].health().pod.agent_address for address in self.identity.agent_addresses
            ]
        except grpc.RpcError as e:
            log.warning("kvgrid: could not ask the agents for their peer addresses: %s", rpc_text(e))
            return
        self._own_peers = found if all(found) else None

    def _release(self, request_id: str) -> None:
        """Drop the request's pins and leases on every rank's agent, off the scheduler's thread:
        vLLM's scheduler must never wait on an agent that is slow or away (the pins' TTL bounds
        them)."""
        future = self._releaser.submit(self._release_now, request_id)
        with self._releasing_lock:
            self._releasing[request_id] = future
        future.add_done_callback(partial(self._released, request_id))

    def _released(self, request_id: str, future: Future[None]) -> None:
        with self._releasing_lock:
            if self._releasing.get(request_id) is future:
                del self._releasing[request_id]

    def _end_leases(self, request_id: str, leases: list[Lease | None]) -> None:
        """End a lookup's leases by id (no load will use them), off the scheduler's thread. By id,
        so a later lookup's lease of the same request is never ended by mistake."""
        ident = self.identity
        for rank, lease in enumerate(leases):
            if lease is not None:
                agent, instance_id = self._agents[ident.agent_addresses[rank]], ident.instance_ids[rank]
                self._releaser.submit(end_lease, agent, instance_id, request_id, lease.lease_id)

    def _release_now(self, request_id: str) -> None:
        ident = self.identity
        for rank in range(ident.world_size):
            try:
                self._agents[ident.agent_addresses[rank]].release(ident.instance_ids[rank], request_id)
            except grpc.RpcError as e:
                log.warning(
                    "kvgrid release for request %s on rank %d failed: %s", request_id, rank, rpc_text(e)
                )

    def close(self) -> None:
        self._releaser.shutdown(wait=True)
        for agent in self._agents.values():
            agent.close()
