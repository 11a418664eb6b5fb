"""The TTFT harness with tensor parallelism: one process per rank, one ``kvgrid agent`` per rank.

Why: to measure time to first token with TP=2 through ``KVGridConnector`` as vLLM runs it --
every rank stores and loads its own shard of the KV (its KV heads) through its own agent, the
scheduler's lookup takes the minimum over the ranks' agents, and the results stay bit-exact.

Layout (as vLLM's multiprocessing executor has it):

* The calling process is rank 0: it holds rank 0's shard of the model (:class:`~kvgrid.bench.ttft.model.
  PagedLlama` with ``tp_rank=0``), vLLM's ``Scheduler`` (whose connector half sees ``world_size=tp``
  and asks every rank's agent) and rank 0's :class:`~kvgrid.bench.ttft.engine.RankWorker`. Ranks
  ``1 .. tp-1`` are spawned processes, each with its shard and one ``RankWorker`` per engine.
* Rank ``r``'s agent listens in ``work/rank{r}`` (its KV cache file lives there too, on CPU); the
  connector's ``agent_socket`` is ``work/rank{rank}/agent.sock`` and every rank's ``VllmConfig``
  carries ``ParallelConfig(tensor_parallel_size=tp, rank=r)``, from which the connector takes its
  rank, its own keys and its agent.
* Two process groups: the default one for the model's all-reduces (gloo on CPU; NCCL on CUDA, rank
  ``r`` on ``cuda:r``, NVLink multicast off: ``NCCL_NVLS_ENABLE=0``) and a gloo group for the control
  plane (vLLM's CPU group): rank 0 broadcasts each command -- per scheduler step the
  :class:`~kvgrid.bench.ttft.engine.StepPlan` (the ``SchedulerOutput``'s parts the runner reads and the
  connector metadata) -- every rank runs it (the same runner order as TTFTEngine's), and rank 0
  gathers one reply per rank. A step's replies are the ranks' ``KVConnectorOutput``, aggregated by
  vLLM's own ``KVOutputAggregator`` (a request's load finished once every rank reported it; failed
  if any rank failed; invalid block ids unioned) before ``update_from_output``.

Invariants: every rank receives the same commands in the same order, so their collectives (the
all-reduces inside a forward) pair up; a rank's error is sent back in its reply and raised on rank 0
naming the rank. A rank that dies makes the others wait in a collective until ``timeout_s``;
so does a rank 0 that sends no command for longer than that (the other ranks wait for the next one
inside a gloo broadcast, which times out).
Logits are replicated after the final all-reduce, so rank 0's logits are the model's: a byte wrong
in any rank's loaded KV changes them. The timings include the control plane (a pickled command
per step), as vLLM's executor pays its own message queue.
"""

from __future__ import annotations

import dataclasses
import functools
import multiprocessing
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from kvgrid.bench.ttft.engine import AgentProcess, EngineOptions, RankWorker, StepPlan, StepResult, TTFTEngine
from kvgrid.bench.ttft.model import ModelShape, PagedLlama

__all__ = ["AfterLoad", "RankSpec", "TPEngine", "TPGroup", "rank_dir"]

T = TypeVar("T")

AfterLoad = Callable[[list[torch.Tensor], str, list[int]], None]
"""A picklable test hook run on one rank: (that rank's per-layer KV views, request id, block ids)."""


@dataclass(frozen=True)
class RankSpec:
    """What every rank builds its shard from (sent to the spawned ranks)."""

    shape: ModelShape
    device: str
    """``cpu`` or ``cuda`` (rank ``r`` on ``cuda:r``)."""
    seed: int
    cuda_graphs: bool
    tp: int
    work: str
    """The directory of ``rank{r}`` folders (agents' sockets, KV files) and the process group's store."""
    timeout_s: float


def rank_dir(work: str | Path, rank: int) -> Path:
    return Path(work) / f"rank{rank}"


def agent_socket(work: str | Path) -> str:
    """The connector's ``agent_socket``: ``{rank}`` is filled in per rank by the connector."""
    return str(Path(work) / "rank{rank}" / "agent.sock")


