"""A throwaway certificate authority for the security tests (real X.509 via ``cryptography``).

Certificates carry what the chart issues: a URI SAN with the SPIFFE-style kvgrid identity
(``spiffe://<trust-domain>/ns/<ns>/role/<role>[/pod/<uid>]``), usable for both TLS server and client
authentication. :meth:`TestCA.write` puts ``tls.crt``/``tls.key``/``ca.crt`` in a directory, the
layout cert-manager Secrets have and the services read.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["TestCA", "spiffe"]

TRUST_DOMAIN = "cluster.local"
NAMESPACE = "kvgrid-test"


def spiffe(role: str, pod: str = "", *, ns: str = NAMESPACE, trust_domain: str = TRUST_DOMAIN) -> str:
    base = f"spiffe://{trust_domain}/ns/{ns}/role/{role}"
    return f"{base}/pod/{pod}" if pod else base


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


class TestCA:
    """One CA; :meth:`issue` makes a leaf certificate for a list of URI SANs."""

    __test__ = False  # not a pytest class

    def __init__(self, name: str = "kvgrid test CA") -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = dt.datetime.now(dt.UTC)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True, content_commitment=False, key_encipherment=False,
                    data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                    encipher_only=False, decipher_only=False,
                ),
                critical=True,
            )
            .sign(self.key, hashes.SHA256())
        )  # fmt: skip

    @property
    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def issue(self, *uris: str, dns: tuple[str, ...] = ()) -> tuple[bytes, bytes]:
        """(certificate PEM, private key PEM) for a leaf with these URI (and DNS) SANs."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(u) for u in uris]
        sans += [x509.DNSName(d) for d in dns]
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, (uris or dns)[0][-60:])]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .sign(self.key, hashes.SHA256())
        )
        return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)

    def write(self, directory: Path, *uris: str, dns: tuple[str, ...] = (), ca: bytes | None = None) -> Path:
        """Issue a leaf for ``uris`` (and ``dns``) and write ``tls.crt``, ``tls.key`` and ``ca.crt``
        (this CA, or the bundle ``ca``) into ``directory``."""
        directory.mkdir(parents=True, exist_ok=True)
        cert, key = self.issue(*uris, dns=dns)
        (directory / "tls.key").write_bytes(key)
        (directory / "tls.crt").write_bytes(cert)
        (directory / "ca.crt").write_bytes(self.pem if ca is None else ca)
        return directory
