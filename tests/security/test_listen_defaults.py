"""Plaintext stays on this machine unless TLS is on or an explicit, loudly named flag says otherwise.

``kvgrid agent`` and ``kvgrid controller`` run as real processes: without TLS a non-loopback listen
host is refused at start (exit code 2, a message naming the value and both ways out); without a host
the agent listens on 127.0.0.1 only; ``--insecure-plaintext-on-network`` (or its env variable) makes
it listen on every interface with a loud warning; with TLS files the agent listens on every
interface as before. Bound addresses are read from the kernel (``/proc/<pid>/fd`` ->
``/proc/net/tcp{,6}``), and where the machine has a non-loopback address a connection to it is tried.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import pytest

from kvgrid.agent.config import AgentConfig
from kvgrid.common.config import ConfigError, load_config
from kvgrid.common.rpc import is_loopback_host
from kvgrid.controller.config import ControllerConfig
from tests.security.conftest import Pki, tls_flags

pytestmark = pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads /proc/net/tcp")

IpPort = tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]


# --- what the kernel says a process listens on -----------------------------------------------------


def _decode(hex_addr: str) -> IpPort:
    addr, port = hex_addr.split(":")
    raw = bytes.fromhex(addr)
    # /proc/net/tcp{,6} print each 32-bit word of the address in host (little-endian) order.
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(raw), int(port, 16)


def listening(pid: int) -> set[IpPort]:
    """(address, port) of every TCP socket ``pid`` listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not Path(table).exists():
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # 0A: LISTEN
                out.add(_decode(f[1]))
    return out


