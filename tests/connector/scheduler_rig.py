"""vLLM's real ``Scheduler`` with ``KVGridConnector``, stepped by hand over real agent processes.

:class:`AgentSwitch` keeps one agent serving behind a fixed socket path and a second one started
in the background, so "the agent restarted" (the running one is killed, a fresh one with an empty
L1 serves the same path) costs no start-up wait in the middle of a run.

:class:`Rig` is one engine: vLLM 0.32's ``Scheduler`` (which builds the scheduler half of the
connector from ``kv_connector_module_path``) and the worker half over CPU KV tensors in a
shared-memory file, stepped in the model runner's order (bind metadata -> handle_preemptions ->
start_load_kv -> forward -> wait_for_save -> transfer results and load errors -> clear ->
``update_from_output``). There is no model: the forward computes nothing and every request that
reaches its last token samples token 7; what is under test is bookkeeping, not numerics.

The connector's background threads are made to settle inside the step (loads answered, stores
landed, a re-registration done) unless the test holds them on purpose (:meth:`Rig.hold_loads`,
:meth:`Rig.hold_stores`), so a run's outcome depends on its rules, not on thread timing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.forward_context import ForwardContext
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import FinishReason
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

from kvgrid.common.hotpath import hot_path_of
from kvgrid.connector.metadata import KVGridConnectorMetadata, LoadOrder
from kvgrid.connector.scheduler import ConnectorScheduler
from kvgrid.connector.vllm import KVGridConnector
from kvgrid.connector.worker import ConnectorWorker
from kvgrid.engine.client import AgentClient
from kvgrid.engine.tensors import allocate_shared_tensor
from tests.agent.helpers import AgentProc, kvgrid_env

BLOCK = 16
CHUNK = 64  # 4 blocks per chunk
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
SPEC = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.bfloat16)
SAMPLED_TOKEN = 7
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


def tiny_model_config(directory: Path) -> ModelConfig:
    """A two-layer Llama's config (no weights: nothing computes)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(TINY_LLAMA))
    return ModelConfig(model=str(directory), skip_tokenizer_init=True, max_model_len=2048)


# ---- agents ---------------------------------------------------------------------------------------


class AgentSwitch:
    """A real agent serving at :attr:`path` (a symbolic link to its socket, and one to its hot-path
    socket), with the next one already starting: :meth:`restart` kills the running agent (SIGKILL:
    pins, leases, registrations and L1 go with it) and points the path at the fresh one."""

    def __init__(self, root: Path, shm_dir: Path, *flags: str, l1_size: str = "16MiB") -> None:
        self.root, self.shm_dir, self.flags, self.l1_size = root, shm_dir, flags, l1_size
        self.path = root / "agent.sock"
        self.restarts = 0
        self._started = 0
        self.current = self._serving(*self._launch())
        self._point_at(self.current)
        self._standby = self._launch()

    def _launch(self) -> tuple[subprocess.Popen[str], Path]:
        """Start an agent (``start_agent``'s command line) without waiting for it to serve."""
        self._started += 1
        directory = self.root / f"agent-{self._started}"
        directory.mkdir()
        cmd = [
            sys.executable, "-m", "kvgrid.cli", "agent", "--uds-path", str(directory / "agent.sock"),
            "--tcp-host", "127.0.0.1", "--tcp-port", "0", "--l1-size", self.l1_size, "--l1-page-size", "4KiB",
            "--shm-allowed-dirs", str(self.shm_dir), "--reaper-interval-ms", "100", "--log-level", "error",
            *self.flags,
        ]  # fmt: skip
        env = kvgrid_env(f"uid-{self._started}")
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env), directory

    @staticmethod
    def _serving(proc: subprocess.Popen[str], directory: Path) -> AgentProc:
        """Wait until a launched agent serves (its first JSON line)."""
        assert proc.stdout is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if line.startswith("{"):
                info = json.loads(line)
                assert info["event"] == "serving", info
                return AgentProc(proc, info["uds_path"], info["tcp_port"], info["epoch"], directory.name)
            if proc.poll() is not None:
                break
        raise RuntimeError(f"agent in {directory} did not serve (exit code {proc.poll()})")

    def _point_at(self, agent: AgentProc) -> None:
        for link, target in (
            (str(self.path), agent.uds_path),
            (hot_path_of(str(self.path)), hot_path_of(agent.uds_path)),
        ):
            tmp = f"{link}.new"
            os.symlink(target, tmp)
            os.replace(tmp, link)

    def restart(self) -> None:
        old = self.current
        old.proc.kill()
        old.proc.wait()
        self.current = self._serving(*self._standby)
        self._point_at(self.current)
        self._standby = self._launch()
        self.restarts += 1

    def client(self) -> AgentClient:
        return AgentClient(str(self.path), timeout_s=10)

    def close(self) -> None:
        standby, _ = self._standby
        standby.kill()
        standby.wait()
        self.current.stop()


