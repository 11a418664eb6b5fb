"""The faults ``kvgrid chaos`` injects, one at a time, and the run that injects them under load.

Each fault is injected, held for a random while (the load keeps going through it), then healed
(the process restarted or continued, connections allowed again, the ballast deleted). After the
heal new requests are held, the in-flight ones finish, and the controller's L1 index of every pod
(``SnapshotIndex``) is compared with the agent's own ``Snapshot`` (same epoch, same keys) every
25 ms: the *recovery* is the seconds from the heal until they are equal for every agent.
"""

from __future__ import annotations

import contextlib
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from kvgrid.api.v1 import common_pb2, controller_pb2, controller_pb2_grpc
from kvgrid.bench.chaos.cluster import AgentSlot, Cluster
from kvgrid.bench.chaos.load import Load

__all__ = ["KINDS", "FaultRun", "Outcome", "index_matches"]

Heal = Callable[[], None]

KINDS: dict[str, str] = {
    "agent-kill": "kill -9 an agent, restart it (its engine registers again)",
    "agent-stop": "SIGSTOP an agent, SIGCONT it",
    "controller-kill": "kill -9 the controller, restart it (its index is in Valkey)",
    "controller-stop": "SIGSTOP the controller, SIGCONT it",
    "valkey-kill": "kill -9 Valkey, restart it empty on the same port",
    "valkey-stop": "SIGSTOP Valkey, SIGCONT it",
    "cut-controller": "close every agent -> controller connection and refuse new ones",
    "cut-valkey": "close every controller -> Valkey connection and refuse new ones",
    "disk-full": "fill an agent's disk-tier filesystem (a tmpfs) until writes fail with ENOSPC",
    "disk-corrupt": "flip one byte in a few of an agent's disk-tier records",
    "s3-stop": "SIGSTOP the S3 server (requests hang until they time out), SIGCONT it",
    "s3-cut": "close every agent -> S3 connection and refuse new ones (S3 unreachable)",
}


def index_matches(cluster: Cluster, stub: controller_pb2_grpc.ControllerServiceStub) -> bool:
    """True when, for every agent, the controller's L1 entries of its pod are exactly the agent's
    L1 keys, under the agent's current epoch."""
    for slot in cluster.agents:
        assert slot.control is not None
        try:
            truth = slot.control.snapshot()
            ix = stub.SnapshotIndex(
                controller_pb2.SnapshotIndexRequest(pod_uid=slot.pod_uid, tier=common_pb2.TIER_L1), timeout=2
            )
        except grpc.RpcError:
            return False
        if ix.pod.epoch != truth.pod.epoch or set(ix.chunk_keys) != set(truth.chunk_keys):
            return False
    return True


@dataclass
class Outcome:
    faults: dict[str, int] = field(default_factory=dict)
    recoveries: dict[str, list[float]] = field(default_factory=dict)
    unrecovered: list[str] = field(default_factory=list)
    undrained: int = 0
    """Faults after which in-flight requests did not finish before the comparison."""
    aborted: str = ""


