"""What cert-manager would do with the chart's certificate requests, done in the test with real X.509
(``cryptography``): sign a rendered ``Certificate`` spec, or a csi-driver volume's attributes, with a
test CA and write the Secret's files (``tls.crt``, ``tls.key``, ``ca.crt``) into a directory.

Only the fields the chart sets are honoured: URI and DNS SANs, common name and usages. cert-manager
itself cannot run here (no Kubernetes API server); everything it would read comes from the rendered
manifest, so a wrong SAN, usage or variable in the chart shows up as a refused handshake or call.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from tests.security.pki import TestCA

_EKU = {"server auth": ExtendedKeyUsageOID.SERVER_AUTH, "client auth": ExtendedKeyUsageOID.CLIENT_AUTH}


def sign(
    ca: TestCA, directory: Path, *, uris: list[str], dns: list[str], common_name: str, usages: list[str]
) -> Path:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(u) for u in uris]
    sans += [x509.DNSName(d) for d in dns]
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name[:64])]))
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    ekus = [_EKU[u] for u in usages if u in _EKU]
    if ekus:
        builder = builder.add_extension(x509.ExtendedKeyUsage(ekus), critical=False)
    cert = builder.sign(ca.key, hashes.SHA256())
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tls.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (directory / "tls.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    (directory / "ca.crt").write_bytes(ca.pem)
    return directory


def sign_certificate(ca: TestCA, certificate: dict[str, Any], root: Path) -> Path:
    """A rendered cert-manager ``Certificate``: its Secret's files under ``root/<secretName>``."""
    spec = certificate["spec"]
    return sign(
        ca,
        root / spec["secretName"],
        uris=spec.get("uris", []),
        dns=spec.get("dnsNames", []),
        common_name=spec.get("commonName", certificate["metadata"]["name"]),
        usages=spec.get("usages", []),
    )


def sign_csi_volume(ca: TestCA, volume: dict[str, Any], pod: dict[str, str], directory: Path) -> Path:
    """A rendered ``csi.cert-manager.io`` volume for a pod (``{"POD_UID": ..., "POD_NAME": ...}``):
    the csi-driver's ``${VAR}`` substitution, then signing."""
    attrs = volume["csi"]["volumeAttributes"]

    def expand(text: str) -> str:
        for name, value in pod.items():
            text = text.replace("${" + name + "}", value)
        assert "${" not in text, f"unexpanded csi-driver variable in {text!r}"
        return text

    def listed(key: str) -> list[str]:
        return [expand(v.strip()) for v in attrs.get(key, "").split(",") if v.strip()]

    return sign(
        ca,
        directory,
        uris=listed("csi.cert-manager.io/uri-sans"),
        dns=listed("csi.cert-manager.io/dns-names"),
        common_name=expand(attrs.get("csi.cert-manager.io/common-name", "agent")),
        usages=listed("csi.cert-manager.io/key-usages"),
    )