# ---- one engine -----------------------------------------------------------------------------------


def shm_kv_caches(path: Path, num_blocks: int) -> tuple[KVCacheConfig, dict[str, torch.Tensor]]:
    """vLLM's own allocation (one int8 buffer, per-layer views by create_kv_cache_views) in a
    shared-memory file the agent can map."""
    page = SPEC.page_size_bytes
    tensors = [
        KVCacheTensor(
            size=page * num_blocks * len(LAYERS),
            layers=[name],
            layer_stride=page * num_blocks,
            block_stride=page,
            offset=i * page * num_blocks,
        )
        for i, name in enumerate(LAYERS)
    ]
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=[KVCacheGroupSpec(LAYERS, SPEC)],
        kv_cache_layout=KVCacheLayout.LBNHC.name,
    )
    raw = allocate_shared_tensor(path, (page * num_blocks * len(LAYERS),), torch.int8)
    caches = {}
    for name, t in zip(LAYERS, tensors, strict=True):
        (view,) = create_kv_cache_views(raw, SPEC, num_blocks, KVCacheLayout.LBNHC, t)
        caches[name] = view
    return config, caches


class StepClock:
    """``time`` for the connector's modules, whose ``monotonic()`` moves only when a step ends (one
    second a step): the scheduler's back-off from an agent that failed and the worker's
    re-registration interval then count steps, not the speed of the machine running the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)


@dataclass
class StepResult:
    out: SchedulerOutput
    meta: KVGridConnectorMetadata
    finished_recving: set[str]
    failed_recving: set[str]
    invalid_block_ids: set[int]
    finished: dict[str, FinishReason]
    """Requests that ended in this step's ``update_from_output``, with why."""


@dataclass
class _Gate:
    """A task parked on one of the worker's single-threaded executors: work queued behind it waits."""

    event: threading.Event = field(default_factory=threading.Event)
    steps_left: int = 0


