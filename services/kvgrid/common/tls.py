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
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Annotated

import grpc
import msgspec

__all__ = [
    "AGENT_SERVER_NAME",
    "CONTROLLER_SERVER_NAME",
    "Channels",
    "ClientTls",
    "TlsFiles",
    "TlsSettings",
    "make_channel",
    "server_credentials",
    "tls_files",
]

log = logging.getLogger(__name__)

CONTROLLER_SERVER_NAME = "kvgrid-controller"
"""The DNS SAN a controller's certificate carries and its clients verify."""
AGENT_SERVER_NAME = "kvgrid-agent"
"""The DNS SAN every agent's certificate carries and its clients (peers, the controller) verify."""


class TlsFiles(msgspec.Struct, frozen=True):
    cert_file: str
    key_file: str
    ca_file: str

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

    def check_tls(self) -> None:
        """ValueError naming the field when the TLS settings are inconsistent (call from __post_init__)."""
        tls_files(self.tls_cert_file, self.tls_key_file, self.tls_ca_file)
        if not self.tls_trust_domain or "/" in self.tls_trust_domain:
            raise ValueError(
                f"tls_trust_domain={self.tls_trust_domain!r}: expected a domain such as cluster.local"
            )

    @property
    def tls(self) -> TlsFiles | None:
        """The mTLS files, None when TLS is off."""
        return tls_files(self.tls_cert_file, self.tls_key_file, self.tls_ca_file)


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
    """A channel to ``target``: mTLS verifying ``server_name`` when ``tls`` is set, else plaintext."""
    opts = list(options or [])
    if tls is None:
        return grpc.insecure_channel(target, options=opts)
    opts.append(("grpc.ssl_target_name_override", server_name))
    return grpc.secure_channel(target, tls.credentials(), options=opts)


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
