"""``kvgrid bench p2p``: GB/s of peer chunk fetches between real agent processes against a raw
socket copy of the same bytes between two processes, measured in the same run.

The bench process plays the engines: it allocates a KV cache (Llama-shaped: ``--layers`` layers of 8
KV heads x 128, 16-token blocks, bf16, 256-token chunks, so a chunk is ``--layers`` MiB) in shared
memory (``--device cpu``) or on the GPU (``--device cuda``, CUDA IPC, pinned L1), starts
``--peers`` serving agents and one fetching agent (``kvgrid agent``, loopback TCP, no controller),
and registers the cache with each. Every round stores ``--chunks`` fresh chunks on each serving
agent, then times concurrent ``Lookup`` calls on the fetching agent, one per serving agent, each
naming its peer (``peer_address``): the agent's own peer-fetch path (FetchChunks control call, then
the data plane chosen by ``--data-plane``, checksum verification, commit into L1). A round counts
only if every chunk arrived.

The limit, timed in the same rounds (alternating with the fetches): a helper process sends the same
number of bytes from one buffer over as many TCP connections as the fetch uses (``--peers`` x
``--streams`` on the socket plane, ``--peers`` on gRPC), and this process receives them with
``recv_into`` into one preallocated buffer. Ratio = fetch GB/s / raw GB/s (median of ``--iters``
rounds each); goal >= 0.9. ``--tls-dir`` runs the agents with mutual TLS (a directory holding
``tls.crt``, ``tls.key`` and ``ca.crt`` of an agent certificate), the raw copy stays plaintext, so
the ratio then includes TLS's cost.

``--security`` lists data-plane modes to measure in the same run, each with agents of its own
(started once; every round fetches once per mode, then times the raw copy): ``none`` (no TLS, the
plaintext data plane with XXH3 checksums) and, with mTLS, the agents' ``peer_data_security``
modes ``mac``, ``aead`` and ``tls`` (docs/security.md, "Peer data plane"). The mTLS modes use
``--tls-dir``, or a throwaway CA and agent certificate made for the run when it is not given.
Default: ``tls`` with ``--tls-dir``, else ``none``. Each mode's ratio is to the same raw copy.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import msgspec
import numpy as np

if TYPE_CHECKING:
    from kvgrid.common.hashing import KeyNamespace
    from kvgrid.engine.client import AgentClient

from kvgrid.bench.agent_procs import AgentDidNotStart, bench_env, shm_scratch, start_agent, stop_all
from kvgrid.common.config import add_config_arguments, config_from_args

__all__ = ["P2PBenchConfig", "add_arguments", "run"]

ENV_PREFIX = "KVGRID_BENCH_P2P_"


def _d(text: str) -> msgspec.Meta:
    return msgspec.Meta(description=text)


class P2PBenchConfig(msgspec.Struct, frozen=True, kw_only=True):
    """``kvgrid bench p2p``'s options: defaults < ``--config`` YAML < ``KVGRID_BENCH_P2P_*`` env < flags."""

    device: Annotated[
        Literal["cpu", "cuda"],
        _d("where the engines' KV cache lives: cpu (shared memory) or cuda (CUDA IPC; pinned L1)"),
    ] = "cpu"
    layers: Annotated[int, _d("KV layers; a chunk is this many MiB"), msgspec.Meta(ge=1)] = 32
    chunks: Annotated[int, _d("chunks each fetch moves from one peer"), msgspec.Meta(ge=1)] = 16
    peers: Annotated[int, _d("serving agents, fetched from at the same time"), msgspec.Meta(ge=1)] = 1
    streams: Annotated[
        int, _d("data-plane TCP connections per fetch (peer_data_streams)"), msgspec.Meta(ge=1, le=16)
    ] = 4
    data_plane: Annotated[Literal["socket", "grpc"], _d("peer_data_plane of every agent")] = "socket"
    tls_dir: Annotated[
        str, _d("directory with tls.crt, tls.key, ca.crt of an agent certificate: run the agents with mTLS")
    ] = ""
    security: Annotated[
        list[Literal["none", "mac", "aead", "tls"]],
        _d(
            "data-plane modes to measure in one run, comma-separated: none (no TLS) or, with mTLS "
            "(--tls-dir, or a throwaway certificate made for the run), the agents' peer_data_security "
            "mac, aead, tls; empty: tls with --tls-dir, else none"
        ),
    ] = msgspec.field(default_factory=list)
    iters: Annotated[int, _d("timed rounds per figure (median)"), msgspec.Meta(ge=1)] = 5
    json: Annotated[bool, _d("print one JSON object instead of a table")] = False


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, P2PBenchConfig, env_prefix=ENV_PREFIX)