def _init_rank(rank: int, spec: RankSpec) -> tuple[PagedLlama, Any]:
    """Join the process groups and build this rank's shard: (model, control-plane group)."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    timeout = timedelta(seconds=spec.timeout_s)
    init = f"file://{Path(spec.work) / 'pg-store'}"
    if spec.device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", init_method=init, rank=rank, world_size=spec.tp, timeout=timeout)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=spec.tp, timeout=timeout)
    group = dist.new_group(backend="gloo", timeout=timeout)
    model = PagedLlama(
        spec.shape, device=device, seed=spec.seed, cuda_graphs=spec.cuda_graphs, tp_rank=rank, tp_size=spec.tp
    )
    return model, group


def _rank_main(rank: int, spec: RankSpec) -> None:
    """Ranks 1 .. tp-1: serve rank 0's commands until ``stop`` (module docstring)."""
    if spec.device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.tp))  # the ranks share the cores
    model, group = _init_rank(rank, spec)
    workers: dict[str, RankWorker] = {}
    tokens: dict[str, torch.Tensor] = {}
    try:
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0, group=group)
            cmd = box[0]
            reply: Any = None
            error: str | None = None
            try:
                reply = _serve(rank, spec, model, workers, tokens, cmd)
            except Exception:
                error = f"rank {rank}: {cmd[0]}: {traceback.format_exc()}"
            dist.gather_object((error, reply), None, dst=0, group=group)
            if cmd[0] == "stop":
                break
    finally:
        for w in workers.values():
            w.close()
        dist.destroy_process_group()


def _serve(
    rank: int,
    spec: RankSpec,
    model: PagedLlama,
    workers: dict[str, RankWorker],
    tokens: dict[str, torch.Tensor],
    cmd: tuple[Any, ...],
) -> Any:
    """One command on rank ``rank`` > 0; returns the reply (what rank 0's :meth:`TPGroup.call` gathers)."""
    kind, key, *args = cmd
    if kind == "stop":
        return None
    if kind == "engine":
        (opts,) = args
        workers[key] = RankWorker(model, agent_socket(spec.work), rank_dir(spec.work, rank), opts, rank=rank)
        return None
    w = workers[key]
    if kind == "prompt":
        tokens[key] = torch.tensor(args[0], dtype=torch.int64, device=model.device)
    elif kind == "step":
        res = w.step(args[0], tokens[key])
        return StepResult(None, [], res.kv_output)  # the logits are rank 0's too
    elif kind == "poison":
        w.poison()
    elif kind == "reference":
        ids, start, slots = args
        w.reference(ids.to(model.device), start, slots.to(model.device))
    elif kind == "flush":
        w.connector.flush_stores()
    elif kind == "after_load":
        target, hook = args
        if target == rank:
            w.after_load = functools.partial(hook, w.kv_list) if hook is not None else None
    elif kind == "close":
        w.close()
        del workers[key]
        tokens.pop(key, None)
    else:
        raise ValueError(f"unknown command {kind!r}")
    return None


class TPGroup:
    """Rank 0's side of a tensor-parallel harness: the agents, the spawned ranks, the process groups
    and rank 0's shard (``model``); :meth:`engine` builds an engine on every rank."""

    def __init__(
        self,
        shape: ModelShape,
        work: Path,
        *,
        tp: int,
        device: str = "cpu",
        seed: int = 0,
        cuda_graphs: bool = True,
        l1_size: int = 64 << 20,
        l1_shared_dir: str = "",
        agent_spin_us: int = 0,
        timeout_s: float = 300.0,
    ) -> None:
        """``work``: an empty directory (it gets the ranks' folders and the process group's store)."""
        shape.check_tp(tp)
        if tp < 2:
            raise ValueError(f"tp={tp}; expected >= 2 (TTFTEngine runs tp=1 in one process)")
        if device == "cuda" and torch.cuda.device_count() < tp:
            raise ValueError(f"tp={tp} on cuda: {torch.cuda.device_count()} GPUs visible; expected >= {tp}")
        self.tp = tp
        self.work = work
        self.spec = RankSpec(
            shape=shape, device=device, seed=seed, cuda_graphs=cuda_graphs, tp=tp, work=str(work),
            timeout_s=timeout_s,
        )  # fmt: skip
        self.agents: list[AgentProcess] = []
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self._joined = False
        try:
            for r in range(tp):
                rank_dir(work, r).mkdir(parents=True, exist_ok=True)
                agent = AgentProcess(
                    rank_dir(work, r), l1_size, l1_shared_dir=l1_shared_dir, spin_us=agent_spin_us
                )
                self.agents.append(agent)
            ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no inherited CUDA or threads
            for r in range(1, tp):
                proc = ctx.Process(target=_rank_main, args=(r, self.spec), name=f"kvgrid-ttft-rank{r}")
                proc.start()
                self.procs.append(proc)
            self.model, self._group = _init_rank(0, self.spec)
            self._joined = True
        except BaseException:
            if dist.is_initialized():
                dist.destroy_process_group()
            self._stop_processes()
            raise

    def call(self, cmd: tuple[Any, ...], local: Callable[[], T]) -> tuple[T, list[Any]]:
        """Send ``cmd`` to ranks 1.., run ``local`` here, gather their replies: (local's result, the
        replies of ranks 1..). A rank's error is raised here, naming the rank."""
        dist.broadcast_object_list([cmd], src=0, group=self._group)
        failed: BaseException | None = None
        result: Any = None
        try:
            result = local()
        except BaseException as exc:  # the others still reply: gather before raising
            failed = exc
        replies: list[Any] = [None] * self.tp
        dist.gather_object((None, None), replies, dst=0, group=self._group)
        if failed is not None:
            raise failed
        errors = [e for e, _ in replies[1:] if e is not None]
        if errors:
            raise RuntimeError("tensor-parallel rank failed: " + "\n".join(errors))
        return result, [reply for _, reply in replies[1:]]

    def engine(self, options: EngineOptions) -> TPEngine:
        """A :class:`TPEngine` on every rank."""
        return TPEngine(self, options)

    def close(self) -> None:
        if self._joined:
            self._joined = False
            try:
                self.call(("stop", ""), lambda: None)
            finally:
                dist.destroy_process_group()
        self._stop_processes()

    def _stop_processes(self) -> None:
        for proc in self.procs:
            proc.join(60)
            if proc.is_alive():
                proc.terminate()
                proc.join(10)
        self.procs = []
        for agent in self.agents:
            agent.stop()
        self.agents = []


