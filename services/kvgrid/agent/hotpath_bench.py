"""``kvgrid bench hotpath``: the host time of one request's calls to its agent, per transport.

One request of a serving engine with engine copies and the connector's ``lease_at_lookup`` (the
default) makes three calls to its agent: Lookup with ``lease`` (the scheduler; the agent leases the
hits and answers their offsets, so no bytes move and the worker needs no Retrieve), Release of that
lease (``AgentClient.release_nowait``, one-way on the hot path, so its column is the send alone and
the agent's work on it delays the Store after it) and Store (its chunks are held already: no bytes
move either). Without it, a Retrieve with ``engine_copies`` takes the lease: a fourth call, timed
here as the flow ``hot+retrieve``. This bench starts a real ``kvgrid agent`` (L1 shared, hot path
on), registers a one-layer CPU KV cache and times each flow, median over ``--iters`` requests:

* ``hot``: the lease flow over the hot path (``kvgrid.agent.hotpath``, a plain Unix socket;
  ``--spin-us``: the client polls for each reply that long before sleeping,
  ``AgentClient(hot_path_spin_us=...)``),
* ``hot+retrieve``: Lookup, Retrieve, Release, Store over the hot path (``lease_at_lookup: false``),
* ``grpc``: the lease flow over gRPC on the agent's Unix socket (what every call cost before the
  hot path),

and, as the limit in the same run, a bare Unix-socket echo between this process and a child process
(no framing, no agent work): its round trip times the flow's round trips (one-way sends not
counted). Printed: microseconds per request and per call, and per flow the limit over its time.
Issue 11's goal: <= 100 us per request on the hot path.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated

import msgspec
import torch

from kvgrid.agent.bench_procs import AgentDidNotStart, bench_env, shm_scratch, start_agent, stop_all
from kvgrid.common.config import add_config_arguments, config_from_args

__all__ = ["HotPathBenchConfig", "add_arguments", "run"]

_ECHO = """
import socket, sys
s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(1); print("ready", flush=True)
c, _ = s.accept()
while True:
    b = c.recv(65536)
    if not b:
        break
    c.sendall(b)
