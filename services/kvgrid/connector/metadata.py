"""What the scheduler half tells the worker halves each step (pickled across processes by vLLM).

The halves share nothing else. Every order names its request and carries the keys of every worker
rank (rank ``r`` hashes with its own namespace), so each worker picks its own without asking.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

__all__ = ["KVGridConnectorMetadata", "LoadOrder", "StoreOrder"]


@dataclass(frozen=True)
class Lease:
    """Chunks one rank's agent leased to the request at Lookup (engine copies): their offsets in
    the agent's shared L1 file, so the worker copies them without a Retrieve, and Releases
    ``lease_id`` once they landed."""

    lease_id: int
    chunk_offsets: list[int]
    l1_file: str
    """The agent's shared L1 file: a worker mapping another one (the agent restarted since the
    Lookup) Retrieves instead, and leaves the dead agent's lease alone."""


@dataclass
class LoadOrder:
    """Scatter the leading held chunks of ``keys`` into the request's blocks.

    By default loads are asynchronous: the request waits (``WAITING_FOR_REMOTE_KVS``) until a worker
    reports it in ``finished_recving``, and vLLM frees its blocks only after that, so every load is
    reported exactly once, whether it succeeded, failed or the request was aborted meanwhile.
    """

    request_id: str
    keys: list[list[bytes]]
    """Per worker rank: the chunk keys to load."""
    block_ids: list[list[int]]
    """One list per KV cache group, from token 0."""
    skip_first_n_tokens: int
    """The engine's own prefix-cache hit: blocks wholly inside it are not written."""
    in_step: bool = False
    """Layer-wise: the request is computed in the same step, so the load must land before each
    layer's attention (``wait_for_layer_load``) instead of being reported between steps."""
    leases: list[Lease | None] = field(default_factory=list)
    """Per worker rank, the chunks its agent leased at Lookup (None or absent: Retrieve them); a
    lease covers at least the order's keys of that rank."""


@dataclass
class StoreOrder:
    """Gather the request's chunks ``[skip_first_n_chunks, len(keys))`` into the agent's L1."""

    request_id: str
    keys: list[list[bytes]]
    block_ids: list[list[int]]
    skip_first_n_chunks: int


@dataclass
class KVGridConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadOrder] = field(default_factory=list)
    stores: list[StoreOrder] = field(default_factory=list)
    flush_stores: list[str] = field(default_factory=list)
    """Requests with stores ordered whose blocks vLLM freed since the last step (preempted, or
    finished with stores synchronous): their freed blocks may be written by this step, so the worker
    waits for their stores still in flight before the step touches any block (``handle_preemptions``)."""
    sending: list[str] = field(default_factory=list)
    """Requests that finished since the last step with asynchronous stores ordered: vLLM keeps their
    blocks (``request_finished`` answered delay-free) until every worker reports them in
    ``finished_sending``, which each does once its stores of the request landed. No step waits."""
