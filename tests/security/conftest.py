"""Fixtures of the mTLS/authorization tests: one CA (and a foreign one), certificate directories per
identity, a real controller serving with mTLS, and channels that present a given identity."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvgrid.api.v1 import controller_pb2_grpc
from kvgrid.common.tls import AGENT_SERVER_NAME, CONTROLLER_SERVER_NAME
from kvgrid.controller.config import ControllerConfig
from kvgrid.controller.service import Server, serve
from tests.security.pki import TestCA, spiffe


class Pki:
    """Certificate directories (``tls.crt``, ``tls.key``, ``ca.crt``) by name, made on first use."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ca = TestCA()
        self.foreign = TestCA("someone else's CA")
        self._dirs: dict[str, Path] = {}

    def _make(self, name: str, *uris: str, dns: tuple[str, ...] = (), ca: TestCA | None = None) -> Path:
        if name not in self._dirs:
            self._dirs[name] = (ca or self.ca).write(self.root / name, *uris, dns=dns)
        return self._dirs[name]

    def controller(self) -> Path:
        return self._make("controller", spiffe("controller"), dns=(CONTROLLER_SERVER_NAME,))

    def agent(self, pod: str = "") -> Path:
        """An agent certificate: per-pod when ``pod`` is given, else the shared one."""
        return self._make(f"agent-{pod or 'shared'}", spiffe("agent", pod), dns=(AGENT_SERVER_NAME,))

    def router(self) -> Path:
        return self._make("router", spiffe("router"))

    def foreign_agent(self) -> Path:
        """An agent identity signed by another CA."""
        return self._make("foreign-agent", spiffe("agent"), dns=(AGENT_SERVER_NAME,), ca=self.foreign)

    def other_domain(self) -> Path:
        """A router identity of another trust domain, signed by our CA."""
        return self._make("other-domain", spiffe("router", trust_domain="evil.example"))

    def no_identity(self) -> Path:
        """A CA-signed certificate without any kvgrid URI SAN."""
        return self._make("no-identity", "https://example.com/whoever")

    def in_namespace(self, ns: str, role: str, pod: str = "", *, dns_form: bool = False) -> Path:
        """A ``role`` identity of Kubernetes namespace ``ns``, signed by our CA (a shared issuer): a URI
        SAN (per-pod with ``pod``), or with ``dns_form`` the DNS SAN the chart's own CA writes. Serving
        roles also carry their server name."""
        server = {"agent": (AGENT_SERVER_NAME,), "controller": (CONTROLLER_SERVER_NAME,)}.get(role, ())
        name = f"ns-{ns}-{role}-{pod or 'shared'}{'-dns' if dns_form else ''}"
        if dns_form:
            return self._make(name, dns=(f"{role}.{ns}.kvgrid-id.cluster.local", *server))
        return self._make(name, spiffe(role, pod, ns=ns), dns=server)


def read(directory: Path) -> tuple[bytes, bytes, bytes]:
    return tuple((directory / n).read_bytes() for n in ("tls.crt", "tls.key", "ca.crt"))  # type: ignore[return-value]


def tls_flags(directory: Path) -> dict[str, Any]:
    return {
        "tls_cert_file": str(directory / "tls.crt"),
        "tls_key_file": str(directory / "tls.key"),
        "tls_ca_file": str(directory / "ca.crt"),
    }


def channel_as(address: str, who: Path | None, server_name: str, *, ca: bytes | None = None) -> grpc.Channel:
    """A channel to ``address`` presenting the certificate in ``who`` (None: no client certificate;
    the server is still verified against ``ca`` or our CA)."""
    opts = [("grpc.ssl_target_name_override", server_name)]
    if who is None:
        assert ca is not None
        return grpc.secure_channel(address, grpc.ssl_channel_credentials(ca), options=opts)
    cert, key, own_ca = read(who)
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(ca or own_ca, key, cert), options=opts)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_controller(pki: Pki) -> Iterator[Server]:
    """A real controller (embedded index) serving ControllerService with mTLS on loopback."""
    server = serve(ControllerConfig(listen="127.0.0.1:0", lease_ttl_ms=60_000, **tls_flags(pki.controller())))
    yield server
    server.stop()