class Rig:
    """One engine over the agent behind ``agents.path`` (module docstring)."""

    def __init__(
        self,
        model_config: ModelConfig,
        agents: AgentSwitch,
        kv: tuple[KVCacheConfig, dict[str, torch.Tensor]],
        *,
        kv_identity: str,
        clock: StepClock | None = None,
        max_num_seqs: int = 8,
        max_num_batched_tokens: int = 128,
        prefix_caching: bool = False,
    ) -> None:
        kv_config, caches = kv
        self.num_blocks = kv_config.num_blocks
        cfg = VllmConfig(
            model_config=model_config,
            cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=prefix_caching),
            scheduler_config=SchedulerConfig(
                max_model_len=2048,
                is_encoder_decoder=False,
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=max_num_seqs,
                enable_chunked_prefill=True,
            ),
            kv_transfer_config=KVTransferConfig(
                kv_connector="KVGridConnector",
                kv_connector_module_path="kvgrid.connector.vllm",
                kv_role="kv_both",
                kv_load_failure_policy="recompute",
                kv_connector_extra_config={
                    "agent_socket": str(agents.path),
                    "chunk_size": CHUNK,
                    "async_store": True,  # CUDA's default: finished requests wait for finished_sending
                    "kv_identity": kv_identity,  # keys of their own: nothing left by other runs hits
                    "reregister_interval_s": 0.5,  # with a StepClock: until the next step
                    "rpc_timeout_s": 10,
                },
            ),
        )
        cfg.cache_config.num_gpu_blocks = self.num_blocks
        self.agents = agents
        self.clock = clock
        self.vllm_config = cfg
        worker = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kv_config)
        assert isinstance(worker, KVGridConnector)
        self.connector_worker = worker
        worker.register_kv_caches(caches)
        self.scheduler = Scheduler(cfg, kv_config, StructuredOutputManager(cfg), block_size=BLOCK)
        self._squeezed: list[KVCacheBlock] = []
        self._squeeze_steps = 0
        self._loads_gate: _Gate | None = None
        self._stores_gate: _Gate | None = None
        self.before_load: Callable[[KVGridConnectorMetadata], bool] | None = None
        """Called with the metadata of each step that orders loads, before the loads start, until
        it answers True (it acted)."""

    # ---- views ----------------------------------------------------------------------------------

    @property
    def sched(self) -> ConnectorScheduler:
        conn = self.scheduler.connector
        assert isinstance(conn, KVGridConnector)
        return conn.scheduler

    @property
    def worker(self) -> ConnectorWorker:
        return self.connector_worker.worker

    @property
    def instance_id(self) -> str:
        return self.connector_worker.identity.instance_id

    def free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    # ---- requests -------------------------------------------------------------------------------

    def add(self, request_id: str, prompt: list[int], max_tokens: int) -> Request:
        req = Request(request_id, prompt, SamplingParams(max_tokens=max_tokens), None)
        self.scheduler.add_request(req)
        return req

    def abort(self, request_id: str) -> bool:
        return bool(self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED))

    def squeeze(self, blocks: int, steps: int) -> int:
        """Take up to ``blocks`` free blocks out of vLLM's pool for ``steps`` steps (the cache
        shrinks: running requests that grow are preempted); the number taken."""
        pool = self.scheduler.kv_cache_manager.block_pool
        n = min(blocks, pool.get_num_free_blocks())
        if self._squeezed or n <= 0:
            return 0
        self._squeezed = pool.get_new_blocks(n)
        self._squeeze_steps = steps
        return n

    def unsqueeze(self) -> None:
        if self._squeezed:
            self.scheduler.kv_cache_manager.block_pool.free_blocks(self._squeezed)
            self._squeezed = []

    # ---- holding the worker's threads -----------------------------------------------------------

    def hold_loads(self, steps: int) -> None:
        """Loads ordered during the next ``steps`` steps stay in flight (queued on the loader
        thread) until the hold ends: vLLM keeps those requests in WAITING_FOR_REMOTE_KVS."""
        if self._loads_gate is None:
            self._loads_gate = _Gate(steps_left=steps)
            self.worker._loader.submit(self._loads_gate.event.wait)

    def hold_stores(self, steps: int) -> None:
        """Stores ordered during the next ``steps`` steps stay in flight (queued on the saver
        thread): finished requests keep their blocks until the hold ends."""
        if self._stores_gate is None:
            self._stores_gate = _Gate(steps_left=steps)
            self.worker._saver.submit(self._stores_gate.event.wait)

    def release_holds(self) -> None:
        self.unsqueeze()
        for gate in (self._loads_gate, self._stores_gate):
            if gate is not None:
                gate.event.set()
        self._loads_gate = self._stores_gate = None
        self._settle_threads()

    @property
    def holding(self) -> bool:
        return self._loads_gate is not None or self._stores_gate is not None

    def _tick_holds(self) -> None:
        self._squeeze_steps -= 1
        if self._squeeze_steps <= 0:
            self.unsqueeze()
        for name in ("_loads_gate", "_stores_gate"):
            gate: _Gate | None = getattr(self, name)
            if gate is not None:
                gate.steps_left -= 1
                if gate.steps_left <= 0:
                    gate.event.set()
                    setattr(self, name, None)
        self._settle_threads()  # what the hold kept lands before the next step's lookups

    def _settle_threads(self) -> None:
        """Wait for what is not held: answered loads, landed stores, a re-registration."""
        w = self.worker
        if self._loads_gate is None:
            w.wait_loads(timeout_s=30)
            if (rereg := w._reregistering) is not None:
                rereg.result(timeout=30)  # it swaps the copier on the loader thread: loads not held
        if self._stores_gate is None:
            w._saver.submit(lambda: None).result(timeout=30)

    def settle_releases(self) -> None:
        """The scheduler half's pin releases queued so far have been answered."""
        self.sched._releaser.submit(lambda: None).result(timeout=30)

    # ---- one step -------------------------------------------------------------------------------

    def step(self) -> StepResult:
        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        assert isinstance(meta, KVGridConnectorMetadata)
        if meta.flush_stores and self._stores_gate is not None:
            # handle_preemptions waits for those stores: in a real engine they land meanwhile.
            self._stores_gate.event.set()
            self._stores_gate = None
        w = self.connector_worker
        ctx = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})
        w.bind_connector_metadata(meta)
        w.handle_preemptions(meta)
        if meta.loads and self.before_load is not None and self.before_load(meta):
            self.before_load = None
        if out.has_sync_kv_loads:
            w.start_load_kv(ctx)
        computed = {n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        if not out.has_sync_kv_loads:
            w.start_load_kv(ctx)
        w.wait_for_save()
        self._settle_threads()
        results = w.get_transfer_results(out.finished_req_ids)
        invalid = w.get_block_ids_with_load_errors()
        w.clear_connector_metadata()
        self._tick_holds()
        if self.clock is not None:
            self.clock.now += 1.0
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            req = self.scheduler.requests[rid]
            reached_end = computed[rid] + out.num_scheduled_tokens[rid] >= req.num_tokens
            sampled.append([SAMPLED_TOKEN] if reached_end else [])
        outputs = self.scheduler.update_from_output(
            out,
            ModelRunnerOutput(
                req_ids=req_ids,
                req_id_to_index={r: i for i, r in enumerate(req_ids)},
                sampled_token_ids=sampled,
                kv_connector_output=KVConnectorOutput(
                    finished_sending=results.finished_sending or None,
                    finished_recving=results.finished_recving or None,
                    failed_recving=results.failed_recving or set(),
                    invalid_block_ids=invalid,
                ),
            ),
        )
        finished = {
            o.request_id: o.finish_reason
            for outs in outputs.values()
            for o in outs.outputs
            if o.finish_reason is not None
        }
        return StepResult(
            out,
            meta,
            set(results.finished_recving or ()),
            set(results.failed_recving or ()),
            invalid,
            finished,
        )

    # ---- agent-side views and faults ------------------------------------------------------------

    def agent_holds_for(self, request_id: str) -> tuple[int, int]:
        """(pins, leased chunks) the agent still held for the request -- dropping them: ask only
        about requests that ended."""
        with self.agents.client() as client:
            try:
                resp = client.release_all(self.instance_id, request_id)
            except grpc.RpcError:  # the agent does not know this engine (it restarted): it holds nothing
                return 0, 0
        return int(resp.released_pins), int(resp.released_chunks)

    def agent_totals(self) -> tuple[int, int]:
        """(pins, leased chunks) the agent holds for anyone."""
        with self.agents.client() as client:
            h = client.health()
        return int(h.num_pinned_chunks), int(h.num_leased_chunks)

    def forget_registration(self) -> None:
        """The agent drops this engine's registration (and its pins), as if it had restarted, but
        keeps its L1: the worker's next call fails and it registers again."""
        with self.agents.client() as client:
            client.unregister_kv_caches(self.instance_id)

    def restart_agent_keeping(self, order: LoadOrder, keep_chunks: int) -> None:
        """The agent restarts after the Lookup of ``order``'s request; the worker registers again
        and another request stores the first ``keep_chunks`` of its chunks before the load runs."""
        self.agents.restart()
        w = self.worker
        w._send_registration()
        if keep_chunks:
            keys = order.keys[0][:keep_chunks]
            w.agent.store(self.instance_id, keys, [order.block_ids[0][: keep_chunks * CHUNK // BLOCK]])

    def close(self) -> None:
        self.release_holds()
        self.scheduler.shutdown()
        self.connector_worker.shutdown()
