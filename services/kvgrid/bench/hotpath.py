"""``kvgrid bench hotpath``: the host time of one request's calls to its agent, per transport.

One request of a serving engine with engine copies and the connector's ``lease_at_lookup`` (the
default) makes three calls to its agent: Lookup with ``lease`` (the scheduler; the agent leases the
hits and answers their offsets, so no bytes move and the worker needs no Retrieve), Release of that
lease (``AgentClient.release_nowait``, one-way on the hot path, so its column is the send alone and
the agent's work on it delays the Store after it) and Store (its chunks are held already: no bytes
move either). Without it, a Retrieve with ``engine_copies`` takes the lease: a fourth call, timed
here as the flow ``hot+retrieve``. This bench starts a real ``kvgrid agent`` (L1 shared, hot path
on), registers a one-layer CPU KV cache and times each flow, median over ``--iters`` requests:

* ``hot``: the lease flow over the hot path (``kvgrid.common.hotpath``, a plain Unix socket;
  ``--spin-us``: the client polls for each reply that long before sleeping,
  ``AgentClient(hot_path_spin_us=...)``),
* ``hot+retrieve``: Lookup, Retrieve, Release, Store over the hot path (``lease_at_lookup: false``),
* ``grpc``: the lease flow over gRPC on the agent's Unix socket (what every call cost before the
  hot path),
* ``hot spaced`` (``--gap-us``, 0 leaves it out): the lease flow over the hot path with the client
  busy for ``--gap-us`` before each call, as an engine is between its calls (they come from the
  scheduler, the completer and the saver, milliseconds apart): the agent's thread has gone back to
  sleep each time, so every call pays its wakeup with cold caches. The flows above send each call
  right after the last one's reply and catch the agent still awake, so they read low,

and, as the limit in the same run, a bare Unix-socket echo between this process and a child process
(no framing, no agent work): its round trip times the flow's round trips (one-way sends not
counted). Printed: microseconds per request and per call, and per flow the limit over its time.
The goal: <= 100 us per request on the hot path.
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
from typing import TYPE_CHECKING, Annotated

import msgspec
import torch

from kvgrid.bench.agent_procs import AgentDidNotStart, bench_env, shm_scratch, start_agent, stop_all
from kvgrid.common.config import add_config_arguments, config_from_args

if TYPE_CHECKING:
    from kvgrid.engine.client import AgentClient

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


FLOWS = {
    "hot": ("hot", True, False),
    "hot+retrieve": ("hot", False, False),
    "grpc": ("grpc", True, False),
    "hot spaced": ("hot", True, True),
}
"""Flow name: (transport, whether the Lookup takes the lease (else a Retrieve does), whether the
client works ``--gap-us`` before each call)."""


def _d(text: str) -> msgspec.Meta:
    return msgspec.Meta(description=text)


class HotPathBenchConfig(msgspec.Struct, frozen=True, kw_only=True):
    iters: Annotated[int, msgspec.Meta(ge=10, description="requests timed per transport (median)")] = 2000
    chunks: Annotated[int, msgspec.Meta(ge=1, le=1024, description="chunks per request (keys per call)")] = 8
    spin_us: Annotated[
        int,
        msgspec.Meta(ge=0, description="the hot-path client spins this long for a reply before sleeping"),
    ] = 0
    agent_spin_us: Annotated[
        int,
        msgspec.Meta(
            ge=0,
            le=1_000_000,
            description="the agent's hot_path_spin_us: it polls for the next call this long before sleeping",
        ),
    ] = 0
    gap_us: Annotated[
        int,
        msgspec.Meta(
            ge=0,
            le=100_000,
            description="the 'hot spaced' flow: the client works this long before each call, as an engine "
            "does between its calls (0: no such flow)",
        ),
    ] = 1000
    json: Annotated[bool, _d("print one JSON object instead of a table")] = False


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, HotPathBenchConfig)


def _work(seconds: float) -> None:
    """Keep this thread busy (not asleep) for ``seconds``: an engine thread between its agent calls."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _flows(cfg: HotPathBenchConfig) -> list[str]:
    return [f for f, (_, _, spaced) in FLOWS.items() if cfg.gap_us or not spaced]


def _request(
    client: AgentClient,
    rid: str,
    keys: list[bytes],
    ids: list[list[int]],
    *,
    lease: bool,
    gap: float,
    chunks: int,
) -> dict[str, float]:
    """Seconds of each call of one request (Lookup, Retrieve unless the Lookup leases, one-way
    Release, Store), each after ``gap`` seconds of work; RuntimeError when the agent's answers are
    not those of a full hit (the bench would time something else)."""
    took = {"retrieve": 0.0}
    _work(gap)
    t0 = time.perf_counter()
    found = client.lookup("bench", rid, keys, lease=lease)
    took["lookup"] = time.perf_counter() - t0
    got, lease_id = len(found.chunk_offsets), found.lease_id
    if not lease:
        _work(gap)
        t0 = time.perf_counter()
        res = client.retrieve("bench", rid, keys, ids, engine_copies=True)
        took["retrieve"] = time.perf_counter() - t0
        got, lease_id = len(res.chunk_offsets), res.lease_id
    _work(gap)
    t0 = time.perf_counter()
    client.release_nowait("bench", rid, lease_id)
    took["release"] = time.perf_counter() - t0
    _work(gap)
    t0 = time.perf_counter()
    held = client.store("bench", keys, ids, skip_first_n_chunks=chunks).num_stored_chunks
    took["store"] = time.perf_counter() - t0
    if (found.num_hit_chunks, got, held) != (chunks,) * 3 or not lease_id:
        raise RuntimeError(
            f"{rid}: lookup {found.num_hit_chunks}, leased {got} (lease {lease_id}), store {held} of {chunks}"
        )
    return took


