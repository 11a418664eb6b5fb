"""``kvgrid demo``: a controller and two agents on this machine, driven by a multi-turn chat workload.

Everything is real except the model: the controller and the agents are the ``kvgrid controller`` /
``kvgrid agent`` processes, talking gRPC over loopback and Unix sockets, and each "engine" owns
paged KV tensors of a small hybrid model (full-attention and sliding-window layers, two engine
groups with different block sizes) in shared memory, exactly as the vLLM connector registers them.
Instead of running a model, "prefill" writes KV bytes derived from each chunk's key, so every chunk
read back from an agent can be checked bit for bit against what prefill would have produced.

Per request: the router asks the controller's ``Score`` to rank the pods, the
engine on that pod asks its agent how many leading chunks it holds (``Lookup``), loads them into
freshly allocated blocks (``Retrieve``), "prefills" the rest and stores the new full chunks
(``Store``); the agent streams admit events to the controller, which the next ``Score`` sees.

Lower tiers: each agent has a disk tier (``--disk-tier-size``, under the demo's work directory) and
an L1 smaller than the workload, so chunks evicted from L1 are written to disk and a later Lookup
that reaches them promotes them back into L1 (asynchronously: Retrieve waits for them), verified
bit for bit like every other load. The counts come from the agents' own Prometheus metrics.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import grpc
import msgspec
import torch

from kvgrid.api.v1 import common_pb2, controller_pb2, controller_pb2_grpc
from kvgrid.common.config import add_config_arguments, config_from_args
from kvgrid.common.groups import EngineGroupInfo
from kvgrid.common.hashing import KeyNamespace, chunk_keys
from kvgrid.common.procs import free_port, wait_serving
from kvgrid.common.wire import key_namespace_to_proto
from kvgrid.engine.client import AgentClient
from kvgrid.engine.tensors import allocate_shared_tensor

__all__ = ["ENGINES", "DemoSettings", "add_arguments", "add_arguments_for_argv", "run", "run_demo"]

# The model: 8 layers alternating full attention (engine group 0, 16 tokens per block) and
# sliding-window attention (engine group 1, 32 tokens per block, 1024-token window), FlashInfer
# layout [num_blocks, 2, block_size, kv_heads, head_size], bf16.
NUM_LAYERS = 8
KV_HEADS = 4
HEAD_SIZE = 64
TOKENS_PER_CHUNK = 256
BLOCK_SIZE = (16, 32)  # per engine group
SLIDING_WINDOW = 1024
GROUPS = [
    EngineGroupInfo(engine_group_id=0, layer_indices=tuple(range(0, NUM_LAYERS, 2)), tokens_per_block=16),
    EngineGroupInfo(
        engine_group_id=1,
        layer_indices=tuple(range(1, NUM_LAYERS, 2)),
        tokens_per_block=32,
        sw_size_tokens=SLIDING_WINDOW,
    ),
]
HINTS = [{"backend": "FLASHINFER", "kv_layout": "NHD"}] * NUM_LAYERS
NAMESPACE = KeyNamespace(
    model="kvgrid-demo-hybrid-8l", tokens_per_chunk=TOKENS_PER_CHUNK, kv_identity="bf16-fi"
)
VOCAB = 128_000
# Most a pod takes of the requests so far, relative to its fair share (see serve_request).
LOAD_BOUND = 1.25


BLOCKS_PER_ENGINE = 1536
"""Paged KV blocks of each demo engine (of the first engine group's block size)."""
ENV_PREFIX = "KVGRID_DEMO_"


def _d(text: str) -> msgspec.Meta:
    return msgspec.Meta(description=text)


class DemoSettings(msgspec.Struct, frozen=True, kw_only=True):
    """``kvgrid demo``'s options, loaded like a service config (``kvgrid.common.config``):
    defaults < ``--config`` YAML < ``KVGRID_DEMO_*`` env < flags."""

    conversations: Annotated[int, _d("concurrent chats")] = 24
    turns: Annotated[int, _d("turns per chat")] = 4
    system_prompts: Annotated[int, _d("distinct shared system prompts")] = 3
    system_tokens: Annotated[int, _d("tokens per system prompt")] = 3072
    user_tokens: Annotated[int, _d("tokens per user message")] = 320
    reply_tokens: Annotated[int, _d("tokens per model reply")] = 160
    pods: Annotated[int, _d("agents (engine pods) to start")] = 2
    l1_size: Annotated[
        str, _d("L1 pool per agent, e.g. 512MiB (smaller than the workload, so the disk tier gets used)")
    ] = "128MiB"
    disk_tier_size: Annotated[
        str, _d("disk tier per agent below L1, under the work directory, e.g. 1GiB; empty = none")
    ] = "1GiB"
    seed: Annotated[int, _d("workload random seed")] = 0
    log_dir: Annotated[str, _d("keep the controller and agent logs here (empty: a temporary directory)")] = ""
    json: Annotated[bool, _d("print JSON, not a table")] = False

    def __post_init__(self) -> None:
        for name in ("conversations", "turns", "system_prompts", "pods"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("system_tokens", "user_tokens", "reply_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        longest = self.system_tokens + self.turns * (self.user_tokens + self.reply_tokens)
        if -(-longest // BLOCK_SIZE[0]) > BLOCKS_PER_ENGINE:
            raise ValueError(
                f"the longest prompt ({longest} tokens) needs more than the engine's {BLOCKS_PER_ENGINE} "
                f"blocks of {BLOCK_SIZE[0]} tokens; use fewer --turns or shorter messages"
            )


@dataclass
class Totals:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    chunks_retrieved: int = 0
    chunks_from_peers: int = 0
    chunks_stored: int = 0
    chunks_verified: int = 0
    chunks_corrupt: int = 0
    bytes_retrieved: int = 0
    bytes_stored: int = 0
    retrieve_s: float = 0.0
    store_s: float = 0.0
    score_ms: list[float] = field(default_factory=list)
    lookup_ms: list[float] = field(default_factory=list)
    routed_to_holder: int = 0
    requests_with_holder: int = 0
    per_pod: dict[str, int] = field(default_factory=dict)


class Engine:
    """One pod's stand-in engine worker: KV tensors in shared memory, a block allocator, an agent client."""

    def __init__(self, pod: int, shm_dir: Path, uds: str, blocks: int) -> None:
        self.pod_uid = f"demo-pod-{pod}"
        self.instance_id = f"engine-{pod}"
        self.num_blocks = (blocks, blocks // 2)  # group 1 blocks hold twice the tokens
        self.tensors: list[torch.Tensor] = []
        paths = []
        for layer in range(NUM_LAYERS):
            g = layer % 2
            path = shm_dir / f"pod{pod}-layer{layer}.kv"
            shape = (self.num_blocks[g], 2, BLOCK_SIZE[g], KV_HEADS, HEAD_SIZE)
            self.tensors.append(allocate_shared_tensor(path, shape, torch.bfloat16))
            paths.append(str(path))
        self.free = [list(range(n)) for n in self.num_blocks]
        self.client = AgentClient(uds, timeout_s=60)
        self.client.wait_ready(60)
        self.client.register_kv_caches(
            self.instance_id,
            self.tensors,
            namespace=NAMESPACE,
            engine_groups=GROUPS,
            shm_paths=paths,
            layout_hints=HINTS,
        )

    def allocate(self, num_tokens: int) -> list[list[int]]:
        ids = []
        for g, bs in enumerate(BLOCK_SIZE):
            need = -(-num_tokens // bs)
            if need > len(self.free[g]):
                raise RuntimeError(f"engine out of blocks: need {need}, {len(self.free[g])} free")
            ids.append([self.free[g].pop() for _ in range(need)])
        return ids

    def release(self, ids: list[list[int]]) -> None:
        for g, group_ids in enumerate(ids):
            self.free[g].extend(group_ids)

    def chunk_blocks(self, ids: list[list[int]], layer: int, chunk: int) -> torch.Tensor:
        g = layer % 2
        per = TOKENS_PER_CHUNK // BLOCK_SIZE[g]
        return torch.tensor(ids[g][chunk * per : (chunk + 1) * per])

    def close(self) -> None:
        with contextlib.suppress(grpc.RpcError):
            self.client.unregister_kv_caches(self.instance_id)
        self.client.close()


def expected_chunk(key: bytes, layer: int, like: torch.Tensor) -> torch.Tensor:
    """The KV bytes "prefill" writes for one chunk of one layer: a pattern seeded by the chunk key."""
    seed = int.from_bytes(key[:6], "little") ^ (layer * 0x9E3779B1)
    n = like.numel()
    bits = (torch.arange(n, dtype=torch.int64) * 0x9E3779B1 + seed) & 0xFFFF
    # Keep bf16 bit patterns finite (clear the top exponent bit) so nothing compares as NaN.
    return (bits & 0xBFFF).to(torch.int16).view(torch.bfloat16).view_as(like)


def prefill(engine: Engine, keys: Sequence[bytes], ids: list[list[int]], first_chunk: int) -> None:
    for c in range(first_chunk, len(keys)):
        for layer, t in enumerate(engine.tensors):
            blocks = engine.chunk_blocks(ids, layer, c)
            t[blocks] = expected_chunk(keys[c], layer, t[blocks])


def verify(engine: Engine, keys: Sequence[bytes], ids: list[list[int]], num_chunks: int) -> tuple[int, int]:
    good = bad = 0
    for c in range(num_chunks):
        ok = True
        for layer, t in enumerate(engine.tensors):
            got = t[engine.chunk_blocks(ids, layer, c)]
            want = expected_chunk(keys[c], layer, got)
            ok &= torch.equal(got.view(torch.int16), want.view(torch.int16))
        good, bad = (good + 1, bad) if ok else (good, bad + 1)
    return good, bad


def workload(s: DemoSettings) -> Iterator[tuple[int, list[int]]]:
    """(conversation, prompt tokens) in arrival order: turns interleave across conversations."""
    rng = random.Random(s.seed)
    systems = [[rng.randrange(VOCAB) for _ in range(s.system_tokens)] for _ in range(s.system_prompts)]
    history = [list(systems[c % s.system_prompts]) for c in range(s.conversations)]
    for _turn in range(s.turns):
        order = list(range(s.conversations))
        rng.shuffle(order)
        for conv in order:
            history[conv] += [rng.randrange(VOCAB) for _ in range(s.user_tokens)]
            yield conv, list(history[conv])
            history[conv] += [rng.randrange(VOCAB) for _ in range(s.reply_tokens)]


def serve_request(
    stub: controller_pb2_grpc.ControllerServiceStub,
    engines: dict[str, Engine],
    prompt: list[int],
    rid: str,
    t: Totals,
) -> None:
    ns = key_namespace_to_proto(NAMESPACE)
    t0 = time.perf_counter()
    resp = stub.Score(
        controller_pb2.ScoreRequest(
            match=controller_pb2.MatchPrefixRequest(token_ids=common_pb2.TokenIds(ids=prompt), namespace=ns),
            # No reservation: this router may override the controller's tie-break (below), and a
            # reservation would mark the controller's pick, not ours.
            reserve=False,
        ),
        timeout=10,
    )
    t.score_ms.append((time.perf_counter() - t0) * 1000)
    # Like a router: lowest estimated TTFT first, under a bounded load (no pod takes more than
    # LOAD_BOUND times its fair share of the requests so far: "consistent hashing with bounded
    # loads"); among pods within 2% of the best TTFT, the one that has served the fewest. The demo
    # runs one request at a time, so the load the agents report is flat and the router counts.
    scored = [sc for sc in resp.scores if sc.match.pod_uid in engines]
    cap = math.ceil(LOAD_BOUND * (t.requests + 1) / len(engines))
    scored = [sc for sc in scored if t.per_pod.get(sc.match.pod_uid, 0) < cap] or scored
    best = None
    if scored:
        cutoff = scored[0].estimated_ttft_ms * 1.02
        best = min(
            (sc.match for sc in scored if sc.estimated_ttft_ms <= cutoff),
            key=lambda m: t.per_pod.get(m.pod_uid, 0),
        )
    engine = engines[best.pod_uid] if best is not None else next(iter(engines.values()))
    matched_anywhere = max((s.match.gpu_chunks + s.match.l1_chunks for s in resp.scores), default=0)
    if matched_anywhere:
        t.requests_with_holder += 1
        if best is not None and best.gpu_chunks + best.l1_chunks == matched_anywhere:
            t.routed_to_holder += 1
    t.per_pod[engine.pod_uid] = t.per_pod.get(engine.pod_uid, 0) + 1

    keys = chunk_keys(prompt, NAMESPACE)
    ids = engine.allocate(len(prompt))
    try:
        t0 = time.perf_counter()
        found = engine.client.lookup(engine.instance_id, rid, keys)
        hits = found.num_hit_chunks
        t.lookup_ms.append((time.perf_counter() - t0) * 1000)
        t.chunks_from_peers += found.num_peer_chunks
        got = 0
        if hits:
            t0 = time.perf_counter()
            res = engine.client.retrieve(engine.instance_id, rid, keys[:hits], ids)
            t.retrieve_s += time.perf_counter() - t0
            got = res.num_retrieved_chunks
            t.bytes_retrieved += res.bytes_moved
            good, bad = verify(engine, keys, ids, got)
            t.chunks_verified += good
            t.chunks_corrupt += bad
        else:
            engine.client.release(engine.instance_id, rid)
        prefill(engine, keys, ids, got)
        t0 = time.perf_counter()
        stored = engine.client.store(engine.instance_id, keys, ids, skip_first_n_chunks=got)
        t.store_s += time.perf_counter() - t0
        t.chunks_retrieved += got
        t.chunks_stored += stored.num_stored_chunks - stored.num_already_present
        t.bytes_stored += stored.bytes_moved
        t.requests += 1
        t.prompt_tokens += len(prompt)
        t.cached_tokens += got * TOKENS_PER_CHUNK
    finally:
        engine.release(ids)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(
    t: Totals, s: DemoSettings, wall_s: float, stats: controller_pb2.GetStatsResponse
) -> dict[str, object]:
    gb = 1e9
    return {
        "requests": t.requests,
        "prompt_tokens": t.prompt_tokens,
        "cached_tokens": t.cached_tokens,
        "hit_rate": t.cached_tokens / t.prompt_tokens if t.prompt_tokens else 0.0,
        "chunks_retrieved": t.chunks_retrieved,
        "chunks_from_peers": t.chunks_from_peers,
        "chunks_stored": t.chunks_stored,
        "chunks_verified": t.chunks_verified,
        "chunks_corrupt": t.chunks_corrupt,
        "bytes_moved": t.bytes_retrieved + t.bytes_stored,
        "retrieve_gbps": t.bytes_retrieved / t.retrieve_s / gb if t.retrieve_s else 0.0,
        "store_gbps": t.bytes_stored / t.store_s / gb if t.store_s else 0.0,
        "score_ms_p50": statistics.median(t.score_ms) if t.score_ms else 0.0,
        "score_ms_p99": _pct(t.score_ms, 0.99),
        "agent_lookup_ms_p50": statistics.median(t.lookup_ms) if t.lookup_ms else 0.0,
        "routed_to_holder": t.routed_to_holder,
        "requests_with_holder": t.requests_with_holder,
        "requests_per_pod": dict(sorted(t.per_pod.items())),
        "controller_entries": stats.num_entries,
        "controller_agents": stats.num_agents,
        "wall_s": wall_s,
        "pods": s.pods,
    }


_TIER_COUNTERS = {
    # summary key: (metric sample name, label that must match or None)
    "tier_chunks_written": ("kvgrid_agent_tier_writes_total", None),
    "tier_chunks_promoted": ("kvgrid_agent_tier_promoted_chunks_total", ("result", "ok")),
    "tier_chunks_failed": ("kvgrid_agent_tier_promoted_chunks_total", ("result", "failed")),
    "tier_lookup_hits": ("kvgrid_agent_lookup_chunks_total", ("result", "hit_tier")),
    "tier_dropped_spills": ("kvgrid_agent_tier_dropped_spills_total", None),
}


def tier_counts(metrics_ports: Sequence[int]) -> dict[str, int]:
    """The lower tiers' counters summed over the agents, read from their ``/metrics`` endpoints."""
    from prometheus_client.parser import text_string_to_metric_families

    out = dict.fromkeys(_TIER_COUNTERS, 0)
    for port in metrics_ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                for key, (name, label) in _TIER_COUNTERS.items():
                    if sample.name == name and (label is None or sample.labels.get(label[0]) == label[1]):
                        out[key] += int(sample.value)
    return out


def run_demo(s: DemoSettings, *, progress: bool = True, log_dir: Path | None = None) -> dict[str, object]:
    """Start the processes, run the workload, stop everything; returns the summary."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    work = Path(tempfile.mkdtemp(prefix="kvgrid-demo-"))
    shm_root = Path("/dev/shm") if Path("/dev/shm").is_dir() else work
    shm_dir = Path(tempfile.mkdtemp(prefix="kvgrid-demo-", dir=shm_root))
    logs = log_dir or work
    procs: list[subprocess.Popen[bytes]] = []
    engines: dict[str, Engine] = {}
    metrics_ports: list[int] = []
    kvgrid = [sys.executable, "-m", "kvgrid.cli"]
    env = {**os.environ, "OTEL_SDK_DISABLED": os.environ.get("OTEL_SDK_DISABLED", "true")}
    try:
        ctrl_addr = f"127.0.0.1:{free_port()}"
        with open(logs / "controller.log", "wb") as log:
            procs.append(
                subprocess.Popen(
                    [*kvgrid, "controller", "--listen", ctrl_addr], stdout=log, stderr=log, env=env
                )
            )
        wait_serving(ctrl_addr, procs[0], "kvgrid controller")
        for pod in range(s.pods):
            uds = str(work / f"agent-{pod}.sock")
            pod_env = {
                **env,
                "POD_UID": f"demo-pod-{pod}",
                "POD_NAME": f"vllm-{pod}",
                "POD_NAMESPACE": "demo",
                "POD_IP": "127.0.0.1",  # advertised to peers; the agents listen on loopback
            }
            args = [
                *kvgrid, "agent", "--uds-path", uds, "--tcp-host", "127.0.0.1", "--tcp-port", "0",
                "--l1-size", s.l1_size, "--controller-address", ctrl_addr, "--shm-allowed-dirs", str(shm_dir),
            ]  # fmt: skip
            if s.disk_tier_size:
                metrics_ports.append(free_port())
                # Eviction from 70 % down to 50 %: the headroom lets the tier writer keep up with a
                # whole prompt's store (a burst larger than it drops spills instead of waiting).
                args += [
                    "--tier-disk-path", str(work / f"disk-tier-{pod}"), "--tier-disk-size", s.disk_tier_size,
                    "--high-watermark", "0.7", "--low-watermark", "0.5",
                    "--prometheus-port", str(metrics_ports[-1]),
                ]  # fmt: skip
                pod_env["OTEL_SDK_DISABLED"] = "false"  # the tier counts come from the metrics
            with open(logs / f"agent-{pod}.log", "wb") as log:
                procs.append(subprocess.Popen(args, stdout=log, stderr=log, env=pod_env))
            wait_serving(f"unix:{uds}", procs[-1], f"kvgrid agent {pod}")
            engine = Engine(pod, shm_dir, uds, BLOCKS_PER_ENGINE)
            engines[engine.pod_uid] = engine
        channel = grpc.insecure_channel(ctrl_addr)
        stub = controller_pb2_grpc.ControllerServiceStub(channel)
        deadline = time.monotonic() + 30
        while stub.GetStats(controller_pb2.GetStatsRequest(), timeout=5).num_agents < s.pods:
            if time.monotonic() > deadline:
                raise RuntimeError("agents did not register with the controller within 30 s")
            time.sleep(0.1)

        totals = Totals()
        total_requests = s.conversations * s.turns
        start = time.perf_counter()
        with Progress(
            TextColumn("[bold]chat turns"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn(
                "hit rate {task.fields[hit]:5.1%}  moved {task.fields[gb]:6.2f} GB  "
                "Score p50 {task.fields[p50]:.2f} ms"
            ),
            TimeElapsedColumn(),
            disable=not progress,
        ) as bar:
            task = bar.add_task("turns", total=total_requests, hit=0.0, gb=0.0, p50=0.0)
            for i, (conv, prompt) in enumerate(workload(s)):
                serve_request(stub, engines, prompt, f"conv{conv}-req{i}", totals)
                bar.update(
                    task,
                    advance=1,
                    hit=totals.cached_tokens / max(1, totals.prompt_tokens),
                    gb=(totals.bytes_retrieved + totals.bytes_stored) / 1e9,
                    p50=statistics.median(totals.score_ms),
                )
        wall = time.perf_counter() - start
        stats = stub.GetStats(controller_pb2.GetStatsRequest(), timeout=5)
        channel.close()
        return {**summary(totals, s, wall, stats), **tier_counts(metrics_ports)}
    finally:
        for engine in engines.values():
            engine.close()
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(shm_dir, ignore_errors=True)
        if log_dir is None:
            shutil.rmtree(work, ignore_errors=True)


def print_summary(r: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="kvgrid demo", show_header=False)
    rows = [
        ("requests (chat turns)", f"{r['requests']}"),
        ("prompt tokens", f"{r['prompt_tokens']:,}"),
        ("tokens loaded from kvgrid", f"{r['cached_tokens']:,}  (hit rate {r['hit_rate']:.1%})"),
        ("chunks retrieved / stored", f"{r['chunks_retrieved']} / {r['chunks_stored']}"),
        ("chunks fetched from the other agent", f"{r['chunks_from_peers']} (agent-to-agent peer fetch)"),
        ("disk tier",
         f"{r.get('tier_chunks_written', 0)} chunks written (evicted from L1), "
         f"{r.get('tier_chunks_promoted', 0)} promoted back on lookups "
         f"({r.get('tier_chunks_failed', 0)} failed), {r.get('tier_dropped_spills', 0)} spills dropped"),
        ("retrieved chunks bit-exact",
         f"{r['chunks_verified']} of {r['chunks_retrieved']} ({r['chunks_corrupt']} corrupt)"),
        ("bytes moved", f"{r['bytes_moved'] / 1e9:.2f} GB"),
        ("through the agent",
         f"retrieve {r['retrieve_gbps']:.2f} GB/s, store {r['store_gbps']:.2f} GB/s (CPU shared memory)"),
        ("controller Score latency", f"p50 {r['score_ms_p50']:.2f} ms, p99 {r['score_ms_p99']:.2f} ms"),
        ("agent Lookup latency", f"p50 {r['agent_lookup_ms_p50']:.2f} ms"),
        ("routed to the pod holding the prefix", f"{r['routed_to_holder']} of {r['requests_with_holder']}"),
        ("requests per pod", ", ".join(f"{k}: {v}" for k, v in r["requests_per_pod"].items())),
        ("controller index", f"{r['controller_entries']} entries, {r['controller_agents']} agents"),
        ("wall time", f"{r['wall_s']:.1f} s"),
    ]  # fmt: skip
    for k, v in rows:
        table.add_row(k, v)
    Console().print(table)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Start a kvgrid controller and agents on this machine (CPU tensors in shared memory), run a "
        "multi-turn chat workload with shared system prompts through Score -> Lookup/Retrieve/Store, "
        "verify every loaded chunk bit for bit, and print hit rate, bytes moved, GB/s and lookup latency."
    )
    _engine_argument(parser)
    add_config_arguments(parser, DemoSettings, env_prefix=ENV_PREFIX)


ENGINES = ("synthetic", "vllm")


def _engine_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--engine",
        choices=ENGINES,
        default="synthetic",
        help=(
            "synthetic (default): stand-in engines with KV in shared memory, fast; vllm: real vLLM CPU "
            "engines with and without KVGridConnector, time to first token (options: "
            "`kvgrid demo --engine vllm --help`)"
        ),
    )


def add_arguments_for_argv(parser: argparse.ArgumentParser, argv: Sequence[str]) -> None:
    """The flags of the engine ``--engine`` in ``argv`` picks (the CLI passes its arguments)."""
    peek = argparse.ArgumentParser(add_help=False)
    _engine_argument(peek)
    known, _ = peek.parse_known_args(list(argv))
    if known.engine == "vllm":
        from kvgrid.bench import demo_vllm

        _engine_argument(parser)
        demo_vllm.add_arguments(parser)
    else:
        add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "engine", "synthetic") == "vllm":
        from kvgrid.bench import demo_vllm

        return demo_vllm.run(args)
    s = config_from_args(DemoSettings, args, env_prefix=ENV_PREFIX)
    log_dir = Path(s.log_dir) if s.log_dir else None
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
    result = run_demo(s, progress=not s.json, log_dir=log_dir)
    if s.json:
        print(json.dumps(result, indent=2))
    else:
        print_summary(result)
    return 0 if result["chunks_corrupt"] == 0 else 1
