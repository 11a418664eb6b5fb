"""Which peer holds what: the controller as a directory (:class:`PeerDirectory`: ``MatchPrefix`` for
who holds the next keys, ``ListAgents`` for where each pod's agent listens, cached) and the ranking
of holders worth fetching from (:func:`choose_peers`).

Invariants: a candidate is never this pod, always has an agent address and holds the first query
chunks in its own L1; the order is deterministic (most own-L1 chunks, then longest match, then pod
UID). The controller holds ``pod_uid/epoch``, never an IP: addresses come only from ``ListAgents``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence

import msgspec

from kvgrid.api.v1 import common_pb2, controller_pb2, controller_pb2_grpc
from kvgrid.common.tls import CONTROLLER_SERVER_NAME, Channels, ClientTls
from kvgrid.common.tracing import traced_channel

__all__ = ["PeerCandidate", "PeerDirectory", "choose_peers"]


class PeerCandidate(msgspec.Struct, frozen=True):
    pod_uid: str
    address: str
    l1_chunks: int
    """Leading query chunks the controller counts in this pod's own L1."""
    total_chunks: int


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
