"""How a peer fetch fails: :class:`PeerError` carries the ``kvgrid_agent_peer_fetch_failures``
reason label; gRPC errors map to it in one place (:func:`peer_error`).

Invariant: none of these leaves the fetcher (:class:`~kvgrid.agent.peers.fetcher.PeerFetcher`
answers a result with ``error`` set instead): a failing peer never fails a Lookup.
"""

from __future__ import annotations

import grpc

__all__ = ["DataPlaneUnreachable", "PartialFetch", "PeerError", "peer_error", "rpc_text"]


class PeerError(Exception):
    """A peer fetch failed; ``reason`` is the metric label (controller, unavailable, deadline, ...)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def peer_error(e: grpc.RpcError) -> PeerError:
    """The :class:`PeerError` for a failed FetchChunks call, labelled by its status code."""
    code = e.code() if isinstance(e, grpc.Call) else grpc.StatusCode.UNKNOWN
    reason = {
        grpc.StatusCode.DEADLINE_EXCEEDED: "deadline",
        grpc.StatusCode.FAILED_PRECONDITION: "layout_mismatch",
        grpc.StatusCode.UNAVAILABLE: "unavailable",
    }.get(code, "error")
    return PeerError(reason, rpc_text(e))


class DataPlaneUnreachable(Exception):
    """No data connection to the peer could be opened (nothing was received)."""


class PartialFetch(Exception):
    """A fetch (either receive path) that failed after ``filled`` leading chunks arrived intact."""

    def __init__(self, filled: int, error: PeerError) -> None:
        super().__init__(str(error))
        self.filled = filled
        self.error = error


def rpc_text(e: grpc.RpcError) -> str:
    """A gRPC error as ``CODE: details`` (for logs and results)."""
    if isinstance(e, grpc.Call):
        return f"{e.code().name}: {e.details()}"
    return str(e)
