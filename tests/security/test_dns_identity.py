"""The DNS SAN identity form (``<role>.<namespace>.kvgrid-id.<trust-domain>``), the one Helm's
``genSignedCert`` can write, against a real controller serving with mTLS.

Every certificate here carries only DNS SANs (no URI SAN), signed by the test CA, so what is proven
comes from grpc's ``peer_dns`` auth property of a verified handshake. Accepted per role; refused
when outside the trust domain, a look-alike, incomplete or of an unknown role; a router DNS
identity cannot write; a URI identity wins over a DNS one on the same certificate.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from kvgrid.api.v1 import common_pb2, controller_pb2, controller_pb2_grpc
from kvgrid.common.authz import parse_dns_identity
from kvgrid.common.tls import AGENT_SERVER_NAME, CONTROLLER_SERVER_NAME
from kvgrid.controller.service import Server
from tests.security.conftest import Pki, channel_as
from tests.security.pki import NAMESPACE, spiffe

Stub = controller_pb2_grpc.ControllerServiceStub
NS_ID = "0123456789abcdef0123456789abcdef"


def dns_id(role: str, *, ns: str = NAMESPACE, trust_domain: str = "cluster.local") -> str:
    return f"{role}.{ns}.kvgrid-id.{trust_domain}"


def _dir(pki: Pki, name: str, *dns: str, uris: tuple[str, ...] = ()) -> Path:
    return pki.ca.write(pki.root / f"dns-{name}", *uris, dns=dns)


def _stub(server: Server, pki: Pki, who: Path) -> tuple[grpc.Channel, Stub]:
    ch = channel_as(server.address, who, CONTROLLER_SERVER_NAME, ca=pki.ca.pem)
    return ch, Stub(ch)


def _register(stub: Stub, pod_uid: str) -> controller_pb2.RegisterAgentResponse:
    req = controller_pb2.RegisterAgentRequest(
        pod=common_pb2.PodIdentity(pod_uid=pod_uid, epoch=1), namespaces=[NS_ID]
    )
    return stub.RegisterAgent(req, timeout=5)


def _stats(stub: Stub) -> controller_pb2.GetStatsResponse:
    return stub.GetStats(controller_pb2.GetStatsRequest(), timeout=5)


def _denied(fn: object) -> str:
    with pytest.raises(grpc.RpcError) as err:
        fn()  # type: ignore[operator]
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value.details()
    return err.value.details() or ""


def test_an_agent_dns_identity_registers_and_owns_its_pod(tls_controller: Server, pki: Pki) -> None:
    who = _dir(pki, "agent", dns_id("agent"), AGENT_SERVER_NAME)
    ch, stub = _stub(tls_controller, pki, who)
    with ch:
        assert _register(stub, "pod-dns-a").lease_ttl_ms > 0
    rec = tls_controller.controller.registry.get("pod-dns-a")
    assert rec is not None
    # Another identity (the URI one) cannot take the pod over: ownership is the DNS identity's.
    ch, uri_agent = _stub(tls_controller, pki, pki.agent())
    with ch:
        text = _denied(lambda: _register(uri_agent, "pod-dns-a"))
    assert dns_id("agent") in text


@pytest.mark.parametrize("role", ["controller", "router"])
def test_controller_and_router_dns_identities_read(tls_controller: Server, pki: Pki, role: str) -> None:
    ch, stub = _stub(tls_controller, pki, _dir(pki, role, dns_id(role)))
    with ch:
        assert _stats(stub).num_agents >= 0
        stub.ListAgents(controller_pb2.ListAgentsRequest(), timeout=5)


def test_a_router_dns_identity_cannot_write(tls_controller: Server, pki: Pki) -> None:
    ch, stub = _stub(tls_controller, pki, _dir(pki, "router", dns_id("router")))
    with ch:
        text = _denied(lambda: _register(stub, "pod-dns-router"))
        _denied(
            lambda: stub.Heartbeat(
                controller_pb2.HeartbeatRequest(pod_uid="pod-dns-router", epoch=1), timeout=5
            )
        )
    assert "needs a agent identity" in text and dns_id("router") in text
    assert tls_controller.controller.registry.get("pod-dns-router") is None


def test_a_dns_identity_of_another_trust_domain_is_refused(tls_controller: Server, pki: Pki) -> None:
    ch, stub = _stub(tls_controller, pki, _dir(pki, "evil", dns_id("agent", trust_domain="evil.example")))
    with ch:
        text = _denied(lambda: _register(stub, "pod-dns-evil"))
    assert "outside trust domain 'cluster.local'" in text and "evil.example" in text


LOOK_ALIKES = [
    "agent.x.kvgrid-id.cluster.local.evil.com",  # a suffix makes it another trust domain
    "agent.kvgrid-id.cluster.local",  # no namespace
    "agent..kvgrid-id.cluster.local",  # empty namespace
    "agent.x.kvgrid-id",  # no trust domain
    "agent.x.kvgrid-id.cluster..local",  # empty label in the trust domain
    "admin.x.kvgrid-id.cluster.local",  # unknown role
    "agent.x.y.kvgrid-id.cluster.local",  # an extra label: the marker is not third
    "evil.agent.x.kvgrid-id.cluster.local",
    "agent.x.kvgrid-ids.cluster.local",
]


@pytest.mark.parametrize("name", LOOK_ALIKES)
def test_look_alike_dns_names_are_no_identity_in_our_domain(
    tls_controller: Server, pki: Pki, name: str
) -> None:
    ident = parse_dns_identity(name)
    assert ident is None or ident.trust_domain != "cluster.local", ident
    ch, stub = _stub(tls_controller, pki, _dir(pki, f"lookalike-{LOOK_ALIKES.index(name)}", name))
    with ch:
        text = _denied(lambda: _register(stub, "pod-lookalike"))
    assert "outside trust domain" in text or "no kvgrid identity" in text
    assert tls_controller.controller.registry.get("pod-lookalike") is None


def test_the_refusal_names_both_accepted_forms(tls_controller: Server, pki: Pki) -> None:
    ch, stub = _stub(tls_controller, pki, _dir(pki, "plain", "example.com"))
    with ch:
        text = _denied(lambda: _stats(stub))
    assert "example.com" in text  # what the certificate had
    assert "spiffe://cluster.local/ns/<namespace>/role/<agent|controller|router>" in text
    assert "<agent|controller|router>.<namespace>.kvgrid-id.cluster.local" in text


def test_a_uri_identity_wins_over_a_dns_one(tls_controller: Server, pki: Pki) -> None:
    """A router URI beside an agent DNS name is a router: the DNS name grants nothing extra."""
    who = _dir(pki, "both", dns_id("agent"), uris=(spiffe("router"),))
    ch, stub = _stub(tls_controller, pki, who)
    with ch:
        assert _stats(stub).num_agents >= 0
        text = _denied(lambda: _register(stub, "pod-both"))
    assert spiffe("router") in text


def test_the_common_name_is_not_an_identity(tls_controller: Server, pki: Pki) -> None:
    """Only SANs count: a subject CN spelling the DNS form proves nothing (TestCA puts the first SAN
    in the CN, so a URI-less, DNS-less leaf is built here with the CN alone)."""
    import datetime as dt

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, dns_id("agent"))]))
        .issuer_name(pki.ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(pki.ca.key, hashes.SHA256())
    )
    d = pki.root / "cn-only"
    d.mkdir()
    (d / "tls.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (d / "tls.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    (d / "ca.crt").write_bytes(pki.ca.pem)
    ch, stub = _stub(tls_controller, pki, d)
    with ch:
        text = _denied(lambda: _register(stub, "pod-cn"))
    assert "no kvgrid identity" in text


def test_the_agent_port_authorizes_dns_identities(tmp_path: Path, pki: Pki) -> None:
    """An agent serving with a DNS-only certificate: a DNS agent fetches chunks, a DNS router may not,
    and only the DNS controller may pull its snapshot."""
    from kvgrid.api.v1 import agent_pb2, agent_pb2_grpc
    from tests.security.conftest import put_chunks as _put
    from tests.security.test_agent_listeners import _agent, _fetch

    server = _agent(tmp_path, _dir(pki, "agent-srv", dns_id("agent"), AGENT_SERVER_NAME))
    try:
        keys = [bytes([4]) * 16]
        _put(server, keys)
        address = f"127.0.0.1:{server.tcp_port}"

        def as_(who: Path) -> grpc.Channel:
            return channel_as(address, who, AGENT_SERVER_NAME, ca=pki.ca.pem)

        with as_(_dir(pki, "agent-peer", dns_id("agent"), AGENT_SERVER_NAME)) as ch:
            assert sum(len(p.data) for p in _fetch(ch, keys)) == 4096
            snap = agent_pb2_grpc.AgentServiceStub(ch)
            assert "needs a controller identity" in _denied(
                lambda: snap.Snapshot(agent_pb2.SnapshotRequest(), timeout=5)
            )
        with as_(_dir(pki, "router", dns_id("router"))) as ch:
            text = _denied(lambda: _fetch(ch, keys))
        assert "needs a agent identity" in text and dns_id("router") in text
        with as_(_dir(pki, "controller", dns_id("controller"))) as ch:
            resp = agent_pb2_grpc.AgentServiceStub(ch).Snapshot(agent_pb2.SnapshotRequest(), timeout=5)
        assert keys[0] in set(resp.chunk_keys)
    finally:
        server.stop(0)
