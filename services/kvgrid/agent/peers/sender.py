"""Serving ``FetchChunks`` (:class:`ChunkSender`, behind ``AgentService.FetchChunks`` on TCP).

The leading held chunks of the requested keys, stored in the caller's namespace (required: chunks
are never served across namespaces) and in the caller's chunk layout, are referenced when the call
starts (eviction cannot free them mid-stream) and streamed in order, each split into parts of at
most ``part_bytes`` and at least ``min_part_bytes`` (a caller cannot make the sender hold a thread
for one message per byte); each chunk's reference is dropped once its last part is out. Errors name
only what the caller sent (never another chunk's layout).

Data plane: when the caller asks for ``data_streams`` and this agent serves a data port, the
references go to a ticket (bound to the caller's certificate identity) and the stream's one message
carries it; the bytes move on the data port (:mod:`kvgrid.agent.peers.dataplane`), and the gRPC
stream stays open until they are out.

Serving deadline: a stream still sending at its ``deadline`` (the agent's ``peer_stream_timeout_ms``)
fails with DEADLINE_EXCEEDED; a data-plane ticket lives at most until then.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

from kvgrid.agent.cache import ChunkCache, MissCause
from kvgrid.agent.l1 import Chunk
from kvgrid.agent.peers.dataplane.protocol import ticket_streams
from kvgrid.agent.peers.dataplane.server import DataPlaneServer
from kvgrid.agent.peers.dataplane.tickets import Ticket
from kvgrid.agent.peers.guard import ServingDeadlineExceeded
from kvgrid.agent.peers.metrics import PeerMetrics
from kvgrid.api.v1 import agent_pb2
from kvgrid.common.checksum import chunk_checksum
from kvgrid.common.errors import FailedPrecondition, InvalidArgument, check_namespace_id, client_input
from kvgrid.common.hashing import check_chunk_keys

__all__ = ["MIN_PART_BYTES", "ChunkSender", "LayoutMismatchError"]

MIN_PART_BYTES = 64 * 1024
"""Floor on a FetchChunks part: a smaller ``max_part_bytes`` is raised to it (never above the
sender's own part size), so a caller cannot make a stream cost one message per few bytes."""


class LayoutMismatchError(FailedPrecondition):
    """The requested chunk is held in another chunk byte layout (gRPC FAILED_PRECONDITION)."""


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
