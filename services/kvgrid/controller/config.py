"""ControllerConfig: every setting of ``kvgrid controller`` (defaults need no file: embedded index)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from kvgrid.common.hashing import KeyNamespace
from kvgrid.common.rpc import check_plaintext_listen
from kvgrid.common.tls import TlsSettings

__all__ = ["ControllerConfig", "VllmEventSource"]


class VllmEventSource(msgspec.Struct, frozen=True):
    """One vLLM engine's KV-event publisher (``--kv-events-config``), attributed to a pod."""

    pod_uid: Annotated[str, msgspec.Meta(description="UID of the pod whose GPU cache the events describe")]
    endpoint: Annotated[
        str, msgspec.Meta(description="ZMQ PUB endpoint to subscribe to, e.g. tcp://10.0.0.5:5557")
    ]
    namespace: Annotated[
        KeyNamespace, msgspec.Meta(description="key namespace used to key the stored tokens")
    ]
    replay_endpoint: Annotated[str, msgspec.Meta(description="ZMQ ROUTER replay endpoint ('' = none)")] = ""
    topic: Annotated[str, msgspec.Meta(description="ZMQ topic prefix to subscribe to ('' = all)")] = ""


class ControllerConfig(TlsSettings, frozen=True, kw_only=True):
    listen: Annotated[
        str,
        msgspec.Meta(
            description="gRPC listen address host:port (port 0 = any free port); without TLS a "
            "non-loopback host (e.g. 0.0.0.0) is refused unless insecure_plaintext_on_network is set"
        ),
    ] = "127.0.0.1:50061"
    insecure_plaintext_on_network: Annotated[
        bool,
        msgspec.Meta(
            description="INSECURE: without TLS, allow a non-loopback listen host anyway: anyone who "
            "reaches the port is unauthenticated and may call every method (read the index, publish "
            "events as any pod). Only for isolated networks; configure tls_cert_file, tls_key_file and "
            "tls_ca_file instead"
        ),
    ] = False
    index_backend: Annotated[
        Literal["memory", "redis"], msgspec.Meta(description="chunk index backend: memory or redis")
    ] = "memory"
    redis_url: Annotated[str, msgspec.Meta(description="Redis/Valkey URL for index_backend=redis")] = ""
    redis_prefix: Annotated[str, msgspec.Meta(description="key prefix of the shared index in Redis")] = "kvg:"
    redis_cluster: Annotated[
        bool,
        msgspec.Meta(
            description="redis_url names a node of a Valkey/Redis Cluster: chunk keys are hashed across "
            "its shards (index_backend=redis only)"
        ),
    ] = False
    lease_ttl_ms: Annotated[int, msgspec.Meta(ge=100, description="agent lease; heartbeats renew it")] = (
        10_000
    )
    sweep_interval_ms: Annotated[
        int, msgspec.Meta(ge=10, description="how often lapsed leases are purged")
    ] = 250
    speculative_ttl_ms: Annotated[
        int, msgspec.Meta(ge=1, description="lifetime of speculative entries from Score(reserve=true)")
    ] = 2_000
    max_resync_buffer_events: Annotated[
        int,
        msgspec.Meta(
            ge=1,
            description="events kept per pod while its snapshot is pulled; past it they are dropped and "
            "a newer snapshot is pulled",
        ),
    ] = 100_000
    max_speculative_ttl_ms: Annotated[
        int,
        msgspec.Meta(
            ge=1,
            description="longest speculative_ttl_ms a Score request may ask for (ms)",
        ),
    ] = 30_000
    snapshot_timeout_ms: Annotated[int, msgspec.Meta(ge=10, description="deadline of one snapshot pull")] = (
        5_000
    )
    resync_retry_ms: Annotated[
        int, msgspec.Meta(ge=10, description="pause before retrying a failed pull")
    ] = 500
    max_query_chunks: Annotated[int, msgspec.Meta(ge=1, description="most chunk keys in one query")] = 4_096
    max_query_tokens: Annotated[int, msgspec.Meta(ge=1, description="most token ids in one query")] = 1 << 20
    max_batch: Annotated[int, msgspec.Meta(ge=1, description="most queries in one batch request")] = 4_096
    max_event_keys: Annotated[
        int, msgspec.Meta(ge=1, description="most chunk keys in one PublishEvents message")
    ] = 1 << 20
    max_entries_per_pod: Annotated[
        int,
        msgspec.Meta(
            ge=1,
            description="most (chunk, tier) index entries one pod may hold; agent admits and snapshots "
            "beyond it are not indexed (counted in kvgrid_controller_rejected_entries)",
        ),
    ] = 1 << 20
    max_index_entries: Annotated[
        int,
        msgspec.Meta(
            ge=1,
            description="most (chunk, tier) entries in the whole index (about 60-80 B each in memory: "
            "the default is ~0.6 GiB); agent admits and snapshots beyond it are not indexed",
        ),
    ] = 1 << 23
    max_entries_per_identity: Annotated[
        int,
        msgspec.Meta(
            ge=0,
            description="most (chunk, tier) index entries of all pods registered by one mTLS identity "
            "together (0 = max_index_entries // 2, so one identity cannot fill the index for the others; "
            "with the chart's shared agent certificate every agent is one identity: size it for the "
            "fleet). Plaintext callers have no identity and no identity cap",
        ),
    ] = 0
    max_pods_per_identity: Annotated[
        int,
        msgspec.Meta(
            ge=0,
            description="most live pods one mTLS identity may register (0 = no bound); a registration "
            "or event stream of one more pod is RESOURCE_EXHAUSTED. A per-pod certificate registers one "
            "pod anyway; with a shared agent certificate set it to the fleet size plus rollout surge",
        ),
    ] = 1024
    backend_check_interval_ms: Annotated[
        int,
        msgspec.Meta(
            ge=10,
            description="how often the index backend is checked for data loss (a Redis/Valkey restarted "
            "empty or flushed); a loss makes every agent resync",
        ),
    ] = 500
    max_message_bytes: Annotated[int, msgspec.Meta(ge=1024, description="gRPC max message size")] = 64 << 20
    grpc_workers: Annotated[
        int,
        msgspec.Meta(
            ge=2,
            description="gRPC handler threads (each open PublishEvents stream holds one; at most "
            "max_publish_streams of them, so unary calls keep the rest)",
        ),
    ] = 256
    publish_streams_per_identity: Annotated[
        int,
        msgspec.Meta(
            ge=0,
            description="most PublishEvents streams one caller may have open at once: its certificate "
            "identity at its IP address (pods sharing the chart's agent certificate are each a caller of "
            "their own), without TLS its IP address; one more is RESOURCE_EXHAUSTED. An agent holds one "
            "stream (a pod with one agent per GPU, one per agent) and briefly two while it reconnects "
            "(0 = 16, or max_publish_streams if that is fewer). At most max_publish_streams, so one caller "
            "never holds every thread",
        ),
    ] = 0
    publish_streams_per_pod: Annotated[
        int,
        msgspec.Meta(
            ge=1,
            description="most PublishEvents streams open at once for one pod UID (one, plus room for a "
            "reconnect whose old stream the server has not seen end yet); one more is RESOURCE_EXHAUSTED",
        ),
    ] = 2
    max_publish_streams: Annotated[
        int,
        msgspec.Meta(
            ge=0,
            description="most PublishEvents streams open at once in all, below grpc_workers so unary calls "
            "(routers' queries, heartbeats, registrations) always find a thread (0 = grpc_workers minus "
            "an eighth of them, at least 1); one more is RESOURCE_EXHAUSTED. Size grpc_workers for the "
            "fleet: one stream per agent served by this replica",
        ),
    ] = 0
    publish_idle_timeout_ms: Annotated[
        int,
        msgspec.Meta(
            ge=100,
            description="a PublishEvents stream is cancelled (its thread and slots freed) once, for this "
            "long, its answer could not be sent (the client stopped reading), or nothing arrived while it "
            "named no pod, a newer stream of its pod was open, or its pod's lease had lapsed; a quiet "
            "stream of a pod with a live lease is kept (an agent with nothing to report)",
        ),
    ] = 30_000
    bytes_per_token: Annotated[
        int, msgspec.Meta(ge=1, description="KV bytes per token of the model (transfer cost)")
    ] = 131_072
    l1_gbps: Annotated[
        float, msgspec.Meta(gt=0, description="L1 (pinned CPU) -> GPU copy bandwidth, GB/s")
    ] = 20.0
    peer_gbps: Annotated[float, msgspec.Meta(gt=0, description="peer L1 -> local fetch bandwidth, GB/s")] = (
        10.0
    )
    peer_latency_ms: Annotated[float, msgspec.Meta(ge=0, description="fixed cost of a peer fetch, ms")] = 1.0
    l2_disk_gbps: Annotated[
        float,
        msgspec.Meta(
            gt=0,
            description="agent disk tier -> L1 read bandwidth, GB/s (default: kvgrid bench tier's verified "
            "read-back on the H200 host, docs/benchmarks.md)",
        ),
    ] = 4.8
    l2_object_store_gbps: Annotated[
        float,
        msgspec.Meta(
            gt=0,
            description="agent object-store (S3) tier -> L1 read bandwidth, GB/s (default: minio gets from a "
            "local SeaweedFS, docs/benchmarks.md; measure your store)",
        ),
    ] = 0.5
    l2_tier: Annotated[
        Literal["disk", "object_store"],
        msgspec.Meta(
            description="which read bandwidth prices L2 chunks in Score: the agents' fastest lower tier "
            "(disk when they have one, else object_store)"
        ),
    ] = "disk"
    prefill_tokens_per_s: Annotated[
        float, msgspec.Meta(gt=0, description="prefill throughput of one pod, tokens/s")
    ] = 10_000.0
    queue_ms_per_running: Annotated[
        float, msgspec.Meta(ge=0, description="added TTFT per running request on the pod, ms")
    ] = 5.0
    queue_ms_per_waiting: Annotated[
        float, msgspec.Meta(ge=0, description="added TTFT per waiting request on the pod, ms")
    ] = 50.0
    vllm_sources: Annotated[
        list[VllmEventSource], msgspec.Meta(description="vLLM KV-event publishers to subscribe to (YAML)")
    ] = msgspec.field(default_factory=list)
    prometheus_port: Annotated[int, msgspec.Meta(ge=0, description="Prometheus scrape port (0 = off)")] = 0
    health_port: Annotated[
        int,
        msgspec.Meta(
            ge=0,
            le=65535,
            description="port of a plaintext listener serving only grpc.health.v1 (kubelet gRPC probes "
            "cannot do mTLS), on the listen host; 0 = none",
        ),
    ] = 0
    lookup_port: Annotated[
        int,
        msgspec.Meta(
            ge=0,
            le=65535,
            description="port of the lean lookup listener (MatchPrefix, BatchMatchPrefix, Score and "
            "ListAgents as length-prefixed protobuf frames: a router's per-request call without gRPC's "
            "cost; docs/controller.md) on the listen host; 0 = off. With TLS it requires mTLS with the "
            "tls_* files and authorizes like the gRPC methods; without TLS it is plaintext, loopback "
            "unless insecure_plaintext_on_network",
        ),
    ] = 0
    readiness_settle_ms: Annotated[
        int,
        msgspec.Meta(
            ge=0,
            description="after start, health stays NOT_SERVING at least this long so agents can register "
            "again (set it to the agents' reconnect_max_backoff_ms with the memory index); then it turns "
            "SERVING once every registered agent's snapshot is pulled and the index backend answers",
        ),
    ] = 0
    readiness_max_wait_ms: Annotated[
        int,
        msgspec.Meta(
            ge=0,
            description="SERVING after this long from start even if some agent's snapshot pull has not "
            "finished (an unreachable agent must not keep the controller out of service)",
        ),
    ] = 30_000
    otlp_endpoint: Annotated[
        str,
        msgspec.Meta(
            description="OTLP collector for traces and metrics, e.g. otel-collector:4317 (empty: "
            "OTEL_EXPORTER_OTLP_ENDPOINT, if set)"
        ),
    ] = ""
    agent_pod_proof: Annotated[
        Literal["token", "certificate", "unverified"],
        msgspec.Meta(
            description="with mTLS, what proves which pod an agent registers, heartbeats and publishes "
            "for (docs/security.md, 'Agent identity modes'): token = a per-pod certificate, or the shared "
            "agent certificate plus the pod's ServiceAccount token (verified by the Kubernetes API, "
            "TokenReview; the chart's default); certificate = per-pod certificates only (cert-manager's "
            "csi-driver); unverified = INSECURE: any holder of the shared agent certificate may act as "
            "any pod it claims first"
        ),
    ] = "unverified"
    agent_token_audience: Annotated[
        str,
        msgspec.Meta(
            min_length=1,
            description="audience the agents' pod tokens must carry (the projected volume's audience)",
        ),
    ] = "kvgrid"
    agent_token_cache_ms: Annotated[
        int,
        msgspec.Meta(
            ge=0,
            description="how long a TokenReview verdict is reused for the same token (never past its "
            "expiry; 0 = ask the API server on every pod-bound call); also how long a deleted pod's "
            "token may still be accepted",
        ),
    ] = 30_000
    agent_token_reviews_per_s: Annotated[
        float,
        msgspec.Meta(
            ge=0,
            description="TokenReviews one caller (certificate identity at its IP address) may cause per "
            "second, with 10 s of burst; more fresh tokens get RESOURCE_EXHAUSTED (0 = no limit)",
        ),
    ] = 1.0
    agent_token_reviews_total_per_s: Annotated[
        float,
        msgspec.Meta(
            ge=0,
            description="TokenReviews all callers together may cause per second, with 10 s of burst: what "
            "the controller asks of the API server at most (0 = no limit)",
        ),
    ] = 200.0
    kube_api_url: Annotated[
        str,
        msgspec.Meta(
            description="https://host:port of the Kubernetes API server for TokenReviews "
            "(agent_pod_proof=token); empty = in-cluster (KUBERNETES_SERVICE_HOST/PORT)"
        ),
    ] = ""
    kube_api_token_file: Annotated[
        str,
        msgspec.Meta(
            description="the controller's own ServiceAccount token, sent with each TokenReview (re-read "
            "when it changes); its ServiceAccount needs create on tokenreviews.authentication.k8s.io"
        ),
    ] = "/var/run/secrets/kubernetes.io/serviceaccount/token"
    kube_api_ca_file: Annotated[
        str, msgspec.Meta(description="CA bundle the Kubernetes API server's certificate chains to")
    ] = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
    kube_api_timeout_ms: Annotated[
        int, msgspec.Meta(ge=1, description="deadline of one TokenReview call to the Kubernetes API (ms)")
    ] = 2_000

    @property
    def publish_streams_cap(self) -> int:
        """The effective ``max_publish_streams`` (0 resolved to ``grpc_workers`` minus an eighth)."""
        return self.max_publish_streams or max(1, self.grpc_workers - max(1, self.grpc_workers // 8))

    @property
    def publish_streams_per_caller(self) -> int:
        """The effective ``publish_streams_per_identity`` (0 resolved to 16, within the total)."""
        return self.publish_streams_per_identity or min(16, self.publish_streams_cap)

    @property
    def identity_entry_cap(self) -> int:
        """The effective ``max_entries_per_identity`` (0 resolved to half the total cap)."""
        return self.max_entries_per_identity or max(1, self.max_index_entries // 2)

    def __post_init__(self) -> None:
        if self.index_backend not in ("memory", "redis"):
            raise ValueError(f"index_backend={self.index_backend!r}: expected 'memory' or 'redis'")
        if self.index_backend == "redis" and not self.redis_url:
            raise ValueError("redis_url='': expected a redis:// URL when index_backend='redis'")
        if self.redis_cluster and self.index_backend != "redis":
            raise ValueError(
                f"redis_cluster=true with index_backend={self.index_backend!r}: "
                "expected index_backend='redis'"
            )
        host, sep, port = self.listen.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"listen={self.listen!r}: expected host:port, e.g. 0.0.0.0:50061")
        taken = {"listen": int(port), "health_port": self.health_port}
        for other, value in taken.items():
            if self.lookup_port and value == self.lookup_port:
                raise ValueError(
                    f"lookup_port={self.lookup_port}: the same port as {other} ({value}); expected "
                    "another port (or 0: no lookup listener)"
                )
        self.check_tls()
        check_plaintext_listen(
            "listen", self.listen, host, tls=self.tls is not None, insecure=self.insecure_plaintext_on_network
        )
        self._check_pod_proof()
        self._check_stream_limits()

    def _check_stream_limits(self) -> None:
        cap = self.publish_streams_cap
        if cap >= self.grpc_workers:
            auto = f" (resolved to {cap})" if not self.max_publish_streams else ""
            raise ValueError(
                f"max_publish_streams={self.max_publish_streams}{auto} >= grpc_workers={self.grpc_workers}: "
                "expected fewer, so open PublishEvents streams cannot hold every thread (routers' queries, "
                "heartbeats and registrations need one); raise grpc_workers or lower max_publish_streams"
            )
        if self.publish_streams_per_caller > cap:
            raise ValueError(
                f"publish_streams_per_identity={self.publish_streams_per_identity} > max_publish_streams="
                f"{cap}{' (grpc_workers minus an eighth)' if not self.max_publish_streams else ''}: expected "
                "at most that, so one caller cannot hold every stream thread; lower it or raise grpc_workers"
            )

    def _check_pod_proof(self) -> None:
        if self.agent_pod_proof not in ("token", "certificate", "unverified"):
            raise ValueError(
                f"agent_pod_proof={self.agent_pod_proof!r}: expected 'token', 'certificate' or 'unverified'"
            )
        if self.agent_pod_proof != "unverified" and self.tls is None:
            raise ValueError(
                f"agent_pod_proof={self.agent_pod_proof!r} needs mTLS (tls_cert_file, tls_key_file and "
                "tls_ca_file): a pod is proven together with the caller's agent certificate, and without "
                "TLS nobody is authenticated; expected the TLS files, or agent_pod_proof='unverified'"
            )
        if self.kube_api_url and not self.kube_api_url.startswith("https://"):
            raise ValueError(
                f"kube_api_url={self.kube_api_url!r}: expected https://host:port (the Kubernetes API "
                "server), or empty for the in-cluster address"
            )
