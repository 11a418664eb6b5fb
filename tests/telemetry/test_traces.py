"""One request, one trace: connector -> agent -> controller and peer agent, seen by a real OTLP receiver.

A real ``kvgrid controller`` and two real ``kvgrid agent`` processes export their spans over OTLP/gRPC
to a receiver in this test process (:class:`tests.telemetry.receivers.GrpcReceiver`). This process
plays the engine: the connector's real scheduler side (:class:`ConnectorScheduler`) looks a vLLM
``Request`` up on agent B; B has none of the chunks, asks the controller who holds them and fetches
them from agent A. The request carries a W3C ``traceparent`` (as vLLM's ``trace_headers`` does when
the HTTP caller sent one); every span of every process must be in that trace, linked parent to child.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from vllm import SamplingParams
from vllm.v1.request import Request

from kvgrid.api.v1 import common_pb2, controller_pb2, controller_pb2_grpc
from kvgrid.connector.config import ConnectorIdentity, KVGridConnectorConfig
from kvgrid.connector.scheduler import ConnectorScheduler
from tests.agent.helpers import (
    BPC,
    NAMESPACE,
    TOKENS_PER_CHUNK,
    AgentProc,
    block_ids,
    register_kv,
    start_agent,
    start_controller,
    wait_for,
)
from tests.telemetry.receivers import GrpcReceiver

NS_ID = NAMESPACE.namespace_id()
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN_ID = "00f067aa0ba902b7"


@dataclass
class Cluster:
    receiver: GrpcReceiver
    controller: controller_pb2_grpc.ControllerServiceStub
    a: AgentProc
    b: AgentProc
    root: Path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, free_port: Callable[[], int]) -> Iterator[Cluster]:
    receiver = GrpcReceiver()
    root = tmp_path_factory.mktemp("traces")
    address = f"127.0.0.1:{free_port()}"
    procs: list[AgentProc] = []
    ctrl = None
    channel = grpc.insecure_channel(address)
    try:
        with pytest.MonkeyPatch.context() as mp:
            # The services read the standard OTel variables: export spans quickly, no OTLP metrics.
            mp.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{receiver.port}")
            mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
            mp.setenv("OTEL_METRICS_EXPORTER", "none")
            ctrl = start_controller(address)
            grpc.channel_ready_future(channel).result(timeout=60)
            for uid in ("pod-a", "pod-b"):
                (root / uid).mkdir()
                procs.append(
                    start_agent(
                        root / uid,
                        "--controller-address",
                        address,
                        "--event-flush-interval-ms",
                        "20",
                        pod_uid=uid,
                        shm_dir=root,
                    )
                )
        stub = controller_pb2_grpc.ControllerServiceStub(channel)
        wait_for(
            "both agents registered", lambda: stub.GetStats(controller_pb2.GetStatsRequest()).num_agents >= 2
        )
        yield Cluster(receiver, stub, procs[0], procs[1], root)
    finally:
        for p in procs:
            p.stop()
        if ctrl is not None:
            ctrl.terminate()
            ctrl.wait(10)
        channel.close()
        receiver.close()


def _connector(agent: AgentProc, instance_id: str) -> ConnectorScheduler:
    identity = ConnectorIdentity(
        rank=0,
        world_size=1,
        dcp_size=1,
        instance_id=instance_id,
        agent_address=agent.uds_path,
        instance_ids=(instance_id,),
        agent_addresses=(agent.uds_path,),
        replicated_kv=False,
        model_name=NAMESPACE.model,
        tokens_per_chunk=TOKENS_PER_CHUNK,
        tokens_per_block=tuple(TOKENS_PER_CHUNK // b for b in BPC),
        kv_identities=(NAMESPACE.kv_identity,),
    )
    return ConnectorScheduler(identity, KVGridConnectorConfig(), is_consumer=True, is_producer=False)


@pytest.fixture(scope="module")
def engine_tracing(cluster: Cluster) -> Iterator[TracerProvider]:
    """This process's tracer provider, as vLLM installs one when its tracing is on."""
    provider = TracerProvider(resource=Resource.create({"service.name": "vllm-engine"}))
    provider.add_span_processor(
        SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"http://127.0.0.1:{cluster.receiver.port}"))
    )
    trace.set_tracer_provider(provider)  # once per process; no other test installs one
    yield provider
    provider.shutdown()


def _by_id(receiver: GrpcReceiver) -> dict[bytes, tuple[dict[str, Any], Any]]:
    with receiver.lock:
        return {s.span_id: (res, s) for res, s in receiver.spans if s.trace_id.hex() == TRACE_ID}


