"""ControllerService over gRPC: protobuf in, :class:`~kvgrid.controller.core.Controller` call, protobuf out.

Three layers, as in the agent: the core (:mod:`kvgrid.controller.core`, gRPC-free), the
conversions (:mod:`kvgrid.controller.wire`) and this module, which serves the core with the shared
server toolkit (:mod:`kvgrid.common.rpc`: start-up, health, reflection, error -> status mapping
and per-call metrics) and pulls agent snapshots over gRPC for the core's resyncs. Errors the caller
caused become their status (INVALID_ARGUMENT, FAILED_PRECONDITION for a stale epoch, NOT_FOUND for
an unknown pod) and count as rejected requests; an index backend that cannot be reached is
UNAVAILABLE (not counted as rejected: the caller did nothing wrong); anything else is INTERNAL.

Authorization (mTLS configured; docs/security.md): :data:`POLICY` lets only agent identities call
the write RPCs (RegisterAgent, Heartbeat, PublishEvents) and every kvgrid identity (agent,
controller, router) the read RPCs but SnapshotIndex. An agent acts only for its own pod: a per-pod
certificate's pod UID (or, with ``agent_pod_proof=token``, the UID and name of the pod whose
ServiceAccount token a shared-certificate agent sent; checked by the authorizer,
:mod:`kvgrid.controller.pod_proof`) must equal the request's, and a live pod belongs to the identity that
registered it (:meth:`~kvgrid.controller.registry.AgentRegistry.check_owner`; the registration
checks and records it atomically, in the shared registry across replicas), so no other identity can
heartbeat it, publish for it or take it over with a newer epoch. SnapshotIndex lists one pod's chunk
keys -- the secret that guards a tenant's KV -- so it answers only the identity that registered the
pod and controller identities of this controller's own namespace (its operators' tool); another
agent (another tenant, another per-pod identity) and every router are PERMISSION_DENIED naming the
caller and the pod's owner. Without TLS everyone may call everything (logged loudly).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import grpc
import msgspec
from grpc_health.v1 import health_pb2_grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from kvgrid.api.v1 import agent_pb2, agent_pb2_grpc, controller_pb2
from kvgrid.common.authz import (
    ANY_ROLE,
    Authorizer,
    Identity,
    Policy,
    Role,
    call_context,
    caller,
    certificate_namespaces,
)
from kvgrid.common.errors import KvgridError, PermissionDenied, Unavailable, within
from kvgrid.common.rpc import RpcServer, ServerOptions
from kvgrid.common.tls import AGENT_SERVER_NAME, Channels, ClientTls, server_credentials
from kvgrid.common.tracing import traced_channel
from kvgrid.common.wire import pod_identity_from_proto
from kvgrid.controller import wire
from kvgrid.controller.config import ControllerConfig
from kvgrid.controller.core import Controller, PackedQueries, Query
from kvgrid.controller.index import ChunkIndex, make_index
from kvgrid.controller.ingest import AgentSnapshot
from kvgrid.controller.pod_proof import pod_proof_for
from kvgrid.controller.readiness import Readiness, ReadinessWatcher
from kvgrid.controller.registry import AgentRecord
from kvgrid.controller.streams import PublishStream, PublishStreams

if TYPE_CHECKING:
    from kvgrid.common.telemetry import Telemetry

__all__ = [
    "POLICY",
    "SERVICE_NAME",
    "AgentSnapshots",
    "Controller",
    "ControllerServicer",
    "PackedQueries",
    "Query",
    "Server",
    "make_index",
    "serve",
]

log = logging.getLogger(__name__)

_SERVICE = controller_pb2.DESCRIPTOR.services_by_name["ControllerService"]
SERVICE_NAME = _SERVICE.full_name

_AGENT: frozenset[Role] = frozenset({"agent"})
POLICY = Policy(
    {
        # Writes: only agents, each for its own pod (checked by the servicer).
        "RegisterAgent": _AGENT,
        "Heartbeat": _AGENT,
        "PublishEvents": _AGENT,
        # Reads (Score with reserve=true adds a speculative entry: a router's routing decision).
        "MatchPrefix": ANY_ROLE,
        "BatchMatchPrefix": ANY_ROLE,
        "Score": ANY_ROLE,
        "BatchScore": ANY_ROLE,
        "ListAgents": ANY_ROLE,
        "GetStats": ANY_ROLE,
        # One pod's chunk keys: to the agent that registered it, or this controller's own namespace's
        # controller identity (checked by the servicer); never to routers.
        "SnapshotIndex": frozenset({"agent", "controller"}),
    },
    # An agent calls these as a proven pod when agent_pod_proof is token or certificate.
    pod_bound=frozenset({"RegisterAgent", "Heartbeat", "PublishEvents", "SnapshotIndex"}),
)
"""ControllerService method -> the roles that may call it over mTLS."""


class AgentSnapshots:
    """Pulls ``AgentService.Snapshot`` from a record's ``agent_address`` (one channel per address;
    mTLS with the controller's certificate when ``tls`` is set)."""

    def __init__(self, tls: ClientTls | None = None, tracer: trace.Tracer | None = None) -> None:
        self._channels = Channels(tls, AGENT_SERVER_NAME, [("grpc.max_receive_message_length", 256 << 20)])
        self._tracer: trace.Tracer = tracer if tracer is not None else trace.NoOpTracer()

    def __call__(self, record: AgentRecord, timeout_s: float) -> AgentSnapshot:
        addr = record.pod.agent_address
        if not addr:
            raise ValueError(f"pod {record.pod.pod_uid!r} registered without agent_address; cannot pull")
        # A pull is the root of its own trace (a resync thread); the agent's Snapshot span is its child.
        with self._tracer.start_as_current_span(
            "controller.snapshot_pull",
            kind=SpanKind.CLIENT,
            attributes={"kvgrid.pod_uid": record.pod.pod_uid, "server.address": addr},
        ) as span:
            ch = traced_channel(self._channels.get(addr))
            try:
                snap = agent_pb2_grpc.AgentServiceStub(ch).Snapshot(
                    agent_pb2.SnapshotRequest(), timeout=timeout_s
                )
            except grpc.RpcError as e:
                code = e.code() if hasattr(e, "code") else e
                span.set_status(trace.Status(trace.StatusCode.ERROR, str(code)))
                raise Unavailable(f"snapshot from {addr}: {code}") from None
            out = wire.agent_snapshot_from_proto(snap)
            span.set_attribute("kvgrid.snapshot.last_sequence", out.last_sequence)
            return out

    def close(self) -> None:
        self._channels.close()


