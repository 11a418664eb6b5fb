"""Mutual TLS for kvgrid's TCP listeners and clients, with certificate files that rotate in place.

Invariants:

- A TLS setting is three PEM files (certificate chain, private key, CA bundle): all three set means
  mTLS, all three empty means plaintext; anything else is a config error naming the fields
  (:func:`tls_files`). The files are the cert-manager Secret layout
  (``/etc/kvgrid/tls/{tls.crt,tls.key,ca.crt}``).
- Servers (:func:`server_credentials`) always *require* a client certificate signed by the CA. The
  files are re-read when they change (checked at every new handshake by comparing each file's
  ``(mtime, size, inode)``; Kubernetes swaps a mounted Secret's files in place), so a rotated
  certificate serves new connections without a restart; open connections keep the old one.
- Clients (:class:`ClientTls`) present their certificate and verify the server's chain against the
  CA and the server's *role name* (a DNS SAN: ``kvgrid-controller`` for the controller,
  ``kvgrid-agent`` for agents; see docs/security.md). Agents are reached by pod IP, which no shared
  certificate names, so the role name is what a client checks. :attr:`ClientTls.generation`
  changes when the files change; callers that keep channels (:class:`Channels`) rebuild them on the
  next call after a change.
- A file that cannot be read or parsed during a reload keeps the previous credentials (logged).
- Callers are accepted from one trust domain (``tls_trust_domain``) and, within it, from the
  Kubernetes namespaces ``tls_allowed_namespaces`` lists; empty (the default) means the namespace(s)
  of this service's own certificate identity, read by :func:`certificate_sans` (the check itself is
  :class:`kvgrid.common.authz.Authorizer`).
"""

from __future__ import annotations

import base64
import logging
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import grpc
import msgspec

__all__ = [
    "AGENT_SERVER_NAME",
    "ANY_NAMESPACE",
    "CONTROLLER_SERVER_NAME",
    "Channels",
    "ClientTls",
    "TlsFiles",
    "TlsSettings",
    "certificate_sans",
    "make_channel",
    "server_credentials",
    "tls_files",
]

log = logging.getLogger(__name__)

CONTROLLER_SERVER_NAME = "kvgrid-controller"
"""The DNS SAN a controller's certificate carries and its clients verify."""
AGENT_SERVER_NAME = "kvgrid-agent"
"""The DNS SAN every agent's certificate carries and its clients (peers, the controller) verify."""


ANY_NAMESPACE = "*"
"""In ``tls_allowed_namespaces``: callers of every namespace of the trust domain are accepted."""
_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


class TlsFiles(msgspec.Struct, frozen=True):
    cert_file: str
    key_file: str
    ca_file: str
    controller_token_file: str = ""
    """An agent's pod token (:mod:`kvgrid.common.pod_tokens`), sent only to the controller ("" = none)."""

    def paths(self) -> tuple[Path, Path, Path]:
        return Path(self.cert_file), Path(self.key_file), Path(self.ca_file)


def tls_files(cert_file: str, key_file: str, ca_file: str, *, prefix: str = "tls_") -> TlsFiles | None:
    """The TLS files of a config (None = TLS off); ValueError naming the fields when only some are set."""
    given = {f"{prefix}cert_file": cert_file, f"{prefix}key_file": key_file, f"{prefix}ca_file": ca_file}
    if not any(given.values()):
        return None
    missing = [k for k, v in given.items() if not v]
    if missing:
        set_ = ", ".join(f"{k}={v!r}" for k, v in given.items() if v)
        raise ValueError(
            f"{set_} but {', '.join(missing)} empty: expected all three TLS files (mTLS) or none (TLS off)"
        )
    return TlsFiles(cert_file, key_file, ca_file)


class TlsSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The TLS fields every kvgrid service's config has (the same names, flags and env keys)."""

    tls_cert_file: Annotated[
        str,
        msgspec.Meta(
            description="PEM certificate (chain) of this service, e.g. /etc/kvgrid/tls/tls.crt; with "
            "tls_key_file and tls_ca_file it turns on mTLS on its TCP listener and its calls to other "
            "kvgrid services (all three or none); reloaded when the file changes"
        ),
    ] = ""
    tls_key_file: Annotated[
        str, msgspec.Meta(description="PEM private key of tls_cert_file, e.g. /etc/kvgrid/tls/tls.key")
    ] = ""
    tls_ca_file: Annotated[
        str,
        msgspec.Meta(
            description="PEM CA bundle that signs every kvgrid certificate, e.g. /etc/kvgrid/tls/ca.crt"
        ),
    ] = ""
    tls_trust_domain: Annotated[
        str,
        msgspec.Meta(
            description="trust domain of accepted identities: spiffe://<domain>/ns/<ns>/role/<role> URI "
            "SANs or <role>.<ns>.kvgrid-id.<domain> DNS SANs (docs/security.md)"
        ),
    ] = "cluster.local"
    tls_allowed_namespaces: Annotated[
        list[str],
        msgspec.Meta(
            description="Kubernetes namespaces whose identities (of tls_trust_domain) may call this "
            "service, comma-separated; empty = only the namespace of this service's own certificate "
            "identity; * = every namespace of the trust domain (docs/security.md)"
        ),
    ] = msgspec.field(default_factory=list)

    def check_tls(self) -> None:
        """ValueError naming the field when the TLS settings are inconsistent (call from __post_init__)."""
        tls_files(self.tls_cert_file, self.tls_key_file, self.tls_ca_file)
        if not self.tls_trust_domain or "/" in self.tls_trust_domain:
            raise ValueError(
                f"tls_trust_domain={self.tls_trust_domain!r}: expected a domain such as cluster.local"
            )
        bad = [n for n in self.tls_allowed_namespaces if n != ANY_NAMESPACE and not _NAMESPACE.fullmatch(n)]
        if bad:
            raise ValueError(
                f"tls_allowed_namespaces={self.tls_allowed_namespaces!r}: {bad[0]!r} is not a Kubernetes "
                f"namespace name (lowercase letters, digits and '-', at most 63) nor {ANY_NAMESPACE!r}"
            )

    @property
    def tls(self) -> TlsFiles | None:
        """The mTLS files, None when TLS is off."""
        return tls_files(self.tls_cert_file, self.tls_key_file, self.tls_ca_file)