class TPEngine(TTFTEngine):
    """:class:`~kvgrid.bench.ttft.engine.TTFTEngine` whose steps, poisons, references and flushes run on
    every rank (module docstring); rank 0's scheduler aggregates the ranks' connector outputs."""

    def __init__(self, group: TPGroup, options: EngineOptions) -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

        self.group = group
        self.key = options.engine_id
        fields = dataclasses.asdict(options)

        def build() -> None:
            TTFTEngine.__init__(
                self, group.model, agent_socket(group.work), rank_dir(group.work, 0), **fields
            )

        try:
            group.call(("engine", self.key, options), build)
        except BaseException:  # free what rank 0 built (another rank failed, or this one midway)
            if hasattr(self, "scheduler"):
                TTFTEngine.close(self)
            elif hasattr(self, "rank"):
                self.rank.close()
            raise
        self._aggregator = KVOutputAggregator.from_connector(self.worker, group.tp)

    def set_after_load(self, rank: int, hook: AfterLoad | None) -> None:
        """Run ``hook`` (picklable) on rank ``rank`` where :attr:`RankWorker.after_load` runs."""

        def here() -> None:
            if rank == 0:
                self.rank.after_load = functools.partial(hook, self.kv_list) if hook is not None else None

        self.group.call(("after_load", self.key, rank, hook), here)

    def poison(self) -> None:
        self.group.call(("poison", self.key), super().poison)

    def reference(self, token_ids: torch.Tensor, start: int, slots: torch.Tensor) -> torch.Tensor:
        cmd = ("reference", self.key, token_ids.cpu(), start, slots.cpu())
        logits, _ = self.group.call(cmd, lambda: self.rank.reference(token_ids, start, slots))
        return logits

    def _begin(self, prompt: list[int]) -> torch.Tensor:
        tokens, _ = self.group.call(
            ("prompt", self.key, prompt), lambda: super(TPEngine, self)._begin(prompt)
        )
        return tokens

    def _execute(self, plan: StepPlan, tokens: torch.Tensor) -> StepResult:
        from vllm.v1.outputs import ModelRunnerOutput

        own, others = self.group.call(("step", self.key, plan), lambda: self.rank.step(plan, tokens))
        outputs = [
            ModelRunnerOutput(
                req_ids=[], req_id_to_index={}, sampled_token_ids=[], kv_connector_output=r.kv_output
            )
            for r in (own, *others)
        ]
        aggregated = self._aggregator.aggregate(list(outputs))
        assert aggregated is not None
        return dataclasses.replace(own, kv_output=aggregated.kv_connector_output)

    def _flush_stores(self) -> None:
        self.group.call(("flush", self.key), super()._flush_stores)

    def close(self) -> None:
        self.group.call(("close", self.key), super().close)