class ControllerServicer:
    """One method per RPC of ControllerService: convert, call the core, convert back."""

    def __init__(
        self,
        ctl: Controller,
        tracer: trace.Tracer | None = None,
        own_namespaces: Collection[str] = (),
        streams: PublishStreams | None = None,
    ) -> None:
        """``own_namespaces``: the namespaces of this controller's certificate identity, whose
        controller identities may list any pod's keys (SnapshotIndex). ``streams``: the bounds of
        PublishEvents streams (:mod:`kvgrid.controller.streams`; None: unbounded)."""
        self.ctl = ctl
        self.streams = streams
        self.own_namespaces = frozenset(own_namespaces)
        self.tracer: trace.Tracer = tracer if tracer is not None else trace.NoOpTracer()
        # A registration's ownership check and the registration itself happen as one step.
        self._register_lock = threading.Lock()

    def _act_for(self, pod_uid: str, what: str, pod_name: str | None = None) -> Identity | None:
        """Refuse (PERMISSION_DENIED) an mTLS caller acting for a pod that is not its own (a per-pod
        certificate's or pod token's pod, and the pod's name when a token proved it); the caller's
        identity (None without TLS)."""
        ident = caller()
        if ident is None:
            return None  # TLS off: unauthenticated mode
        ident.check_acts_for(pod_uid, f"{what} for pod_uid={pod_uid!r}", pod_name)
        self.ctl.registry.check_owner(pod_uid, ident.uri)
        return ident

    def _own_events(
        self,
        requests: Iterator[controller_pb2.PublishEventsRequest],
        pods: list[str],
        bounds: PublishStream | None = None,
    ) -> Iterator[controller_pb2.PublishEventsRequest]:
        """``requests``, each pod checked like a registration (a stream may register its pod
        implicitly, with a newer epoch); the pods go to ``pods``, the first also to ``bounds`` (its
        per-pod slot; every message counts as the stream's progress). Each message is a span, child of
        the stream's server span, ending when the core asks for the next message (i.e. once this one
        is applied); started and ended explicitly, never made current, as a generator may resume
        in another context."""
        stream = otel_context.get_current()
        for req in requests:
            if bounds is not None:
                bounds.received()
            if req.HasField("pod") and req.pod.pod_uid not in pods:
                self._act_for(req.pod.pod_uid, "PublishEvents", req.pod.pod_name)
                if bounds is not None and not pods:
                    bounds.name_pod(req.pod.pod_uid, "PublishEvents")
                pods.append(req.pod.pod_uid)
            span = self.tracer.start_span(
                "PublishEvents batch",
                context=stream,
                attributes={
                    "kvgrid.events": len(req.events),
                    "kvgrid.chunk_keys": sum(len(e.chunk_keys) for e in req.events),
                    "kvgrid.pod_uid": pods[-1] if pods else "",
                },
            )
            try:
                yield req
            finally:
                span.end()

    def _answered(self, rpc: str, queries: int) -> None:
        if self.ctl.metrics is not None:
            self.ctl.metrics.answered(rpc, queries)

    def rejected(self, method: str, error: KvgridError) -> None:
        """The toolkit's hook for calls refused with a client-facing error (GetStats counts them;
        an outage of the index backend is not the caller's doing and is not counted)."""
        if not isinstance(error, Unavailable):
            self.ctl.rejected += 1

    def RegisterAgent(self, req: controller_pb2.RegisterAgentRequest) -> controller_pb2.RegisterAgentResponse:
        pod = pod_identity_from_proto(req.pod)
        with self._register_lock:
            ident = self._act_for(pod.pod_uid, "RegisterAgent", pod.pod_name)
            reg = self.ctl.register(
                pod, list(req.namespaces), req.l1_capacity_bytes, owner=ident.uri if ident else None
            )
        return wire.registration_to_proto(reg)

    def Heartbeat(self, req: controller_pb2.HeartbeatRequest) -> controller_pb2.HeartbeatResponse:
        self._act_for(req.pod_uid, "Heartbeat")
        load = wire.load_from_proto(req.load) if req.HasField("load") else None
        return wire.lease_to_proto(self.ctl.heartbeat(req.pod_uid, req.epoch, load))

    def PublishEvents(
        self, requests: Iterator[controller_pb2.PublishEventsRequest]
    ) -> Iterator[controller_pb2.PublishEventsResponse]:
        ident = caller()
        # RESOURCE_EXHAUSTED before anything is read when the caller (or everyone) has too many open.
        bounds = self.streams.open("PublishEvents", ident, call_context()) if self.streams else None
        try:
            pods: list[str] = []
            owned = 0
            owner = ident.uri if ident is not None else None
            msgs = wire.event_messages_from_proto(self._own_events(requests, pods, bounds))
            for ack in self.ctl.publish(msgs, owner=owner):
                if ident is not None and owned < len(pods):
                    # The stream's pod is registered now (perhaps implicitly, by this stream).
                    for uid in pods[owned:]:
                        self.ctl.registry.set_owner(uid, ident.uri)
                    owned = len(pods)
                if bounds is None:
                    yield wire.publish_ack_to_proto(ack)
                    continue
                bounds.answer()
                yield wire.publish_ack_to_proto(ack)  # resumes once gRPC sent it
                bounds.answered()
        finally:
            if bounds is not None:
                bounds.end()

    def _may_list(self, pod_uid: str) -> None:
        """PERMISSION_DENIED unless the mTLS caller may list ``pod_uid``'s keys: the identity that
        registered it, or a controller identity of this controller's own namespace."""
        ident = caller()
        if ident is None:
            return  # TLS off: unauthenticated mode
        what = f"SnapshotIndex of pod_uid={pod_uid!r}"
        if ident.role == "controller":
            if ident.namespace not in self.own_namespaces:
                raise PermissionDenied(
                    f"{what}: the caller {ident.uri!r} is a controller of namespace {ident.namespace!r}; "
                    f"only the pod's own agent identity and controller identities of this controller's "
                    f"namespace ({', '.join(sorted(self.own_namespaces)) or 'none'}) may list its chunk keys"
                )
            return
        ident.check_acts_for(pod_uid, what, rule="an agent may list only its own pod's chunk keys")
        try:
            self.ctl.registry.check_owner(pod_uid, ident.uri)
        except PermissionDenied as e:
            raise PermissionDenied(
                f"{what}: the caller {ident.uri!r} (namespace {ident.namespace!r}) may list only the pods "
                f"it registered: {e}"
            ) from None

    def SnapshotIndex(self, req: controller_pb2.SnapshotIndexRequest) -> controller_pb2.SnapshotIndexResponse:
        self._may_list(req.pod_uid)
        tier = wire.tier_from_proto(req.tier)
        return wire.snapshot_to_proto(self.ctl.snapshot_index(req.pod_uid, tier))

    def MatchPrefix(self, req: controller_pb2.MatchPrefixRequest) -> controller_pb2.MatchPrefixResponse:
        resp = wire.match_to_proto(self.ctl.match(wire.prefix_query_from_proto(req)))
        self._answered("MatchPrefix", 1)
        return resp

    def BatchMatchPrefix(
        self, req: controller_pb2.BatchMatchPrefixRequest
    ) -> controller_pb2.BatchMatchPrefixResponse:
        if wire.is_packed(req):
            r = self.ctl.match_packed(wire.packed_from_proto(req))
        else:
            self.ctl.check_batch(len(req.requests))
            qs = []
            for i, q in enumerate(req.requests):
                with within(f"requests[{i}]"):
                    qs.append(wire.prefix_query_from_proto(q))
            r = self.ctl.match_batch(qs)
        resp = wire.batch_match_to_proto(r, req.compact)
        self._answered("BatchMatchPrefix", len(r.num_chunks))
        return resp

    def Score(self, req: controller_pb2.ScoreRequest) -> controller_pb2.ScoreResponse:
        resp = wire.score_to_proto(self.ctl.score(wire.score_query_from_proto(req)))
        self._answered("Score", 1)
        return resp

    def BatchScore(self, req: controller_pb2.BatchScoreRequest) -> controller_pb2.BatchScoreResponse:
        self.ctl.check_batch(len(req.requests))
        sqs = []
        for i, r in enumerate(req.requests):
            with within(f"requests[{i}].match"):
                sqs.append(wire.score_query_from_proto(r))
        results = self.ctl.score_batch(sqs)
        self._answered("BatchScore", len(results))
        return controller_pb2.BatchScoreResponse(responses=[wire.score_to_proto(s) for s in results])

    def ListAgents(self, req: controller_pb2.ListAgentsRequest) -> controller_pb2.ListAgentsResponse:
        return wire.agents_to_proto(self.ctl.list_agents())

    def GetStats(self, req: controller_pb2.GetStatsRequest) -> controller_pb2.GetStatsResponse:
        return wire.stats_to_proto(self.ctl.stats())