def _tlv(der: bytes, i: int, end: int) -> tuple[int, int, int]:
    """(tag, content start, content end) of the DER element at ``i``; ValueError when it overruns ``end``."""
    if i + 2 > end:
        raise ValueError("truncated DER")
    tag, n, i = der[i], der[i + 1], i + 2
    if n & 0x80:
        k = n & 0x7F
        if not 0 < k <= 4 or i + k > end:
            raise ValueError("bad DER length")
        n, i = int.from_bytes(der[i : i + k], "big"), i + k
    if i + n > end:
        raise ValueError("truncated DER")
    return tag, i, i + n


def _children(der: bytes, start: int, end: int) -> Iterator[tuple[int, int, int]]:
    while start < end:
        tag, s, e = _tlv(der, start, end)
        yield tag, s, e
        start = e


_SAN_OID = bytes.fromhex("551d11")  # 2.5.29.17 subjectAltName
_PEM_CERT = re.compile(rb"-----BEGIN CERTIFICATE-----(.+?)-----END CERTIFICATE-----", re.S)


def certificate_sans(pem: bytes) -> tuple[list[str], list[str]]:
    """(URI SANs, DNS SANs) of the first (leaf) certificate of a PEM chain; ValueError when there is
    no parsable certificate. A small DER walk: the runtime needs no X.509 library for this."""
    m = _PEM_CERT.search(pem)
    if m is None:
        raise ValueError("no PEM certificate")
    try:
        der = base64.b64decode(b"".join(m.group(1).split()), validate=True)
    except ValueError:
        raise ValueError("PEM certificate is not base64") from None
    uris: list[str] = []
    names: list[str] = []
    _, cs, ce = _tlv(der, 0, len(der))  # Certificate ::= SEQUENCE { tbsCertificate, ... }
    _, ts, te = _tlv(der, cs, ce)  # TBSCertificate ::= SEQUENCE { ..., [3] extensions }
    for tag, s, e in _children(der, ts, te):
        if tag != 0xA3:
            continue
        _, xs, xe = _tlv(der, s, e)  # SEQUENCE OF Extension { extnID, critical?, extnValue }
        for _, es, ee in _children(der, xs, xe):
            parts = list(_children(der, es, ee))
            if len(parts) < 2 or parts[0][0] != 0x06 or der[parts[0][1] : parts[0][2]] != _SAN_OID:
                continue
            _, vs, ve = parts[-1]  # OCTET STRING holding GeneralNames ::= SEQUENCE OF GeneralName
            _, gs, ge = _tlv(der, vs, ve)
            for gtag, ns, ne in _children(der, gs, ge):
                if gtag == 0x86:  # [6] uniformResourceIdentifier
                    uris.append(der[ns:ne].decode("ascii", errors="replace"))
                elif gtag == 0x82:  # [2] dNSName
                    names.append(der[ns:ne].decode("ascii", errors="replace"))
    return uris, names


_Stamp = tuple[tuple[int, int, int], ...]


def _stamp(files: TlsFiles) -> _Stamp:
    out = []
    for p in files.paths():
        st = p.stat()  # follows the ..data symlink Kubernetes swaps on rotation
        out.append((st.st_mtime_ns, st.st_size, st.st_ino))
    return tuple(out)


def _read(files: TlsFiles) -> tuple[bytes, bytes, bytes]:
    """(certificate chain, key, CA) bytes; ValueError naming the file that is missing or empty."""
    out = []
    for name, p in zip(("tls_cert_file", "tls_key_file", "tls_ca_file"), files.paths(), strict=True):
        try:
            data = p.read_bytes()
        except OSError as e:
            raise ValueError(f"{name}={str(p)!r}: cannot read: {e.strerror or e}") from None
        if b"-----BEGIN" not in data:
            raise ValueError(f"{name}={str(p)!r}: expected a PEM file")
        out.append(data)
    return out[0], out[1], out[2]


