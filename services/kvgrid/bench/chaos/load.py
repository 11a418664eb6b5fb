"""The load ``kvgrid chaos`` keeps on the cluster: the demo's chat workload served by stand-in
engines (``kvgrid.bench.demo``'s model, KV in shared memory), one worker thread per agent.

Per request, like a vLLM worker with the connector: route with the controller's ``Score`` (any
pod when the controller is away), ``Lookup`` on that pod's agent, ``Retrieve`` the hits into fresh
blocks, check every loaded chunk bit for bit against the bytes "prefill" derives from its key,
"prefill" the rest and ``Store`` it. A failing agent call never fails the request: the engine
recomputes (counted, not an error), and re-registers with its agent when the agent lost it.

A load whose Retrieve did not answer may still be writing into its blocks (the agent was stopped,
the answer lost): like vLLM, which frees a loading request's blocks only once the load is
reported, those blocks are set aside until that agent process is gone or ``QUARANTINE_S`` passed.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch

from kvgrid.api.v1 import common_pb2, controller_pb2, controller_pb2_grpc
from kvgrid.bench.demo import (
    BLOCK_SIZE,
    GROUPS,
    HEAD_SIZE,
    HINTS,
    KV_HEADS,
    NAMESPACE,
    NUM_LAYERS,
    TOKENS_PER_CHUNK,
    DemoSettings,
    expected_chunk,
    workload,
)
from kvgrid.common.hashing import chunk_keys
from kvgrid.common.wire import key_namespace_to_proto
from kvgrid.engine.client import AgentClient
from kvgrid.engine.tensors import allocate_shared_tensor

__all__ = ["Load", "LoadStats", "chat_prompts"]

BLOCKS_PER_ENGINE = 1536
QUARANTINE_S = 30.0
AGENT_TIMEOUT_S = 10.0


def chat_prompts(seed: int) -> Iterator[tuple[int, list[int]]]:
    """The demo's multi-turn chats, round after round; round r replays the chats of seed
    ``seed + r % 4``, so prefixes come back after L1 evicted them (disk and S3 hits)."""
    r = 0
    while True:
        s = DemoSettings(
            conversations=8, turns=3, system_prompts=3, system_tokens=1024, user_tokens=256,
            reply_tokens=128, seed=seed + r % 4,
        )  # fmt: skip
        yield from workload(s)
        r += 1


@dataclass
class LoadStats:
    requests: int = 0
    chunks_loaded: int = 0
    chunks_verified: int = 0
    wrong_chunks: int = 0
    wrong_bytes: int = 0
    chunks_stored: int = 0
    peer_chunks: int = 0
    recomputed: int = 0
    """Requests that met a failing agent call and recomputed (no error: the contract)."""
    reregistrations: int = 0
    stuck: int = 0
    stuck_ids: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    """Anything but an agent RPC failure (a bug of the harness or the service)."""
    latencies: list[float] = field(default_factory=list)


class Engine:
    """One pod's stand-in engine: KV tensors in shared memory, a block allocator, an agent client."""

    def __init__(self, pod: int, pod_uid: str, shm_dir: Path, uds: str) -> None:
        self.pod_uid = pod_uid
        self.instance_id = f"chaos-engine-{pod}"
        self.uds = uds
        self.num_blocks = (BLOCKS_PER_ENGINE, BLOCKS_PER_ENGINE // 2)
        self.tensors: list[torch.Tensor] = []
        self.paths: list[str] = []
        for layer in range(NUM_LAYERS):
            g = layer % 2
            path = shm_dir / f"pod{pod}-layer{layer}.kv"
            shape = (self.num_blocks[g], 2, BLOCK_SIZE[g], KV_HEADS, HEAD_SIZE)
            self.tensors.append(allocate_shared_tensor(path, shape, torch.bfloat16))
            self.paths.append(str(path))
        self.free = [list(range(n)) for n in self.num_blocks]
        self.quarantine: list[tuple[float, int, list[list[int]]]] = []  # (since, agent start, ids)
        self.lock = threading.Lock()
        self.client: AgentClient | None = None
        self.registered_start = -1
        """The agent start (``AgentSlot.starts``) this engine is registered with; -1: none."""

    def register(self, agent_start: int) -> None:
        with self.lock:
            if self.client is not None:
                self.client.close()
            self.client = AgentClient(self.uds, timeout_s=AGENT_TIMEOUT_S)
            self.registered_start = -1
        self.client.register_kv_caches(
            self.instance_id, self.tensors, namespace=NAMESPACE, engine_groups=GROUPS,
            shm_paths=self.paths, layout_hints=HINTS,
        )  # fmt: skip
        with self.lock:
            self.registered_start = agent_start
            # Blocks of loads that agent process never reported: it is gone, they are free again.
            keep = []
            for since, start, ids in self.quarantine:
                if start < agent_start:
                    self._give_back(ids)
                else:
                    keep.append((since, start, ids))
            self.quarantine = keep

    def allocate(self, num_tokens: int) -> list[list[int]] | None:
        with self.lock:
            now = time.monotonic()
            keep = []
            for since, start, ids in self.quarantine:
                if now - since > QUARANTINE_S:
                    self._give_back(ids)
                else:
                    keep.append((since, start, ids))
            self.quarantine = keep
            needs = [-(-num_tokens // bs) for bs in BLOCK_SIZE]
            if any(n > len(f) for n, f in zip(needs, self.free, strict=True)):
                return None
            return [[f.pop() for _ in range(n)] for n, f in zip(needs, self.free, strict=True)]

    def _give_back(self, ids: list[list[int]]) -> None:
        for g, group_ids in enumerate(ids):
            self.free[g].extend(group_ids)

    def release(self, ids: list[list[int]]) -> None:
        with self.lock:
            self._give_back(ids)

    def set_aside(self, ids: list[list[int]], agent_start: int) -> None:
        with self.lock:
            self.quarantine.append((time.monotonic(), agent_start, ids))

    def chunk_blocks(self, ids: list[list[int]], layer: int, chunk: int) -> torch.Tensor:
        g = layer % 2
        per = TOKENS_PER_CHUNK // BLOCK_SIZE[g]
        return torch.tensor(ids[g][chunk * per : (chunk + 1) * per])

    def prefill(self, keys: list[bytes], ids: list[list[int]], first: int) -> None:
        for c in range(first, len(keys)):
            for layer, t in enumerate(self.tensors):
                blocks = self.chunk_blocks(ids, layer, c)
                t[blocks] = expected_chunk(keys[c], layer, t[blocks])

    def check(self, keys: list[bytes], ids: list[list[int]], num_chunks: int) -> tuple[int, int]:
        """(wrong chunks, wrong bytes) among the first ``num_chunks`` loaded chunks."""
        wrong_chunks = wrong_bytes = 0
        for c in range(num_chunks):
            bad = 0
            for layer, t in enumerate(self.tensors):
                got = t[self.chunk_blocks(ids, layer, c)]
                want = expected_chunk(keys[c], layer, got)
                a, b = got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)
                if not torch.equal(a, b):
                    bad += int((a != b).sum())
            wrong_chunks += bad > 0
            wrong_bytes += bad
        return wrong_chunks, wrong_bytes

    def close(self) -> None:
        if self.client is not None:
            with contextlib.suppress(grpc.RpcError):
                self.client.unregister_kv_caches(self.instance_id)
            self.client.close()


class Load:
    """Worker threads serving chat requests until :meth:`stop`; :meth:`pause` holds new requests
    (in-flight ones finish) so the index can be compared with the agents at rest."""

    def __init__(
        self,
        engines: list[Engine],
        controller: str,
        agent_start: Callable[[int], int],
        *,
        seed: int,
        stuck_after_s: float,
        plant: str = "",
    ) -> None:
        self.engines = engines
        self.agent_start = agent_start
        self.stats = LoadStats()
        self.stuck_after_s = stuck_after_s
        self.plant = plant
        self._channel = grpc.insecure_channel(controller)
        self._stub = controller_pb2_grpc.ControllerServiceStub(self._channel)
        self._prompts = chat_prompts(seed)
        self._rng = random.Random(seed ^ 0x5EED)
        self._lock = threading.Lock()
        self._running = threading.Event()
        self._running.set()
        self._stopped = False
        self._inflight: dict[str, float] = {}
        self._flagged: set[str] = set()
        self._failed_rids: list[tuple[int, str]] = []
        self._next = 0
        self._threads = [
            threading.Thread(target=self._worker, name=f"chaos-load-{i}", daemon=True)
            for i in range(len(engines))
        ]
        self._watch = threading.Thread(target=self._watchdog, name="chaos-watchdog", daemon=True)

    def start(self) -> None:
        for t in self._threads:
            t.start()
        self._watch.start()

    def pause(self, timeout_s: float) -> bool:
        """Hold new requests and wait for the in-flight ones (True when none is left)."""
        self._running.clear()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if not self._inflight:
                    return True
            time.sleep(0.01)
        return False

    def resume(self) -> None:
        self._running.set()

    def stop(self, timeout_s: float) -> None:
        self._stopped = True
        self._running.set()
        for t in self._threads:
            t.join(timeout_s)
        self._flag_stuck(final=True)
        self._channel.close()

    def failed_requests(self) -> list[tuple[int, str]]:
        """(engine, request id) of requests whose agent calls failed: their pins may outlive them
        on an agent that was stopped, so the drain check releases them once more."""
        with self._lock:
            return list(self._failed_rids)

    # ----- workers -----

    def _worker(self) -> None:
        while not self._stopped:
            self._running.wait()
            if self._stopped:
                return
            with self._lock:
                if not self._running.is_set():
                    continue
                _, prompt = next(self._prompts)
                rid = f"chaos-req-{self._next}"
                self._next += 1
                self._inflight[rid] = time.monotonic()
            t0 = time.monotonic()
            try:
                self._serve(prompt, rid)
            except Exception as e:  # a bug, not a fault: reported, the load goes on
                with self._lock:
                    self.stats.errors.append(f"{rid}: {type(e).__name__}: {e}")
            finally:
                with self._lock:
                    self._inflight.pop(rid, None)
                    self.stats.latencies.append(time.monotonic() - t0)

    def _watchdog(self) -> None:
        while not self._stopped:
            self._flag_stuck(final=False)
            time.sleep(0.5)

    def _flag_stuck(self, *, final: bool) -> None:
        now = time.monotonic()
        with self._lock:
            for rid, since in self._inflight.items():
                if rid not in self._flagged and (final or now - since > self.stuck_after_s):
                    self._flagged.add(rid)
                    self.stats.stuck += 1
                    self.stats.stuck_ids.append(rid)

    def _route(self, prompt: list[int]) -> Engine:
        # Mostly where Score points, sometimes elsewhere (peer fetches); any pod when it fails.
        by_uid = {e.pod_uid: e for e in self.engines}
        with contextlib.suppress(grpc.RpcError):
            resp = self._stub.Score(
                controller_pb2.ScoreRequest(
                    match=controller_pb2.MatchPrefixRequest(
                        token_ids=common_pb2.TokenIds(ids=prompt), namespace=key_namespace_to_proto(NAMESPACE)
                    ),
                    reserve=False,
                ),
                timeout=2,
            )
            scored = [s.match.pod_uid for s in resp.scores if s.match.pod_uid in by_uid]
            with self._lock:
                explore = self._rng.random() < 0.3
            if scored and not explore:
                return by_uid[scored[0]]
        with self._lock:
            return self._rng.choice(self.engines)

    def _serve(self, prompt: list[int], rid: str) -> None:
        keys = chunk_keys(prompt, NAMESPACE)
        engine = self._route(prompt)
        pod = self.engines.index(engine)
        ids = engine.allocate(len(prompt))
        if ids is None:
            time.sleep(0.05)  # every block is set aside for loads an agent never reported
            return
        release_blocks = True
        got = 0
        filled = False
        try:
            start = self.agent_start(pod)
            if engine.registered_start != start:
                try:
                    engine.register(start)
                    with self._lock:
                        self.stats.reregistrations += 1
                except grpc.RpcError:
                    pass
            client = engine.client
            if client is None or engine.registered_start != start:
                with self._lock:
                    self.stats.recomputed += 1
            else:
                try:
                    found = client.lookup(engine.instance_id, rid, keys)
                    if self.plant == "leak-pin" and found.num_hit_chunks and rid.endswith("7"):
                        # Control: a lookup whose pins nobody releases (a long TTL outlives the drain).
                        client.lookup(engine.instance_id, rid + "-leak", keys[: found.num_hit_chunks],
                                      pin_ttl_ms=600_000)  # fmt: skip
                    with self._lock:
                        self.stats.peer_chunks += found.num_peer_chunks
                    if found.num_hit_chunks:
                        try:
                            res = client.retrieve(engine.instance_id, rid, keys[: found.num_hit_chunks], ids)
                        except grpc.RpcError:
                            release_blocks = False  # the agent may still write into them
                            engine.set_aside(ids, start)
                            raise
                        got = res.num_retrieved_chunks
                        if self.plant == "flip-byte" and got and rid.endswith("3"):
                            t = engine.tensors[0]  # control: one bit of a loaded chunk flipped
                            b = int(engine.chunk_blocks(ids, 0, 0)[0])
                            t.view(torch.int16)[b, 0, 0, 0, 0] ^= 1
                        wrong_chunks, wrong_bytes = engine.check(keys, ids, got)
                        with self._lock:
                            self.stats.chunks_loaded += got
                            self.stats.chunks_verified += got - wrong_chunks
                            self.stats.wrong_chunks += wrong_chunks
                            self.stats.wrong_bytes += wrong_bytes
                    else:
                        client.release(engine.instance_id, rid)
                    engine.prefill(keys, ids, got)
                    filled = True
                    st = client.store(engine.instance_id, keys, ids, skip_first_n_chunks=got)
                    with self._lock:
                        self.stats.chunks_stored += st.num_stored_chunks - st.num_already_present
                except grpc.RpcError as e:
                    with self._lock:
                        self.stats.recomputed += 1
                        self._failed_rids.append((pod, rid))
                    code, text = e.code(), str(e.details())
                    if code == grpc.StatusCode.NOT_FOUND or "is not registered" in text:
                        engine.registered_start = -1  # the agent lost this instance: register again
                    with contextlib.suppress(grpc.RpcError):
                        client.release_nowait(engine.instance_id, rid)
            if not filled:
                engine.prefill(keys, ids, got)  # the recompute
            with self._lock:
                self.stats.requests += 1
        finally:
            if release_blocks:
                engine.release(ids)
