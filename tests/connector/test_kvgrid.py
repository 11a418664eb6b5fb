"""KVGridConnector inside vLLM's real scheduler, against a real ``kvgrid agent`` process.

vLLM 0.32's own ``Scheduler`` drives the scheduler-side connector (it builds it through
``KVConnectorFactory`` from ``kv_connector_module_path``); the test plays the model runner: it
calls the worker-side hooks in the runner's order (bind metadata -> start_load_kv -> forward ->
wait_for_save -> transfer results / load errors -> clear) and "computes" KV by writing random
bytes into the scheduled token slots of CPU KV tensors that live in a shared-memory file.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, supports_hma
from vllm.forward_context import ForwardContext
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs, FinishReason
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvgrid.common.hashing import chunk_keys
from kvgrid.connector import scheduler as connector_scheduler
from kvgrid.connector.chunk_policy import (
    failed_block_ids,
    kv_identity,
    loadable_chunks,
    new_tokens_to_load,
    storable_chunks,
)
from kvgrid.connector.shm import shared_memory_file
from kvgrid.connector.vllm import (
    KVGridConnector,
    KVGridConnectorMetadata,
    LoadOrder,
    parse_connector_config,
)
from kvgrid.engine.client import AgentClient
from kvgrid.engine.tensors import allocate_shared_tensor
from tests.agent.helpers import AgentProc, start_agent, wait_for

BLOCK = 16
CHUNK = 64  # 4 blocks per chunk
NB = 64
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
SPEC = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.bfloat16)
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_hidden_layers": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 2048,
    "torch_dtype": "bfloat16",
    "rms_norm_eps": 1e-5,
}


# ---- pure planning rules -------------------------------------------------------------------------


def test_plan_rules() -> None:
    # Never the whole prompt: 192 tokens = 3 full chunks, but only 2 may be loaded.
    assert loadable_chunks(192, 64) == 2
    assert loadable_chunks(193, 64) == 3
    assert loadable_chunks(0, 64) == 0
    assert new_tokens_to_load(2, 64, 80) == 48
    assert new_tokens_to_load(1, 64, 80) == 0
    assert storable_chunks(130, 200, 64) == 2
    assert storable_chunks(500, 200, 64) == 3  # prompt chunks only
    # Tokens [64, 128) failed, the engine's own hit covers [0, 80): blocks 5..7 of group 0
    # (16 tokens/block) and block 2..3 of group 1 (32 tokens/block); the null block never counts.
    ids = [[10, 11, 12, 13, 14, 15, 16, 17], [0, 21, 22, 23]]
    got = failed_block_ids(ids, [16, 32], start_token=64, end_token=128, skip_first_n_tokens=80)
    assert got == {15, 16, 17, 22, 23}
    assert failed_block_ids(ids, [16, 32], start_token=0, end_token=64, groups=[1]) == {21}
    with pytest.raises(ValueError, match="tokens_per_block has 1 entries"):
        failed_block_ids(ids, [16], start_token=0, end_token=64)


def test_kv_identity_separates_ranks_and_dtypes() -> None:
    base = {"dtype": "bfloat16", "layout": "LBNHC", "world_size": 2, "tp_size": 2, "pp_size": 1}
    ids = {kv_identity(rank=r, **base) for r in range(2)}  # type: ignore[arg-type]
    assert len(ids) == 2
    assert kv_identity(rank=0, **{**base, "dtype": "fp8"}) not in ids  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rank=2"):
        kv_identity(rank=2, **base)  # type: ignore[arg-type]


def test_extra_config_is_validated() -> None:
    cfg = parse_connector_config({"agent_socket": "/tmp/a.sock", "chunk_size": 128, "pin_ttl_ms": 5})
    assert (cfg.agent_socket, cfg.chunk_size, cfg.pin_ttl_ms) == ("/tmp/a.sock", 128, 5)
    assert parse_connector_config(None).chunk_size == 256
    assert parse_connector_config(None).lease_at_lookup is True  # one round trip less per load (docs)
    with pytest.raises(ValueError, match="chunk_sise"):
        parse_connector_config({"chunk_sise": 64})
    with pytest.raises(ValueError, match="chunk_size"):
        parse_connector_config({"chunk_size": 0})


def test_shared_memory_file(tmp_path: Path) -> None:
    path = tmp_path / "kv.bin"
    t = allocate_shared_tensor(path, (4, 256), torch.bfloat16)
    assert shared_memory_file(t[2:]) == str(path)  # any view of the storage
    with pytest.raises(ValueError, match="anonymous memory"):
        shared_memory_file(torch.zeros(1 << 20, dtype=torch.uint8), "layer 'x'")


# ---- vLLM + agent fixtures -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tiny-llama")
    (d / "config.json").write_text(json.dumps(TINY_LLAMA))
    return d


@pytest.fixture(scope="module")
def model_config(model_dir: Path) -> ModelConfig:
    return ModelConfig(model=str(model_dir), skip_tokenizer_init=True, max_model_len=2048)


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[AgentProc]:
    proc = start_agent(tmp_path)
    try:
        yield proc
    finally:
        proc.stop()


def make_vllm_config(
    model_config: ModelConfig, socket: str, *, max_num_batched_tokens: int = 2048, **extra: object
) -> VllmConfig:
    cfg = VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=False),
        scheduler_config=SchedulerConfig(
            max_model_len=2048,
            is_encoder_decoder=False,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=8,
            enable_chunked_prefill=True,
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVGridConnector",
            kv_connector_module_path="kvgrid.connector.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={"agent_socket": socket, "chunk_size": CHUNK, **extra},
        ),
    )
    cfg.cache_config.num_gpu_blocks = NB
    return cfg


def shm_kv_caches(directory: Path) -> tuple[KVCacheConfig, dict[str, torch.Tensor]]:
    """vLLM's own allocation (one int8 buffer, per-layer views by create_kv_cache_views), with the
    buffer in a shared-memory file so the agent can map it."""
    page = SPEC.page_size_bytes
    tensors = [
        KVCacheTensor(
            size=page * NB * len(LAYERS),
            layers=[name],
            layer_stride=page * NB,
            block_stride=page,
            offset=i * page * NB,
        )
        for i, name in enumerate(LAYERS)
    ]
    config = KVCacheConfig(
        num_blocks=NB,
        kv_cache_tensors=tensors,
        kv_cache_groups=[KVCacheGroupSpec(LAYERS, SPEC)],
        kv_cache_layout=KVCacheLayout.LBNHC.name,
    )
    raw = allocate_shared_tensor(directory / "kv-cache.bin", (page * NB * len(LAYERS),), torch.int8)
    caches = {}
    for name, t in zip(LAYERS, tensors, strict=True):
        (view,) = create_kv_cache_views(raw, SPEC, NB, KVCacheLayout.LBNHC, t)
        caches[name] = view
    return config, caches


@dataclass
class Engine:
    """vLLM's scheduler plus the worker-side connector, stepped the way the model runner does."""

    scheduler: Scheduler
    worker: KVGridConnector
    caches: dict[str, torch.Tensor]
    gen: torch.Generator = field(default_factory=lambda: torch.Generator().manual_seed(0))
    block_table: dict[str, list[int]] = field(default_factory=dict)
    invalid_reported: list[set[int]] = field(default_factory=list)
    last_outputs: dict[int, EngineCoreOutputs] = field(default_factory=dict)

    def finish_reasons(self) -> dict[str, FinishReason | None]:
        return {o.request_id: o.finish_reason for outs in self.last_outputs.values() for o in outs.outputs}

    @property
    def connector(self) -> KVGridConnector:
        conn = self.scheduler.connector
        assert isinstance(conn, KVGridConnector)
        return conn

    def add(self, request_id: str, prompt: list[int], *, max_tokens: int = 1, **kw: object) -> Request:
        req = Request(request_id, prompt, SamplingParams(max_tokens=max_tokens), None, **kw)  # type: ignore[arg-type]
        self.scheduler.add_request(req)
        return req

    def slot(self, req_id: str, pos: int) -> tuple[int, int]:
        return self.block_table[req_id][pos // BLOCK], pos % BLOCK

    def tokens_kv(self, req_id: str, start: int, end: int) -> list[torch.Tensor]:
        """Copies of the KV of token positions [start, end) of a request, per layer."""
        out = []
        for name in LAYERS:
            view = self.caches[name]  # [B, H, N, C]
            out.append(
                torch.stack(
                    [view[b, :, s, :].clone() for b, s in (self.slot(req_id, p) for p in range(start, end))]
                )
            )
        return out

    def step(
        self, *, before_forward: object = None, before_load: object = None
    ) -> tuple[SchedulerOutput, set[int]]:
        out = self.scheduler.schedule()
        for new in out.scheduled_new_reqs:
            self.block_table[new.req_id] = list(new.block_ids[0])
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            more = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                self.block_table[rid] = list(more[0]) if more else []
            elif more:
                self.block_table[rid].extend(more[0])
        # vLLM's runner: before anything writes a block, stores still reading freed blocks land.
        assert isinstance(out.kv_connector_metadata, KVGridConnectorMetadata)
        self.worker.handle_preemptions(out.kv_connector_metadata)
        # Fresh blocks hold stale bytes of earlier requests (prefix caching is off); clear them so
        # what a new request's blocks hold after the step was written by this step.
        for new in out.scheduled_new_reqs:
            for name in LAYERS:
                self.caches[name][new.block_ids[0]] = 0
        if callable(before_forward):
            before_forward(out)
        w = self.worker
        assert out.kv_connector_metadata is not None
        w.bind_connector_metadata(out.kv_connector_metadata)
        ctx = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})
        assert isinstance(out.kv_connector_metadata, KVGridConnectorMetadata)
        for load in out.kv_connector_metadata.loads:  # the runner zeroes fresh blocks
            for name in LAYERS:
                self.caches[name][load.block_ids[0]] = 0
        if callable(before_load):
            before_load(out)
        if out.has_sync_kv_loads:
            w.start_load_kv(ctx)
        computed = {n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs}
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for rid, n in out.num_scheduled_tokens.items():  # the forward writes KV of scheduled tokens
            for p in range(computed[rid], computed[rid] + n):
                b, s = self.slot(rid, p)
                for name in LAYERS:
                    view = self.caches[name]
                    view[b, :, s, :] = torch.randint(
                        -100, 100, view[b, :, s, :].shape, generator=self.gen, dtype=torch.int8
                    ).to(view.dtype)
        if not out.has_sync_kv_loads:
            w.start_load_kv(ctx)
        w.wait_for_save()
        w.worker.wait_loads(timeout_s=30)  # loads are async; waiting makes each step's outcome fixed
        results = w.get_transfer_results(out.finished_req_ids)
        invalid = w.get_block_ids_with_load_errors()
        w.clear_connector_metadata()
        self.invalid_reported.append(invalid)
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            req = self.scheduler.requests[rid]
            done_prefill = computed[rid] + out.num_scheduled_tokens[rid] >= req.num_tokens
            sampled.append([7] if done_prefill else [])
        self.last_outputs = self.scheduler.update_from_output(
            out,
            ModelRunnerOutput(
                req_ids=req_ids,
                req_id_to_index={r: i for i, r in enumerate(req_ids)},
                sampled_token_ids=sampled,
                kv_connector_output=KVConnectorOutput(
                    finished_sending=results.finished_sending or None,
                    finished_recving=results.finished_recving or None,
                    failed_recving=results.failed_recving or None,
                    invalid_block_ids=invalid,
                ),
            ),
        )
        return out, invalid


