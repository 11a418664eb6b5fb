"""A cluster of simulated vLLM pods for judging routing policies on a request trace. Pure logic: no
I/O, no clock; time is the trace's (milliseconds).

Model (one line each, so a reader can argue with it):

- A request is its prefix blocks (``hash_ids`` of the Mooncake trace: equal ids = the same prefix
  KV, ``block_tokens`` tokens each) plus its prompt and output lengths.
- A pod prefills one request at a time, FIFO (prefill is compute-bound: requests queued behind one
  another wait). Decode runs beside it and does not slow prefill; a decoding request counts as
  *running* for ``output_tokens * decode_ms_per_token``.
- When a request's prefill starts, its leading blocks are served from the fastest tier holding
  them: the pod's GPU prefix cache (free), the pod's own L1 (one copy to GPU), any other pod's L1
  (a peer fetch, then the copy); a tier slower than recomputing a block is not used, as the
  engine would recompute; the rest is prefilled at ``prefill_tokens_per_s``. Time to first
  token = the wait in the queue + that. These are the costs :mod:`kvgrid.controller.scoring` estimates with.
- When its prefill ends, every block of the request enters the pod's GPU cache and its L1 (the
  connector stores computed chunks), both LRU; what they push out is evicted. The cache changes
  come out as :class:`CacheEvent` for the caller to publish.

Invariants: a pod's ``gpu`` and ``l1`` never hold more than their capacity; events for one pod
come out in the order its caches changed; the simulation never reads a policy's choice back into
the costs, so every policy is judged by the same model.
"""

from __future__ import annotations

import heapq
import json
import statistics
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Literal

import msgspec

__all__ = [
    "CacheEvent",
    "Cluster",
    "Hardware",
    "PodLoad",
    "Served",
    "TraceRequest",
    "load_trace",
    "summarize",
]

Tier = Literal["gpu", "l1"]


class TraceRequest(msgspec.Struct, frozen=True):
    arrival_ms: float
    input_tokens: int
    output_tokens: int
    blocks: tuple[int, ...]


def load_trace(path: Path, limit: int = 0) -> list[TraceRequest]:
    """The Mooncake trace's JSON lines (``timestamp`` ms, ``input_length``, ``output_length``,
    ``hash_ids``), in file order; ``limit`` > 0 keeps the first ``limit`` requests."""
    out: list[TraceRequest] = []
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if limit and len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                out.append(
                    TraceRequest(
                        float(r["timestamp"]),
                        int(r["input_length"]),
                        int(r["output_length"]),
                        tuple(r["hash_ids"]),
                    )
                )
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(
                    f"{path}:{n}: expected a JSON object with timestamp, input_length, output_length, "
                    f"hash_ids: {e}"
                ) from e
    return out


class Hardware(msgspec.Struct, frozen=True, kw_only=True):
    """One pod's speeds and sizes; the defaults are a Llama-3-8B engine on one H200."""

    block_tokens: int = 512
    bytes_per_token: int = 131_072  # 32 layers x 8 KV heads x 128 x (K, V) x bf16
    prefill_tokens_per_s: float = 10_000.0
    l1_gbps: float = 45.0  # pinned L1 -> GPU for a batch of chunks (docs/agent.md, H200)
    peer_gbps: float = 0.9  # today's peer fetch over gRPC (docs/benchmarks.md)
    peer_latency_ms: float = 1.0
    decode_ms_per_token: float = 15.0
    gpu_blocks: int = 1_500  # ~96 GiB of KV at 64 MiB per 512-token block
    l1_blocks: int = 4_096  # 256 GiB of pinned host memory

    def __post_init__(self) -> None:
        for name in ("block_tokens", "bytes_per_token", "gpu_blocks", "l1_blocks"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)}: expected > 0")
        for name in ("prefill_tokens_per_s", "l1_gbps", "peer_gbps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)}: expected > 0")

    @property
    def recompute_ms(self) -> float:
        return self.block_tokens / self.prefill_tokens_per_s * 1e3

    def copy_ms(self, gbps: float) -> float:
        return self.block_tokens * self.bytes_per_token / (gbps * 1e9) * 1e3


class CacheEvent(msgspec.Struct, frozen=True):
    pod: int
    kind: Literal["admit", "evict"]
    tier: Tier
    blocks: tuple[int, ...]


