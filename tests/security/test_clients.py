"""The command-line side of TLS: ``kvgrid lookup`` with a router certificate against an mTLS
controller, and clear errors for incomplete or missing TLS files."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgrid import cli
from kvgrid.controller.service import Server
from tests.security.conftest import Pki


def _tls(d: Path) -> list[str]:
    return [
        "--tls-cert-file",
        str(d / "tls.crt"),
        "--tls-key-file",
        str(d / "tls.key"),
        "--tls-ca-file",
        str(d / "ca.crt"),
    ]


def test_kvgrid_lookup_with_a_router_certificate(
    tls_controller: Server, pki: Pki, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    assert cli.main(["lookup", "--controller", tls_controller.address, *_tls(pki.router()), "stats"]) == 0
    assert "index_backend" in capsys.readouterr().out
    # Without the files: the handshake is refused, one clear line.
    assert cli.main(["lookup", "--controller", tls_controller.address, "--timeout", "2", "stats"]) == 1
    assert "UNAVAILABLE" in capsys.readouterr().out
    # The same files from the environment (the names the services read).
    r = pki.router()
    monkeypatch.setenv("KVGRID_TLS_CERT_FILE", str(r / "tls.crt"))
    monkeypatch.setenv("KVGRID_TLS_KEY_FILE", str(r / "tls.key"))
    monkeypatch.setenv("KVGRID_TLS_CA_FILE", str(r / "ca.crt"))
    assert cli.main(["lookup", "--controller", tls_controller.address, "agents"]) == 0


def test_lookup_with_some_tls_files_names_the_missing_ones(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["lookup", "--controller", "127.0.0.1:1", "--tls-cert-file", "/x", "stats"])
    assert "tls_key_file, tls_ca_file empty" in capsys.readouterr().err


def test_agent_refuses_to_start_with_incomplete_or_missing_tls_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["agent", "--uds-path", str(tmp_path / "a.sock"), "--tls-cert-file", "/x"]) == 2
    err = capsys.readouterr().err
    assert "tls_cert_file='/x' but tls_key_file, tls_ca_file empty" in err
    missing = ["--tls-cert-file", str(tmp_path / "no.crt"), "--tls-key-file", "/k", "--tls-ca-file", "/c"]
    flags = [
        "--uds-path",
        str(tmp_path / "a.sock"),
        "--tcp-port",
        "0",
        "--l1-size",
        "1MiB",
        "--l1-page-size",
        "4KiB",
    ]
    assert cli.main(["agent", *flags, *missing]) == 2
    assert f"tls_cert_file={str(tmp_path / 'no.crt')!r}: cannot read" in capsys.readouterr().err
