"""Peer indexers for ``kvgrid bench lookup --peers``, run as a script by the peers' Python.

Run as ``PYTHON lookup_peers.py WORKLOAD`` by the bench (it imports nothing of kvgrid, so it can run
in another environment: the peers' wheels pin versions kvgrid's environment must not take). It
loads the workload file the bench wrote (msgpack: pods, per-pod chains, queries), then answers
one JSON command per stdin line with one JSON line on stdout:

- ``dynamo_inproc``: Dynamo's radix tree (``dynamo._core.RadixTree`` from ``ai-dynamo-runtime``)
  filled with every pod's chains as ``stored`` events (one block per chunk: the chunk's 4 tokens,
  Dynamo's own XXH3 block hash); RSS growth, apply time;
- ``inproc_single``: ``find_matches`` of one query at a time for ``seconds`` (wall latencies and
  this process's CPU per query);
- ``dynamo_http``: Dynamo's standalone indexer service (``python -m dynamo.indexer``) fed through
  vLLM-format KV events on one ZMQ PUB socket per pod (the path its docs describe); its pid,
  address, RSS growth, time until every pod's events were applied;
- ``bodies``: the ``/query_by_hash`` JSON bodies of the queries (for the bench's HTTP callers);
- ``answers``: the longest match per query, in blocks, from each running Dynamo (the bench
  compares it with kvgrid's);
- ``quit``.

Invariant: the same queries as kvgrid's, in the same order; a peer that cannot be imported or
started answers ``{"error": ...}`` naming why, and the bench reports it instead of a number.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import http.client
import importlib
import json
import os
import socket
import struct
import subprocess
import sys
import time
from typing import Any

import msgspec

TOKENS = struct.Struct("<4I")
BLOCK = 4  # tokens per block (each chunk is one block of 4 tokens)
MODEL = "bench"


def rss_bytes(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def trim() -> None:
    """Return freed heap pages to the OS (glibc), as the bench does for kvgrid's index."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def tokens(keys: list[bytes]) -> list[int]:
    out: list[int] = []
    for k in keys:
        out += (t & 0x7FFF_FFFF for t in TOKENS.unpack(k))
    return out


