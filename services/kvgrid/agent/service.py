"""AgentService over gRPC: a Unix socket for the engine, TCP for peers and the controller.

Each listener is its own gRPC server with its own thread pool (``grpc_workers`` for the Unix
socket, ``tcp_grpc_workers`` for TCP), both serving the same servicer and core: however many
threads TCP callers hold (slow FetchChunks streams), the engine's Register/Lookup/Store/Retrieve
and Health on the Unix socket keep their own threads.

Listener split (docs/security.md): the Unix socket (plaintext; filesystem permissions protect it)
serves every RPC; the TCP port serves only :data:`TCP_POLICY`'s methods -- FetchChunks to agent
identities (peers) and Snapshot to the controller identity -- and answers every engine method with
UNIMPLEMENTED naming the Unix socket. With TLS files configured the TCP port requires mTLS and the
toolkit checks each caller's certificate identity against :data:`TCP_POLICY`; without them it is
plaintext, serves those two methods to anyone, and logs a loud warning at start; it (and the peer
data plane) then binds loopback unless ``insecure_plaintext_on_network`` is set
(:attr:`AgentConfig.listen_host`).

The TCP port has a servicer of its own, with a :class:`~kvgrid.agent.peers.guard.TcpGuard`: with
mTLS a caller reads only the tenants' chunks it is entitled to (FetchChunks for another tenant's
namespace id is PERMISSION_DENIED before any chunk is referenced or any data-plane ticket issued;
Snapshot lists only the namespace ids the caller may read), every caller has at most
``peer_streams_per_identity`` FetchChunks streams open (RESOURCE_EXHAUSTED past it) and every stream
ends by ``peer_stream_timeout_ms``. The Unix socket's servicer has no guard: whoever opens the socket
is the pod's engine.

:class:`AgentServicer` converts protobuf to :class:`~kvgrid.agent.core.AgentCore` calls and back;
the shared server toolkit (:mod:`kvgrid.common.rpc`) serves it: it parses requests (a malformed
message is INVALID_ARGUMENT naming its type), maps errors to status codes in one place (the
:mod:`kvgrid.common.errors` types with their text: an unknown instance or bad input is
INVALID_ARGUMENT, a chunk held in another layout FAILED_PRECONDITION; anything else is INTERNAL
with a one-line message, the traceback going to the agent's log) and records per-call metrics.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from pathlib import Path

from opentelemetry import metrics, trace

from kvgrid.agent.cache import ChunkCache
from kvgrid.agent.config import AgentConfig
from kvgrid.agent.core import AgentCore
from kvgrid.agent.events import EventLog, EventPublisher
from kvgrid.agent.hotpath import HotPathServer
from kvgrid.agent.peers.dataplane.server import DataPlaneServer
from kvgrid.agent.peers.guard import TcpGuard
from kvgrid.agent.peers.sender import ChunkSender
from kvgrid.agent.tensors import SharedFileCache, open_ipc_event, open_layer_tensor
from kvgrid.agent.transfer import parse_layout_hints
from kvgrid.api.v1 import agent_pb2, common_pb2, controller_pb2
from kvgrid.common.authz import Authorizer, ChunkReaders, Policy, call_context, caller
from kvgrid.common.errors import InvalidArgument, check_namespace_id, client_input
from kvgrid.common.hotpath import hot_path_of
from kvgrid.common.identity import PodIdentity
from kvgrid.common.rpc import RpcMetrics, RpcServer, ServerOptions, is_loopback_host
from kvgrid.common.tensor_wire import dtype_name
from kvgrid.common.tls import ClientTls, server_credentials
from kvgrid.common.wire import engine_group_infos_from_proto, key_namespace_from_proto, pod_identity_to_proto

__all__ = ["SERVICE_NAME", "TCP_POLICY", "AgentServer", "AgentServicer"]

log = logging.getLogger(__name__)

_SERVICE = agent_pb2.DESCRIPTOR.services_by_name["AgentService"]
SERVICE_NAME = _SERVICE.full_name

TCP_POLICY = Policy({"FetchChunks": frozenset({"agent"}), "Snapshot": frozenset({"controller"})})
"""What the TCP port serves and to whom: peers fetch chunks, the controller pulls snapshots."""


class AgentServicer:
    """Protobuf in, protobuf out; every call goes to :class:`AgentCore`."""

    def __init__(
        self,
        core: AgentCore,
        events: EventLog,
        data_plane: DataPlaneServer | None = None,
        guard: TcpGuard | None = None,
    ) -> None:
        """``guard``: the TCP port's checks (tenants, streams per caller, serving deadline); None on
        the Unix socket."""
        self.core = core
        self.events = events
        self.data_plane = data_plane
        self.guard = guard

    def RegisterKVCaches(self, req: agent_pb2.RegisterKVCachesRequest) -> agent_pb2.RegisterKVCachesResponse:
        if not req.HasField("namespace"):
            raise InvalidArgument("namespace is missing: expected the key namespace (model, cache salt, ...)")
        ns_msg = common_pb2.KeyNamespace()
        ns_msg.CopyFrom(req.namespace)
        if not ns_msg.tokens_per_chunk:
            ns_msg.tokens_per_chunk = self.core.config.tokens_per_chunk
        namespace = key_namespace_from_proto(ns_msg)
        groups = engine_group_infos_from_proto(req.engine_groups)
        layers = sorted(req.layers, key=lambda m: m.layer_index)
        if [m.layer_index for m in layers] != list(range(len(layers))):
            raise InvalidArgument(
                f"layers have layer_index {[m.layer_index for m in req.layers]}; "
                f"expected each of 0..{len(layers) - 1} once"
            )
        shm = SharedFileCache(self.core.config.shm_allowed_dirs)
        with client_input():  # the engine's description of its layers
            tensors = [open_layer_tensor(m, shm) for m in layers]
            hints = [parse_layout_hints(m.layout_hint, m.layout_hints) for m in layers]
            fence = open_ipc_event("fence_event", req.fence_event, tensors)
            done = open_ipc_event("done_event", req.done_event, tensors)
        inst = self.core.register(
            req.instance_id,
            engine_groups=groups,
            tensors=tensors,
            namespace=namespace,
            engine_pid=req.engine_pid,
            layout_hints=hints,
            fence=fence,
            done=done,
        )
        return agent_pb2.RegisterKVCachesResponse(
            instance_id=inst.instance_id,
            kernel_groups=[
                agent_pb2.KernelGroupSummary(
                    layer_indices=kg.layer_indices,
                    kv_format=str(kg.kv_format),
                    dtype=dtype_name(kg.dtype),
                    engine_group_idx=kg.engine_group_idx,
                    tokens_per_block=kg.tokens_per_block,
                    slots_per_block=kg.slots_per_block,
                    bytes_per_chunk=kg.bytes_per_chunk(inst.tokens_per_chunk),
                )
                for kg in inst.mover.manager.kernel_groups
            ],
            bytes_per_chunk=inst.bytes_per_chunk,
            layout_id=inst.layout_id,
            namespace_id=inst.namespace_id,
            tokens_per_chunk=inst.tokens_per_chunk,
            l1_file=self.core.pool.shared_file,
            l1_file_bytes=self.core.pool.file_bytes if self.core.pool.shared_file else 0,
        )

    def UnregisterKVCaches(
        self, req: agent_pb2.UnregisterKVCachesRequest
    ) -> agent_pb2.UnregisterKVCachesResponse:
        return agent_pb2.UnregisterKVCachesResponse(released_pins=self.core.unregister(req.instance_id))

    def Lookup(self, req: agent_pb2.LookupRequest) -> agent_pb2.LookupResponse:
        r = self.core.lookup(
            req.instance_id,
            req.request_id,
            list(req.chunk_keys),
            req.pin_ttl_ms,
            peer_address=req.peer_address,
            lease=req.lease,
        )
        return agent_pb2.LookupResponse(
            num_hit_chunks=r.num_hit_chunks,
            miss_cause=r.miss_cause,
            num_peer_chunks=r.num_peer_chunks,
            chunk_offsets=r.chunk_offsets,
            lease_id=r.lease_id,
            l1_file=r.l1_file,
        )

    def Retrieve(self, req: agent_pb2.RetrieveRequest) -> agent_pb2.RetrieveResponse:
        r = self.core.retrieve(
            req.instance_id,
            req.request_id,
            list(req.chunk_keys),
            [list(b.ids) for b in req.block_ids],
            req.skip_first_n_tokens,
            after_fence=req.after_fence,
            signal_done=req.signal_done,
            engine_copies=req.engine_copies,
        )
        return agent_pb2.RetrieveResponse(
            hit_mask=r.hit_mask,
            num_retrieved_chunks=r.num_retrieved_chunks,
            bytes_moved=r.bytes_moved,
            miss_cause=r.miss_cause,
            chunk_offsets=r.chunk_offsets,
            lease_id=r.lease_id,
        )

    def Store(self, req: agent_pb2.StoreRequest) -> agent_pb2.StoreResponse:
        r = self.core.store(
            req.instance_id,
            list(req.chunk_keys),
            [list(b.ids) for b in req.block_ids],
            req.skip_first_n_chunks,
            after_fence=req.after_fence,
            engine_copies=req.engine_copies,
            store_id=req.store_id,
            copy_failed=req.copy_failed,
        )
        return agent_pb2.StoreResponse(
            num_stored_chunks=r.num_stored_chunks,
            num_already_present=r.num_already_present,
            bytes_moved=r.bytes_moved,
            partial_reason=r.partial_reason,
            store_id=r.store_id,
            copy_chunk_indices=r.copy_chunk_indices,
            chunk_offsets=r.chunk_offsets,
        )

    def Release(self, req: agent_pb2.ReleaseRequest) -> agent_pb2.ReleaseResponse:
        pins, chunks = self.core.release(req.instance_id, req.request_id, req.lease_id)
        return agent_pb2.ReleaseResponse(released_pins=pins, released_chunks=chunks)

    def Snapshot(self, req: agent_pb2.SnapshotRequest) -> agent_pb2.SnapshotResponse:
        readable = self.guard.readable("Snapshot", caller()) if self.guard is not None else None
        by_ns, last_seq = self.core.cache.snapshot()
        namespaces = sorted(set(self.core.namespaces()) | set(by_ns))
        if readable is not None:  # another tenant's identity: only what chunk_readers grants it
            by_ns = {ns: keys for ns, keys in by_ns.items() if ns in readable}
            namespaces = [ns for ns in namespaces if ns in readable]
        return agent_pb2.SnapshotResponse(
            pod=pod_identity_to_proto(self.core.pod),
            chunk_keys=[k for ns in sorted(by_ns) for k in by_ns[ns]],
            last_sequence=last_seq,
            namespaces=namespaces,
            by_namespace=[
                agent_pb2.NamespaceChunkKeys(namespace=ns, chunk_keys=by_ns[ns]) for ns in sorted(by_ns)
            ],
        )

    def Health(self, req: agent_pb2.HealthRequest) -> agent_pb2.HealthResponse:
        s = self.core.cache.stats()
        peer = self.core.peer_metrics.stats
        return agent_pb2.HealthResponse(
            pod=pod_identity_to_proto(self.core.pod),
            l1_capacity_bytes=s.capacity_bytes,
            l1_used_bytes=s.used_bytes,
            num_chunks=s.num_chunks,
            instance_ids=sorted(i.instance_id for i in self.core.instances()),
            num_pinned_chunks=s.num_pins,
            num_evictions=s.evictions,
            peer_fetched_chunks=peer.fetched_chunks,
            peer_fetch_failures=peer.fetch_failures,
            peer_served_chunks=peer.served_chunks,
            retrieved_chunks=self.core.totals.retrieved_chunks,
            stored_chunks=self.core.totals.stored_chunks,
            num_leased_chunks=self.core.leased_chunks(),
        )

    def FetchChunks(self, req: agent_pb2.FetchChunksRequest) -> ChunkSender:
        cfg = self.core.config
        ident = caller()
        deadline, end = None, None
        if self.guard is not None:
            # Checked before any chunk is referenced or ticket issued: a refusal changes nothing.
            check_namespace_id(
                req.namespace_id,
                "namespace_id",
                "of the caller's registration (chunks are served per namespace)",
            )
            self.guard.check_read("FetchChunks", ident, req.namespace_id)
            deadline, end = self.guard.open_stream("FetchChunks", ident, call_context())
        try:
            return ChunkSender(
                self.core.cache,
                req,
                part_bytes=min(cfg.peer_fetch_part_size, cfg.max_message_bytes - 1024),
                max_chunks=cfg.peer_fetch_max_chunks,
                metrics=self.core.peer_metrics,
                data_plane=self.data_plane,
                # The fetcher gives up at its own peer_fetch_timeout_ms; ours bounds a vanished one.
                ticket_ttl_s=cfg.peer_fetch_timeout_ms / 1000,
                deadline=deadline,
                caller=ident.uri if ident is not None else "",
                on_close=end,
            )
        except BaseException:
            if end is not None:
                end()
            raise


def _advertise(config: AgentConfig, tcp_port: int | None) -> str:
    if config.advertise_address:
        return config.advertise_address
    if tcp_port is None:
        return ""
    host = os.environ.get("POD_IP")
    if not host and is_loopback_host(config.listen_host):
        # Listening on loopback only: the host name may resolve to an address nothing listens on.
        host = f"[{config.listen_host}]" if ":" in config.listen_host else config.listen_host
    return f"{host or socket.gethostname()}:{tcp_port}"


class AgentServer:
    """The running agent: core, gRPC server, reaper thread and (optionally) event publisher."""

    def __init__(
        self,
        config: AgentConfig,
        *,
        pod: PodIdentity | None = None,
        meter: metrics.Meter | None = None,
        tracer: trace.Tracer | None = None,
    ) -> None:
        self.config = config
        self.events = EventLog(config.event_buffer_size, buffer=bool(config.controller_address))
        self._pod_arg = pod
        self._meter, self._tracer = meter, tracer
        self.servers: list[RpcServer] = []
        self.core: AgentCore | None = None
        self.publisher: EventPublisher | None = None
        self.tcp_port: int | None = None
        self.uds_path: str | None = None
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None
        self.data_plane: DataPlaneServer | None = None
        self.hot_path: HotPathServer | None = None
        self.tcp_guard: TcpGuard | None = None
        self.tcp_servicer: AgentServicer | None = None
        """The TCP port's servicer (its ``data_plane`` is the one tickets name)."""

    def start(self) -> AgentServer:
        cfg = self.config
        rpc_metrics = RpcMetrics(self._meter or metrics.get_meter("kvgrid.agent"))

        tls = cfg.tls

        def server(workers: int, name: str, authorizer: Authorizer | None = None) -> RpcServer:
            opts = ServerOptions(
                max_message_bytes=cfg.max_message_bytes, workers=workers, thread_name_prefix=name
            )
            return RpcServer(opts, rpc_metrics=rpc_metrics, authorizer=authorizer, tracer=self._tracer)

        servers: list[RpcServer] = []
        tcp_servers: set[int] = set()
        if cfg.tcp_port >= 0:
            # Without TLS every caller is admitted unidentified; the guard still needs each call's
            # context (serving deadline, callers told apart by address).
            authz = (
                Authorizer.for_settings(TCP_POLICY, cfg)
                if tls is not None
                else Authorizer.unauthenticated(TCP_POLICY)
            )
            self.tcp_guard = TcpGuard(
                ChunkReaders.for_settings(cfg, cfg.chunk_readers) if tls is not None else None,
                streams_per_caller=cfg.peer_streams_per_identity,
                stream_timeout_s=cfg.peer_stream_timeout_ms / 1000,
            )
            tcp = server(cfg.tcp_grpc_workers, "kvgrid-agent-tcp", authz)
            creds = server_credentials(tls) if tls is not None else None
            host = f"[{cfg.listen_host}]" if ":" in cfg.listen_host else cfg.listen_host  # IPv6
            port = tcp.bind(f"{host}:{cfg.tcp_port}", creds)
            if port == 0:
                raise ValueError(f"tcp_host/tcp_port {host}:{cfg.tcp_port}: cannot bind")
            self.tcp_port = port
            tcp_servers.add(id(tcp))
            servers.append(tcp)
        if cfg.uds_path:
            uds = server(cfg.grpc_workers, "kvgrid-agent-uds")
            path = Path(cfg.uds_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.is_socket():
                path.unlink()  # stale socket of a previous run
            uds.bind(f"unix:{path}")
            self.uds_path = str(path)
            servers.append(uds)
        pod = self._pod_arg or PodIdentity.from_env(agent_address=_advertise(cfg, self.tcp_port))
        self.core = AgentCore(cfg, pod, listener=self.events, meter=self._meter, tracer=self._tracer)
        if self.tcp_port is not None and cfg.peer_data_plane == "socket":
            peer_metrics = self.core.peer_metrics

            def sent(nbytes: int) -> None:
                peer_metrics.served_chunks.add(1)
                peer_metrics.served_bytes.add(nbytes)
                peer_metrics.stats.add(served=1)

            self.data_plane = DataPlaneServer(
                cfg.listen_host,
                cfg.peer_data_port,
                tls=tls,
                on_sent=sent,
                handshake_timeout_s=cfg.peer_data_handshake_timeout_ms / 1000,
                idle_timeout_s=cfg.peer_data_idle_timeout_ms / 1000,
                max_unauthenticated=cfg.peer_data_max_unauthenticated,
                security=cfg.peer_data_security,
            ).start()
        servicer = AgentServicer(self.core, self.events, self.data_plane)
        self.tcp_servicer = AgentServicer(self.core, self.events, self.data_plane, self.tcp_guard)
        if self.uds_path:
            hot = hot_path_of(self.uds_path)
            if cfg.hot_path:
                self.hot_path = HotPathServer(
                    hot,
                    servicer,
                    max_message_bytes=cfg.max_message_bytes,
                    metrics=rpc_metrics,
                    tracer=self._tracer,
                    spin_us=cfg.hot_path_spin_us,
                ).start()
            else:
                Path(hot).unlink(missing_ok=True)  # a previous run's: clients would try it
        for rpc in servers:
            if id(rpc) in tcp_servers:
                rpc.add_service(
                    _SERVICE,
                    self.tcp_servicer,
                    served=TCP_POLICY.allowed,
                    not_served="the engine API is served on the agent's Unix socket only "
                    f"(uds_path); TCP serves {', '.join(sorted(TCP_POLICY.allowed))}",
                )
            else:
                rpc.add_service(_SERVICE, servicer)
            rpc.start()
        self.servers = servers
        self._reaper = threading.Thread(target=self._reap_loop, name="kvgrid-agent-reaper", daemon=True)
        self._reaper.start()
        if cfg.controller_address:
            core = self.core
            self.publisher = EventPublisher(
                cfg.controller_address,
                self.events,
                pod,
                namespaces=core.namespaces,
                l1_capacity_bytes=core.pool.capacity_bytes,
                load=lambda: _load(core.cache),
                flush_interval_s=cfg.event_flush_interval_ms / 1000,
                heartbeat_interval_s=cfg.heartbeat_interval_ms / 1000,
                initial_backoff_s=cfg.reconnect_initial_backoff_ms / 1000,
                max_backoff_s=cfg.reconnect_max_backoff_ms / 1000,
                tls=ClientTls(tls) if tls is not None else None,
                meter=self._meter,
            )
            core.on_instances_changed = self.publisher.reregister
            self.publisher.start()
        log.info(
            "kvgrid agent %s (epoch %d) serving on %s; L1 %d bytes (%s)",
            pod.pod_uid,
            pod.epoch,
            ", ".join(
                x
                for x in (
                    self.uds_path and f"unix:{self.uds_path}",
                    self.tcp_port and f"tcp:{self.tcp_port} ({'mTLS' if tls else 'plaintext'})",
                    self.data_plane and f"peer data plane tcp:{self.data_plane.port}",
                )
                if x
            ),
            self.core.pool.capacity_bytes,
            "pinned" if self.core.pool.pinned else "pageable",
        )
        return self

    def _reap_loop(self) -> None:
        interval = self.config.reaper_interval_ms / 1000
        while not self._stop.wait(interval):
            try:
                assert self.core is not None
                self.core.reap()
            except Exception:
                log.exception("reaper failed")

    def stop(self, grace: float = 2.0) -> None:
        self._stop.set()
        if self.publisher is not None:
            self.publisher.stop()
        if self.hot_path is not None:
            self.hot_path.stop()
        stopping = [rpc.server.stop(grace) for rpc in self.servers]
        for done in stopping:
            done.wait()
        if self.data_plane is not None:
            self.data_plane.stop()
        if self.tcp_guard is not None:
            self.tcp_guard.stop()
        if self.uds_path:
            Path(self.uds_path).unlink(missing_ok=True)
        if self.core is not None:
            self.core.close()

    def wait(self) -> None:
        while not self._stop.wait(1.0):
            pass


def _load(cache: ChunkCache) -> controller_pb2.AgentLoad:
    s = cache.stats()
    return controller_pb2.AgentLoad(l1_used_bytes=s.used_bytes, l1_capacity_bytes=s.capacity_bytes)
