"""The data-plane receive path of a fetch: a ``FetchChunks`` answer that carries a ticket is checked
(port, chunk size, the security mode and its key) and its chunks are received on the holder's data
port (:func:`~kvgrid.agent.peers.dataplane.client.fetch_streams`); and the backoff for peers whose
data port could not be reached (:class:`DataPlaneBackoff`).

Invariants: with TLS the fetcher takes the mode the answer names only when it is at least as
strong as its own ``peer_data_security`` (``mac`` < ``aead``, ``tls``), else the fetch fails
(``protocol``); a data port that admitted nothing raises
:class:`~kvgrid.agent.peers.errors.DataPlaneUnreachable` (the fetch is retried over gRPC), any
other failure :class:`~kvgrid.agent.peers.errors.PartialFetch` with the leading chunks that
arrived intact. A peer's backoff is never permanent: its data port is tried again once it passed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np

from kvgrid.agent.peers.dataplane.client import fetch_streams
from kvgrid.agent.peers.dataplane.protocol import KEY_BYTES, accepted_security, ticket_streams
from kvgrid.agent.peers.dataplane.tls_contexts import client_context
from kvgrid.agent.peers.errors import DataPlaneUnreachable, PartialFetch, PeerError
from kvgrid.api.v1 import agent_pb2
from kvgrid.common.tls import TlsFiles

__all__ = ["DataPlaneBackoff", "receive_ticket"]


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


def receive_ticket(
    address: str,
    msg: agent_pb2.FetchChunksResponse,
    limit: int,
    bytes_per_chunk: int,
    targets: dict[int, np.ndarray],
    verified: Callable[[int, bytes], None],
    deadline: float,
    *,
    data_streams: int,
    own_security: str,
    tls_files: TlsFiles | None,
) -> int:
    """Receive the first ``limit`` chunks of a ticket on the peer's data port into ``targets``
    and return how many leading chunks arrived intact (their checksums recorded); a failure
    raises :class:`PartialFetch` carrying that count. On a return the caller forgets the peer's
    backoff (:meth:`DataPlaneBackoff.succeeded`)."""
    if not msg.data_port or msg.chunk_bytes != bytes_per_chunk:
        raise PeerError(
            "protocol",
            f"data plane ticket with port {msg.data_port} and chunk_bytes {msg.chunk_bytes}; "
            f"expected a port and {bytes_per_chunk}",
        )
    tls = tls_files is not None
    try:
        security = accepted_security(msg.data_security, own_security, tls=tls)
    except ValueError as e:
        raise PeerError("protocol", f"data plane ticket: {e}") from None
    if security in ("mac", "aead") and len(msg.data_key) != KEY_BYTES:
        raise PeerError(
            "protocol",
            f"data plane ticket ({security}) with a data_key of {len(msg.data_key)} bytes; expected "
            f"{KEY_BYTES}",
        )
    got = fetch_streams(
        _host(address),
        msg.data_port,
        msg.data_ticket,
        streams=ticket_streams(data_streams, msg.num_chunks),
        num_chunks=limit,
        chunk_bytes=bytes_per_chunk,
        targets=targets,
        deadline=deadline,
        tls=client_context(tls_files) if security == "tls" and tls_files is not None else None,
        security=security,
        key=msg.data_key,
    )
    filled = got.leading()
    for i in range(filled):
        if i in targets:
            verified(i, got.checksums[i])
    if got.failure is not None:
        if got.failure.reason == "unreachable" and not got.checksums:
            raise DataPlaneUnreachable(str(got.failure))
        raise PartialFetch(filled, PeerError(got.failure.reason, str(got.failure)))
    return filled


def _host(address: str) -> str:
    """The host of a ``host:port`` agent address (IPv6 in brackets or not)."""
    host = address.rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host
