"""Peer fetch: copying chunks another agent holds in its L1 into this agent's L1.

Serving side (:class:`ChunkSender`, behind ``AgentService.FetchChunks`` on TCP): the leading held
chunks of the requested keys, stored in the caller's namespace (required: chunks are never served
across namespaces) and in the caller's chunk layout, are referenced when the call starts (eviction
cannot free them mid-stream) and streamed in order, each split into parts of at most
``part_bytes`` and at least ``min_part_bytes`` (a caller cannot make the sender hold a thread for
one message per byte); each chunk's reference is dropped once its last part is out. Errors name
only what the caller sent (never another chunk's layout).

Fetching side (:class:`PeerFetcher`, used by ``Lookup``): ask the controller which pods hold the
next keys in L1 (``MatchPrefix`` over the keys after the local hits), map pod -> agent address
(``ListAgents``, cached), stream ``FetchChunks`` from the best peer -- then, for the keys after
what it sent, from whoever holds those (a prefix is stitched from several pods) -- into freshly
reserved local chunks (the same reserve -> fill -> commit path a store takes, so a chunk becomes
visible only once every byte arrived and matched the checksum sent with it, and its admit event
goes to the controller as usual). Everything runs under one deadline; any failure leaves the local cache as it
was, plus the chunks that arrived complete and intact.

Data plane (``peer_data_plane=socket``, :mod:`kvgrid.agent.p2p`): the fetcher asks for
``data_streams``; a sender with a data plane answers with one ticket message (bound to the caller's
certificate identity) and moves the bytes on its data port (the gRPC stream stays open until they
are out, holding the chunks' references); a sender without one streams them as above, so either side
may have it off. With TLS the fetcher also asks for its ``peer_data_security`` and takes the mode
the answer names only when it is at least as strong (``mac`` < ``aead``, ``tls``). A data port the
fetcher cannot reach is retried over gRPC at once, and that peer's fetches use gRPC until a backoff
passes (:class:`DataPlaneBackoff`, ``peer_data_retry_*_ms``); then its data port is tried again --
never given up for good.

Serving deadline: a stream still sending at its ``deadline`` (the agent's ``peer_stream_timeout_ms``)
fails with DEADLINE_EXCEEDED; a data-plane ticket lives at most until then.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
import msgspec
import numpy as np
from opentelemetry import metrics, trace

from kvgrid.agent.cache import ChunkCache, MissCause
from kvgrid.agent.config import AgentConfig
from kvgrid.agent.l1 import Chunk
from kvgrid.agent.p2p import (
    KEY_BYTES,
    DataPlaneServer,
    Ticket,
    accepted_security,
    check_security_dependencies,
    client_context,
    fetch_streams,
    ticket_streams,
)
from kvgrid.agent.peer_guard import ServingDeadlineExceeded
from kvgrid.api.v1 import agent_pb2, agent_pb2_grpc, common_pb2, controller_pb2, controller_pb2_grpc
from kvgrid.common.checksum import ChecksumMismatch, chunk_checksum, verify_checksum
from kvgrid.common.errors import FailedPrecondition, InvalidArgument, check_namespace_id, client_input
from kvgrid.common.hashing import check_chunk_keys
from kvgrid.common.tls import AGENT_SERVER_NAME, CONTROLLER_SERVER_NAME, Channels, ClientTls
from kvgrid.common.tracing import traced_channel

__all__ = [
    "MIN_PART_BYTES",
    "ChunkSender",
    "DataPlaneBackoff",
    "LayoutMismatchError",
    "PeerCandidate",
    "PeerError",
    "PeerFetchResult",
    "PeerFetcher",
    "PeerMetrics",
    "PeerStats",
    "choose_peers",
]

log = logging.getLogger(__name__)

# Room for the message's other fields next to the data part.
_MESSAGE_OVERHEAD = 1024

MIN_PART_BYTES = 64 * 1024
"""Floor on a FetchChunks part: a smaller ``max_part_bytes`` is raised to it (never above the
sender's own part size), so a caller cannot make a stream cost one message per few bytes."""


class LayoutMismatchError(FailedPrecondition):
    """The requested chunk is held in another chunk byte layout (gRPC FAILED_PRECONDITION)."""


class PeerError(Exception):
    """A peer fetch failed; ``reason`` is the metric label (controller, unavailable, deadline, ...)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class PeerCandidate(msgspec.Struct, frozen=True):
    pod_uid: str
    address: str
    l1_chunks: int
    """Leading query chunks the controller counts in this pod's own L1."""
    total_chunks: int


class PeerFetchResult(msgspec.Struct, frozen=True):
    chunks: int = 0
    """Chunks now held locally that the fetch filled (complete ones only)."""
    nbytes: int = 0
    peer: str = ""
    """The holder the chunks came from (several, comma-separated, when a prefix was stitched)."""
    error: str = ""
    """Empty when nothing failed (no holder at all is not a failure)."""

    def then(self, more: PeerFetchResult) -> PeerFetchResult:
        """This fetch followed by ``more`` (of the keys after this one's chunks)."""
        peers = ",".join(p for p in (self.peer, more.peer) if p)
        return PeerFetchResult(self.chunks + more.chunks, self.nbytes + more.nbytes, peers, more.error)


class PeerStats:
    """Counters for Health (the OpenTelemetry instruments carry the same numbers)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.fetched_chunks = 0
        self.fetch_failures = 0
        self.served_chunks = 0

    def add(self, *, fetched: int = 0, failures: int = 0, served: int = 0) -> None:
        with self._lock:
            self.fetched_chunks += fetched
            self.fetch_failures += failures
            self.served_chunks += served


_DURATION_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class PeerMetrics:
    """``kvgrid_agent_peer_*`` instruments."""

    def __init__(self, meter: metrics.Meter) -> None:
        self.stats = PeerStats()
        self.fetch_bytes = meter.create_counter(
            "kvgrid_agent_peer_fetch", unit="By", description="Bytes fetched from peer agents into L1"
        )
        self.fetch_chunks = meter.create_counter(
            "kvgrid_agent_peer_fetch_chunks",
            unit="{chunk}",
            description="Chunks fetched from peer agents into L1",
        )
        self.fetch_duration = meter.create_histogram(
            "kvgrid_agent_peer_fetch_duration",
            unit="s",
            description="Wall time of one Lookup's peer fetch (controller query, stream, commit), by outcome",
            explicit_bucket_boundaries_advisory=_DURATION_BUCKETS_S,
        )
        self.fetch_throughput = meter.create_histogram(
            "kvgrid_agent_peer_fetch_throughput",
            unit="GBy/s",
            description="GB/s of each peer fetch stream that moved bytes",
            explicit_bucket_boundaries_advisory=(0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 50),
        )
        self.fetch_failures = meter.create_counter(
            "kvgrid_agent_peer_fetch_failures",
            unit="{fetch}",
            description="Peer fetches that failed, by reason (controller, unavailable, deadline, "
            "layout_mismatch, protocol, checksum, error; data_plane_unreachable: a data port could not be "
            "reached and the fetch was retried over gRPC)",
        )
        self.served_bytes = meter.create_counter(
            "kvgrid_agent_peer_served", unit="By", description="Bytes streamed to peer agents"
        )
        self.served_chunks = meter.create_counter(
            "kvgrid_agent_peer_served_chunks", unit="{chunk}", description="Chunks streamed to peer agents"
        )


# ---- serving ---------------------------------------------------------------------------------


class ChunkSender:
    """One FetchChunks stream: references the leading held chunks at construction (so errors come
    before the first message) and releases each as soon as it is sent; :meth:`close` releases
    whatever is left (client gone, server stopping) and is idempotent."""

    def __init__(
        self,
        cache: ChunkCache,
        req: agent_pb2.FetchChunksRequest,
        *,
        part_bytes: int,
        max_chunks: int,
        min_part_bytes: int = MIN_PART_BYTES,
        metrics: PeerMetrics | None = None,
        data_plane: DataPlaneServer | None = None,
        ticket_ttl_s: float = 2.0,
        deadline: float | None = None,
        caller: str = "",
        on_close: Callable[[], None] | None = None,
    ) -> None:
        """``deadline`` (``time.monotonic()``): the stream fails with DEADLINE_EXCEEDED when it is
        still sending then; ``caller``: the certificate identity a data-plane ticket is bound to
        ("" without TLS); ``on_close``: called once when the stream ends (however it ends)."""
        if not req.layout_id:
            raise InvalidArgument(
                "layout_id is empty: expected the caller's RegisterKVCachesResponse.layout_id"
            )
        namespace_id = check_namespace_id(
            req.namespace_id, "namespace_id", "of the caller's registration (chunks are served per namespace)"
        )
        with client_input():
            keys = check_chunk_keys(req.chunk_keys)[:max_chunks]
        if req.max_part_bytes:
            part_bytes = min(part_bytes, max(int(req.max_part_bytes), min_part_bytes))
        self.part_bytes = max(1, part_bytes)
        self.cache = cache
        self.metrics = metrics
        self.requester = req.requester_pod_uid
        # Chunks still being promoted from a lower tier are waited for; a failed one ends the run.
        chunks, cause = cache.acquire_ready_prefix(keys, req.layout_id, namespace_id=namespace_id)
        if not chunks and cause == MissCause.LAYOUT_MISMATCH and keys:
            # Names only what the caller sent: the held layout is not revealed.
            raise LayoutMismatchError(
                f"chunk_keys[0] is held in namespace_id={namespace_id!r} with another layout than "
                f"layout_id={req.layout_id!r}: the chunk byte layouts differ (model, dtype, block size "
                f"or KV layout)"
            )
        self._lock = threading.Lock()
        self._pending: list[Chunk] = chunks  # referenced, not yet fully sent
        self._ticket: Ticket | None = None  # data plane: holds the references instead
        self.num_chunks = len(chunks)
        self.data_plane = data_plane if req.data_streams else None
        self.data_streams = int(req.data_streams)
        self.data_security = req.data_security
        self.ticket_ttl_s = ticket_ttl_s
        self.deadline = deadline
        self.caller = caller
        self._on_close = on_close

    def close(self) -> None:
        with self._lock:
            left, self._pending = self._pending, []
            ticket = self._ticket
            on_close, self._on_close = self._on_close, None
        if left:
            self.cache.release(left)
        if ticket is not None:
            ticket.close()  # the call ended (client gone): wakes _iter_ticket, which retires it
        if on_close is not None:
            on_close()

    def _check_deadline(self) -> None:
        if self.deadline is not None and time.monotonic() >= self.deadline:
            raise ServingDeadlineExceeded(
                f"FetchChunks: still streaming at this agent's serving deadline (peer_stream_timeout_ms) "
                f"with {len(self._pending)} of {self.num_chunks} chunks unsent; fetch fewer chunks or read "
                f"faster"
            )

    def _peek(self) -> Chunk | None:
        with self._lock:
            return self._pending[0] if self._pending else None

    def _iter_ticket(self, plane: DataPlaneServer) -> Iterator[agent_pb2.FetchChunksResponse]:
        """Data plane: hand the references to a ticket, send it, keep the stream open until the
        chunks went out on the data port (or the TTL passed); closing the stream retires it."""
        with self._lock:
            chunks, self._pending = self._pending, []
        ticket = plane.issue(
            self.cache,
            chunks,
            ticket_streams(self.data_streams, len(chunks)),
            identity=self.caller,
            requested=self.data_security,
        )
        with self._lock:
            self._ticket = ticket
        ttl = self.ticket_ttl_s
        if self.deadline is not None:
            ttl = min(ttl, max(0.0, self.deadline - time.monotonic()))
        try:
            yield agent_pb2.FetchChunksResponse(
                num_chunks=ticket.num_chunks,
                chunk_bytes=chunks[0].nbytes,
                data_ticket=ticket.secret,
                data_port=plane.port,
                data_security="" if ticket.security == "plain" else ticket.security,
                data_key=ticket.key,
            )
            ticket.finished.wait(ttl)
        finally:
            plane.retire(ticket)

    def __iter__(self) -> Iterator[agent_pb2.FetchChunksResponse]:
        if self.data_plane is not None and self.num_chunks:
            yield from self._iter_ticket(self.data_plane)
            return
        try:
            for index in range(self.num_chunks):
                chunk = self._peek()
                if chunk is None:  # closed meanwhile
                    return
                data = chunk.buffer.numpy()
                size = chunk.nbytes
                if not chunk.checksum:
                    # Computed when first needed, not on the engine's store path: one core hashes a
                    # 32 MiB chunk in ~3 ms, against ~0.6 ms for the GPU's copy of it into L1.
                    chunk.checksum = chunk_checksum(data[:size])
                for off in range(0, size, self.part_bytes):
                    self._check_deadline()
                    msg = agent_pb2.FetchChunksResponse(
                        chunk_index=index,
                        chunk_bytes=size,
                        offset=off,
                        data=data[off : off + self.part_bytes].tobytes(),
                    )
                    if off == 0:
                        msg.checksum = chunk.checksum  # the fetcher verifies it
                        if index == 0:
                            msg.num_chunks = self.num_chunks
                    yield msg
                with self._lock:
                    if not self._pending or self._pending[0] is not chunk:
                        return  # closed meanwhile: close() released it
                    self._pending.pop(0)
                self.cache.release([chunk])
                if self.metrics is not None:
                    self.metrics.served_chunks.add(1)
                    self.metrics.served_bytes.add(size)
                    self.metrics.stats.add(served=1)
        finally:
            self.close()


# ---- fetching --------------------------------------------------------------------------------


def choose_peers(
    match: controller_pb2.MatchPrefixResponse,
    self_uid: str,
    addresses: Mapping[str, str],
    limit: int,
) -> list[PeerCandidate]:
    """Pods worth fetching from, best first: not us, with an agent address, holding the first
    query chunks in their own L1 (``l1_chunks`` > 0); most own-L1 chunks first, then longest
    match, then pod UID (deterministic)."""
    cands = [
        PeerCandidate(
            pod_uid=m.pod_uid,
            address=addresses[m.pod_uid],
            l1_chunks=m.l1_chunks,
            total_chunks=m.gpu_chunks + m.l1_chunks + m.peer_chunks,
        )
        for m in match.matches
        if m.pod_uid != self_uid and m.l1_chunks > 0 and addresses.get(m.pod_uid)
    ]
    cands.sort(key=lambda c: (-c.l1_chunks, -c.total_chunks, c.pod_uid))
    return cands[:limit]


class DataPlaneBackoff:
    """Peers whose data port could not be reached, and when to try it again: ``initial_s`` after the
    first failure, doubling per consecutive failure up to ``max_s``; a fetch that moved its bytes on
    the data plane forgets the peer. Never permanent: a port that comes back is used again.
    Thread-safe."""

    def __init__(self, initial_s: float, max_s: float) -> None:
        self.initial_s, self.max_s = initial_s, max_s
        self._lock = threading.Lock()
        self._until: dict[str, tuple[float, int]] = {}  # address -> (retry at, consecutive failures)

    def usable(self, address: str) -> bool:
        """True unless ``address``'s data port failed and its backoff has not passed yet."""
        with self._lock:
            entry = self._until.get(address)
            return entry is None or time.monotonic() >= entry[0]

    def failed(self, address: str) -> float:
        """Record a failure of ``address``'s data port; the seconds until it is tried again."""
        with self._lock:
            failures = self._until.get(address, (0.0, 0))[1] + 1
            wait = min(self.max_s, self.initial_s * 2 ** min(failures - 1, 30))
            self._until[address] = (time.monotonic() + wait, failures)
            return wait

    def succeeded(self, address: str) -> None:
        with self._lock:
            self._until.pop(address, None)


class PeerDirectory:
    """The controller as a directory: who holds which keys (MatchPrefix) and where each pod's agent
    listens (ListAgents, cached for ``ttl_s``). Thread-safe."""

    def __init__(
        self,
        controller_address: str,
        *,
        ttl_s: float,
        max_message_bytes: int,
        tls: ClientTls | None = None,
    ) -> None:
        self.address = controller_address
        self._channels = Channels(
            tls, CONTROLLER_SERVER_NAME, [("grpc.max_receive_message_length", max_message_bytes)]
        )
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._addresses: dict[str, str] = {}
        self._fetched_at = float("-inf")

    def match(
        self, keys: Sequence[bytes], namespace_id: str, timeout_s: float
    ) -> controller_pb2.MatchPrefixResponse:
        req = controller_pb2.MatchPrefixRequest(
            chunk_keys=common_pb2.ChunkKeys(keys=list(keys)), namespace_id=namespace_id
        )
        return self.stub.MatchPrefix(req, timeout=timeout_s)

    @property
    def stub(self) -> controller_pb2_grpc.ControllerServiceStub:
        """A stub on the current channel (a new one after the TLS files changed)."""
        return controller_pb2_grpc.ControllerServiceStub(traced_channel(self._channels.get(self.address)))

    def addresses(self, timeout_s: float, *, refresh: bool = False) -> dict[str, str]:
        with self._lock:
            fresh = time.monotonic() - self._fetched_at < self.ttl_s
            if fresh and not refresh:
                return self._addresses
        resp = self.stub.ListAgents(controller_pb2.ListAgentsRequest(), timeout=timeout_s)
        # Pods without a TCP address stay in the table (as "") so they do not force refreshes.
        table = {a.pod.pod_uid: a.pod.agent_address for a in resp.agents}
        with self._lock:
            self._addresses, self._fetched_at = table, time.monotonic()
        return table

    def close(self) -> None:
        self._channels.close()


class PeerFetcher:
    """Fetches the chunks after a Lookup's local hits from the best peer. Thread-safe."""

    def __init__(
        self,
        cache: ChunkCache,
        config: AgentConfig,
        self_uid: str,
        metrics: PeerMetrics,
        tracer: trace.Tracer,
    ) -> None:
        self.cache = cache
        self.config = config
        self.self_uid = self_uid
        self.metrics = metrics
        self.tracer = tracer
        tls = ClientTls(config.tls) if config.tls is not None else None
        self.directory = (
            PeerDirectory(
                config.controller_address,
                ttl_s=config.peer_directory_ttl_ms / 1000,
                max_message_bytes=config.max_message_bytes,
                tls=tls,
            )
            if config.peer_fetch_enabled
            else None
        )
        self._channels = Channels(
            tls,
            AGENT_SERVER_NAME,
            [
                ("grpc.max_receive_message_length", config.max_message_bytes),
                ("grpc.max_send_message_length", config.max_message_bytes),
            ],
        )
        self.part_bytes = max(
            1, min(config.peer_fetch_part_size, config.max_message_bytes - _MESSAGE_OVERHEAD)
        )
        self.data_streams = config.peer_data_streams if config.peer_data_plane == "socket" else 0
        self._tls_files = config.tls
        # With TLS: the data plane's mode asked for, and the weakest taken (p2p.accepted_security).
        self.data_security = config.peer_data_security if config.tls is not None else ""
        if self.data_streams and self.data_security:
            check_security_dependencies(self.data_security)  # a missing package fails at start
        # Background receivers of asynchronous fetches (peer_fetch_mode=async), and the peers whose
        # data port could not be reached lately (fetched over gRPC until their backoff passes).
        self._landing = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kvgrid-peer-land")
        self.data_plane_backoff = DataPlaneBackoff(
            config.peer_data_retry_initial_ms / 1000, config.peer_data_retry_max_ms / 1000
        )

    def _stub(self, address: str) -> agent_pb2_grpc.AgentServiceStub:
        # traced: the peer's FetchChunks span joins the Lookup's trace
        return agent_pb2_grpc.AgentServiceStub(traced_channel(self._channels.get(address)))

    def _forget_channels(self, keep: Mapping[str, str]) -> None:
        """Close channels to addresses no agent has any more (pods that went away)."""
        self._channels.forget(set(keep.values()))

    def close(self) -> None:
        self._landing.shutdown(wait=True)  # each ends by its fetch's deadline
        self._channels.close()
        if self.directory is not None:
            self.directory.close()

    def fetch(
        self,
        keys: Sequence[bytes],
        *,
        namespace_id: str,
        layout_id: str,
        bytes_per_chunk: int,
        peer_address: str = "",
    ) -> PeerFetchResult:
        """Fetch leading chunks of ``keys`` (the keys after the local hits) into L1: from the peer
        at ``peer_address`` when given, else from the holder the controller names. Never raises
        for a peer or controller problem: the result's ``error`` says what went wrong."""
        keys = list(keys[: self.config.peer_fetch_max_chunks])
        if not keys:
            return PeerFetchResult()
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.config.peer_fetch_timeout_ms / 1000
        with self.tracer.start_as_current_span("agent.peer_fetch", attributes={"chunks": len(keys)}) as span:
            try:
                if peer_address:
                    named = PeerCandidate(
                        pod_uid=peer_address, address=peer_address, l1_chunks=0, total_chunks=0
                    )
                    result = self.fetch_from(named, keys, namespace_id, layout_id, bytes_per_chunk, deadline)
                elif self.directory is None:
                    result = PeerFetchResult()  # peer fetch is off: nobody to ask who holds them
                else:
                    result = self._fetch(
                        keys, self.directory, namespace_id, layout_id, bytes_per_chunk, deadline
                    )
            except Exception as e:  # a bug here must not fail the Lookup either
                log.exception("peer fetch failed unexpectedly")
                result = self._failed("error", f"{type(e).__name__}: {e}", "")
            span.set_attribute("fetched_chunks", result.chunks)
            span.set_attribute("bytes", result.nbytes)
            if result.peer:
                span.set_attribute("peer", result.peer)
            if result.error:
                span.set_attribute("error", result.error)
        outcome = "failed" if result.error else ("fetched" if result.chunks else "no_holder")
        self.metrics.fetch_duration.record(time.perf_counter() - t0, {"outcome": outcome})
        return result

    def _fetch(
        self,
        keys: list[bytes],
        directory: PeerDirectory,
        namespace_id: str,
        layout_id: str,
        bytes_per_chunk: int,
        deadline: float,
    ) -> PeerFetchResult:
        """Stitch the prefix from as many holders as it takes: fetch the leading chunks from the
        best holder, then ask again for the keys after them (another pod may hold the next part),
        until nobody holds the next chunk, a fetch fails, or the deadline passes."""
        total = PeerFetchResult()
        while len(keys) > total.chunks and time.monotonic() < deadline:
            part = self._fetch_leading(
                keys[total.chunks :], directory, namespace_id, layout_id, bytes_per_chunk, deadline
            )
            total = total.then(part)
            if part.error or not part.chunks:
                break
        return total

    def _fetch_leading(
        self,
        keys: list[bytes],
        directory: PeerDirectory,
        namespace_id: str,
        layout_id: str,
        bytes_per_chunk: int,
        deadline: float,
    ) -> PeerFetchResult:
        """The leading chunks of ``keys`` from the best holder the controller names (the next
        best when one fails before sending anything)."""

        def left() -> float:
            return max(0.001, deadline - time.monotonic())

        try:
            match = directory.match(keys, namespace_id, left())
            if match.peer_fetchable_chunks == 0:
                return PeerFetchResult()  # nobody holds the next chunk in L1
            addresses = directory.addresses(left())
            if any(m.pod_uid not in addresses for m in match.matches if m.pod_uid != self.self_uid):
                addresses = directory.addresses(left(), refresh=True)  # a pod we have not seen yet
                self._forget_channels(addresses)
        except grpc.RpcError as e:
            return self._failed("controller", f"controller query failed: {_rpc_text(e)}", "")
        cands = choose_peers(match, self.self_uid, addresses, self.config.peer_fetch_max_peers)
        if not cands:
            return PeerFetchResult()
        last = PeerFetchResult()
        for cand in cands:
            last = self.fetch_from(cand, keys, namespace_id, layout_id, bytes_per_chunk, deadline)
            if last.chunks or time.monotonic() >= deadline:
                return last  # progress made, or no time for another peer
            # Nothing sent: the next candidate. A pod's l1_chunks may all lie after chunks it can
            # only fetch itself (MatchPrefix counts a chunk in the fastest tier holding it), so
            # the best-ranked pod need not hold the first key; a failure other than these two
            # may be that peer's alone.
            if last.error and last.error.split(":", 1)[0] in ("deadline", "layout_mismatch"):
                return last
        return last

    def fetch_from(
        self,
        cand: PeerCandidate,
        keys: Sequence[bytes],
        namespace_id: str,
        layout_id: str,
        bytes_per_chunk: int,
        deadline: float,
    ) -> PeerFetchResult:
        """Stream the leading chunks of ``keys`` from one peer into L1 (until ``deadline``, a
        ``time.monotonic()`` value). Chunks that arrived complete are kept even if the stream fails
        later; the rest of the reservation is freed."""
        got = [0, 0]  # chunks held, bytes fetched (set even when the stream fails)
        args = (cand, list(keys), namespace_id, layout_id, bytes_per_chunk, deadline, got)
        streams = self.data_streams if self.data_plane_backoff.usable(cand.address) else 0
        try:
            try:
                self._fetch_from(*args, data_streams=streams)
            except _DataPlaneUnreachable as e:
                # A data port a firewall or NetworkPolicy blocks must not end peer fetch: the
                # chunks come over the control connection instead (counted, so it gets fixed), and
                # so do the next fetches from this peer until its backoff passes.
                wait = self.data_plane_backoff.failed(cand.address)
                self._failed(
                    "data_plane_unreachable",
                    f"peer {cand.pod_uid}: {e}; retrying over gRPC (its data port again in {wait:.1f} s)",
                    "",
                )
                self._fetch_from(*args, data_streams=0)
        except PeerError as e:
            failed = self._failed(e.reason, f"peer {cand.pod_uid} at {cand.address}: {e}", cand.pod_uid)
            return msgspec.structs.replace(failed, chunks=got[0], nbytes=got[1])
        except Exception as e:
            log.exception("peer fetch from %s failed unexpectedly", cand.pod_uid)
            failed = self._failed("error", f"peer {cand.pod_uid}: {type(e).__name__}: {e}", cand.pod_uid)
            return msgspec.structs.replace(failed, chunks=got[0], nbytes=got[1])
        return PeerFetchResult(chunks=got[0], nbytes=got[1], peer=cand.pod_uid)

    def _failed(self, reason: str, message: str, peer: str) -> PeerFetchResult:
        log.warning("peer fetch failed (%s): %s", reason, message)
        self.metrics.fetch_failures.add(1, {"reason": reason})
        self.metrics.stats.add(failures=1)
        return PeerFetchResult(peer=peer, error=f"{reason}: {message}")

    def _fetch_from(
        self,
        cand: PeerCandidate,
        keys: list[bytes],
        namespace_id: str,
        layout_id: str,
        bytes_per_chunk: int,
        deadline: float,
        got: list[int],
        *,
        data_streams: int,
    ) -> None:
        req = agent_pb2.FetchChunksRequest(
            chunk_keys=keys,
            layout_id=layout_id,
            namespace_id=namespace_id,
            max_part_bytes=self.part_bytes,
            requester_pod_uid=self.self_uid,
            data_streams=data_streams,
            data_security=self.data_security if data_streams else "",
        )
        t0 = time.perf_counter()
        call = self._stub(cand.address).FetchChunks(req, timeout=max(0.001, deadline - time.monotonic()))
        try:
            first = next(call, None)
        except grpc.RpcError as e:
            call.cancel()
            raise _peer_error(e) from None
        if first is None:
            return  # the peer holds none of them
        n = first.num_chunks
        if not 0 < n <= len(keys):
            call.cancel()
            raise PeerError("protocol", f"num_chunks={n}: expected 1..{len(keys)}")
        res = self.cache.reserve_store(
            keys[:n], namespace_id=namespace_id, layout_id=layout_id, nbytes=bytes_per_chunk
        )
        limit = len(res.entries)  # stops early when L1 is full (res.reason)
        fresh = {i: c for i, c, new in res.entries if new}
        if res.reason:
            log.info("peer fetch from %s keeps %d of %d chunks: %s", cand.pod_uid, limit, n, res.reason)
        land = _Landing(cand, call, first, limit, bytes_per_chunk, deadline, t0)
        if self.config.peer_fetch_mode == "sync":
            filled = 0
            try:
                filled = self._receive(land, {i: c.buffer.numpy() for i, c in fresh.items()}, fresh, None)
            except _PartialFetch as e:
                filled = e.filled  # the intact leading chunks are committed below
                raise e.error from None
            finally:
                call.cancel()  # no-op when the stream ended; stops the peer when we stopped early
                held, _ = self.cache.commit(res, upto=filled)
                got[0] = held
                got[1] = self._count_fetched(land, sum(1 for i in fresh if i < filled))
            return
        # async: commit the chunks pending (visible and counted) and receive them in the background;
        # readers wait for each one (acquire_ready_prefix).
        got[0], mine = self.cache.commit_pending(res, upto=limit)
        self._landing.submit(self._land, land, mine)

    def _land(self, land: _Landing, mine: dict[int, Chunk]) -> None:
        """Receive an asynchronous fetch's chunks: each becomes ready once it arrived intact; from the
        first that did not, they fail (they leave the index and the engine recomputes them)."""
        filled = 0
        try:
            filled = self._receive(land, {i: c.buffer.numpy() for i, c in mine.items()}, None, mine)
        except _DataPlaneUnreachable as e:
            # The next fetches from it go over gRPC until the backoff passes, then try its port again.
            wait = self.data_plane_backoff.failed(land.cand.address)
            self._failed(
                "data_plane_unreachable",
                f"peer {land.cand.pod_uid}: {e} (its data port again in {wait:.1f} s)",
                land.cand.pod_uid,
            )
        except _PartialFetch as e:
            filled = e.filled
            self._failed(e.error.reason, f"peer {land.cand.pod_uid}: {e.error}", land.cand.pod_uid)
        except PeerError as e:
            self._failed(e.reason, f"peer {land.cand.pod_uid}: {e}", land.cand.pod_uid)
        except Exception as e:
            log.exception("background peer fetch from %s failed unexpectedly", land.cand.pod_uid)
            self._failed("error", f"peer {land.cand.pod_uid}: {type(e).__name__}: {e}", land.cand.pod_uid)
        finally:
            land.call.cancel()
            rest = [c for i, c in mine.items() if i >= filled]  # those below are ready
            if rest:
                self.cache.fail_pending(rest)
            # Counted one by one as they became ready (a reader sees a chunk only once it is counted).
            self._count_fetched(land, sum(1 for i in mine if i < filled), counted=True)

    def _count_fetched(self, land: _Landing, fetched: int, *, counted: bool = False) -> int:
        """Record ``fetched`` chunks that arrived (``counted``: their chunk and byte counts were added
        already, one by one); returns their bytes."""
        nbytes = fetched * land.bytes_per_chunk
        dt = time.perf_counter() - land.t0
        if fetched:
            if not counted:
                self._count_chunks(fetched, nbytes)
            if dt > 0:
                self.metrics.fetch_throughput.record(nbytes / dt / 1e9)
        log.debug("fetched %d chunks from %s in %.1f ms", fetched, land.cand.pod_uid, dt * 1e3)
        return nbytes

    def _count_chunks(self, chunks: int, nbytes: int) -> None:
        self.metrics.fetch_chunks.add(chunks)
        self.metrics.fetch_bytes.add(nbytes)
        self.metrics.stats.add(fetched=chunks)

    def _receive(
        self,
        land: _Landing,
        targets: dict[int, np.ndarray],
        fresh: dict[int, Chunk] | None,
        pending: dict[int, Chunk] | None,
    ) -> int:
        """Receive the first ``land.limit`` chunks of the stream into ``targets`` (chunk index ->
        bytes; a chunk not in it is read past: another store holds it) and return how many leading
        chunks arrived intact. Each verified chunk gets its checksum (``fresh``) or becomes ready
        (``pending``). A failure after some chunks raises :class:`_PartialFetch` with their count."""
        limit, bytes_per_chunk = land.limit, land.bytes_per_chunk

        def verified(i: int, checksum: bytes) -> None:
            if fresh is not None and i in fresh:
                fresh[i].checksum = checksum
            if pending is not None and i in pending:
                self._count_chunks(1, bytes_per_chunk)
                self.cache.finish_pending(pending[i], checksum)

        if limit == 0:
            return 0
        if land.first.data_ticket:
            return self._receive_data_plane(
                land.cand, land.first, limit, bytes_per_chunk, targets, verified, land.deadline
            )
        filled = 0  # leading chunks received completely
        written = 0  # bytes of chunk ``filled`` received so far
        expected = b""  # checksum of the chunk being received
        try:
            for msg in itertools.chain((land.first,), land.call):
                if msg.chunk_index != filled or msg.offset != written:
                    raise PeerError(
                        "protocol",
                        f"got chunk {msg.chunk_index} offset {msg.offset}; expected chunk {filled} offset "
                        f"{written}",
                    )
                if msg.chunk_bytes != bytes_per_chunk or written + len(msg.data) > bytes_per_chunk:
                    raise PeerError(
                        "protocol",
                        f"chunk {filled}: {msg.chunk_bytes} bytes (part of {len(msg.data)} at {written}); "
                        f"expected {bytes_per_chunk}",
                    )
                if written == 0:
                    expected = msg.checksum  # sent with the chunk's first part
                dst = targets.get(filled)
                if dst is not None:  # None: another store committed the key meanwhile
                    dst[written : written + len(msg.data)] = np.frombuffer(msg.data, dtype=np.uint8)
                written += len(msg.data)
                if written == bytes_per_chunk:
                    if dst is not None:
                        # Integrity: bytes that do not match the checksum recorded at store (or came
                        # without one) are never committed, so never reach a lookup or the engine.
                        try:
                            verify_checksum(dst, expected)
                        except ChecksumMismatch as e:
                            raise PeerError("checksum", f"chunk {filled} discarded: {e}") from None
                        verified(filled, expected)
                    filled, written = filled + 1, 0
                    if filled == limit:
                        break
        except PeerError as e:
            raise _PartialFetch(filled, e) from None
        except grpc.RpcError as e:
            raise _PartialFetch(filled, _peer_error(e)) from None
        return filled

    def _receive_data_plane(
        self,
        cand: PeerCandidate,
        msg: agent_pb2.FetchChunksResponse,
        limit: int,
        bytes_per_chunk: int,
        targets: dict[int, np.ndarray],
        verified: Callable[[int, bytes], None],
        deadline: float,
    ) -> int:
        """Receive the first ``limit`` chunks of a ticket on the peer's data port into ``targets``
        and return how many leading chunks arrived intact (their checksums recorded); a failure
        raises :class:`_PartialFetch` carrying that count."""
        if not msg.data_port or msg.chunk_bytes != bytes_per_chunk:
            raise PeerError(
                "protocol",
                f"data plane ticket with port {msg.data_port} and chunk_bytes {msg.chunk_bytes}; "
                f"expected a port and {bytes_per_chunk}",
            )
        tls = self._tls_files is not None
        try:
            security = accepted_security(msg.data_security, self.data_security, tls=tls)
        except ValueError as e:
            raise PeerError("protocol", f"data plane ticket: {e}") from None
        if security in ("mac", "aead") and len(msg.data_key) != KEY_BYTES:
            raise PeerError(
                "protocol",
                f"data plane ticket ({security}) with a data_key of {len(msg.data_key)} bytes; expected "
                f"{KEY_BYTES}",
            )
        got = fetch_streams(
            _host(cand.address),
            msg.data_port,
            msg.data_ticket,
            streams=ticket_streams(self.data_streams, msg.num_chunks),
            num_chunks=limit,
            chunk_bytes=bytes_per_chunk,
            targets=targets,
            deadline=deadline,
            tls=client_context(self._tls_files)
            if security == "tls" and self._tls_files is not None
            else None,
            security=security,
            key=msg.data_key,
        )
        filled = got.leading()
        for i in range(filled):
            if i in targets:
                verified(i, got.checksums[i])
        if got.failure is not None:
            if got.failure.reason == "unreachable" and not got.checksums:
                raise _DataPlaneUnreachable(str(got.failure))
            raise _PartialFetch(filled, PeerError(got.failure.reason, str(got.failure)))
        self.data_plane_backoff.succeeded(cand.address)
        return filled


@dataclass(frozen=True)
class _Landing:
    """One peer stream after its first message: what is left to receive."""

    cand: PeerCandidate
    call: Any
    """The FetchChunks response iterator (a grpc call)."""
    first: agent_pb2.FetchChunksResponse
    limit: int
    """Chunks to receive (the reservation may hold fewer than the peer sends)."""
    bytes_per_chunk: int
    deadline: float
    t0: float


def _peer_error(e: grpc.RpcError) -> PeerError:
    code = e.code() if isinstance(e, grpc.Call) else grpc.StatusCode.UNKNOWN
    reason = {
        grpc.StatusCode.DEADLINE_EXCEEDED: "deadline",
        grpc.StatusCode.FAILED_PRECONDITION: "layout_mismatch",
        grpc.StatusCode.UNAVAILABLE: "unavailable",
    }.get(code, "error")
    return PeerError(reason, _rpc_text(e))


class _DataPlaneUnreachable(Exception):
    """No data connection to the peer could be opened (nothing was received)."""


class _PartialFetch(Exception):
    """A data-plane fetch that failed after ``filled`` leading chunks arrived intact."""

    def __init__(self, filled: int, error: PeerError) -> None:
        super().__init__(str(error))
        self.filled = filled
        self.error = error


def _host(address: str) -> str:
    """The host of a ``host:port`` agent address (IPv6 in brackets or not)."""
    host = address.rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def _rpc_text(e: grpc.RpcError) -> str:
    if isinstance(e, grpc.Call):
        return f"{e.code().name}: {e.details()}"
    return str(e)