def _loopback(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    mapped = getattr(ip, "ipv4_mapped", None)  # grpc binds 127.0.0.1 as ::ffff:127.0.0.1 on a v6 socket
    return (mapped or ip).is_loopback


def _external_ip() -> str | None:
    """An address of this machine that is not loopback (the source of its default route), if any."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.77", 9))  # UDP connect: picks a route, sends nothing
        except OSError:
            return None
        ip = str(s.getsockname()[0])
    return None if ipaddress.ip_address(ip).is_loopback or ip == "0.0.0.0" else ip


def _connects(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=5):
            return True
    except OSError:
        return False


# --- the processes ---------------------------------------------------------------------------------


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGRID_")}
    env.update(POD_UID="uid-listen-test", POD_NAME="listen-test", OTEL_SDK_DISABLED="true", **extra)
    return env


def _agent_cmd(directory: Path, *flags: str) -> list[str]:
    return [
        sys.executable, "-m", "kvgrid.cli", "agent", "--uds-path", str(directory / "agent.sock"),
        "--tcp-port", "0", "--l1-size", "8MiB", "--l1-page-size", "4KiB", *flags,
    ]  # fmt: skip


def _controller_cmd(*flags: str) -> list[str]:
    return [sys.executable, "-m", "kvgrid.cli", "controller", "--log-level", "WARNING", *flags]


def _refused(cmd: list[str], env: dict[str, str]) -> str:
    """Run a start that must fail: its stderr, after checking it exited 2 promptly."""
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert time.monotonic() - t0 < 30  # at config time, before any listener, L1 pool or torch import
    assert "Traceback" not in proc.stderr, proc.stderr
    assert not proc.stdout.strip(), proc.stdout  # never got as far as "serving"/"listening"
    return proc.stderr


def _assert_clear_refusal(stderr: str, field: str, value: str) -> None:
    assert f"{field}={value!r} is not a loopback address and TLS is off" in stderr, stderr
    # The two ways out, by flag and env name.
    assert "--tls-cert-file" in stderr and "KVGRID_TLS_" in stderr, stderr
    assert "--insecure-plaintext-on-network" in stderr, stderr
    assert "KVGRID_INSECURE_PLAINTEXT_ON_NETWORK=true" in stderr, stderr


class Running:
    def __init__(self, proc: subprocess.Popen[str], first_line: str) -> None:
        self.proc, self.first_line = proc, first_line
        self.stderr = ""

    @property
    def listeners(self) -> set[IpPort]:
        return listening(self.proc.pid)


@contextmanager
def _running(cmd: list[str], env: dict[str, str], ready: Callable[[str], bool]) -> Iterator[Running]:
    """A process started with ``cmd``; yields once a stdout line satisfies ``ready``. Its stderr is
    in ``.stderr`` after the block."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    run = Running(proc, "")
    try:
        deadline = time.monotonic() + 60
        line = ""
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if ready(line):
                break
            if proc.poll() is not None:
                pytest.fail(f"{cmd[3]} exited with {proc.returncode}: {proc.stderr.read()}")
        else:
            pytest.fail(f"{cmd[3]} did not start in time")
        run.first_line = line
        yield run
    finally:
        proc.terminate()
        try:
            _out, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            _out, err = proc.communicate()
        run.stderr = err


def _agent(
    directory: Path, *flags: str, env: dict[str, str] | None = None
) -> AbstractContextManager[Running]:
    return _running(_agent_cmd(directory, *flags), env or _env(), lambda line: line.startswith("{"))


def _tcp_port(run: Running) -> int:
    info = json.loads(run.first_line)
    assert info["event"] == "serving"
    return int(info["tcp_port"])


# --- refused at start ------------------------------------------------------------------------------


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.20.30.40", "kvgrid-agent.example"])
def test_the_agent_refuses_a_network_host_without_tls(tmp_path: Path, host: str) -> None:
    stderr = _refused(_agent_cmd(tmp_path, "--tcp-host", host), _env())
    assert stderr.startswith("kvgrid agent: ")
    _assert_clear_refusal(stderr, "tcp_host", host)
    assert not (tmp_path / "agent.sock").exists()


def test_the_agent_refuses_a_network_host_from_env_or_yaml(tmp_path: Path) -> None:
    _assert_clear_refusal(
        _refused(_agent_cmd(tmp_path), _env(KVGRID_TCP_HOST="0.0.0.0")), "tcp_host", "0.0.0.0"
    )
    config = tmp_path / "agent.yaml"
    config.write_text("tcp_host: 0.0.0.0\n")
    _assert_clear_refusal(
        _refused(_agent_cmd(tmp_path, "--config", str(config)), _env()), "tcp_host", "0.0.0.0"
    )


@pytest.mark.parametrize("listen", ["0.0.0.0:50061", "[::]:0", "10.20.30.40:50061"])
def test_the_controller_refuses_a_network_listen_address_without_tls(listen: str) -> None:
    stderr = _refused(_controller_cmd("--listen", listen), _env())
    assert stderr.startswith("kvgrid controller: ")
    _assert_clear_refusal(stderr, "listen", listen)


# --- loopback by default ---------------------------------------------------------------------------


def test_the_agent_listens_on_loopback_only_by_default(tmp_path: Path) -> None:
    with _agent(tmp_path) as run:
        port = _tcp_port(run)
        listeners = run.listeners
        assert port in {p for _ip, p in listeners}
        # The gRPC port and the peer data plane: both loopback, nothing on a wildcard or external address.
        assert len(listeners) >= 2 and all(_loopback(ip) for ip, _p in listeners), listeners
        assert _connects("127.0.0.1", port)
        external = _external_ip()
        if external is not None:
            assert not _connects(external, port), f"{external}:{port} accepted a connection"
    assert "WITHOUT TLS" in run.stderr and "INSECURE" not in run.stderr


def test_the_controller_listens_on_loopback_only_by_default() -> None:
    default = ControllerConfig().listen
    host, _, port = default.rpartition(":")
    assert is_loopback_host(host)
    with socket.socket() as s:  # the default port must be free to start one with no --listen at all
        try:
            s.bind((host, int(port)))
        except OSError:
            pytest.skip(f"{default} is in use on this machine")
    with _running(_controller_cmd(), _env(), lambda line: "listening on" in line) as run:
        assert f"listening on {default} " in run.first_line
        listeners = run.listeners
        assert (int(port) in {p for _ip, p in listeners}) and all(_loopback(ip) for ip, _p in listeners)
        external = _external_ip()
        if external is not None:
            assert not _connects(external, int(port))


# --- the explicit flag: every interface, loudly ----------------------------------------------------


@pytest.mark.parametrize("how", ["flag", "env"])
def test_the_insecure_flag_listens_on_every_interface_and_warns(tmp_path: Path, how: str) -> None:
    flags, env = ("--insecure-plaintext-on-network",), _env()
    if how == "env":
        flags, env = (), _env(KVGRID_INSECURE_PLAINTEXT_ON_NETWORK="true")
    with _agent(tmp_path, *flags, env=env) as run:
        port = _tcp_port(run)
        listeners = run.listeners
        assert len(listeners) >= 2 and all(ip.is_unspecified for ip, _p in listeners), listeners
        external = _external_ip()
        if external is not None:
            assert _connects(external, port)
    assert "INSECURE: serving 0.0.0.0:0 WITHOUT TLS ON A NETWORK ADDRESS" in run.stderr, run.stderr


def test_the_controller_with_the_insecure_flag_listens_on_every_interface_and_warns(
    free_port: Callable[[], int],
) -> None:
    listen = f"0.0.0.0:{free_port()}"
    cmd = _controller_cmd("--listen", listen, "--insecure-plaintext-on-network")
    with _running(cmd, _env(), lambda line: "listening on" in line) as run:
        assert f"listening on {listen} " in run.first_line
        assert all(ip.is_unspecified for ip, _p in run.listeners), run.listeners
    assert f"INSECURE: serving {listen} WITHOUT TLS ON A NETWORK ADDRESS" in run.stderr, run.stderr


# --- with TLS: every interface, as before ----------------------------------------------------------


def _tls_args(directory: Path) -> list[str]:
    return [f"--{k.replace('_', '-')}={v}" for k, v in tls_flags(directory).items()]


def test_with_tls_the_agent_listens_on_every_interface(tmp_path: Path, pki: Pki) -> None:
    with _agent(tmp_path, *_tls_args(pki.agent())) as run:
        _tcp_port(run)
        listeners = run.listeners
        assert len(listeners) >= 2 and all(ip.is_unspecified for ip, _p in listeners), listeners
    assert "WITHOUT TLS" not in run.stderr, run.stderr


def test_with_tls_the_controller_may_listen_on_every_interface(
    pki: Pki, free_port: Callable[[], int]
) -> None:
    listen = f"0.0.0.0:{free_port()}"
    cmd = _controller_cmd("--listen", listen, *_tls_args(pki.controller()))
    with _running(cmd, _env(), lambda line: "listening on" in line) as run:
        assert all(ip.is_unspecified for ip, _p in run.listeners), run.listeners
    assert "WITHOUT TLS" not in run.stderr, run.stderr


# --- the rule itself -------------------------------------------------------------------------------


def test_the_listen_rule_in_the_configs(pki: Pki) -> None:
    assert AgentConfig().tcp_host == "" and AgentConfig().listen_host == "127.0.0.1"
    assert AgentConfig(insecure_plaintext_on_network=True).listen_host == "0.0.0.0"
    assert AgentConfig(**tls_flags(pki.agent())).listen_host == "0.0.0.0"
    assert AgentConfig(tcp_host="::1").listen_host == "::1"
    for host in ("127.0.0.1", "127.0.0.53", "::1", "localhost"):
        AgentConfig(tcp_host=host)
        ControllerConfig(listen=f"[{host}]:0" if ":" in host else f"{host}:0")
    AgentConfig(tcp_host="0.0.0.0", tcp_port=-1)  # no TCP listener: nothing to refuse
    AgentConfig(tcp_host="0.0.0.0", insecure_plaintext_on_network=True)
    AgentConfig(tcp_host="0.0.0.0", **tls_flags(pki.agent()))
    ControllerConfig(listen="0.0.0.0:0", insecure_plaintext_on_network=True)
    ControllerConfig(listen="0.0.0.0:0", **tls_flags(pki.controller()))
    with pytest.raises(ValueError, match=r"tcp_host='0\.0\.0\.0' is not a loopback address"):
        AgentConfig(tcp_host="0.0.0.0")
    with pytest.raises(ValueError, match=r"listen='\[::\]:0' is not a loopback address"):
        ControllerConfig(listen="[::]:0")
    with pytest.raises(ConfigError, match="insecure-plaintext-on-network"):
        load_config(ControllerConfig, env={"KVGRID_LISTEN": "0.0.0.0:1"})
    assert load_config(
        ControllerConfig, env={"KVGRID_LISTEN": "0.0.0.0:1", "KVGRID_INSECURE_PLAINTEXT_ON_NETWORK": "true"}
    ).insecure_plaintext_on_network
    assert not is_loopback_host("0.0.0.0") and not is_loopback_host("[::]") and not is_loopback_host("myhost")