class PodLoad(msgspec.Struct, frozen=True):
    """What a pod reports: requests decoding / queued or prefilling, and how full its caches are
    (blocks; vLLM reports the GPU share as ``gpu_kv_usage``, the agent its L1 bytes)."""

    running: int
    waiting: int
    gpu_used: int = 0
    l1_used: int = 0


class Served(msgspec.Struct, frozen=True):
    """One request's outcome on the pod it was sent to."""

    pod: int
    arrival_ms: float
    ttft_ms: float
    queue_ms: float
    gpu_blocks: int
    l1_blocks: int
    peer_blocks: int
    prefill_tokens: int
    input_tokens: int


class _Lru:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, block: int) -> bool:
        return block in self.blocks

    def admit(self, blocks: Iterable[int]) -> tuple[list[int], list[int]]:
        """Touch ``blocks`` (most recent last); returns (newly admitted, evicted)."""
        new: list[int] = []
        for b in blocks:
            if b in self.blocks:
                self.blocks.move_to_end(b)
            else:
                self.blocks[b] = None
                new.append(b)
        evicted: list[int] = []
        while len(self.blocks) > self.capacity:
            b, _ = self.blocks.popitem(last=False)
            evicted.append(b)
        gone, fresh = set(evicted), set(new)
        return [b for b in new if b not in gone], [b for b in evicted if b not in fresh]


class _Pod:
    def __init__(self, hw: Hardware) -> None:
        self.gpu = _Lru(hw.gpu_blocks)
        self.l1 = _Lru(hw.l1_blocks)
        self.queue: deque[tuple[int, TraceRequest]] = deque()
        self.busy = False
        self.running = 0


