"""Engine-side client of the agent (what the vLLM connector uses), over the Unix socket.

The engine API (register, lookup, retrieve, store, release, health) is served on the agent's Unix
socket only; over TCP an agent serves just FetchChunks (to agent identities) and Snapshot (to the
controller), so a ``host:port`` target is for those two -- with ``tls`` (the caller's certificate)
when the agent requires mTLS. Results come back as the msgspec structs of
:mod:`kvgrid.common.agent_results`; gRPC errors surface as ``grpc.RpcError`` (INVALID_ARGUMENT carries the
agent's explanation; an engine method over TCP is UNIMPLEMENTED).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence

import grpc
import torch

from kvgrid.api.v1 import agent_pb2
from kvgrid.common.agent_results import LookupResult, MissCause, RetrieveResult, StoreResult
from kvgrid.common.groups import EngineGroupInfo, to_proto
from kvgrid.common.hashing import KeyNamespace
from kvgrid.common.hotpath import HOT_METHODS, hot_path_of
from kvgrid.common.tls import AGENT_SERVER_NAME, ClientTls, make_channel
from kvgrid.common.tracing import traced_channel
from kvgrid.common.wire import block_ids_to_proto, key_namespace_to_proto
from kvgrid.engine.hotpath import HotPathAbsent, HotPathClient
from kvgrid.engine.tensors import export_layer_tensor

__all__ = ["AgentClient", "agent_target"]

SERVICE = "/kvgrid.v1.AgentService/"


def agent_target(address: str) -> str:
    """A gRPC target from a socket path (``/run/kvgrid/agent.sock``), ``unix:...`` or ``host:port``."""
    if address.startswith(("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:")):
        return address
    if address.startswith("/") or address.startswith("."):
        return f"unix:{address}"
    return address


class AgentClient:
    """One channel to one agent. Thread-safe (gRPC channels are)."""

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = 60.0,
        max_message_bytes: int = 64 << 20,
        tls: ClientTls | None = None,
        hot_path: bool = True,
        hot_path_spin_us: int = 0,
    ) -> None:
        """``tls``: mTLS credentials for a TCP target (ignored for a Unix socket, always plaintext).
        ``hot_path``: on a Unix socket, send Lookup/Retrieve/Store/Release over the agent's hot path
        (``kvgrid.engine.hotpath``) whenever the agent serves it; gRPC otherwise.
        ``hot_path_spin_us``: wait for a hot-path reply spinning up to this long before sleeping
        (``HotPathClient``'s ``spin_us``: faster replies for a core and the GIL meanwhile)."""
        self.target = agent_target(address)
        self.timeout_s = timeout_s
        unix = self.target.startswith(("unix:", "unix-abstract:"))
        self.hot: HotPathClient | None = None
        if hot_path and self.target.startswith("unix:"):
            self.hot = HotPathClient(
                hot_path_of(self.target.removeprefix("unix:")), timeout_s=timeout_s, spin_us=hot_path_spin_us
            )
        # traced: the caller's current span (the connector's) is the parent of the agent's spans
        self.channel = traced_channel(
            make_channel(
                self.target,
                None if unix else tls,
                AGENT_SERVER_NAME,
                [
                    ("grpc.max_receive_message_length", max_message_bytes),
                    ("grpc.max_send_message_length", max_message_bytes),
                ],
            )
        )
        self._calls: dict[str, grpc.UnaryUnaryMultiCallable] = {}
        self._streams: dict[str, grpc.UnaryStreamMultiCallable] = {}
        for m in agent_pb2.DESCRIPTOR.services_by_name["AgentService"].methods:
            resp_cls = getattr(agent_pb2, m.output_type.name)
            if m.server_streaming:
                self._streams[m.name] = self.channel.unary_stream(
                    SERVICE + m.name,
                    request_serializer=lambda msg: msg.SerializeToString(),
                    response_deserializer=resp_cls.FromString,
                )
                continue
            self._calls[m.name] = self.channel.unary_unary(
                SERVICE + m.name,
                request_serializer=lambda msg: msg.SerializeToString(),
                response_deserializer=resp_cls.FromString,
            )

    def _call(self, name: str, req: object, timeout_s: float | None = None) -> object:
        if self.hot is not None and name in HOT_METHODS:
            try:
                return self.hot.call(name, req, timeout_s)  # type: ignore[arg-type]
            except HotPathAbsent:
                pass  # the agent serves no hot path: gRPC
        return self._calls[name](req, timeout=timeout_s or self.timeout_s)

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        grpc.channel_ready_future(self.channel).result(timeout=timeout_s)

    def register_kv_caches(
        self,
        instance_id: str,
        tensors: Sequence[torch.Tensor],
        *,
        namespace: KeyNamespace,
        engine_groups: Sequence[EngineGroupInfo] = (),
        shm_paths: Sequence[str | os.PathLike[str]] | None = None,
        layout_hints: Sequence[Mapping[str, object] | None] | None = None,
        engine_pid: int | None = None,
        fence_event: torch.cuda.Event | None = None,
        done_event: torch.cuda.Event | None = None,
    ) -> agent_pb2.RegisterKVCachesResponse:
        """Register one engine worker's KV tensors (layer i = ``tensors[i]``). CPU tensors need
        ``shm_paths[i]``, the file each lives in (see :func:`kvgrid.engine.tensors.allocate_shared_tensor`).
        ``fence_event``: an interprocess CUDA event the engine records before a transfer sent with
        ``after_fence`` (the agent's copy waits for it on the GPU instead of the engine's host);
        ``done_event``: one the agent records after the copies of a Retrieve with ``signal_done``."""
        layers = []
        for i, t in enumerate(tensors):
            msg = export_layer_tensor(i, t, shm_path=shm_paths[i] if shm_paths is not None else None)
            hints = layout_hints[i] if layout_hints is not None else None
            for k, v in (hints or {}).items():
                msg.layout_hints[k] = str(v)
            layers.append(msg)
        req = agent_pb2.RegisterKVCachesRequest(
            instance_id=instance_id,
            engine_groups=to_proto(engine_groups),
            layers=layers,
            namespace=key_namespace_to_proto(namespace),
            engine_pid=os.getpid() if engine_pid is None else engine_pid,
            fence_event=fence_event.ipc_handle() if fence_event is not None else b"",
            done_event=done_event.ipc_handle() if done_event is not None else b"",
        )
        return self._call("RegisterKVCaches", req)  # type: ignore[return-value]

    def unregister_kv_caches(self, instance_id: str) -> int:
        resp = self._call("UnregisterKVCaches", agent_pb2.UnregisterKVCachesRequest(instance_id=instance_id))
        return int(resp.released_pins)  # type: ignore[attr-defined]

    def lookup(
        self,
        instance_id: str,
        request_id: str,
        chunk_keys: Sequence[bytes],
        *,
        pin_ttl_ms: int = 0,
        peer_address: str = "",
        lease: bool = False,
    ) -> LookupResult:
        """``peer_address``: fetch what is missing from that peer agent (P/D: the producer's).
        ``lease`` (engine copies): lease the hits now when their bytes are all in the shared L1,
        answering their offsets and the lease id (0: none taken, Retrieve them instead)."""
        resp = self._call(
            "Lookup",
            agent_pb2.LookupRequest(
                instance_id=instance_id,
                request_id=request_id,
                chunk_keys=chunk_keys,
                pin_ttl_ms=pin_ttl_ms,
                peer_address=peer_address,
                lease=lease,
            ),
        )
        assert isinstance(resp, agent_pb2.LookupResponse)
        return LookupResult(
            num_hit_chunks=resp.num_hit_chunks,
            miss_cause=MissCause.from_wire(resp.miss_cause),
            num_peer_chunks=resp.num_peer_chunks,
            chunk_offsets=list(resp.chunk_offsets),
            lease_id=resp.lease_id,
            l1_file=resp.l1_file,
        )

    def retrieve(
        self,
        instance_id: str,
        request_id: str,
        chunk_keys: Sequence[bytes],
        block_ids: Sequence[Sequence[int]],
        *,
        skip_first_n_tokens: int = 0,
        after_fence: bool = False,
        signal_done: bool = False,
        engine_copies: bool = False,
    ) -> RetrieveResult:
        """``block_ids``: one list per engine group, covering the request from token 0.
        ``engine_copies``: the agent copies nothing and answers ``chunk_offsets`` in its shared L1
        file, held for ``request_id`` until :meth:`release`."""
        resp = self._call(
            "Retrieve",
            agent_pb2.RetrieveRequest(
                instance_id=instance_id,
                request_id=request_id,
                chunk_keys=chunk_keys,
                block_ids=block_ids_to_proto(block_ids),
                skip_first_n_tokens=skip_first_n_tokens,
                after_fence=after_fence,
                signal_done=signal_done,
                engine_copies=engine_copies,
            ),
        )
        assert isinstance(resp, agent_pb2.RetrieveResponse)
        return RetrieveResult(
            hit_mask=list(resp.hit_mask),
            num_retrieved_chunks=resp.num_retrieved_chunks,
            bytes_moved=resp.bytes_moved,
            miss_cause=MissCause.from_wire(resp.miss_cause),
            chunk_offsets=list(resp.chunk_offsets),
            lease_id=resp.lease_id,
        )

    def store(
        self,
        instance_id: str,
        chunk_keys: Sequence[bytes],
        block_ids: Sequence[Sequence[int]],
        *,
        skip_first_n_chunks: int = 0,
        after_fence: bool = False,
        engine_copies: bool = False,
    ) -> StoreResult:
        """``block_ids``: one list per engine group, covering every chunk from token 0.
        ``engine_copies``: reserve only; the engine copies the chunks the answer names, then
        :meth:`finish_store`."""
        req = agent_pb2.StoreRequest(
            instance_id=instance_id,
            chunk_keys=chunk_keys,
            block_ids=block_ids_to_proto(block_ids),
            skip_first_n_chunks=skip_first_n_chunks,
            after_fence=after_fence,
            engine_copies=engine_copies,
        )
        return self._store(req)

    def finish_store(self, instance_id: str, store_id: int, *, copy_failed: bool = False) -> StoreResult:
        """End an engine_copies store: its chunks become visible (``copy_failed``: dropped)."""
        return self._store(
            agent_pb2.StoreRequest(instance_id=instance_id, store_id=store_id, copy_failed=copy_failed)
        )

    def _store(self, req: agent_pb2.StoreRequest) -> StoreResult:
        resp = self._call("Store", req)
        assert isinstance(resp, agent_pb2.StoreResponse)
        return StoreResult(
            num_stored_chunks=resp.num_stored_chunks,
            num_already_present=resp.num_already_present,
            bytes_moved=resp.bytes_moved,
            partial_reason=resp.partial_reason,
            store_id=resp.store_id,
            copy_chunk_indices=list(resp.copy_chunk_indices),
            chunk_offsets=list(resp.chunk_offsets),
        )

    def release(self, instance_id: str, request_id: str) -> int:
        """Drop the request's pins (the count) and end its engine_copies lease."""
        return int(self.release_all(instance_id, request_id).released_pins)

    def release_all(self, instance_id: str, request_id: str, lease_id: int = 0) -> agent_pb2.ReleaseResponse:
        """Release, answering both counts (pins, leased chunks). ``lease_id`` (a Retrieve's): end
        only that lease, keep the pins."""
        req = agent_pb2.ReleaseRequest(instance_id=instance_id, request_id=request_id, lease_id=lease_id)
        return self._call("Release", req)  # type: ignore[return-value]

    def release_nowait(self, instance_id: str, request_id: str, lease_id: int = 0) -> None:
        """:meth:`release_all` without waiting for the agent: over the hot path a one-way frame (the
        agent runs it before this thread's next call and answers nothing; errors are counted
        there), else a gRPC Release whose answer is dropped (its errors raise). Raises
        ``grpc.RpcError`` UNAVAILABLE when the frame cannot be sent."""
        req = agent_pb2.ReleaseRequest(instance_id=instance_id, request_id=request_id, lease_id=lease_id)
        if self.hot is not None:
            try:
                self.hot.send("Release", req, None)
                return
            except HotPathAbsent:
                pass  # the agent serves no hot path: gRPC
        self._calls["Release"](req, timeout=self.timeout_s)

    def snapshot(self) -> agent_pb2.SnapshotResponse:
        return self._call("Snapshot", agent_pb2.SnapshotRequest())  # type: ignore[return-value]

    def health(self) -> agent_pb2.HealthResponse:
        return self._call("Health", agent_pb2.HealthRequest())  # type: ignore[return-value]

    def fetch_chunks(
        self,
        chunk_keys: Sequence[bytes],
        layout_id: str,
        *,
        namespace_id: str,
        max_part_bytes: int = 0,
        timeout_s: float | None = None,
    ) -> Iterator[agent_pb2.FetchChunksResponse]:
        """The peer-fetch stream (usually agent to agent over TCP): parts of the leading chunks
        stored in namespace ``namespace_id`` (required) and held in layout ``layout_id``. A chunk
        held in another layout is FAILED_PRECONDITION."""
        req = agent_pb2.FetchChunksRequest(
            chunk_keys=chunk_keys,
            layout_id=layout_id,
            namespace_id=namespace_id,
            max_part_bytes=max_part_bytes,
        )
        stream: Iterator[agent_pb2.FetchChunksResponse] = self._streams["FetchChunks"](
            req, timeout=timeout_s or self.timeout_s
        )
        return stream

    def close(self) -> None:
        if self.hot is not None:
            self.hot.close()
        self.channel.close()

    def __enter__(self) -> AgentClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
