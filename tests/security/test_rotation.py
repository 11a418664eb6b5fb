"""Certificate rotation without a restart: the files are replaced in place (as Kubernetes does with
a mounted Secret) and new connections use the new ones while open connections keep working."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest

from kvgrid.api.v1 import controller_pb2, controller_pb2_grpc
from kvgrid.common.tls import CONTROLLER_SERVER_NAME, Channels, ClientTls, TlsFiles
from kvgrid.controller.config import ControllerConfig
from kvgrid.controller.service import serve
from tests.security.conftest import channel_as, tls_flags
from tests.security.pki import TestCA, spiffe


def _replace(directory: Path, cert: bytes, key: bytes, ca: bytes) -> None:
    """Swap the three files atomically (new inodes), like the kubelet's ..data symlink swap."""
    for name, data in (("tls.crt", cert), ("tls.key", key), ("ca.crt", ca)):
        tmp = directory / f".{name}.new"
        tmp.write_bytes(data)
        os.replace(tmp, directory / name)


def _stats(ch: grpc.Channel) -> int:
    return (
        controller_pb2_grpc.ControllerServiceStub(ch)
        .GetStats(controller_pb2.GetStatsRequest(), timeout=5)
        .num_agents
    )


def _refused(ch: grpc.Channel) -> bool:
    try:
        _stats(ch)
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.UNAVAILABLE, e
        return True
    return False


def test_server_and_client_certificates_rotate_without_a_restart(tmp_path: Path) -> None:
    old_ca, new_ca = TestCA("old CA"), TestCA("new CA")
    both = old_ca.pem + new_ca.pem
    srv = old_ca.write(tmp_path / "srv", spiffe("controller"), dns=(CONTROLLER_SERVER_NAME,))
    old_router = old_ca.write(tmp_path / "old-router", spiffe("router"), ca=both)
    new_router = new_ca.write(tmp_path / "new-router", spiffe("router"), ca=new_ca.pem)
    server = serve(ControllerConfig(listen="127.0.0.1:0", **tls_flags(srv)))
    addr = server.address
    try:
        # Before: the server's certificate is the old CA's and only old-CA clients are accepted.
        kept = channel_as(addr, old_router, CONTROLLER_SERVER_NAME)
        assert _stats(kept) == 0
        assert _refused(channel_as(addr, new_router, CONTROLLER_SERVER_NAME))

        # Rotate the server: a certificate from the new CA; both CAs trusted during the switch.
        cert, key = new_ca.issue(spiffe("controller"), dns=(CONTROLLER_SERVER_NAME,))
        _replace(srv, cert, key, both)
        assert _stats(channel_as(addr, new_router, CONTROLLER_SERVER_NAME)) == 0  # sees the new cert
        assert _refused(channel_as(addr, old_router, CONTROLLER_SERVER_NAME, ca=old_ca.pem))
        assert _stats(kept) == 0  # the connection made before the rotation still works

        # Rotate the client side too: the server now trusts only the new CA; a client whose files
        # are replaced gets a new channel with the new certificate on its next call.
        _replace(srv, cert, key, new_ca.pem)
        files = TlsFiles(*(str(old_router / n) for n in ("tls.crt", "tls.key", "ca.crt")))
        channels = Channels(ClientTls(files), CONTROLLER_SERVER_NAME)
        assert _refused(channels.get(addr))  # old client certificate: refused at the new handshake
        before = channels.get(addr)
        cert, key = new_ca.issue(spiffe("router"))
        _replace(old_router, cert, key, new_ca.pem)
        after = channels.get(addr)
        assert after is not before
        assert _stats(after) == 0
        channels.close()
    finally:
        server.stop()


def test_a_broken_file_during_rotation_keeps_the_previous_certificate(tmp_path: Path) -> None:
    ca = TestCA()
    srv = ca.write(tmp_path / "srv", spiffe("controller"), dns=(CONTROLLER_SERVER_NAME,))
    router = ca.write(tmp_path / "router", spiffe("router"))
    server = serve(ControllerConfig(listen="127.0.0.1:0", **tls_flags(srv)))
    try:
        (srv / "tls.crt").write_bytes(b"half-written")
        assert _stats(channel_as(server.address, router, CONTROLLER_SERVER_NAME)) == 0
    finally:
        server.stop()


def test_partial_tls_settings_are_a_config_error() -> None:
    with pytest.raises(ValueError, match=r"tls_cert_file='/x' but tls_key_file, tls_ca_file empty"):
        ControllerConfig(tls_cert_file="/x")
    from kvgrid.agent.config import AgentConfig

    with pytest.raises(ValueError, match=r"tls_ca_file empty: expected all three TLS files"):
        AgentConfig(tls_cert_file="/x", tls_key_file="/y")
    with pytest.raises(ValueError, match=r"tls_trust_domain='a/b'"):
        AgentConfig(tls_trust_domain="a/b")