def _echo_rtt(tmp: Path, iters: int, nbytes: int, gap: float = 0.0) -> float:
    """Median seconds of one round trip of ``nbytes`` through a bare Unix-socket echo process, each
    after this thread worked ``gap`` seconds (the echo asleep meanwhile)."""
    path = str(tmp / f"echo-{gap}.sock")
    proc = subprocess.Popen([sys.executable, "-c", _ECHO, path], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(path)
            msg, times = b"x" * nbytes, []
            for _ in range(iters):
                _work(gap)
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
    from kvgrid.common.hashing import KeyNamespace, chunk_keys
    from kvgrid.engine.client import AgentClient
    from kvgrid.engine.tensors import allocate_shared_tensor

    block, tpc = 16, 64
    bpc = tpc // block
    shape = (bpc * cfg.chunks, 2, block, 2, 8)
    kv = allocate_shared_tensor(tmp / "layer0.kv", shape, torch.bfloat16)
    kv.copy_(torch.randn(shape).to(torch.bfloat16))
    uds = tmp / "agent.sock"
    agent, _ = start_agent(
        "hotpath",
        ["--uds-path", str(uds), "--tcp-port", "-1", "--l1-size", "64MiB", "--shm-allowed-dirs", str(tmp),
         "--l1-shared-dir", str(tmp), "--log-level", "warning", "--hot-path-spin-us", str(cfg.agent_spin_us)],
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
        for name in _flows(cfg):
            transport, lease, spaced = FLOWS[name]
            c, gap = clients[transport], cfg.gap_us / 1e6 if spaced else 0.0
            calls: dict[str, list[float]] = {"lookup": [], "retrieve": [], "release": [], "store": []}
            for i in range(cfg.iters + 50):  # the first 50 warm up (connections, caches)
                took = _request(c, f"{name}-{i}", keys, ids, lease=lease, gap=gap, chunks=cfg.chunks)
                if i >= 50:
                    for step, xs in calls.items():
                        xs.append(took[step])
            per_call[name] = calls
    finally:
        stop_all(clients.values(), [agent])
    nbytes = 64 + 16 * cfg.chunks
    echo = {False: _echo_rtt(tmp, cfg.iters, nbytes)}
    if cfg.gap_us:
        echo[True] = _echo_rtt(tmp, cfg.iters, nbytes, cfg.gap_us / 1e6)

    def us(x: float) -> float:
        return float(f"{x * 1e6:.4g}")

    out: dict[str, object] = {
        "iters": cfg.iters,
        "chunks": cfg.chunks,
        "spin_us": cfg.spin_us,
        "agent_spin_us": cfg.agent_spin_us,
        "gap_us": cfg.gap_us,
        "echo_rtt_us": us(echo[False]),
        **({"spaced_echo_rtt_us": us(echo[True])} if cfg.gap_us else {}),
    }
    for name, calls in per_call.items():
        per_request = [sum(xs) for xs in zip(*calls.values(), strict=True)]
        request_us = statistics.median(per_request)
        _, lease, spaced = FLOWS[name]
        limit = (2 if lease else 3) * echo[spaced]  # Release is one-way
        out[name] = {
            "request_us": us(request_us),
            **{f"{k}_us": us(statistics.median(v)) for k, v in calls.items()},
            "limit_us": us(limit),
            "limit_vs_request": float(f"{limit / request_us:.4g}"),
        }
    hot, before, grpc_ = out["hot"], out["hot+retrieve"], out["grpc"]
    assert isinstance(hot, dict) and isinstance(before, dict) and isinstance(grpc_, dict)
    out["hot_vs_grpc"] = float(f"{hot['request_us'] / grpc_['request_us']:.4g}")
    out["lease_vs_retrieve"] = float(f"{hot['request_us'] / before['request_us']:.4g}")
    if cfg.gap_us:
        apart = out["hot spaced"]
        assert isinstance(apart, dict)
        out["spaced_vs_hot"] = float(f"{apart['request_us'] / hot['request_us']:.4g}")
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
    spaced_echo = f" ({result['spaced_echo_rtt_us']:.4g} us spaced)" if cfg.gap_us else ""
    print(
        f"one request's agent calls ({cfg.chunks} chunks, no bytes moved, hot-path spin: client "
        f"{cfg.spin_us} us, agent {cfg.agent_spin_us} us; spaced flow {cfg.gap_us} us apart), median of "
        f"{cfg.iters}; bare Unix-socket round trip {result['echo_rtt_us']:.4g} us{spaced_echo}; "
        "limit = the flow's round trips x that"
    )
    head = ("request us", "lookup", "retrieve", "release", "store", "limit us", "limit/req")
    print(f"{'':14}" + "".join(f"{h:>11}" for h in head))
    for name in _flows(cfg):
        r = result[name]
        assert isinstance(r, dict)
        cols = ("request_us", "lookup_us", "retrieve_us", "release_us", "store_us", "limit_us")
        print(f"{name:14}" + "".join(f"{r[c]:>11.4g}" for c in cols) + f"{r['limit_vs_request']:>11.3g}")
    print(
        f"hot / grpc {result['hot_vs_grpc']:.4g}; "
        f"lease at Lookup / Lookup + Retrieve {result['lease_vs_retrieve']:.4g}"
        + (f"; spaced / back to back {result['spaced_vs_hot']:.4g}" if cfg.gap_us else "")
    )
    return 0