@pytest.fixture
def engine(agent: AgentProc, model_config: ModelConfig, tmp_path: Path) -> Iterator[Engine]:
    yield make_engine(agent, model_config, tmp_path)


def make_engine(agent: AgentProc, model_config: ModelConfig, tmp_path: Path, **kw: object) -> Engine:
    cfg = make_vllm_config(model_config, agent.uds_path, **kw)  # type: ignore[arg-type]
    kv_config, caches = shm_kv_caches(tmp_path)
    worker = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kv_config)
    assert isinstance(worker, KVGridConnector)
    worker.register_kv_caches(caches)
    scheduler = Scheduler(cfg, kv_config, StructuredOutputManager(cfg), block_size=BLOCK)
    return Engine(scheduler, worker, caches)


def prompt(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 31) % 997 for i in range(n)]


# ---- the connector in vLLM -------------------------------------------------------------------------


def test_factory_builds_both_roles(agent: AgentProc, model_config: ModelConfig, tmp_path: Path) -> None:
    cfg = make_vllm_config(model_config, agent.uds_path)
    kv_config, _ = shm_kv_caches(tmp_path)
    assert supports_hma(KVGridConnector)
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        conn = KVConnectorFactory.create_connector(cfg, role, kv_config)
        assert isinstance(conn, KVGridConnector) and conn.role == role
        assert conn.requires_kv_delivery is False
        assert conn.identity.instance_id == f"{cfg.kv_transfer_config.engine_id}-dp0-r0"  # type: ignore[union-attr]
        conn.shutdown()
    with pytest.raises(ValueError, match="multiple of KV cache group 0's 16 tokens"):
        KVConnectorFactory.create_connector(
            make_vllm_config(model_config, agent.uds_path, chunk_size=40),
            KVConnectorRole.SCHEDULER,
            kv_config,
        )


