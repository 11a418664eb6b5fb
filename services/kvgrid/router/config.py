"""Configuration of ``kvgrid router`` (defaults < ``--config`` YAML < ``KVGRID_ROUTER_*`` env < flags).

The key-namespace fields must describe the engines exactly as their KVGridConnector does
(``kvgrid.connector.config``): the model name, the chunk size and the KV identity of rank 0 (dtype,
layout, parallel sizes, extra text). A difference changes every chunk key, so Score finds nothing
and routing silently degrades to "no prefix anywhere"; docs/router.md says how to check.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from kvgrid.common.hashing import KeyNamespace
from kvgrid.common.tls import CONTROLLER_SERVER_NAME
from kvgrid.connector.chunk_policy import kv_identity

__all__ = ["ENV_PREFIX", "RouterConfig"]

ENV_PREFIX = "KVGRID_ROUTER_"


def _d(text: str) -> msgspec.Meta:
    return msgspec.Meta(description=text)


class RouterConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    host: Annotated[
        str,
        _d(
            "HTTP listen address: 127.0.0.1 serves this host only (as kvgrid's other services by "
            "default); 0.0.0.0 serves the network (in a Deployment, behind its Service)"
        ),
    ] = "127.0.0.1"
    port: Annotated[int, _d("HTTP listen port (0 = any free port)"), msgspec.Meta(ge=0, le=65535)] = 8080
    controller: Annotated[str, _d("kvgrid controller host:port (gRPC)")] = "127.0.0.1:50061"
    lookup_address: Annotated[
        str,
        _d(
            "host:port of the controller's lean lookup listener (its lookup_port): Score and ListAgents "
            "go there instead of gRPC (same answers, less per-call cost), with the same tls_* files and "
            "tls_server_name; empty = over gRPC to controller"
        ),
    ] = ""
    tls_cert_file: Annotated[
        str,
        _d(
            "PEM client certificate with a router identity; all three tls_* files for mTLS, "
            "none for plaintext"
        ),
    ] = ""
    tls_key_file: Annotated[str, _d("PEM private key of tls_cert_file")] = ""
    tls_ca_file: Annotated[str, _d("PEM CA bundle that signs the controller's certificate")] = ""
    tls_server_name: Annotated[str, _d("name the controller's certificate must carry")] = (
        CONTROLLER_SERVER_NAME
    )
    score_timeout_s: Annotated[
        float,
        _d("deadline of each Score/ListAgents call (s); past it the request is routed least-loaded"),
        msgspec.Meta(gt=0),
    ] = 0.5
    controller_retry_s: Annotated[
        float,
        _d("after a controller error, requests are routed least-loaded without asking it for this long (s)"),
        msgspec.Meta(ge=0),
    ] = 1.0
    reserve: Annotated[
        bool, _d("ask Score to record a speculative entry for the chosen pod (helps bursts of one prefix)")
    ] = True
    agents_refresh_s: Annotated[
        float,
        _d("how often the pod list is refreshed from the controller's ListAgents (s)"),
        msgspec.Meta(gt=0),
    ] = 5.0
    engine_urls: Annotated[
        dict[str, str],
        _d(
            "pod UID or pod name -> vLLM base URL, e.g. {pod-a: 'http://10.0.0.5:8000'}; these pods are "
            "also routable while the controller is down. Other pods: http://<agent host>:engine_port"
        ),
    ] = msgspec.field(default_factory=dict)
    engine_port: Annotated[
        int,
        _d("vLLM HTTP port on pods without an engine_urls entry (the agent is a sidecar: same pod IP)"),
        msgspec.Meta(ge=1, le=65535),
    ] = 8000
    connect_timeout_s: Annotated[
        float, _d("TCP connect deadline to a vLLM pod (s); past it the next pod is tried"), msgspec.Meta(gt=0)
    ] = 3.0
    max_attempts: Annotated[
        int, _d("pods tried per request (the chosen one, then the next best)"), msgspec.Meta(ge=1)
    ] = 3
    model_name: Annotated[
        str,
        _d(
            "model in the key namespace: the connector's model_name (default vLLM's --model); "
            "empty = the request's 'model' field"
        ),
    ] = ""
    chunk_size: Annotated[int, _d("tokens per chunk: the connector's chunk_size"), msgspec.Meta(ge=1)] = 256
    kv_dtype: Annotated[str, _d("KV cache dtype of the engines (vLLM's cache dtype, or the model dtype)")] = (
        "bfloat16"
    )
    kv_layout: Annotated[
        str,
        _d(
            "KV cache layout of the engines: the name vLLM logs at start ('Using LBHNC KV cache "
            "layout'); empty = none logged (auto)"
        ),
    ] = ""
    tensor_parallel_size: Annotated[int, _d("engines' --tensor-parallel-size"), msgspec.Meta(ge=1)] = 1
    pipeline_parallel_size: Annotated[int, _d("engines' --pipeline-parallel-size"), msgspec.Meta(ge=1)] = 1
    kv_identity_extra: Annotated[str, _d("the connector's kv_identity (extra text)")] = ""

    def __post_init__(self) -> None:
        if self.lookup_address:
            host, sep, port = self.lookup_address.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
                raise ValueError(
                    f"lookup_address={self.lookup_address!r}: expected host:port of the controller's "
                    "lookup listener, e.g. kvgrid-controller.llm:50062 (or empty: gRPC to controller)"
                )

    def namespace(self, model: str) -> KeyNamespace:
        """Rank 0's key namespace for ``model`` (used when ``model_name`` is empty); salt and LoRA
        are set per request."""
        world = self.tensor_parallel_size * self.pipeline_parallel_size
        return KeyNamespace(
            model=self.model_name or model,
            tokens_per_chunk=self.chunk_size,
            kv_identity=kv_identity(
                dtype=self.kv_dtype,
                layout=self.kv_layout,
                rank=0,
                world_size=world,
                tp_size=self.tensor_parallel_size,
                pp_size=self.pipeline_parallel_size,
                extra=self.kv_identity_extra,
            ),
        )