class Server(msgspec.Struct):
    """A running controller: ``address`` is host:port actually bound."""

    controller: Controller
    grpc_server: Any
    address: str
    snapshots: AgentSnapshots | None = None
    health_server: Any = None
    health_address: str = ""
    """host:port of the plaintext health-only listener ("" when ``health_port`` is 0)."""
    readiness: ReadinessWatcher | None = None
    streams: PublishStreams | None = None
    """The PublishEvents bounds (open streams, refusals, idle cancels)."""

    def stop(self, grace: float | None = 0.5) -> None:
        if self.readiness is not None:
            self.readiness.stop()
        if self.streams is not None:
            self.streams.stop()
        if self.health_server is not None:
            self.health_server.stop(0)
        self.grpc_server.stop(grace).wait()
        self.controller.stop()
        if self.snapshots is not None:
            self.snapshots.close()


def serve(
    cfg: ControllerConfig, index: ChunkIndex | None = None, telemetry: Telemetry | None = None
) -> Server:
    """Start the controller and its gRPC server (health + reflection); returns once listening.

    With ``telemetry`` (from :func:`kvgrid.common.telemetry.setup_telemetry`) the controller
    records its ``kvgrid_controller_*`` metrics and the toolkit its ``kvgrid_rpc_server_*`` ones on
    ``telemetry.meter``, and spans (every RPC, each PublishEvents message, snapshot pulls) on
    ``telemetry.tracer``. Health is NOT_SERVING until :mod:`kvgrid.controller.readiness` says ready.
    """
    tls = cfg.tls
    tracer = telemetry.tracer if telemetry is not None else None
    snapshots = AgentSnapshots(ClientTls(tls) if tls is not None else None, tracer)
    ctl = Controller(cfg, index, telemetry, snapshots=snapshots)
    rpc = RpcServer(
        ServerOptions(
            max_message_bytes=cfg.max_message_bytes,
            workers=cfg.grpc_workers,
            thread_name_prefix="kvgrid-controller",
        ),
        telemetry.meter if telemetry is not None else None,
        # Without TLS every caller is admitted unidentified; the stream bounds still need each call's
        # context (callers told apart by address, idle streams cancelled).
        authorizer=(
            Authorizer.for_settings(POLICY, cfg, pod_proof_for(cfg))
            if tls is not None
            else Authorizer.unauthenticated(POLICY)
        ),
        tracer=tracer,
    )
    streams = PublishStreams(
        per_caller=cfg.publish_streams_per_caller,
        per_pod=cfg.publish_streams_per_pod,
        total=cfg.publish_streams_cap,
        idle_timeout_s=cfg.publish_idle_timeout_ms / 1000,
        pod_live=lambda uid: (rec := ctl.registry.get(uid)) is not None and not rec.dropped,
    )
    servicer = ControllerServicer(
        ctl, tracer, own_namespaces=certificate_namespaces(cfg)[0] if tls is not None else (), streams=streams
    )
    rpc.add_service(_SERVICE, servicer, on_error=servicer.rejected)
    port = rpc.bind(cfg.listen, server_credentials(tls) if tls is not None else None)
    if port == 0:
        ctl.stop()
        snapshots.close()
        raise ValueError(f"listen={cfg.listen!r}: could not bind")
    host = cfg.listen.rpartition(":")[0]
    health_server, health_address = None, ""
    if cfg.health_port:
        # Kubelet gRPC probes speak plaintext and present no certificate: with mTLS on the main port
        # they need a listener of their own that serves nothing but grpc.health.v1.
        health_server = grpc.server(ThreadPoolExecutor(2, thread_name_prefix="kvgrid-controller-health"))
        health_pb2_grpc.add_HealthServicer_to_server(rpc.health, health_server)
        hport = health_server.add_insecure_port(f"{host}:{cfg.health_port}")
        if not hport:
            ctl.stop()
            snapshots.close()
            raise ValueError(f"health_port={cfg.health_port}: could not bind on {host}")
        health_address = f"{host}:{hport}"
    ctl.start()
    # Both listeners share rpc.health: the kubelet's probe sees the same readiness as gRPC clients.
    readiness = ReadinessWatcher(
        Readiness(ctl, settle_s=cfg.readiness_settle_ms / 1000, max_wait_s=cfg.readiness_max_wait_ms / 1000),
        rpc.health,
        rpc.service_names,
    )
    if telemetry is not None:
        readiness.observe(telemetry.meter)
    rpc.start(serving=False)
    readiness.start()
    if health_server is not None:
        health_server.start()
    return Server(
        controller=ctl,
        grpc_server=rpc.server,
        address=f"{host}:{port}",
        snapshots=snapshots,
        health_server=health_server,
        health_address=health_address,
        readiness=readiness,
        streams=streams,
    )