def test_store_then_prefix_hit_loads_bit_exact(engine: Engine, agent: AgentProc) -> None:
    a_prompt = prompt(200)
    engine.add("A", a_prompt)
    out, invalid = engine.step()
    assert out.num_scheduled_tokens == {"A": 200} and not invalid
    meta = out.kv_connector_metadata
    assert isinstance(meta, KVGridConnectorMetadata)
    assert not meta.loads and [
        (s.request_id, len(s.keys[0]), s.skip_first_n_chunks) for s in meta.stores
    ] == [("A", 3, 0)]
    a_kv = engine.tokens_kv("A", 0, 192)
    assert engine.scheduler.requests.get("A") is None  # finished after its one token

    # The agent now holds A's three full chunks under the scheduler's keys.
    ns = engine.connector.identity.namespace(0)
    with AgentClient(agent.uds_path) as client:
        hit = client.lookup(engine.connector.identity.instance_id, "", chunk_keys(a_prompt, ns))
        assert hit.num_hit_chunks == 3

    # B shares A's first 128 tokens (2 chunks), then diverges. The load is asynchronous: the first
    # step schedules no tokens of B and carries its load; B computes its own 60 tokens next step.
    b_prompt = a_prompt[:128] + prompt(60, seed=5)
    b = engine.add("B", b_prompt)
    zeros_before: list[torch.Tensor] = []
    load_blocks: list[int] = []

    def before_load(o: SchedulerOutput) -> None:
        assert isinstance(o.kv_connector_metadata, KVGridConnectorMetadata)
        (order,) = o.kv_connector_metadata.loads
        load_blocks.extend(order.block_ids[0])
        engine.block_table["B"] = list(order.block_ids[0])
        zeros_before.extend(engine.tokens_kv("B", 0, 128))

    out, invalid = engine.step(before_load=before_load)
    assert out.num_scheduled_tokens == {} and not out.has_sync_kv_loads and not invalid
    assert b.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert all(not t.any() for t in zeros_before)  # fresh blocks: what is there now was loaded
    meta = out.kv_connector_metadata
    assert isinstance(meta, KVGridConnectorMetadata)
    (load,) = meta.loads
    assert (load.request_id, len(load.keys[0]), load.skip_first_n_tokens) == ("B", 2, 0)
    for got, want in zip(engine.tokens_kv("B", 0, 128), a_kv, strict=True):
        assert torch.equal(got.view(torch.int16), want[:128].view(torch.int16))  # bit-exact
    out, invalid = engine.step()
    assert out.num_scheduled_tokens == {"B": 60} and not invalid  # 128 tokens came from kvgrid
    meta = out.kv_connector_metadata
    assert isinstance(meta, KVGridConnectorMetadata)
    assert not meta.loads and not meta.stores  # B's only full chunks came from the agent
    assert engine.block_table["B"][:8] == load_blocks[:8]  # the loaded blocks are the ones computed on
    assert b.status == RequestStatus.FINISHED_LENGTH_CAPPED

    # The whole prompt is never reported: A's first 192 tokens again -> 128 matched, 64 computed.
    engine.add("C", a_prompt[:192])
    engine.step()
    out, _ = engine.step()
    assert out.num_scheduled_tokens == {"C": 64}


