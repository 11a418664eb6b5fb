"""The chart's own CA (``tls.provider=helm``, what ``auto`` picks without cert-manager): what it
renders, and that the rendered Secrets work with the real services.

The certificates are the ones ``helm template`` generated (genCA / genSignedCert), read back from
the rendered Secrets, so a wrong SAN, usage or signature in the chart shows up as a refused handshake
or call. The end-to-end test runs a real controller and the engine pod's agent with the rendered
KVGRID_TLS_* env over mTLS (tests/deploy/test_tls.py's machinery): the agent registers, and the
router Secret reads (MatchPrefix) but cannot write (RegisterAgent).

Not covered here: ``lookup`` keeping the CA across upgrades needs a Kubernetes API server, which
cannot run here; without one, ``lookup`` returns nothing and every render makes a new CA.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from kvgrid.api.v1 import common_pb2, controller_pb2, controller_pb2_grpc
from kvgrid.common.tls import AGENT_SERVER_NAME, CONTROLLER_SERVER_NAME
from tests.deploy.chart import CHART, NAMESPACE, RELEASE, find, run, template, validate, values_args
from tests.deploy.test_tls import EXAMPLE, _channel, _run_rendered

HELM_CA: dict[str, Any] = {"tls": {"provider": "helm"}}
CA_SECRET = f"{RELEASE}-kvgrid-ca"
ROLES = ("controller", "router", "agent")


def _dns_id(role: str, trust_domain: str = "cluster.local") -> str:
    return f"{role}.{NAMESPACE}.kvgrid-id.{trust_domain}"


def _secret(docs: list[dict[str, Any]], name: str) -> dict[str, bytes]:
    doc = find(docs, "Secret", name)
    assert doc["type"] == "kubernetes.io/tls"
    return {k: base64.b64decode(v) for k, v in doc["data"].items()}


def _cert(pem: bytes) -> x509.Certificate:
    return x509.load_pem_x509_certificate(pem)


def _sans(cert: x509.Certificate) -> tuple[list[str], list[str]]:
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return san.get_values_for_type(x509.DNSName), san.get_values_for_type(x509.UniformResourceIdentifier)


def _write_secrets(docs: list[dict[str, Any]], root: Path) -> dict[str, Path]:
    """The role Secrets' files as the kubelet would mount them, by Secret name."""
    out: dict[str, Path] = {}
    for role in ROLES:
        name = f"{RELEASE}-kvgrid-{role}-tls"
        d = root / name
        d.mkdir(parents=True)
        for key, value in _secret(docs, name).items():
            (d / key).write_bytes(value)
        out[name] = d
    return out