class FaultRun:
    def __init__(
        self,
        cluster: Cluster,
        load: Load,
        kinds: list[str],
        *,
        seed: int,
        hold_s: tuple[float, float],
        gap_s: tuple[float, float],
        recovery_timeout_s: float,
        drain_timeout_s: float,
        progress: bool,
    ) -> None:
        self.cluster = cluster
        self.load = load
        self.kinds = kinds
        self.rng = random.Random(seed)
        self.hold_s = hold_s
        self.gap_s = gap_s
        self.recovery_timeout_s = recovery_timeout_s
        self.drain_timeout_s = drain_timeout_s
        self.progress = progress
        self.out = Outcome()
        self.effects: dict[str, int] = {}
        """What the faults did: connections cut, disk-tier records corrupted, ballast bytes."""
        self._channel = grpc.insecure_channel(f"127.0.0.1:{cluster.controller_port}")
        self.stub = controller_pb2_grpc.ControllerServiceStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    # ----- the loop -----

    def schedule(self) -> str:
        """Every kind once (shuffled), then at random: a short run still covers them all."""
        n = sum(self.out.faults.values())
        if n < len(self.kinds):
            if n == 0:
                self._first = self.rng.sample(self.kinds, len(self.kinds))
            return self._first[n]
        return self.rng.choice(self.kinds)

    def run(self, max_faults: int, duration_s: float) -> None:
        start = time.monotonic()
        last_report = start
        while True:
            n = sum(self.out.faults.values())
            if (max_faults and n >= max_faults) or (duration_s and time.monotonic() - start >= duration_s):
                break
            time.sleep(self.rng.uniform(*self.gap_s))  # load between faults
            kind = self.schedule()
            try:
                self.one(kind)
            except Exception as e:  # a heal that failed: the cluster is not whole, stop here
                self.out.aborted = f"{kind}: {type(e).__name__}: {e}"
                return
            now = time.monotonic()
            if self.progress and (now - last_report > 10 or n + 1 == max_faults):
                last_report = now
                self.print_progress(now - start)

    def print_progress(self, elapsed: float) -> None:
        st = self.load.stats
        rec = [r for rs in self.out.recoveries.values() for r in rs]
        p50, p99 = percentile(rec, 0.5), percentile(rec, 0.99)
        print(
            f"chaos: {sum(self.out.faults.values())} faults in {elapsed:.0f} s, {st.requests} requests, "
            f"{st.chunks_loaded} chunks loaded, wrong bytes {st.wrong_bytes}, stuck {st.stuck}, "
            f"recovery p50 {p50:.2f} s p99 {p99:.2f} s, unrecovered {len(self.out.unrecovered)}",
            file=sys.stderr,
            flush=True,
        )

    def one(self, kind: str) -> None:
        heal = self.inject(kind)
        self.out.faults[kind] = self.out.faults.get(kind, 0) + 1
        try:
            time.sleep(self.rng.uniform(*self.hold_s))
        finally:
            heal()
        healed = time.monotonic()
        if not self.load.pause(self.drain_timeout_s):
            self.out.undrained += 1
        try:
            while not index_matches(self.cluster, self.stub):
                if time.monotonic() - healed > self.recovery_timeout_s:
                    self.out.unrecovered.append(kind)
                    return
                time.sleep(0.025)
            self.out.recoveries.setdefault(kind, []).append(time.monotonic() - healed)
        finally:
            self.load.resume()

    # ----- the faults: each injects and returns its heal -----

    def _agent(self) -> AgentSlot:
        return self.rng.choice(self.cluster.agents)

    def inject(self, kind: str) -> Heal:
        c = self.cluster
        if kind == "agent-kill":
            slot = self._agent()
            c.kill_agent(slot)
            return lambda: c.restart_agent(slot)
        if kind == "agent-stop":
            proc = self._agent().proc
            c.pause(proc)
            return lambda: c.resume(proc)
        if kind == "controller-kill":
            c.kill(c.controller)
            return c.restart_controller
        if kind == "controller-stop":
            proc = c.controller
            c.pause(proc)
            return lambda: c.resume(proc)
        if kind == "valkey-kill":
            c.kill(c.valkey)
            return c.restart_valkey
        if kind == "valkey-stop":
            proc = c.valkey
            c.pause(proc)
            return lambda: c.resume(proc)
        if kind in ("cut-controller", "cut-valkey", "s3-cut"):
            proxy = c.proxies[{"cut-controller": "controller", "cut-valkey": "valkey", "s3-cut": "s3"}[kind]]
            self._effect(f"{kind} connections closed", proxy.cut())
            return proxy.restore
        if kind == "disk-full":
            ballast = c.fill_disk(self._agent())
            self._effect("disk-full ballast MiB", ballast.stat().st_size >> 20)
            return lambda: ballast.unlink(missing_ok=True)
        if kind == "disk-corrupt":
            slot = max(self.cluster.agents, key=lambda s: len(list(s.tier_dir.rglob("*.kvc"))))
            self._effect("disk-corrupt records altered", c.corrupt_records(slot, self.rng, 3))
            return lambda: None
        if kind == "s3-stop":
            proc = c.weed
            c.pause(proc)
            return lambda: c.resume(proc)
        raise ValueError(f"unknown fault kind {kind!r}: expected one of {', '.join(KINDS)}")

    def _effect(self, what: str, n: int) -> None:
        self.effects[what] = self.effects.get(what, 0) + n

    # ----- after the run -----

    def leaks(self, engines_release: Callable[[], None]) -> tuple[int, int]:
        """(pins, leased chunks) the agents still hold once the load stopped, every request that
        met a failure was released once more, and ``drain_timeout_s`` passed."""
        engines_release()
        deadline = time.monotonic() + self.drain_timeout_s
        pins = leases = 0
        while True:
            pins = leases = 0
            for slot in self.cluster.agents:
                assert slot.control is not None
                with contextlib.suppress(grpc.RpcError):
                    h = slot.control.health()
                    pins += h.num_pinned_chunks
                    leases += h.num_leased_chunks
            if (pins == 0 and leases == 0) or time.monotonic() > deadline:
                return pins, leases
            time.sleep(0.1)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary_of(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50_s": statistics.median(values) if values else 0.0,
        "p99_s": percentile(values, 0.99),
        "max_s": max(values, default=0.0),
    }