def test_async_store_returns_at_once_and_vllm_keeps_the_blocks_until_it_landed(
    agent: AgentProc, model_config: ModelConfig, tmp_path: Path
) -> None:
    engine = make_engine(agent, model_config, tmp_path, async_store=True)
    worker = engine.worker.worker
    gate = threading.Event()
    worker._saver.submit(gate.wait)  # hold the store thread: A's store queues behind this
    a_prompt = prompt(200, seed=8)
    engine.add("A", a_prompt)
    out, _ = engine.step()  # A's forward; wait_for_save returned with the store still queued
    a_kv = engine.tokens_kv("A", 0, 192)
    ns = engine.connector.identity.namespace(0)
    instance = engine.connector.identity.instance_id
    with AgentClient(agent.uds_path) as client:
        assert client.lookup(instance, "", chunk_keys(a_prompt, ns)).num_hit_chunks == 0
        held = engine.scheduler.requests.get("A")
        assert held is not None and held.is_finished()  # A finished: vLLM keeps its blocks

        # The next step names A once in ``sending`` and does not wait for its store: A stays held.
        engine.add("B", prompt(100, seed=9))
        out, _ = engine.step()
        meta = out.kv_connector_metadata
        assert isinstance(meta, KVGridConnectorMetadata) and meta.sending == ["A"] and not meta.flush_stores
        assert engine.scheduler.requests.get("A") is not None
        gate.set()
        worker.flush_stores()
        out, _ = engine.step()  # reports A sent: vLLM frees its blocks now
        assert engine.scheduler.requests.get("A") is None
        assert client.lookup(instance, "", chunk_keys(a_prompt, ns)).num_hit_chunks == 3
        assert isinstance(out.kv_connector_metadata, KVGridConnectorMetadata)
        assert out.kv_connector_metadata.sending == ["B"]  # B had a store; A is not named again

    # What landed is A's KV as the forward wrote it: load it into C, bit for bit.
    def before_load(o: SchedulerOutput) -> None:
        assert isinstance(o.kv_connector_metadata, KVGridConnectorMetadata)
        (order,) = o.kv_connector_metadata.loads
        engine.block_table["C"] = list(order.block_ids[0])

    engine.add("C", [*a_prompt[:192], 5])
    engine.step(before_load=before_load)  # the asynchronous load ends inside this step
    for got, want in zip(engine.tokens_kv("C", 0, 192), a_kv, strict=True):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_engine_copies_lease_at_lookup_and_a_lookup_again_ends_the_earlier_lease(
    model_config: ModelConfig, tmp_path: Path
) -> None:
    """With engine copies the scheduler's Lookup leases the hit (the worker needs no Retrieve). A
    request looked up again before it is scheduled (no free blocks yet) ends its earlier lease by
    id; the request's end ends the rest."""
    agent = start_agent(tmp_path, "--l1-shared-dir", str(tmp_path))
    try:
        engine = make_engine(agent, model_config, tmp_path, engine_copies=True, lease_at_lookup=True)
        sched = engine.connector.scheduler
        assert sched.lease_at_lookup
        a_prompt = prompt(200)
        engine.add("A", a_prompt)
        engine.step()  # computed and stored: 3 chunks
        req = Request("again", a_prompt, SamplingParams(max_tokens=1), None)  # type: ignore[arg-type]
        with AgentClient(agent.uds_path) as client:
            assert sched.lookup(req, 0) == (192, True)
            assert client.health().num_leased_chunks == 3
            assert sched.lookup(req, 0) == (192, True)  # the first lookup's lease ends
            wait_for("the earlier lease ended", lambda: client.health().num_leased_chunks == 3, 10)
            sched.finished(req)
            wait_for("the request's lease ended", lambda: client.health().num_leased_chunks == 0, 10)
            assert client.health().num_pinned_chunks == 0
    finally:
        agent.stop()


