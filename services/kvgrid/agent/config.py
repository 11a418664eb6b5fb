"""Configuration of the per-GPU agent (``kvgrid agent``): defaults < YAML < ``KVGRID_*`` env < flags."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from kvgrid.common.authz import parse_chunk_readers
from kvgrid.common.config import ByteSize, GiB, check_choices
from kvgrid.common.rpc import check_plaintext_listen
from kvgrid.common.tls import TlsFiles, TlsSettings

__all__ = ["AgentConfig", "EvictionPolicyName", "LogLevel", "PromotionMode", "Switch"]

Switch = Literal["auto", "on", "off"]
"""A feature that is on, off, or decided from the environment (auto)."""
EvictionPolicyName = Literal["lru", "fifo"]
"""The names of ``kvgrid.agent.eviction.POLICIES``."""
LogLevel = Literal["debug", "info", "warning", "error"]
PromotionMode = Literal["async", "sync"]
"""How a lookup brings lower-tier chunks into L1 (``kvgrid.agent.promotion``)."""


def _d(text: str) -> msgspec.Meta:
    return msgspec.Meta(description=text)


class AgentConfig(TlsSettings, frozen=True, kw_only=True):
    """Everything ``kvgrid agent`` can be told; each description is its ``--help`` line."""

    uds_path: Annotated[
        str,
        _d(
            "Unix socket the engine (vLLM connector) talks to; put it in a volume shared with the "
            "engine container. Empty disables the socket"
        ),
    ] = "/run/kvgrid/agent.sock"
    tcp_host: Annotated[
        str,
        _d(
            "Address the TCP AgentService and the peer data plane listen on (peers, controller snapshot "
            "pulls); empty = 0.0.0.0 with TLS (or insecure_plaintext_on_network), else 127.0.0.1. "
            "Without TLS a non-loopback address is refused unless insecure_plaintext_on_network is set"
        ),
    ] = ""
    tcp_port: Annotated[
        int, _d("TCP port of the AgentService; 0 picks a free port, -1 disables TCP"), msgspec.Meta(ge=-1)
    ] = 50062
    insecure_plaintext_on_network: Annotated[
        bool,
        _d(
            "INSECURE: without TLS, listen on the network anyway (tcp_host empty = 0.0.0.0): anyone who "
            "reaches the TCP port lists every cached chunk key (Snapshot) and reads KV (FetchChunks). "
            "Only for isolated networks; configure tls_cert_file, tls_key_file and tls_ca_file instead"
        ),
    ] = False
    advertise_address: Annotated[
        str,
        _d(
            "host:port peers and the controller use to reach this agent (sent with events); empty = "
            "POD_IP env (or the host name) with the TCP port"
        ),
    ] = ""
    hot_path: Annotated[
        bool,
        _d(
            "Also serve the engine's per-request calls (Lookup, Retrieve, Store, Release) on "
            "{uds_path}.hot, a plain Unix socket framing the same messages: ~20 us a call instead "
            "of gRPC's ~0.7 ms (connectors use it when it is there)"
        ),
    ] = True
    hot_path_spin_us: Annotated[
        int,
        _d(
            "After each hot-path call, poll that connection this long for the engine's next call "
            "before sleeping: a call within it finds the agent awake (measured: an engine's calls 1 ms "
            "apart cost half as much on the 2-core VM) at the price of a busy core meanwhile; at most "
            "one connection polls at a time. 0: sleep at once"
        ),
        msgspec.Meta(ge=0, le=1_000_000),
    ] = 0
    l1_size: Annotated[
        ByteSize,
        _d(
            "Size of the L1 chunk pool, allocated once at start (pinned host memory when a GPU is "
            "present); e.g. 64GiB"
        ),
    ] = 4 * GiB
    l1_page_size: Annotated[
        ByteSize,
        _d("Allocation unit and alignment of L1 chunks (a power of two); a chunk takes whole pages"),
    ] = 64 * 1024
    l1_pin_memory: Annotated[
        Switch, _d("Page-lock the L1 pool: auto (when CUDA is available), on, or off")
    ] = "auto"
    l1_shared_dir: Annotated[
        str,
        _d(
            "Put the L1 pool in a file in this directory (e.g. /dev/shm, shared with the engine's "
            "container) so engines map it and run the transfer kernels in their own CUDA context "
            "(connector option engine_copies); every engine registered here can then read all of L1. "
            "Empty = a private pool, the agent copies"
        ),
    ] = ""
    eviction_policy: Annotated[
        EvictionPolicyName, _d("Which unreferenced chunks go first when L1 fills: lru or fifo")
    ] = "lru"
    high_watermark: Annotated[
        float,
        _d("L1 usage fraction that triggers eviction before a store allocates"),
        msgspec.Meta(gt=0, le=1),
    ] = 0.95
    low_watermark: Annotated[
        float, _d("L1 usage fraction eviction brings the pool back down to"), msgspec.Meta(gt=0, le=1)
    ] = 0.85
    pin_ttl_ms: Annotated[
        int,
        _d("How long a Lookup pins the chunks it found when the request does not say (ms)"),
        msgspec.Meta(gt=0),
    ] = 30_000
    pin_ttl_max_ms: Annotated[
        int,
        _d(
            "Longest pin a Lookup may ask for (ms); a larger pin_ttl_ms is clamped to it, so no client "
            "can hold L1 pinned for long"
        ),
        msgspec.Meta(gt=0),
    ] = 60_000
    tokens_per_chunk: Annotated[
        int,
        _d(
            "Default chunk size in tokens when a registration's key namespace does not set one; a "
            "multiple of every group's tokens_per_block"
        ),
        msgspec.Meta(gt=0),
    ] = 256
    shm_allowed_dirs: Annotated[
        list[str],
        _d("Directories CPU (shared-memory) KV tensor files may be registered from, comma-separated"),
    ] = msgspec.field(default_factory=lambda: ["/dev/shm"])
    reaper_interval_ms: Annotated[
        int,
        _d("How often the agent checks that registered engine processes still live and expires pins (ms)"),
        msgspec.Meta(gt=0),
    ] = 1000
    grpc_workers: Annotated[
        int, _d("Threads serving gRPC requests on the engine's Unix socket"), msgspec.Meta(gt=0)
    ] = 16
    tcp_grpc_workers: Annotated[
        int,
        _d(
            "Threads serving gRPC requests on the TCP port (peers, the controller): a pool of its own, "
            "so peer streams cannot starve the engine's Unix socket"
        ),
        msgspec.Meta(gt=0),
    ] = 16
    max_message_bytes: Annotated[
        ByteSize, _d("Largest gRPC message accepted or sent (chunk-key lists of long prompts)")
    ] = 64 * 1024 * 1024
    controller_address: Annotated[
        str,
        _d("host:port of the kvgrid controller to stream admit/evict events to; empty = no events"),
    ] = ""
    controller_token_file: Annotated[
        str,
        _d(
            "ServiceAccount token of this agent's pod (a projected volume, audience kvgrid), sent as "
            "'authorization: Bearer' on every call to the controller and re-read when the kubelet "
            "rotates it; the controller's agent_pod_proof=token requires it with a shared agent "
            "certificate (docs/security.md). Needs mTLS: it goes only to servers proving the controller "
            "certificate name. Empty = none"
        ),
    ] = ""
    event_flush_interval_ms: Annotated[
        int, _d("Longest time an event waits before it is sent to the controller (ms)"), msgspec.Meta(gt=0)
    ] = 100
    event_buffer_size: Annotated[
        int,
        _d(
            "Events kept until the controller acknowledges them; when more pile up the oldest go and "
            "the controller resyncs from a snapshot"
        ),
        msgspec.Meta(gt=0),
    ] = 100_000
    heartbeat_interval_ms: Annotated[
        int, _d("How often the agent renews its lease with the controller (ms)"), msgspec.Meta(gt=0)
    ] = 2000
    reconnect_initial_backoff_ms: Annotated[
        int,
        _d("First wait before reconnecting to the controller (ms); doubles per failure"),
        msgspec.Meta(gt=0),
    ] = 200
    reconnect_max_backoff_ms: Annotated[
        int, _d("Longest wait between reconnect attempts (ms)"), msgspec.Meta(gt=0)
    ] = 10_000
    peer_fetch: Annotated[
        Switch,
        _d(
            "Fetch missing leading chunks from other agents' L1 during Lookup (asks the controller who "
            "holds them): auto (on when --controller-address is set), on, or off"
        ),
    ] = "auto"
    peer_fetch_mode: Annotated[
        PromotionMode,
        _d(
            "How a lookup brings chunks from a peer: async (answer once the peer said how many it sends; "
            "they arrive in the background and a retrieve waits for each) or sync (receive them inside "
            "the lookup)"
        ),
    ] = "async"
    peer_fetch_max_chunks: Annotated[
        int, _d("Most chunks one Lookup fetches from a peer (and one FetchChunks serves)"), msgspec.Meta(gt=0)
    ] = 64
    peer_fetch_timeout_ms: Annotated[
        int,
        _d(
            "Deadline of one Lookup's peer fetch, controller query included (ms); chunks complete by then "
            "are kept, the rest is a miss"
        ),
        msgspec.Meta(gt=0),
    ] = 2000
    peer_fetch_part_size: Annotated[
        ByteSize,
        _d(
            "Largest piece of a chunk per FetchChunks message (capped by --max-message-bytes); about 1MiB "
            "streams fastest through gRPC"
        ),
    ] = 1024 * 1024
    peer_fetch_max_peers: Annotated[
        int,
        _d("Peers one Lookup tries, best first, when a peer fails before sending anything"),
        msgspec.Meta(gt=0),
    ] = 2
    peer_data_plane: Annotated[
        Literal["socket", "grpc"],
        _d(
            "How peer fetch moves chunk bytes: socket (a TCP data port, bytes straight into L1, one-time "
            "tickets issued over the mTLS FetchChunks call, TLS when TLS is configured) or grpc (inside "
            "the FetchChunks stream); each side falls back to grpc when the other has it off"
        ),
    ] = "socket"
    peer_data_port: Annotated[
        int,
        _d("TCP port of the peer data plane (on --tcp-host); 0 picks a free port (sent with each ticket)"),
        msgspec.Meta(ge=0, le=65535),
    ] = 0
    peer_data_streams: Annotated[
        int,
        _d("TCP connections one peer fetch opens to the peer's data port (chunks round-robin over them)"),
        msgspec.Meta(ge=1, le=16),
    ] = 4
    peer_data_security: Annotated[
        Literal["mac", "aead", "tls"],
        _d(
            "With mTLS, how the peer data plane protects chunk bytes: mac (plaintext TCP; every chunk "
            "carries a keyed BLAKE3 MAC under a fresh key per ticket, handed out by the mTLS FetchChunks "
            "call: a changed, swapped or replayed chunk is refused, but the bytes are readable on the "
            "network), aead (AES-256-GCM under a per-ticket key: integrity and confidentiality) or tls "
            "(mutual TLS connections: the slowest). A fetcher asks for its mode and refuses a weaker one; "
            "a server serves the mode asked for, or its own when that is stronger (mac < aead, tls). "
            "Without TLS the data plane is plaintext with checksums whatever this says"
        ),
    ] = "mac"
    peer_directory_ttl_ms: Annotated[
        int,
        _d("How long the controller's agent list (pod -> peer address) is reused before asking again (ms)"),
        msgspec.Meta(gt=0),
    ] = 5000
    chunk_readers: Annotated[
        list[str],
        _d(
            "With mTLS: namespaces of other tenants whose identities may read this agent's chunks "
            "(FetchChunks, the data plane, Snapshot), comma-separated: <namespace> (every namespace id), "
            "<namespace>/<namespace-id> (that one) or * (any namespace). Identities of this agent's own "
            "namespace (its certificate's) always may; others get PERMISSION_DENIED (docs/security.md)"
        ),
    ] = msgspec.field(default_factory=list)
    peer_stream_timeout_ms: Annotated[
        int,
        _d(
            "Longest a FetchChunks stream is served (ms), whatever deadline its caller set: a stream "
            "still open then is ended (DEADLINE_EXCEEDED, or cancelled when its reader stopped reading), "
            "so unread streams give their thread and chunk references back"
        ),
        msgspec.Meta(gt=0),
    ] = 10_000
    peer_streams_per_identity: Annotated[
        int,
        _d(
            "Most FetchChunks streams one caller may have open at once on the TCP port (its certificate "
            "identity; without TLS its IP address); one more is RESOURCE_EXHAUSTED. Below "
            "tcp_grpc_workers, so one caller never holds every TCP thread"
        ),
        msgspec.Meta(gt=0),
    ] = 8
    peer_data_handshake_timeout_ms: Annotated[
        int,
        _d(
            "A connection to the peer data port must finish its TLS handshake and present a live ticket "
            "within this (ms) of being accepted, else it is closed without a byte sent"
        ),
        msgspec.Meta(gt=0),
    ] = 5000
    peer_data_idle_timeout_ms: Annotated[
        int,
        _d(
            "An admitted data-plane connection whose reader takes none of the next MiB this long (ms) is "
            "closed, giving its thread and chunk references back"
        ),
        msgspec.Meta(gt=0),
    ] = 10_000
    peer_data_max_unauthenticated: Annotated[
        int,
        _d(
            "Connections on the peer data port that have not presented a live ticket yet; one more "
            "closes the oldest of them, so idle or slow connections cannot lock real peers out"
        ),
        msgspec.Meta(ge=1, le=255),
    ] = 64
    peer_data_retry_initial_ms: Annotated[
        int,
        _d(
            "After a peer's data port could not be reached, fetches from that peer use gRPC this long "
            "(ms) before trying its data port again; doubles per consecutive failure"
        ),
        msgspec.Meta(gt=0),
    ] = 1000
    peer_data_retry_max_ms: Annotated[
        int, _d("Longest wait before retrying an unreachable peer data port (ms)"), msgspec.Meta(gt=0)
    ] = 30_000
    tier_disk_path: Annotated[
        str,
        _d(
            "Directory of the local-disk tier: chunks evicted from L1 are written there by a background "
            "writer and read back on a lookup hit; records an earlier run left there are indexed again at "
            "start (torn ones removed). Empty = no disk tier"
        ),
    ] = ""
    tier_disk_size: Annotated[
        ByteSize, _d("Capacity of the disk tier; its least recently used chunks go to the S3 tier (or away)")
    ] = 16 * GiB
    tier_promotion: Annotated[
        PromotionMode,
        _d(
            "How a lookup that hits chunks in a lower tier brings them into L1: async (answer at once, "
            "read them on a worker pool; a retrieve waits for them) or sync (read them inside the lookup)"
        ),
    ] = "async"
    tier_promotion_workers: Annotated[
        int,
        _d("Worker threads reading lower-tier chunks into L1 for lookups (one lookup's chunks per worker)"),
        msgspec.Meta(ge=1, le=64),
    ] = 2
    tier_s3_endpoint: Annotated[
        str,
        _d(
            "URL of an S3-compatible object store for the object-store tier, e.g. http://seaweedfs:8333 "
            "(below the disk tier, or below L1 without one). Empty = no object-store tier"
        ),
    ] = ""
    tier_s3_bucket: Annotated[str, _d("Bucket of the object-store tier (must exist)")] = ""
    tier_s3_prefix: Annotated[
        str, _d("Object name prefix; objects are <prefix>/<namespace id>/<chunk key hex>")
    ] = "kvgrid"
    tier_s3_region: Annotated[str, _d("Region of the object store; empty = the server's default")] = ""
    tier_s3_credentials_dir: Annotated[
        str,
        _d(
            "Directory with files access_key_id and secret_access_key (a mounted Kubernetes Secret); "
            "empty = the AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY env variables"
        ),
    ] = ""
    tier_s3_size: Annotated[
        ByteSize, _d("Bytes of objects this agent keeps in the object-store tier; least recently used go")
    ] = 256 * GiB
    tier_s3_part_size: Annotated[
        ByteSize, _d("Objects larger than this are uploaded in parts of this size (multipart; >= 5MiB)")
    ] = 16 * 1024 * 1024
    tier_s3_max_retries: Annotated[
        int,
        _d("Retries of an object-store request after a transport error, 5xx or throttling"),
        msgspec.Meta(ge=0, le=20),
    ] = 4
    tier_s3_retry_backoff_ms: Annotated[
        int,
        _d("First wait before an object-store retry (ms); doubles per retry, with jitter"),
        msgspec.Meta(gt=0),
    ] = 50
    prometheus_port: Annotated[
        int, _d("Port of the Prometheus /metrics endpoint; 0 disables it"), msgspec.Meta(ge=0)
    ] = 0
    otlp_endpoint: Annotated[
        str,
        _d("OTLP gRPC endpoint for metrics and traces; empty = OTEL_EXPORTER_OTLP_ENDPOINT or none"),
    ] = ""
    log_level: Annotated[LogLevel, _d("Logging level: debug, info, warning or error")] = "info"

    def __post_init__(self) -> None:
        check_choices(self)
        self.check_tls()
        if self.controller_token_file and super().tls is None:
            raise ValueError(
                f"controller_token_file={self.controller_token_file!r} needs mTLS (tls_cert_file, "
                "tls_key_file and tls_ca_file): the pod token is sent only over TLS, to a server proving "
                "the controller's certificate name; expected the TLS files too, or no token file"
            )
        if self.tcp_port >= 0:
            check_plaintext_listen(
                "tcp_host",
                self.tcp_host,
                self.listen_host,
                tls=self.tls is not None,
                insecure=self.insecure_plaintext_on_network,
            )
        if self.low_watermark > self.high_watermark:
            raise ValueError(
                f"low_watermark={self.low_watermark} > high_watermark={self.high_watermark}: "
                "expected low <= high"
            )
        ps = self.l1_page_size
        if ps <= 0 or ps & (ps - 1):
            raise ValueError(f"l1_page_size={ps}: expected a power of two")
        if self.l1_size < ps:
            raise ValueError(f"l1_size={self.l1_size}: expected at least one page ({ps} bytes)")
        if not self.uds_path and self.tcp_port < 0:
            raise ValueError("uds_path is empty and tcp_port=-1: expected at least one listener")
        if self.peer_fetch == "on" and not self.controller_address:
            raise ValueError(
                "peer_fetch='on' but controller_address is empty: peer fetch asks the controller who "
                "holds a chunk; set controller_address or peer_fetch=off"
            )
        if self.peer_fetch != "off" and self.pin_ttl_ms <= self.peer_fetch_timeout_ms:
            # Lookup pins its local hits before fetching the rest from a peer; a pin that lapses
            # mid-fetch lets eviction take them back.
            raise ValueError(
                f"pin_ttl_ms={self.pin_ttl_ms} <= peer_fetch_timeout_ms={self.peer_fetch_timeout_ms}: "
                "expected pins to outlive a peer fetch"
            )
        if self.pin_ttl_ms > self.pin_ttl_max_ms:
            raise ValueError(
                f"pin_ttl_ms={self.pin_ttl_ms} > pin_ttl_max_ms={self.pin_ttl_max_ms}: expected the default "
                "pin within the cap"
            )
        if self.peer_fetch_part_size < 1024:
            raise ValueError(f"peer_fetch_part_size={self.peer_fetch_part_size}: expected >= 1024 bytes")
        self._check_peer_limits()
        self._check_tiers()
        if self.reconnect_max_backoff_ms < self.reconnect_initial_backoff_ms:
            raise ValueError(
                f"reconnect_max_backoff_ms={self.reconnect_max_backoff_ms} < reconnect_initial_backoff_ms="
                f"{self.reconnect_initial_backoff_ms}: expected max >= initial"
            )

    def _check_peer_limits(self) -> None:
        parse_chunk_readers(self.chunk_readers)
        if self.peer_streams_per_identity >= self.tcp_grpc_workers:
            raise ValueError(
                f"peer_streams_per_identity={self.peer_streams_per_identity} >= tcp_grpc_workers="
                f"{self.tcp_grpc_workers}: expected fewer, so one caller's streams cannot hold every TCP "
                "thread (the controller's snapshot pulls and other peers need one)"
            )
        if self.peer_data_retry_max_ms < self.peer_data_retry_initial_ms:
            raise ValueError(
                f"peer_data_retry_max_ms={self.peer_data_retry_max_ms} < peer_data_retry_initial_ms="
                f"{self.peer_data_retry_initial_ms}: expected max >= initial"
            )

    def _check_tiers(self) -> None:
        if self.tier_disk_path and self.tier_disk_size < 64 * 1024:
            raise ValueError(
                f"tier_disk_size={self.tier_disk_size}: expected >= 64KiB when tier_disk_path is set"
            )
        if bool(self.tier_s3_endpoint) != bool(self.tier_s3_bucket):
            raise ValueError(
                f"tier_s3_endpoint={self.tier_s3_endpoint!r}, tier_s3_bucket={self.tier_s3_bucket!r}: "
                "expected both set (object-store tier on) or both empty (off)"
            )
        if self.tier_s3_endpoint:
            scheme, _, host = self.tier_s3_endpoint.partition("://")
            if scheme not in ("http", "https") or not host or "/" in host.rstrip("/"):
                raise ValueError(
                    f"tier_s3_endpoint={self.tier_s3_endpoint!r}: expected http://host:port or https://host:port"
                )
            if self.tier_s3_part_size < 5 * 1024 * 1024:
                raise ValueError(
                    f"tier_s3_part_size={self.tier_s3_part_size}: expected >= 5MiB (the S3 minimum part size)"
                )
            if self.tier_s3_size < 64 * 1024:
                raise ValueError(f"tier_s3_size={self.tier_s3_size}: expected >= 64KiB")

    @property
    def tls(self) -> TlsFiles | None:
        """The mTLS files (None when TLS is off), with ``controller_token_file`` for the calls to the
        controller (:func:`kvgrid.common.tls.make_channel` adds it to those only)."""
        files = super().tls
        if files is None or not self.controller_token_file:
            return files
        return msgspec.structs.replace(files, controller_token_file=self.controller_token_file)

    @property
    def peer_fetch_enabled(self) -> bool:
        return self.peer_fetch == "on" or (self.peer_fetch == "auto" and bool(self.controller_address))

    @property
    def pin_memory(self) -> bool | None:
        return {"auto": None, "on": True, "off": False}[self.l1_pin_memory]

    @property
    def listen_host(self) -> str:
        """The host the TCP listeners bind: tcp_host, or when empty 0.0.0.0 with TLS (or
        insecure_plaintext_on_network) and 127.0.0.1 without."""
        if self.tcp_host:
            return self.tcp_host
        return "0.0.0.0" if self.tls is not None or self.insecure_plaintext_on_network else "127.0.0.1"