class _Watched:
    """The files' current bytes, re-read when their stamp changes. Thread-safe."""

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        self._lock = threading.Lock()
        self.pem = _read(files)  # first: a missing file is a ValueError naming the setting
        self._stamp = _stamp(files)
        self.generation = 0

    def changed(self) -> bool:
        """Re-read the files if they changed; True when new bytes were loaded."""
        with self._lock:
            try:
                stamp = _stamp(self.files)
                if stamp == self._stamp:
                    return False
                pem = _read(self.files)
            except (OSError, ValueError) as e:
                log.warning("TLS files changed but cannot be reloaded (keeping the previous ones): %s", e)
                return False
            self._stamp = stamp
            if pem == self.pem:
                return False
            self.pem = pem
            self.generation += 1
            log.info("TLS certificate files reloaded (%s)", self.files.cert_file)
            return True


def server_credentials(files: TlsFiles) -> grpc.ServerCredentials:
    """mTLS server credentials that require a CA-signed client certificate and pick up rotated files."""
    watched = _Watched(files)

    def config() -> grpc.ServerCertificateConfiguration:
        cert, key, ca = watched.pem
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        # grpc calls this at the start of every handshake: None keeps the current configuration.
        return config() if watched.changed() else None

    # The stub types the fetcher's result without None, which grpc documents as "no change".
    return grpc.dynamic_ssl_server_credentials(
        config(),
        fetch,  # type: ignore[arg-type]
        require_client_authentication=True,
    )


class ClientTls:
    """A client's mTLS credentials, rebuilt when the files change (checked on each :meth:`credentials`)."""

    def __init__(self, files: TlsFiles) -> None:
        self._watched = _Watched(files)
        self._creds: grpc.ChannelCredentials | None = None
        self._creds_generation = -1
        self._lock = threading.Lock()
        self.controller_token: grpc.UnaryUnaryClientInterceptor | None = None
        """The ``authorization: Bearer`` interceptor of ``files.controller_token_file`` (re-read when
        it changes), which :func:`make_channel` adds to channels to the controller only."""
        if files.controller_token_file:
            from kvgrid.common.pod_tokens import BearerToken, TokenFile

            self.controller_token = BearerToken(TokenFile(files.controller_token_file))

    @property
    def generation(self) -> int:
        """Changes whenever the files change: a channel made at another generation is stale."""
        self._watched.changed()
        return self._watched.generation

    def credentials(self) -> grpc.ChannelCredentials:
        gen = self.generation
        with self._lock:
            if self._creds is None or self._creds_generation != gen:
                cert, key, ca = self._watched.pem
                self._creds = grpc.ssl_channel_credentials(ca, key, cert)
                self._creds_generation = gen
            return self._creds


def make_channel(
    target: str,
    tls: ClientTls | None,
    server_name: str,
    options: list[tuple[str, object]] | None = None,
) -> grpc.Channel:
    """A channel to ``target``: mTLS verifying ``server_name`` when ``tls`` is set, else plaintext.

    A channel that verifies the controller's name (:data:`CONTROLLER_SERVER_NAME`) also carries the
    agent's pod token when ``tls`` has one; no other does (a peer agent could replay it)."""
    opts = list(options or [])
    if tls is None:
        return grpc.insecure_channel(target, options=opts)
    opts.append(("grpc.ssl_target_name_override", server_name))
    channel = grpc.secure_channel(target, tls.credentials(), options=opts)
    if server_name == CONTROLLER_SERVER_NAME and tls.controller_token is not None:
        channel = grpc.intercept_channel(channel, tls.controller_token)
    return channel


class Channels:
    """One channel per target for calls to servers of one role, made with the current TLS files.

    A channel made before the files changed is replaced on the next :meth:`get` (the new one
    handshakes with the new certificate); the old one is dropped, not closed, so calls still running
    on it finish (grpc closes it once nothing refers to it). Thread-safe.
    """

    def __init__(
        self, tls: ClientTls | None, server_name: str, options: list[tuple[str, object]] | None = None
    ) -> None:
        self.tls, self.server_name, self.options = tls, server_name, list(options or [])
        self._lock = threading.Lock()
        self._by_target: dict[str, tuple[int, grpc.Channel]] = {}

    def get(self, target: str) -> grpc.Channel:
        gen = self.tls.generation if self.tls is not None else 0
        with self._lock:
            entry = self._by_target.get(target)
            if entry is None or entry[0] != gen:
                entry = self._by_target[target] = (
                    gen,
                    make_channel(target, self.tls, self.server_name, self.options),
                )
            return entry[1]

    def forget(self, keep: set[str]) -> None:
        """Close the channels to targets not in ``keep`` (servers that went away)."""
        with self._lock:
            for t in [t for t in self._by_target if t not in keep]:
                self._by_target.pop(t)[1].close()

    def close(self) -> None:
        self.forget(set())
