"""Channels to a kvgrid controller for routers and tools (``kvgrid lookup``), with or without mTLS.

A router calls the controller's read RPCs (MatchPrefix, Score, ListAgents, GetStats, ...) with its
own certificate (URI SAN ``spiffe://<trust-domain>/ns/<ns>/role/router``, docs/security.md). Give
the same three PEM files the services take -- all three for mTLS, none for plaintext -- and
:func:`controller_stub` returns a stub on a channel that presents the certificate and verifies the
controller's (its CA and its role name, ``kvgrid-controller``). Files are read when the channel is
made: after a certificate rotation make a new channel (a reconnect does not re-read them).
"""

from __future__ import annotations

import grpc

from kvgrid.api.v1 import controller_pb2_grpc
from kvgrid.common.tls import CONTROLLER_SERVER_NAME, ClientTls, make_channel, tls_files

__all__ = ["controller_channel", "controller_stub"]


def controller_channel(
    address: str,
    *,
    cert_file: str = "",
    key_file: str = "",
    ca_file: str = "",
    server_name: str = CONTROLLER_SERVER_NAME,
    options: list[tuple[str, object]] | None = None,
) -> grpc.Channel:
    """A channel to the controller at ``address`` (host:port); mTLS when the three files are given,
    plaintext when none are (ValueError naming the fields when only some are)."""
    files = tls_files(cert_file, key_file, ca_file)
    return make_channel(address, ClientTls(files) if files is not None else None, server_name, options)


def controller_stub(
    address: str,
    *,
    cert_file: str = "",
    key_file: str = "",
    ca_file: str = "",
    server_name: str = CONTROLLER_SERVER_NAME,
    options: list[tuple[str, object]] | None = None,
) -> controller_pb2_grpc.ControllerServiceStub:
    """A ControllerService stub on :func:`controller_channel` (same arguments)."""
    channel = controller_channel(
        address,
        cert_file=cert_file,
        key_file=key_file,
        ca_file=ca_file,
        server_name=server_name,
        options=options,
    )
    return controller_pb2_grpc.ControllerServiceStub(channel)
