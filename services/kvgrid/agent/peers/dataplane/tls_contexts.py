"""TLS for the data port (``tls`` tickets): the server's context (mutual TLS, rebuilt when the
certificate files change, never per connection), the fetcher's context, and the certificate
identities a server-side connection presents.

Invariant: the server requires a client certificate from the CA; a ``tls`` ticket issued to an
identity is only served on a connection whose verified certificate names it (:func:`peer_sans`).
"""

from __future__ import annotations

import logging
import os
import socket
import ssl
import threading

from kvgrid.common.tls import TlsFiles

__all__ = ["ServerContexts", "client_context", "peer_sans", "server_context"]

log = logging.getLogger(__name__)


def server_context(files: TlsFiles) -> ssl.SSLContext:
    """Mutual TLS for the data port: this agent's certificate, a client certificate from the CA
    required. Rebuilt when the files change (``ServerContexts``), so rotated files apply to new
    connections."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(files.cert_file, files.key_file)
    ctx.load_verify_locations(files.ca_file)
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


class ServerContexts:
    """The data port's server context, rebuilt only when a TLS file changed (its mtime, size or
    inode, as :mod:`kvgrid.common.tls` checks): loading the certificate and CA costs milliseconds of
    CPU, which a flood of connections must not be able to make the agent spend per connection.
    A file that cannot be read keeps the previous context (logged). Thread-safe."""

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        self._lock = threading.Lock()
        self._stamp = self._read_stamp()
        self._ctx = server_context(files)

    def _read_stamp(self) -> tuple[tuple[int, int, int], ...]:
        out = []
        for path in (self.files.cert_file, self.files.key_file, self.files.ca_file):
            st = os.stat(path)
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
        return tuple(out)

    def get(self) -> ssl.SSLContext:
        with self._lock:
            try:
                stamp = self._read_stamp()
                if stamp != self._stamp:
                    self._ctx, self._stamp = server_context(self.files), stamp
            except (OSError, ssl.SSLError) as e:
                log.warning(
                    "data plane: TLS files changed but cannot be reloaded (keeping the previous): %s", e
                )
            return self._ctx


def client_context(files: TlsFiles) -> ssl.SSLContext:
    """The fetcher's side: present this agent's certificate, verify the peer's chain and role name."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(files.cert_file, files.key_file)
    ctx.load_verify_locations(files.ca_file)
    return ctx


def peer_sans(conn: socket.socket) -> list[str]:
    """URI and DNS SANs of a TLS connection's verified client certificate."""
    if not isinstance(conn, ssl.SSLSocket):
        return []
    cert = conn.getpeercert() or {}
    sans = cert.get("subjectAltName", ())
    out: list[str] = []
    for entry in sans if isinstance(sans, tuple) else ():
        if isinstance(entry, tuple) and len(entry) == 2 and entry[0] in ("URI", "DNS"):
            out.append(str(entry[1]))
    return out