"""


FLOWS = {"hot": ("hot", True), "hot+retrieve": ("hot", False), "grpc": ("grpc", True)}
"""Flow name: (transport, whether the Lookup takes the lease; else a Retrieve does)."""


def _d(text: str) -> msgspec.Meta:
    return msgspec.Meta(description=text)


class HotPathBenchConfig(msgspec.Struct, frozen=True, kw_only=True):
    iters: Annotated[int, msgspec.Meta(ge=10, description="requests timed per transport (median)")] = 2000
    chunks: Annotated[int, msgspec.Meta(ge=1, le=1024, description="chunks per request (keys per call)")] = 8
    spin_us: Annotated[
        int,
        msgspec.Meta(ge=0, description="the hot-path client spins this long for a reply before sleeping"),
    ] = 0
    json: Annotated[bool, _d("print one JSON object instead of a table")] = False


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, HotPathBenchConfig)


def _echo_rtt(tmp: Path, iters: int, nbytes: int) -> float:
    """Median seconds of one round trip of ``nbytes`` through a bare Unix-socket echo process."""
    path = str(tmp / "echo.sock")
    proc = subprocess.Popen([sys.executable, "-c", _ECHO, path], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(path)
            msg, times = b"x" * nbytes, []
            for _ in range(iters):
                t0 = time.perf_counter()
                s.sendall(msg)
                got = 0
                while got < nbytes:
                    got += len(s.recv(65536))
                times.append(time.perf_counter() - t0)
    finally:
        proc.wait(10)
    return statistics.median(times)


def measure(cfg: HotPathBenchConfig, tmp: Path) -> dict[str, object]:
    from kvgrid.agent.client import AgentClient
    from kvgrid.agent.tensors import allocate_shared_tensor
    from kvgrid.common.hashing import KeyNamespace, chunk_keys

    block, tpc = 16, 64
    bpc = tpc // block
    shape = (bpc * cfg.chunks, 2, block, 2, 8)
    kv = allocate_shared_tensor(tmp / "layer0.kv", shape, torch.bfloat16)
    kv.copy_(torch.randn(shape).to(torch.bfloat16))
    uds = tmp / "agent.sock"
    agent, _ = start_agent(
        "hotpath",
        ["--uds-path", str(uds), "--tcp-port", "-1", "--l1-size", "64MiB", "--shm-allowed-dirs", str(tmp),
         "--l1-shared-dir", str(tmp), "--log-level", "warning"],
        bench_env(),
    )  # fmt: skip
    clients = {
        "hot": AgentClient(str(uds), timeout_s=60, hot_path_spin_us=cfg.spin_us),
        "grpc": AgentClient(str(uds), timeout_s=60, hot_path=False),
    }
    try:
        ns = KeyNamespace(model="bench-hotpath", tokens_per_chunk=tpc)
        hints = [{"backend": "FLASHINFER"}]
        clients["grpc"].register_kv_caches(
            "bench", [kv], namespace=ns, shm_paths=[str(tmp / "layer0.kv")], layout_hints=hints
        )
        keys = chunk_keys(list(range(cfg.chunks * tpc)), ns)
        ids = [list(range(bpc * cfg.chunks))]
        clients["grpc"].store("bench", keys, ids)
        per_call: dict[str, dict[str, list[float]]] = {}
        for name, (transport, lease) in FLOWS.items():
            c = clients[transport]
            calls: dict[str, list[float]] = {"lookup": [], "retrieve": [], "release": [], "store": []}
            for i in range(cfg.iters + 50):  # the first 50 warm up (connections, caches)
                rid = f"{name}-{i}"
                t = [time.perf_counter()]
                found = c.lookup("bench", rid, keys, lease=lease)
                t.append(time.perf_counter())
                if lease:
                    got, lease_id = len(found.chunk_offsets), found.lease_id
                    t.append(t[-1])  # no Retrieve
                else:
                    res = c.retrieve("bench", rid, keys, ids, engine_copies=True)
                    got, lease_id = len(res.chunk_offsets), res.lease_id
                    t.append(time.perf_counter())
                c.release_nowait("bench", rid, lease_id)
                t.append(time.perf_counter())
                held = c.store("bench", keys, ids, skip_first_n_chunks=cfg.chunks).num_stored_chunks
                t.append(time.perf_counter())
                if (found.num_hit_chunks, got, held) != (cfg.chunks,) * 3 or not lease_id:
                    raise RuntimeError(
                        f"{name}: lookup {found.num_hit_chunks}, leased {got} (lease {lease_id}), "
                        f"store {held} of {cfg.chunks}"
                    )
                if i >= 50:
                    for k, step in enumerate(calls):
                        calls[step].append(t[k + 1] - t[k])
            per_call[name] = calls
    finally:
        stop_all(clients.values(), [agent])
    echo = _echo_rtt(tmp, cfg.iters, 64 + 16 * cfg.chunks)

    def us(x: float) -> float:
        return float(f"{x * 1e6:.4g}")

    out: dict[str, object] = {
        "iters": cfg.iters,
        "chunks": cfg.chunks,
        "spin_us": cfg.spin_us,
        "echo_rtt_us": us(echo),
    }
    for name, calls in per_call.items():
        per_request = [sum(xs) for xs in zip(*calls.values(), strict=True)]
        request_us = statistics.median(per_request)
        round_trips = 2 if FLOWS[name][1] else 3  # Release is one-way
        out[name] = {
            "request_us": us(request_us),
            **{f"{k}_us": us(statistics.median(v)) for k, v in calls.items()},
            "limit_us": us(round_trips * echo),
            "limit_vs_request": float(f"{round_trips * echo / request_us:.4g}"),
        }
    hot, before, grpc_ = out["hot"], out["hot+retrieve"], out["grpc"]
    assert isinstance(hot, dict) and isinstance(before, dict) and isinstance(grpc_, dict)
    out["hot_vs_grpc"] = float(f"{hot['request_us'] / grpc_['request_us']:.4g}")
    out["lease_vs_retrieve"] = float(f"{hot['request_us'] / before['request_us']:.4g}")
    return out


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(HotPathBenchConfig, args)
    with shm_scratch("kvgrid-bench-hotpath-") as tmp:
        try:
            result = measure(cfg, tmp)
        except AgentDidNotStart as e:
            print(f"kvgrid bench hotpath: {e}", file=sys.stderr)
            return 1
    if cfg.json:
        print(json.dumps(result))
        return 0
    print(
        f"one request's agent calls ({cfg.chunks} chunks, no bytes moved, hot-path spin "
        f"{cfg.spin_us} us), median of {cfg.iters}; bare Unix-socket round trip "
        f"{result['echo_rtt_us']:.4g} us; limit = the flow's round trips x that"
    )
    head = ("request us", "lookup", "retrieve", "release", "store", "limit us", "limit/req")
    print(f"{'':14}" + "".join(f"{h:>11}" for h in head))
    for name in FLOWS:
        r = result[name]
        assert isinstance(r, dict)
        cols = ("request_us", "lookup_us", "retrieve_us", "release_us", "store_us", "limit_us")
        print(f"{name:14}" + "".join(f"{r[c]:>11.4g}" for c in cols) + f"{r['limit_vs_request']:>11.3g}")
    print(
        f"hot / grpc {result['hot_vs_grpc']:.4g}; "
        f"lease at Lookup / Lookup + Retrieve {result['lease_vs_retrieve']:.4g}"
    )
    return 0