def ext(key: bytes) -> int:
    """The engine-side block hash (opaque to the indexer): the key's first 8 bytes."""
    return int.from_bytes(key[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


class Peers:
    def __init__(self, workload: dict[str, Any]) -> None:
        self.dynamo = importlib.import_module("dynamo._core")  # in the peers' environment only
        self.hash = self.dynamo.compute_block_hash_for_seq
        self.pods: int = workload["pods"]
        self.chains: dict[int, list[tuple[bytes | None, list[bytes]]]] = {
            int(p): [(parent, keys) for parent, keys in lst] for p, lst in workload["chains"].items()
        }
        self.queries: list[list[bytes]] = workload["queries"]
        self.local = [self.hash(tokens(q), BLOCK) for q in self.queries]
        self.tree: Any = None
        self.http: subprocess.Popen[bytes] | None = None
        self.http_addr = ""

    # --- Dynamo in-process ----------------------------------------------------------------------
    def dynamo_inproc(self) -> dict[str, Any]:
        trim()
        rss0 = rss_bytes()
        tree = self.dynamo.RadixTree()
        blocks = events = 0
        t0 = time.perf_counter()
        for pod, chains in self.chains.items():
            for i, (parent, keys) in enumerate(chains):
                local = self.hash(tokens(keys), BLOCK)
                ev = {
                    "event_id": i,
                    "data": {
                        "stored": {
                            "parent_hash": None if parent is None else ext(parent),
                            "blocks": [
                                {"block_hash": ext(k), "tokens_hash": h}
                                for k, h in zip(keys, local, strict=True)
                            ],
                        }
                    },
                }
                tree.apply_event(pod + 1, json.dumps(ev).encode())
                blocks += len(keys)
                events += 1
        # events are applied by the tree's own thread: wait until the last pod's last chain matches
        self._wait(lambda: self._tree_best(tree, self._probe()) == len(self._probe()), "in-process tree")
        dt = time.perf_counter() - t0
        self.tree = tree
        trim()
        return {"rss_bytes": rss_bytes() - rss0, "apply_s": dt, "events": events, "blocks": blocks}

    def _probe(self) -> list[int]:
        pod = max(self.chains)
        parent_chain: list[bytes] = []
        keys_of = {}
        for parent, keys in self.chains[pod]:
            keys_of[keys[-1]] = (parent, keys)
        last_parent, last_keys = self.chains[pod][-1]
        parent_chain = list(last_keys)
        while last_parent is not None:
            last_parent, keys = keys_of[last_parent]
            parent_chain = keys + parent_chain
        return self.hash(tokens(parent_chain), BLOCK)

    @staticmethod
    def _tree_best(tree: Any, local: list[int]) -> int:
        return max(tree.find_matches(local).scores.values(), default=0)

    @staticmethod
    def _wait(done: Any, what: str, timeout: float = 600.0) -> None:
        end = time.monotonic() + timeout
        while not done():
            if time.monotonic() > end:
                raise RuntimeError(f"{what}: events not applied after {timeout} s")
            time.sleep(0.01)

    def inproc_single(self, seconds: float) -> dict[str, Any]:
        tree, local = self.tree, self.local
        for q in local[:50]:
            tree.find_matches(q)
        lat = []
        i = 0
        stop = time.perf_counter() + seconds
        t0 = time.perf_counter()
        c0 = time.process_time()
        while time.perf_counter() < stop:
            t = time.perf_counter()
            tree.find_matches(local[i % len(local)]).scores  # noqa: B018 - the answer is read as a router would
            lat.append(time.perf_counter() - t)
            i += 1
        wall = time.perf_counter() - t0
        cpu = time.process_time() - c0
        lat.sort()
        return {
            "calls_s": len(lat) / wall,
            "p50_ms": 1000 * lat[len(lat) // 2],
            "p99_ms": 1000 * lat[int(len(lat) * 0.99)],
            "cpu_us": 1e6 * cpu / len(lat),
        }

    # --- Dynamo's indexer service (HTTP + ZMQ) ------------------------------------------------------
    def dynamo_http(self, threads: int) -> dict[str, Any]:
        import zmq

        port = _free_port()
        self.http_addr = f"127.0.0.1:{port}"
        self.http = subprocess.Popen(
            [sys.executable, "-m", "dynamo.indexer", "--port", str(port), "--threads", str(threads)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self._wait(lambda: _get(self.http_addr, "/health") == 200, "dynamo indexer start", 60)
        rss0 = rss_bytes(self.http.pid)
        ctx = zmq.Context()
        ctx.set(zmq.MAX_SOCKETS, len(self.chains) + 64)  # the default, 1,023, is short of 1,024 pods
        socks = {}
        for pod in self.chains:
            s = ctx.socket(zmq.PUB)
            s.setsockopt(zmq.SNDHWM, 0)
            zport = s.bind_to_random_port("tcp://127.0.0.1")
            socks[pod] = s
            body = {"instance_id": pod + 1, "endpoint": f"tcp://127.0.0.1:{zport}", "model_name": MODEL,
                    "block_size": BLOCK}  # fmt: skip
            code, text = _post(self.http_addr, "/register", body)
            if code != 201:
                raise RuntimeError(f"dynamo indexer /register: HTTP {code}: {text}")
        # the subscriber connects asynchronously: publish a probe per pod until each is seen
        seq = dict.fromkeys(self.chains, 0)
        probe_keys = {pod: [os.urandom(16)] for pod in self.chains}
        pending = set(self.chains)
        end = time.monotonic() + 60
        while pending:
            for pod in list(pending):
                seq[pod] += 1
                socks[pod].send_multipart(_vllm_batch(seq[pod], None, probe_keys[pod]))
            time.sleep(0.05)
            for pod in list(pending):
                if self._http_best(self.hash(tokens(probe_keys[pod]), BLOCK)) >= 1:
                    pending.discard(pod)
            if time.monotonic() > end:
                raise RuntimeError(f"dynamo indexer never received events of {len(pending)} pods")
        t0 = time.perf_counter()
        events = 0
        for pod, chains in self.chains.items():
            for parent, keys in chains:
                seq[pod] += 1
                socks[pod].send_multipart(_vllm_batch(seq[pod], parent, keys))
                events += 1
        probe = self._probe()
        self._wait(lambda: self._http_best(probe) == len(probe), "dynamo indexer")
        dt = time.perf_counter() - t0
        for s in socks.values():
            s.close(0)
        ctx.term()
        return {"address": self.http_addr, "pid": self.http.pid, "rss_bytes": rss_bytes(self.http.pid) - rss0,
                "ingest_s": dt, "events": events}  # fmt: skip

    def _http_best(self, local: list[int]) -> int:
        code, text = _post(self.http_addr, "/query_by_hash", self._body(local))
        if code != 200:
            raise RuntimeError(f"dynamo indexer /query_by_hash: HTTP {code}: {text}")
        scores = json.loads(text)["scores"]
        return max((v for ranks in scores.values() for v in ranks.values()), default=0) // BLOCK

    @staticmethod
    def _body(local: list[int]) -> dict[str, Any]:
        return {"block_hashes": [h - (1 << 64) if h >= 1 << 63 else h for h in local], "model_name": MODEL}

    def bodies(self) -> dict[str, Any]:
        return {"bodies": [json.dumps(self._body(q), separators=(",", ":")) for q in self.local]}

    def answers(self, n: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.tree is not None:
            out["inproc"] = [self._tree_best(self.tree, q) for q in self.local[:n]]
        if self.http is not None:
            out["http"] = [self._http_best(q) for q in self.local[:n]]
        return out

    def close(self) -> None:
        if self.http is not None:
            self.http.terminate()
            self.http.wait(10)


def _vllm_batch(seq: int, parent: bytes | None, keys: list[bytes]) -> list[bytes]:
    """One vLLM KV-event ZMQ message (topic, sequence, msgpack EventBatch) storing ``keys``."""
    parent_hash = None if parent is None else ext(parent)
    stored = ["BlockStored", [ext(k) for k in keys], parent_hash, tokens(keys), BLOCK, None, "GPU", None]
    return [b"", seq.to_bytes(8, "big"), msgspec.msgpack.encode([time.time(), [stored], 0])]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(addr: str, path: str) -> int:
    host, _, port = addr.rpartition(":")
    try:
        c = http.client.HTTPConnection(host, int(port), timeout=2)
        c.request("GET", path)
        return c.getresponse().status
    except OSError:
        return 0


_CONNS: dict[str, http.client.HTTPConnection] = {}


def _post(addr: str, path: str, body: Any) -> tuple[int, str]:
    c = _CONNS.get(addr)
    if c is None:
        host, _, port = addr.rpartition(":")
        c = _CONNS[addr] = http.client.HTTPConnection(host, int(port), timeout=30)
    c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    return r.status, r.read().decode()


def main() -> int:
    with open(sys.argv[1], "rb") as f:
        workload = msgspec.msgpack.decode(f.read())
    try:
        peers = Peers(workload)
    except Exception as e:  # reported to the bench, which prints why the peer is absent
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
        return 0
    gc.collect()
    gc.freeze()  # the workload's objects are not the peer's state (as in the bench's process)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["cmd"] == "quit":
                break
            fn = getattr(peers, cmd["cmd"])
            out = fn(*cmd.get("args", []))
        except Exception as e:
            out = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(out), flush=True)
    peers.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