def test_agents_without_a_peer_address_are_asked_once_not_per_finished_request(
    model_config: ModelConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A finished request that stored chunks carries its agents' peer addresses (P/D). An agent that
    serves no peers answers "none", and that answer is kept: a Health RPC per finished request would
    block vLLM's scheduler thread inside each request's time to first token."""
    agent = start_agent(tmp_path, "--tcp-port", "-1")  # no TCP listener: no peer address
    try:
        engine = make_engine(agent, model_config, tmp_path)
        sched = engine.connector.scheduler
        assert sched is not None
        (client,) = sched._agents.values()
        asked: list[float] = []
        real_health = client.health

        def counted_health(*args: object, **kw: object) -> object:
            asked.append(time.monotonic())
            return real_health(*args, **kw)

        monkeypatch.setattr(client, "health", counted_health)
        for i in range(3):
            engine.add(f"R{i}", prompt(200, seed=40 + i))
            out, _ = engine.step()
            assert out.kv_connector_metadata.stores  # type: ignore[union-attr]
            assert f"R{i}" not in engine.scheduler.requests
        assert len(asked) == 1
        # Once the answer is older than the refresh interval, it is asked again, off the scheduler.
        monkeypatch.setattr(connector_scheduler, "PEER_ADDRESS_REFRESH_S", 0.0)
        engine.add("R3", prompt(200, seed=43))
        engine.step()
        sched._releaser.submit(lambda: None).result(timeout=30)  # the refresh queued before it ran
        assert len(asked) == 2
    finally:
        agent.stop()


def test_namespace_separates_cache_salt(engine: Engine) -> None:
    p = prompt(150, seed=3)
    engine.add("A", p)
    engine.step()
    engine.add("B", p, cache_salt="tenant-b")
    out, _ = engine.step()
    assert out.num_scheduled_tokens == {"B": 150}  # another tenant's prefix is not served
    engine.add("C", p)
    out, _ = engine.step()
    assert out.num_scheduled_tokens == {}  # loading
    out, _ = engine.step()
    assert out.num_scheduled_tokens == {"C": 150 - 128}


def test_chunked_prefill_stores_each_completed_chunk(
    agent: AgentProc, model_config: ModelConfig, tmp_path: Path
) -> None:
    engine = make_engine(agent, model_config, tmp_path, max_num_batched_tokens=96)
    engine.add("A", prompt(300, seed=9))
    orders = []
    for _ in range(4):
        out, _ = engine.step()
        meta = out.kv_connector_metadata
        assert isinstance(meta, KVGridConnectorMetadata)
        orders += [(len(s.keys[0]), s.skip_first_n_chunks) for s in meta.stores]
    # 96, 192, 288, 300 tokens computed -> chunks 0, 1-2, 3-4 complete (the 300th token ends no chunk).
    assert orders == [(1, 0), (3, 1), (4, 3)]


def test_missing_chunk_reports_its_blocks(engine: Engine, agent: AgentProc) -> None:
    a_prompt = prompt(200, seed=11)
    engine.add("A", a_prompt)
    engine.step()
    keys = chunk_keys(a_prompt, engine.connector.identity.namespace(0))
    # A load order for 3 chunks whose third key the agent never stored.
    forged = [*keys[:2], bytes(16)]
    blocks = [list(range(20, 36))]
    w = engine.worker
    w.bind_connector_metadata(
        KVGridConnectorMetadata(loads=[LoadOrder("X", [forged], blocks, skip_first_n_tokens=16)])
    )
    w.start_load_kv(ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={}))
    w.clear_connector_metadata()
    w.worker.wait_loads()
    assert w.get_block_ids_with_load_errors() == set()  # reported with the request, not before
    assert w.get_transfer_results(set()).finished_recving == {"X"}
    assert w.get_block_ids_with_load_errors() == {28, 29, 30, 31}  # chunk 2 = blocks 8..11
    assert w.get_block_ids_with_load_errors() == set()  # reported once
    # A load that fails outright (unknown chunk from the start) reports every block it would write,
    # except those inside the engine's own hit (first 16 tokens = block 20).
    w.bind_connector_metadata(KVGridConnectorMetadata(loads=[LoadOrder("Y", [[bytes(16)] * 2], blocks, 16)]))
    w.start_load_kv(ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={}))
    w.clear_connector_metadata()
    w.worker.wait_loads()
    results = w.get_transfer_results(set())
    assert results.finished_recving == {"Y"} and not results.failed_recving  # one group: blocks suffice
    assert w.get_block_ids_with_load_errors() == set(range(21, 28))


def test_a_staged_load_that_fails_inside_its_step_reports_all_its_blocks(engine: Engine) -> None:
    """A layer-wise load counted as loaded when its step began, then abandoned inside the forward
    (staged_loads.StagedLoad.abandon on CUDA: a stage failed to queue), reports every block it was to
    write as a load error -- outside the engine's own hit -- and moves its chunks from loaded to
    failed in the stats, so vLLM recomputes them."""
    w = engine.worker.worker
    blocks = [list(range(20, 36))]  # 4 chunks of 4 blocks (64 tokens each)
    order = LoadOrder("S", [[bytes(16)] * 4], blocks, skip_first_n_tokens=16, in_step=True)
    w.stats.chunks_loaded, w.stats.chunks_engine_copied = 4, 4  # as _settle counted it
    w._load_failed_late(order, loaded=4, wanted=4)
    assert w.take_load_errors() == set(range(21, 36))  # block 20 is inside the engine's own hit
    assert (w.stats.chunks_loaded, w.stats.chunks_engine_copied, w.stats.chunks_load_failed) == (0, 0, 4)


def test_agent_loss_between_lookup_and_load_fails_the_request(engine: Engine, agent: AgentProc) -> None:
    a_prompt = prompt(200, seed=13)
    engine.add("A", a_prompt)
    engine.step()
    engine.add("B", a_prompt[:130])
    with AgentClient(agent.uds_path) as client:
        # The scheduler's Lookup finds 2 chunks; then the registration vanishes before the load.
        out, invalid = engine.step(
            before_load=lambda o: client.unregister_kv_caches(engine.connector.identity.instance_id)
        )
    assert out.num_scheduled_tokens == {}
    assert len(invalid) == 8  # the 8 blocks of B's 128 external tokens
    # kv_load_failure_policy="fail" (vLLM's default): the request ends with an error.
    assert engine.finish_reasons() == {"B": FinishReason.ERROR}


def test_cpu_kv_cache_outside_shared_memory_is_refused(
    agent: AgentProc, model_config: ModelConfig, tmp_path: Path
) -> None:
    cfg = make_vllm_config(model_config, agent.uds_path)
    kv_config, caches = shm_kv_caches(tmp_path)
    worker = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kv_config)
    plain = {name: torch.zeros_like(t) for name, t in caches.items()}
    with pytest.raises(ValueError, match=r"layer 'model\.layers\.0\.self_attn\.attn'.*anonymous memory"):
        worker.register_kv_caches(plain)


def test_unreachable_agent_is_a_clear_error(model_config: ModelConfig, tmp_path: Path) -> None:
    cfg = make_vllm_config(model_config, str(tmp_path / "nobody.sock"), rpc_timeout_s=2)
    kv_config, caches = shm_kv_caches(tmp_path)
    worker = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kv_config)
    with pytest.raises(ConnectionError, match=r"nobody\.sock"):
        worker.register_kv_caches(caches)
    # The scheduler side degrades to "no hit" instead of failing requests.
    sched = KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, kv_config)
    req = Request("r", prompt(300), SamplingParams(max_tokens=1), None)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert os.path.exists(tmp_path / "kv-cache.bin")


def test_mamba_state_groups_are_refused_with_a_clear_error(
    agent: AgentProc, model_config: ModelConfig, tmp_path: Path
) -> None:
    from vllm.v1.kv_cache_interface import MambaSpec

    cfg = make_vllm_config(model_config, agent.uds_path)
    kv_config, _ = shm_kv_caches(tmp_path)
    mamba = MambaSpec(
        block_size=BLOCK,
        shapes=((3, 8),),
        dtypes=(torch.bfloat16,),
        page_size_padded=SPEC.page_size_bytes,
        mamba_cache_mode="align",
    )
    kv_config.kv_cache_groups.append(KVCacheGroupSpec(["model.layers.2.mixer"], mamba))
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ValueError, match=r"groups \[1\] hold Mamba state"):
            KVConnectorFactory.create_connector(cfg, role, kv_config)


def test_layerwise_asks_vllm_for_piecewise_cuda_graphs() -> None:
    # wait_for_layer_load and save_kv_layer are Python between layers: a full graph would skip them.
    assert KVGridConnector.requires_piecewise_for_cudagraph({"layerwise": True}) is True
    assert KVGridConnector.requires_piecewise_for_cudagraph({}) is False