def test_a_lookup_is_one_trace_across_connector_agents_and_controller(
    cluster: Cluster, engine_tracing: TracerProvider
) -> None:
    n = 3
    tokens = [(31 * i + 7) % 50_000 for i in range(n * TOKENS_PER_CHUNK + 1)]
    request = Request(
        "req-traced",
        tokens,
        SamplingParams(max_tokens=1),
        None,
        trace_headers={"traceparent": f"00-{TRACE_ID}-{CALLER_SPAN_ID}-01"},
    )
    connector = _connector(cluster.b, "e-b")
    keys = connector.request_keys(request)
    assert keys is not None and len(keys[0]) == n
    # Engine A stores the prompt's chunks in agent A; the controller learns it from A's events.
    (cluster.root / "e-a").mkdir()
    (cluster.root / "e-b").mkdir()
    client_a, client_b = cluster.a.client(), cluster.b.client()
    register_kv(client_a, "e-a", cluster.root / "e-a", seed=1)
    register_kv(client_b, "e-b", cluster.root / "e-b", seed=2)
    assert client_a.store("e-a", keys[0], block_ids(0, n)).num_stored_chunks == n

    def indexed() -> bool:
        resp = cluster.controller.MatchPrefix(
            controller_pb2.MatchPrefixRequest(
                chunk_keys=common_pb2.ChunkKeys(keys=keys[0]), namespace_id=NS_ID
            )
        )
        return any(m.pod_uid == cluster.a.pod_uid and m.l1_chunks == n for m in resp.matches)

    wait_for("A's chunks indexed", indexed)
    tokens_to_load, _ = connector.lookup(request, 0)
    assert tokens_to_load == n * TOKENS_PER_CHUNK  # every chunk came from peer A through B
    engine_tracing.force_flush()

    def services() -> set[str]:
        return {res["service.name"] for res, _ in _by_id(cluster.receiver).values()}

    want_services = {"vllm-engine", "kvgrid-agent", "kvgrid-controller"}

    def lookup_exported() -> bool:  # B's server span ends after the fetch: its batch can come later
        return any(s.name == "kvgrid.v1.AgentService/Lookup" for _, s in _by_id(cluster.receiver).values())

    wait_for(
        "spans of every service",
        lambda: want_services <= services() and _has_fetch(cluster) and lookup_exported(),
    )
    spans = _by_id(cluster.receiver)

    def named(name: str) -> list[tuple[dict[str, Any], Any]]:
        return [(res, s) for res, s in spans.values() if s.name == name]

    # The connector's span continues the caller's trace.
    [(res, conn)] = named("kvgrid.connector.lookup")
    assert res["service.name"] == "vllm-engine" and conn.parent_span_id.hex() == CALLER_SPAN_ID
    # Agent B's server span is the connector span's child.
    [(res_b, lookup)] = named("kvgrid.v1.AgentService/Lookup")
    assert res_b["k8s.pod.uid"] == "pod-b" and lookup.parent_span_id == conn.span_id
    # B asked the controller (its span a descendant of B's Lookup) and fetched from A (ditto).
    ctl_spans = [(res, s) for res, s in spans.values() if res["service.name"] == "kvgrid-controller"]
    assert {s.name for _, s in ctl_spans} >= {"kvgrid.v1.ControllerService/MatchPrefix"}
    [(res_a, fetch)] = named("kvgrid.v1.AgentService/FetchChunks")
    assert res_a["k8s.pod.uid"] == "pod-a"
    for _, span in [*ctl_spans, (res_a, fetch)]:
        chain = _ancestors(span, spans)
        assert chain[-1] == conn.span_id and lookup.span_id in chain, (span.name, chain)
        assert spans[span.parent_span_id][0].get("k8s.pod.uid") == "pod-b"  # called by agent B
    # Server spans carry the RPC attributes and the status.
    attrs = {kv.key: kv.value for kv in lookup.attributes}
    assert attrs["rpc.system"].string_value == "grpc" and attrs["rpc.method"].string_value == "Lookup"
    assert attrs["rpc.grpc.status_code"].int_value == 0


def _has_fetch(cluster: Cluster) -> bool:
    return any(s.name == "kvgrid.v1.AgentService/FetchChunks" for _, s in _by_id(cluster.receiver).values())


def _ancestors(span: Any, spans: dict[bytes, tuple[dict[str, Any], Any]]) -> list[bytes]:
    """Span ids from ``span``'s parent up to the first span whose parent is not in the trace here."""
    chain = []
    parent = span.parent_span_id
    while parent in spans:
        chain.append(parent)
        parent = spans[parent][1].parent_span_id
    return chain


def test_controller_spans_for_snapshot_pulls_and_event_batches(cluster: Cluster) -> None:
    """The controller pulled each agent's snapshot when it registered (a span whose child is the
    agent's Snapshot server span) and spans every PublishEvents message."""

    def pulls() -> list[Any]:
        with cluster.receiver.lock:
            return [s for _, s in cluster.receiver.spans if s.name == "controller.snapshot_pull"]

    wait_for("snapshot pull spans", lambda: len(pulls()) >= 2)
    with cluster.receiver.lock:
        all_spans = list(cluster.receiver.spans)
    by_parent = {s.parent_span_id: (res, s) for res, s in all_spans if s.parent_span_id}
    for pull in pulls()[:2]:
        res, child = by_parent[pull.span_id]
        assert child.name == "kvgrid.v1.AgentService/Snapshot" and res["service.name"] == "kvgrid-agent"
        assert child.trace_id == pull.trace_id
    # Each PublishEvents message is a span, child of its stream's server span (which is exported
    # only when the stream ends), saying how many events it carried.
    batches = [s for _, s in all_spans if s.name == "PublishEvents batch"]
    assert batches and all(b.parent_span_id for b in batches)
    keys = [kv.value.int_value for b in batches for kv in b.attributes if kv.key == "kvgrid.chunk_keys"]
    assert len(keys) == len(batches) and sum(keys) >= 3  # at least agent A's admits of the test above