# ---- the raw socket copy ----------------------------------------------------------------------


def _raw_sender(port_out: multiprocessing.Queue, nbytes: int, connections: int, rounds: int) -> None:
    """Helper process: per round, accept ``connections`` connections and send each its share of
    ``nbytes`` from one buffer (a view: no copy in Python)."""
    buf = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8)
    share = nbytes // connections
    with socket.create_server(("127.0.0.1", 0)) as srv:
        port_out.put(srv.getsockname()[1])
        for _ in range(rounds):
            conns = [srv.accept()[0] for _ in range(connections)]

            def send(k: int, conn: socket.socket) -> None:
                with conn:
                    conn.recv(1)  # go
                    conn.sendall(buf.data[k * share : (k + 1) * share])

            threads = [threading.Thread(target=send, args=(k, c)) for k, c in enumerate(conns)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()


def _raw_round(port: int, dst: np.ndarray, connections: int) -> float:
    """Seconds to receive ``dst.nbytes`` over ``connections`` connections into ``dst``."""
    share = dst.nbytes // connections
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(connections)]

    def recv(k: int, sock: socket.socket) -> None:
        view = dst.data.cast("B")[k * share : (k + 1) * share]
        with sock:
            sock.sendall(b"g")
            got = 0
            while got < share:
                n = sock.recv_into(view[got:], share - got)
                if n == 0:
                    raise ConnectionError("raw sender hung up")
                got += n

    threads = [threading.Thread(target=recv, args=(k, s)) for k, s in enumerate(socks)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


# ---- the agents -------------------------------------------------------------------------------


def _start_agent(
    name: str,
    tmp: Path,
    cfg: P2PBenchConfig,
    l1_bytes: int,
    env: dict[str, str],
    mode: str,
    tls_dir: Path | None,
) -> tuple[subprocess.Popen[str], str, int]:
    uds = tmp / f"agent-{name}.sock"
    flags = [
        "--uds-path", str(uds), "--tcp-host", "127.0.0.1", "--tcp-port", "0", "--l1-size", str(l1_bytes),
        "--shm-allowed-dirs", str(tmp),
        "--peer-fetch", "off", "--peer-fetch-max-chunks", str(cfg.chunks),
        "--peer-fetch-timeout-ms", "600000",
        "--peer-fetch-mode", "sync",  # the Lookup returns when the bytes are in: it times the transfer
        "--peer-data-plane", cfg.data_plane, "--peer-data-streams", str(cfg.streams),
        "--log-level", "warning",
    ]  # fmt: skip
    if mode != "none":
        assert tls_dir is not None
        flags += ["--tls-cert-file", str(tls_dir / "tls.crt"), "--tls-key-file", str(tls_dir / "tls.key")]
        flags += ["--tls-ca-file", str(tls_dir / "ca.crt"), "--peer-data-security", mode]
    proc, info = start_agent(name, flags, {**env, "POD_UID": f"bench-{name}", "POD_IP": "127.0.0.1"})
    return proc, str(uds), int(info["tcp_port"])


def run(args: argparse.Namespace) -> int:
    import torch

    cfg = config_from_args(P2PBenchConfig, args, env_prefix=ENV_PREFIX)
    if cfg.device == "cuda" and not torch.cuda.is_available():
        print("kvgrid bench p2p: --device cuda but no CUDA device is visible", file=sys.stderr)
        return 2
    if cfg.tls_dir:
        missing = [n for n in ("tls.crt", "tls.key", "ca.crt") if not (Path(cfg.tls_dir) / n).is_file()]
        if missing:
            print(
                f"kvgrid bench p2p: --tls-dir {cfg.tls_dir!r} lacks {', '.join(missing)}: expected an agent "
                "certificate's tls.crt, tls.key and ca.crt",
                file=sys.stderr,
            )
            return 2
    modes: list[str] = list(dict.fromkeys(cfg.security)) or ["tls" if cfg.tls_dir else "none"]
    with shm_scratch("kvgrid-p2p-") as tmp, _tls_dir(cfg, modes) as tls_dir:
        return _run(cfg, tmp, modes, tls_dir)


@contextlib.contextmanager
def _tls_dir(cfg: P2PBenchConfig, modes: list[str]) -> Iterator[Path | None]:
    """``--tls-dir``, or a throwaway agent certificate when an mTLS mode is asked for without one."""
    if cfg.tls_dir or modes == ["none"]:
        yield Path(cfg.tls_dir) if cfg.tls_dir else None
        return
    with tempfile.TemporaryDirectory(prefix="kvgrid-p2p-tls-") as d:
        _write_agent_certificate(Path(d))
        yield Path(d)


def _write_agent_certificate(directory: Path) -> None:
    """A CA and an agent certificate of it (the identity and server name the chart issues) as
    ``tls.crt``, ``tls.key`` and ``ca.crt``: what ``--tls-dir`` would hold."""
    import datetime as dt

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    from kvgrid.common.tls import AGENT_SERVER_NAME

    now = dt.datetime.now(dt.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def cert(
        subject: str,
        key: ec.EllipticCurvePrivateKey,
        issuer: x509.Name,
        signer: ec.EllipticCurvePrivateKey,
        ca: bool,
    ) -> x509.Certificate:
        b = (
            x509.CertificateBuilder()
            .subject_name(name(subject))
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            b = b.add_extension(
                x509.SubjectAlternativeName(
                    [
                        x509.UniformResourceIdentifier("spiffe://cluster.local/ns/kvgrid-bench/role/agent"),
                        x509.DNSName(AGENT_SERVER_NAME),
                    ]
                ),
                critical=False,
            ).add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
        return b.sign(signer, hashes.SHA256())

    ca_key, leaf_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = cert("kvgrid bench CA", ca_key, name("kvgrid bench CA"), ca_key, True)
    leaf = cert("kvgrid bench agent", leaf_key, ca.subject, ca_key, False)
    pem = serialization.Encoding.PEM
    (directory / "ca.crt").write_bytes(ca.public_bytes(pem))
    (directory / "tls.crt").write_bytes(leaf.public_bytes(pem))
    (directory / "tls.key").write_bytes(
        leaf_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )


def _run(cfg: P2PBenchConfig, tmp: Path, modes: list[str], tls_dir: Path | None) -> int:
    """The engines' KV cache under ``tmp`` (cpu) and the agents' sockets there; one set of agents
    (``--peers`` serving, one fetching) per mode in ``modes``."""
    import torch

    from kvgrid.common.hashing import KeyNamespace
    from kvgrid.engine.client import AgentClient
    from kvgrid.engine.tensors import allocate_shared_tensor

    tokens_per_chunk, block = 256, 16
    bpc = tokens_per_chunk // block
    shape = (bpc * cfg.chunks, 2, block, 8, 128)
    tensors: list[torch.Tensor] = []
    paths: list[str] | None = [] if cfg.device == "cpu" else None
    for layer in range(cfg.layers):
        if paths is not None:
            path = tmp / f"layer{layer}.kv"
            t = allocate_shared_tensor(path, shape, torch.bfloat16)
            paths.append(str(path))
            t.view(torch.int16).copy_(torch.randint(-(2**15), 2**15, shape, dtype=torch.int16))
        else:
            t = torch.randn(shape, device="cuda").to(torch.bfloat16)
        tensors.append(t)
    chunk_bytes = cfg.layers * tokens_per_chunk * 2 * 8 * 128 * 2
    per_peer = chunk_bytes * cfg.chunks
    total = per_peer * cfg.peers
    connections = cfg.peers * (cfg.streams if cfg.data_plane == "socket" else 1)
    hints = {"backend": "FLASHINFER"}
    ns = KeyNamespace(model="bench-p2p", tokens_per_chunk=tokens_per_chunk)
    env = bench_env()

    rounds = cfg.iters + 1  # the first of each is a warm-up
    ctx = multiprocessing.get_context("spawn")
    port_q: multiprocessing.Queue = ctx.Queue()
    sender = ctx.Process(target=_raw_sender, args=(port_q, total, connections, rounds), daemon=True)
    sender.start()
    raw_port = int(port_q.get(timeout=60))
    raw_dst = np.empty(total, dtype=np.uint8)

    procs: list[subprocess.Popen[str]] = []
    clients: list[AgentClient] = []
    fetch_s: dict[str, list[float]] = {m: [] for m in modes}
    raw_s: list[float] = []
    try:
        sets: dict[str, tuple[list[AgentClient], list[str], AgentClient]] = {}
        for mode in modes:
            peers, addresses = [], []
            for p in range(cfg.peers):
                proc, uds, port = _start_agent(
                    f"{mode}-peer{p}", tmp, cfg, per_peer + (64 << 20), env, mode, tls_dir
                )
                procs.append(proc)
                peers.append(AgentClient(uds, timeout_s=600))
                addresses.append(f"127.0.0.1:{port}")
            # The fetcher holds two rounds' worth; older rounds are evicted (LRU).
            proc, uds, _ = _start_agent(
                f"{mode}-fetcher", tmp, cfg, 2 * total + (64 << 20), env, mode, tls_dir
            )
            procs.append(proc)
            fetcher = AgentClient(uds, timeout_s=600)
            clients += [*peers, fetcher]
            sets[mode] = (peers, addresses, fetcher)
        for c in clients:
            c.wait_ready()
            c.register_kv_caches(
                "bench", tensors, namespace=ns, shm_paths=paths, layout_hints=[hints] * len(tensors)
            )
        ids = [list(range(bpc * cfg.chunks))]
        for r in range(rounds):
            for mode, (peers, addresses, fetcher) in sets.items():
                dt = _fetch_round(cfg, r, ns, ids, peers, addresses, fetcher, tokens_per_chunk)
                if dt is None:
                    return 1
                if r:
                    fetch_s[mode].append(dt)
            raw = _raw_round(raw_port, raw_dst, connections)
            if r:
                raw_s.append(raw)
    except AgentDidNotStart as e:
        print(f"kvgrid bench p2p: {e}", file=sys.stderr)
        return 1
    finally:
        stop_all(clients, procs)
        sender.join(10)
        if sender.is_alive():
            sender.terminate()

    raw_gbps = total / statistics.median(raw_s) / 1e9
    by_mode = {}
    for mode in modes:
        gbps = total / statistics.median(fetch_s[mode]) / 1e9
        by_mode[mode] = {
            "fetch_gbps": round(gbps, 3),
            "ratio": round(gbps / raw_gbps, 3),
            "fetch_ms": round(statistics.median(fetch_s[mode]) * 1e3, 2),
        }
    first = by_mode[modes[0]]
    result = {
        "device": cfg.device,
        "data_plane": cfg.data_plane,
        "tls": modes[0] != "none",
        "security": modes[0],
        "peers": cfg.peers,
        "streams": cfg.streams if cfg.data_plane == "socket" else 1,
        "chunks": cfg.chunks,
        "chunk_bytes": chunk_bytes,
        **first,
        "raw_socket_gbps": round(raw_gbps, 3),
        "modes": by_mode,
    }
    if cfg.json:
        print(json.dumps(result))
        return 0
    print(
        f"peer fetch on loopback: {cfg.peers} peer(s) x {cfg.chunks} chunks x {chunk_bytes / 2**20:.0f} MiB, "
        f"data plane {cfg.data_plane}, {result['streams']} stream(s) per peer"
    )
    for mode, m in by_mode.items():
        label = _LABELS[mode] if cfg.data_plane == "socket" else ("mTLS" if mode != "none" else "no TLS")
        print(
            f"  Lookup fetching, {label + ':':38s} {m['fetch_gbps']:6.2f} GB/s ({m['fetch_ms']} ms)   "
            f"ratio {m['ratio']:.3f}"
        )
    print(f"  raw socket copy, {connections} connection(s) (limit):{' ' * 12}{raw_gbps:6.2f} GB/s")
    return 0


_LABELS = {
    "none": "no TLS (xxh3 checksums)",
    "mac": "mTLS ticket, mac (keyed BLAKE3)",
    "aead": "mTLS ticket, aead (AES-256-GCM)",
    "tls": "mTLS ticket, tls (TLS data sockets)",
}


def _fetch_round(
    cfg: P2PBenchConfig,
    r: int,
    ns: KeyNamespace,
    ids: list[list[int]],
    peers: list[AgentClient],
    addresses: list[str],
    fetcher: AgentClient,
    tokens_per_chunk: int,
) -> float | None:
    """Store ``--chunks`` fresh chunks on each peer, then time the concurrent Lookups fetching them
    (seconds; None when a store or fetch fell short, said on stderr)."""
    from kvgrid.common.hashing import chunk_keys

    keys = []
    for p, client in enumerate(peers):
        tokens = [(r * 7919 + p * 104_729 + j) % 32_000 for j in range(cfg.chunks * tokens_per_chunk)]
        keys.append(chunk_keys(tokens, ns))
        if client.store("bench", keys[p], ids).num_stored_chunks != cfg.chunks:
            print(f"kvgrid bench p2p: store on peer {p} fell short", file=sys.stderr)
            return None
    got = [0] * len(peers)

    def fetch(p: int) -> None:
        got[p] = fetcher.lookup("bench", "", keys[p], peer_address=addresses[p]).num_peer_chunks

    fetches = [threading.Thread(target=fetch, args=(p,)) for p in range(len(peers))]
    t0 = time.perf_counter()
    for th in fetches:
        th.start()
    for th in fetches:
        th.join()
    dt = time.perf_counter() - t0
    if got != [cfg.chunks] * len(peers):
        print(f"kvgrid bench p2p: fetch fell short: {got} of {cfg.chunks} per peer", file=sys.stderr)
        return None
    return dt