@pytest.fixture(scope="module")
def helm_docs(helm: list[str], tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """auto on a cluster without cert-manager."""
    return template(helm, EXAMPLE, tmp_path_factory.mktemp("render"), crds=False)


def test_auto_without_cert_manager_renders_a_ca_and_role_secrets(helm_docs: list[dict[str, Any]]) -> None:
    assert not [d for d in helm_docs if d["kind"] in ("Certificate", "Issuer")]
    for doc in helm_docs:
        validate(doc)
    ca_files = _secret(helm_docs, CA_SECRET)
    assert set(ca_files) == {"tls.crt", "tls.key"}
    ca = _cert(ca_files["tls.crt"])
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for role in ROLES:
        files = _secret(helm_docs, f"{RELEASE}-kvgrid-{role}-tls")
        assert set(files) == {"tls.crt", "tls.key", "ca.crt"}
        assert files["ca.crt"] == ca_files["tls.crt"]
        leaf = _cert(files["tls.crt"])
        leaf.verify_directly_issued_by(ca)
        dns, uris = _sans(leaf)
        assert uris == []  # Helm writes none: the identity is the DNS form
        assert dns[0] == _dns_id(role)
        ekus = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert ExtendedKeyUsageOID.CLIENT_AUTH in ekus
    # The services verify these server names whatever address they dial (kvgrid.common.tls).
    assert (
        CONTROLLER_SERVER_NAME
        in _sans(_cert(_secret(helm_docs, f"{RELEASE}-kvgrid-controller-tls")["tls.crt"]))[0]
    )
    assert AGENT_SERVER_NAME in _sans(_cert(_secret(helm_docs, f"{RELEASE}-kvgrid-agent-tls")["tls.crt"]))[0]


_POD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet"}


def _pod_specs(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    specs = [d["spec"]["template"]["spec"] for d in docs if d["kind"] in _POD_KINDS]
    specs += [d["spec"] for d in docs if d["kind"] == "Pod"]
    specs += [d["spec"]["jobTemplate"]["spec"]["template"]["spec"] for d in docs if d["kind"] == "CronJob"]
    return specs


def _secrets_used(spec: dict[str, Any]) -> set[str]:
    names = set()
    for v in spec.get("volumes", []):
        if "secret" in v:
            names.add(v["secret"]["secretName"])
        for src in v.get("projected", {}).get("sources", []):
            if "secret" in src:
                names.add(src["secret"]["name"])
    for c in [*spec.get("initContainers", []), *spec.get("containers", [])]:
        for e in c.get("env", []):
            if "secretKeyRef" in e.get("valueFrom", {}):
                names.add(e["valueFrom"]["secretKeyRef"]["name"])
        names |= {f["secretRef"]["name"] for f in c.get("envFrom", []) if "secretRef" in f}
    return names


def test_the_ca_key_is_in_no_pod(helm_docs: list[dict[str, Any]]) -> None:
    specs = _pod_specs(helm_docs)
    used = set().union(*map(_secrets_used, specs))
    assert (
        len(specs) >= 2
        and f"{RELEASE}-kvgrid-controller-tls" in used
        and f"{RELEASE}-kvgrid-agent-tls" in used
    )
    assert CA_SECRET not in used


def test_provider_helm_is_used_even_with_cert_manager(helm: list[str], tmp_path: Path) -> None:
    values = {"tls": {"provider": "helm", "trustDomain": "prod.example"}, **EXAMPLE}
    docs = template(helm, values, tmp_path)  # cert-manager's API present
    assert not [d for d in docs if d["kind"] in ("Certificate", "Issuer")]
    for role in ROLES:
        leaf = _cert(_secret(docs, f"{RELEASE}-kvgrid-{role}-tls")["tls.crt"])
        assert _sans(leaf)[0][0] == _dns_id(role, "prod.example")


def test_without_a_cluster_each_render_makes_a_new_ca(helm: list[str], tmp_path: Path) -> None:
    """What docs/deploy.md says about helm template: lookup finds no CA Secret, so one is made."""
    first = _secret(template(helm, HELM_CA, tmp_path, crds=False), CA_SECRET)["tls.crt"]
    second = _secret(template(helm, HELM_CA, tmp_path, crds=False), CA_SECRET)["tls.crt"]
    assert first != second


def test_per_pod_identities_need_cert_manager(helm: list[str], tmp_path: Path) -> None:
    values = {"tls": {"provider": "helm", "agentIdentity": "perPod"}}
    proc = run([*helm, "template", RELEASE, str(CHART), "-n", NAMESPACE, *values_args(values, tmp_path)])
    assert proc.returncode != 0
    assert "tls.agentIdentity=perPod needs certificates from cert-manager's csi-driver" in proc.stderr
    assert 'got tls provider "helm"' in proc.stderr, proc.stderr


def test_the_helm_ca_setup_registers_and_a_router_only_reads(
    helm_docs: list[dict[str, Any]], tmp_path: Path, free_port: Callable[[], int]
) -> None:
    certs = _write_secrets(helm_docs, tmp_path / "secrets")
    seen: dict[str, Any] = {}

    def as_router(address: str, files: dict[str, Path]) -> None:
        with _channel(address, files[f"{RELEASE}-kvgrid-router-tls"]) as ch:
            stub = controller_pb2_grpc.ControllerServiceStub(ch)
            keys = common_pb2.ChunkKeys(keys=[bytes([3]) * 16])
            seen["match"] = stub.MatchPrefix(
                controller_pb2.MatchPrefixRequest(chunk_keys=keys, namespace_id="0" * 32), timeout=5
            )
            with pytest.raises(grpc.RpcError) as err:
                stub.RegisterAgent(
                    controller_pb2.RegisterAgentRequest(
                        pod=common_pb2.PodIdentity(pod_uid="forged", epoch=1)
                    ),
                    timeout=5,
                )
            seen["register"] = (err.value.code(), err.value.details())

    assert _run_rendered(
        helm_docs, tmp_path, free_port, None, "uid-h", certs=certs, while_running=as_router
    ) == {"uid-h"}
    assert seen["match"].num_query_chunks == 1
    code, text = seen["register"]
    assert code == grpc.StatusCode.PERMISSION_DENIED and _dns_id("router") in text, text


def test_install_notes_name_the_dns_identities_and_the_ca_secret(helm: list[str], tmp_path: Path) -> None:
    proc = run([*helm, "install", RELEASE, str(CHART), "-n", NAMESPACE, "--dry-run=client"])
    assert proc.returncode == 0, proc.stderr
    assert "certificates from helm" in proc.stdout
    assert f"<controller|agent|router>.{NAMESPACE}.kvgrid-id.cluster.local (DNS SANs)" in proc.stdout
    assert f"The chart's CA is Secret {CA_SECRET}" in proc.stdout