class Cluster:
    """``pods`` identical pods; drive it with :meth:`advance` (to an arrival time) and
    :meth:`submit` (a routed request); read :meth:`loads` and :meth:`local_match` to route."""

    def __init__(self, pods: int, hw: Hardware) -> None:
        if pods <= 0:
            raise ValueError(f"pods={pods}: expected > 0")
        self.hw = hw
        self.pods = [_Pod(hw) for _ in range(pods)]
        self.served: list[Served] = []
        self._timers: list[tuple[float, int, str, int, int]] = []  # (time, seq, what, pod, request)
        self._requests: dict[int, tuple[TraceRequest, float, float, tuple[int, int, int]]] = {}
        self._seq = 0
        self._events: list[CacheEvent] = []

    # --- what a router may look at ---------------------------------------------------------------
    def loads(self) -> list[PodLoad]:
        return [
            PodLoad(p.running, len(p.queue) + p.busy, len(p.gpu.blocks), len(p.l1.blocks)) for p in self.pods
        ]

    def local_match(self, pod: int, blocks: Sequence[int]) -> int:
        """Leading blocks the pod holds itself (GPU or its L1)."""
        p = self.pods[pod]
        n = 0
        for b in blocks:
            if b not in p.gpu and b not in p.l1:
                break
            n += 1
        return n

    # --- the simulation --------------------------------------------------------------------------
    def advance(self, now_ms: float) -> list[CacheEvent]:
        """Run every completion due by ``now_ms``; returns the cache events they caused, in order."""
        while self._timers and self._timers[0][0] <= now_ms:
            t, _, what, pod, rid = heapq.heappop(self._timers)
            if what == "prefill":
                self._prefill_done(t, pod, rid)
            else:
                self.pods[pod].running -= 1
        out, self._events = self._events, []
        return out

    def submit(self, rid: int, pod: int, req: TraceRequest) -> None:
        p = self.pods[pod]
        p.queue.append((rid, req))
        if not p.busy:
            self._start_next(req.arrival_ms, pod)

    def drain(self) -> list[CacheEvent]:
        return self.advance(float("inf"))

    def _timer(self, t: float, what: str, pod: int, rid: int) -> None:
        self._seq += 1
        heapq.heappush(self._timers, (t, self._seq, what, pod, rid))

    def _tiers(self, pod: int, blocks: Sequence[int]) -> tuple[int, int, int]:
        """Leading blocks by the fastest tier holding each: own GPU, own L1, another pod's L1. A
        tier slower than recomputing is not used (the engine would recompute), so not a hit."""
        me, hw = self.pods[pod], self.hw
        use_l1 = hw.copy_ms(hw.l1_gbps) < hw.recompute_ms
        use_peers = use_l1 and hw.copy_ms(hw.l1_gbps) + hw.copy_ms(hw.peer_gbps) < hw.recompute_ms
        others = [q.l1 for i, q in enumerate(self.pods) if i != pod] if use_peers else []
        gpu = l1 = peer = 0
        for b in blocks:
            if b in me.gpu and not (l1 or peer):
                gpu += 1
            elif use_l1 and b in me.l1:  # after the GPU prefix ends, blocks come through the agent
                l1 += 1
            elif any(b in o for o in others):
                peer += 1
            else:
                break
        return gpu, l1, peer

    def _start_next(self, now: float, pod: int) -> None:
        p = self.pods[pod]
        if not p.queue:
            p.busy = False
            return
        rid, req = p.queue.popleft()
        p.busy = True
        hw = self.hw
        gpu, l1, peer = self._tiers(pod, req.blocks)
        per_l1, per_peer = hw.copy_ms(hw.l1_gbps), hw.copy_ms(hw.peer_gbps)
        matched_tokens = min(req.input_tokens, (gpu + l1 + peer) * hw.block_tokens)
        prefill = req.input_tokens - matched_tokens
        work = (
            (l1 + peer) * per_l1
            + peer * per_peer
            + (hw.peer_latency_ms if peer else 0.0)
            + prefill / hw.prefill_tokens_per_s * 1e3
        )
        self._requests[rid] = (req, now, now + work, (gpu, l1, peer))
        self._timer(now + work, "prefill", pod, rid)

    def _prefill_done(self, t: float, pod: int, rid: int) -> None:
        req, start, end, (gpu, l1, peer) = self._requests.pop(rid)
        p = self.pods[pod]
        for tier, cache in (("gpu", p.gpu), ("l1", p.l1)):
            new, evicted = cache.admit(req.blocks)
            if evicted:
                self._events.append(CacheEvent(pod, "evict", tier, tuple(evicted)))  # type: ignore[arg-type]
            if new:
                self._events.append(CacheEvent(pod, "admit", tier, tuple(new)))  # type: ignore[arg-type]
        matched = min(req.input_tokens, (gpu + l1 + peer) * self.hw.block_tokens)
        self.served.append(
            Served(
                pod=pod,
                arrival_ms=req.arrival_ms,
                ttft_ms=end - req.arrival_ms,
                queue_ms=start - req.arrival_ms,
                gpu_blocks=gpu,
                l1_blocks=l1,
                peer_blocks=peer,
                prefill_tokens=req.input_tokens - matched,
                input_tokens=req.input_tokens,
            )
        )
        p.running += 1
        self._timer(t + req.output_tokens * self.hw.decode_ms_per_token, "decode", pod, rid)
        self._start_next(t, pod)


def _pct(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else 0.0


def summarize(served: Sequence[Served], pods: int, hw: Hardware) -> dict[str, float]:
    """Hit rates by tier (share of prompt tokens), TTFT mean/p50/p90/p99 (ms) and load spread: the
    largest pod's prefilled tokens over the mean pod's (1.0 = perfectly even)."""
    total = sum(s.input_tokens for s in served) or 1
    ttft = [s.ttft_ms for s in served]
    per_pod = [0] * pods
    for s in served:
        per_pod[s.pod] += s.prefill_tokens
    mean_pod = statistics.fmean(per_pod) or 1.0

    def share(f: Callable[[Served], int]) -> float:
        return sum(min(s.input_tokens, f(s) * hw.block_tokens) for s in served) / total

    return {
        "requests": float(len(served)),
        "gpu_hit": share(lambda s: s.gpu_blocks),
        "l1_hit": share(lambda s: s.l1_blocks),
        "peer_hit": share(lambda s: s.peer_blocks),
        "hit": share(lambda s: s.gpu_blocks + s.l1_blocks + s.peer_blocks),
        "ttft_mean_ms": statistics.fmean(ttft) if ttft else 0.0,
        "ttft_p50_ms": _pct(ttft, 0.50),
        "ttft_p90_ms": _pct(ttft, 0.90),
        "ttft_p99_ms": _pct(ttft, 0.99),
        "queue_mean_ms": statistics.fmean(s.queue_ms for s in served) if served else 0.0,
        "load_max_over_mean": max(per_pod) / mean_pod,
    }