@pytest.fixture
def controller_as(
    tls_controller: Server, pki: Pki
) -> Iterator[Callable[[Path | None], controller_pb2_grpc.ControllerServiceStub]]:
    """``controller_as(cert_dir)``: a stub on a new mTLS channel presenting that identity."""
    channels: list[grpc.Channel] = []

    def make(who: Path | None) -> controller_pb2_grpc.ControllerServiceStub:
        ch = channel_as(tls_controller.address, who, CONTROLLER_SERVER_NAME, ca=pki.ca.pem)
        channels.append(ch)
        return controller_pb2_grpc.ControllerServiceStub(ch)

    yield make
    for ch in channels:
        ch.close()


class SnapshotAgent:
    """The snapshot side of an agent, serving AgentService.Snapshot over mTLS with the certificate in
    ``who`` (what the controller pulls after a registration); ``keys`` is its L1 truth."""

    def __init__(self, who: Path, pod_uid: str, epoch: int, keys: list[bytes], namespace_id: str) -> None:
        from concurrent import futures

        from kvgrid.api.v1 import agent_pb2, agent_pb2_grpc, common_pb2
        from kvgrid.common.tls import TlsFiles, server_credentials

        outer = self

        class _Snap(agent_pb2_grpc.AgentServiceServicer):
            def Snapshot(self, request: object, context: object) -> agent_pb2.SnapshotResponse:
                outer.pulls += 1
                return agent_pb2.SnapshotResponse(
                    pod=outer.pod,
                    chunk_keys=keys,
                    last_sequence=0,
                    namespaces=[namespace_id],
                    by_namespace=[agent_pb2.NamespaceChunkKeys(namespace=namespace_id, chunk_keys=keys)],
                )

        self.pulls = 0
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        agent_pb2_grpc.add_AgentServiceServicer_to_server(_Snap(), self.server)  # type: ignore[abstract]
        files = TlsFiles(str(who / "tls.crt"), str(who / "tls.key"), str(who / "ca.crt"))
        port = self.server.add_secure_port("127.0.0.1:0", server_credentials(files))
        self.server.start()
        self.pod = common_pb2.PodIdentity(pod_uid=pod_uid, epoch=epoch, agent_address=f"127.0.0.1:{port}")

    def stop(self) -> None:
        self.server.stop(0).wait()


NS_ID = "0123456789abcdef0123456789abcdef"
"""The tenant namespace id the security tests store and publish chunks under."""


def publish_admit(stub: Any, pod_uid: str, keys: list[bytes], epoch: int = 1) -> list[Any]:
    """One PublishEvents stream of one L1 admit of ``keys`` by ``pod_uid``; the replies."""
    from kvgrid.api.v1 import common_pb2, controller_pb2

    req = controller_pb2.PublishEventsRequest(
        pod=common_pb2.PodIdentity(pod_uid=pod_uid, epoch=epoch),
        events=[
            controller_pb2.ChunkEvent(
                sequence=1, kind=controller_pb2.EVENT_KIND_ADMIT, tier=common_pb2.TIER_L1,
                chunk_keys=keys, namespace=NS_ID,
            )
        ],
    )  # fmt: skip
    return list(stub.PublishEvents(iter([req]), timeout=5))


def put_chunks(server: Any, keys: list[bytes], nbytes: int = 4096) -> None:
    """Store ``keys`` (known bytes) straight into an agent server's L1, under :data:`NS_ID`."""
    import torch

    assert server.core is not None
    res = server.core.cache.reserve_store(keys, namespace_id=NS_ID, layout_id="L", nbytes=nbytes)
    for _, chunk in res.new_chunks:
        chunk.buffer.copy_(torch.arange(nbytes, dtype=torch.int32).to(torch.uint8))
    server.core.cache.commit(res)
