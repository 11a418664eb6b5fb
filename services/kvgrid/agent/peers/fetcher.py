"""Fetching (:class:`PeerFetcher`, used by ``Lookup``): copying chunks another agent holds in its L1
into this agent's L1.

Ask the controller which pods hold the next keys in L1 (``MatchPrefix`` over the keys after the
local hits), map pod -> agent address (``ListAgents``, cached; :mod:`kvgrid.agent.peers.directory`),
stream ``FetchChunks`` from the best peer -- then, for the keys after what it sent, from whoever
holds those (a prefix is stitched from several pods) -- into freshly reserved local chunks (the
same reserve -> fill -> commit path a store takes, so a chunk becomes visible only once every byte
arrived and matched the checksum sent with it, and its admit event goes to the controller as
usual). Everything runs under one deadline; any failure leaves the local cache as it was, plus the
chunks that arrived complete and intact. With ``peer_fetch_mode=async`` the announced chunks are
committed pending at once and received in the background, each becoming ready once it arrived
intact (a failed one leaves the index).

Data plane (``peer_data_plane=socket``, :mod:`kvgrid.agent.peers.dataplane`): the fetcher asks for
``data_streams``; a sender with a data plane answers with one ticket message (bound to the caller's
certificate identity) and moves the bytes on its data port (the gRPC stream stays open until they
are out, holding the chunks' references); a sender without one streams them as parts, so either
side may have it off. With TLS the fetcher also asks for its ``peer_data_security`` and takes the
mode the answer names only when it is at least as strong (``mac`` < ``aead``, ``tls``). A data port
the fetcher cannot reach is retried over gRPC at once, and that peer's fetches use gRPC until a
backoff passes (:class:`~kvgrid.agent.peers.socket_stream.DataPlaneBackoff`,
``peer_data_retry_*_ms``); then its data port is tried again -- never given up for good. The two
receive paths: :mod:`kvgrid.agent.peers.grpc_stream`, :mod:`kvgrid.agent.peers.socket_stream`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
import msgspec
import numpy as np
from opentelemetry import trace

from kvgrid.agent.cache import ChunkCache
from kvgrid.agent.config import AgentConfig
from kvgrid.agent.l1 import Chunk
from kvgrid.agent.peers.dataplane.keys import check_security_dependencies
from kvgrid.agent.peers.directory import PeerCandidate, PeerDirectory, choose_peers
from kvgrid.agent.peers.errors import DataPlaneUnreachable, PartialFetch, PeerError, peer_error, rpc_text
from kvgrid.agent.peers.grpc_stream import receive_parts
from kvgrid.agent.peers.metrics import PeerMetrics
from kvgrid.agent.peers.socket_stream import DataPlaneBackoff, receive_ticket
from kvgrid.api.v1 import agent_pb2, agent_pb2_grpc
from kvgrid.common.tls import AGENT_SERVER_NAME, Channels, ClientTls
from kvgrid.common.tracing import traced_channel

__all__ = ["PeerFetchResult", "PeerFetcher"]

log = logging.getLogger(__name__)

# Room for the message's other fields next to the data part.
_MESSAGE_OVERHEAD = 1024


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
        # With TLS: the data plane's mode asked for, and the weakest taken (accepted_security,
        # dataplane/protocol.py).
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
            return self._failed("controller", f"controller query failed: {rpc_text(e)}", "")
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
            except DataPlaneUnreachable as e:
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
            raise peer_error(e) from None
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
            except PartialFetch as e:
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
        except DataPlaneUnreachable as e:
            # The next fetches from it go over gRPC until the backoff passes, then try its port again.
            wait = self.data_plane_backoff.failed(land.cand.address)
            self._failed(
                "data_plane_unreachable",
                f"peer {land.cand.pod_uid}: {e} (its data port again in {wait:.1f} s)",
                land.cand.pod_uid,
            )
        except PartialFetch as e:
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
        """Receive the first ``land.limit`` chunks of the stream -- on the peer's data port when its
        first message carries a ticket (:func:`receive_ticket`), else as the stream's parts
        (:func:`receive_parts`) -- into ``targets`` (chunk index -> bytes; a chunk not in it is read
        past: another store holds it) and return how many leading
        chunks arrived intact. Each verified chunk gets its checksum (``fresh``) or becomes ready
        (``pending``). A failure after some chunks raises :class:`PartialFetch` with their count."""
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
            filled = receive_ticket(
                land.cand.address,
                land.first,
                limit,
                bytes_per_chunk,
                targets,
                verified,
                land.deadline,
                data_streams=self.data_streams,
                own_security=self.data_security,
                tls_files=self._tls_files,
            )
            self.data_plane_backoff.succeeded(land.cand.address)
            return filled
        return receive_parts(land.first, land.call, limit, bytes_per_chunk, targets, verified)


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
