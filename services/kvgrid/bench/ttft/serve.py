"""``kvgrid bench serve``: many requests at once through vLLM's scheduler, at rising request rates,
vLLM alone against vLLM + kvgrid, same run, same requests.

Each (configuration, rate) is one run of a fresh :class:`~kvgrid.bench.ttft.serve_engine.ServeEngine` (a
new KV cache, a new ``kvgrid agent`` with an empty L1) serving one workload in real time: requests
arrive as :mod:`kvgrid.bench.ttft.workloads` lays them out at the rate (chat sessions in closed loop, a
session's next turn after its previous answer plus a think time), the engine steps continuously
(continuous batching, chunked prefill, preemption), and every token's time is taken when the step
that sampled it returned. Configurations:

* ``vllm-prefix``: vLLM alone, its GPU prefix cache on (what users run today);
* ``vllm-nocache``: vLLM alone, prefix cache off;
* ``kvgrid``: vLLM (prefix cache on) + ``KVGridConnector`` with its defaults and an agent whose L1
  is what the Helm chart gives one GPU (8 GiB);
* ``kvgrid-engine-copies``: the same with the agent's L1 shared with the engine, which copies its
  loads and stores itself (the chart's ``l1Shared``);
* ``kvgrid-lookup-only``: the connector that never stores (``kv_role: kv_consumer``): what its
  lookups and calls cost a request without the stores.

The GPU KV cache holds ``--gpu-cache-fraction`` (default 1/4) of the workload's working set, so
vLLM's own cache cannot keep it. A run admits arrivals for ``--run-s`` seconds, then drains for at
most ``--drain-s``; a request without its first token by then counts with the time it waited
(a lower bound: the percentile is then at least that).

Per configuration and rate: TTFT p50/p90/p99, inter-token latency p50/p90, completed requests/s and
prompt tokens/s, vLLM's GPU prefix-cache hit rate and the connector's, bytes loaded and stored, the
agent's CPU seconds, preemptions. The limit beside them: ``prefill_ms`` (the model over one mean
prompt alone, no scheduler) and the ratios to ``vllm-prefix`` at the same rate.

Checks, every run: the drained engine holds no request, no used block and no runner state, and the
agent no pinned or leased chunk; with ``--check-tokens`` (the CPU test) every request's generated
tokens are equal across configurations. After the sweep a sampled hit (one prompt served twice by a
kvgrid engine, the second time loaded) must give first-token logits equal bit for bit to the same
forwards without kvgrid (full prefill, then the hit's tail over that KV: same kernels, same shapes).
A failed check exits 1.

The JSON goes to ``--out`` with two plots beside it (TTFT p90 and throughput against the rate).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import torch

from kvgrid.bench.ttft.bench import PRESETS
from kvgrid.bench.ttft.engine import AgentProcess, EngineOptions
from kvgrid.bench.ttft.model import ModelShape, PagedLlama
from kvgrid.bench.ttft.serve_engine import GRAPH_SIZES, RowSpan, ServeEngine, pack_batch
from kvgrid.bench.ttft.workloads import ChatConfig, ChatWorkload, QAConfig, QAWorkload, Workload
from kvgrid.common.config import add_config_arguments, config_from_args

__all__ = ["ServeBenchConfig", "add_arguments", "measure", "plot", "run"]

ENV_PREFIX = "KVGRID_BENCH_SERVE_"
Config = Literal["vllm-prefix", "vllm-nocache", "kvgrid", "kvgrid-engine-copies", "kvgrid-lookup-only"]
CONFIGS: tuple[Config, ...] = ("vllm-prefix", "vllm-nocache", "kvgrid")
BASELINE: Config = "vllm-prefix"


def _d(text: str) -> msgspec.Meta:
    return msgspec.Meta(description=text)


class ServeBenchConfig(msgspec.Struct, frozen=True, kw_only=True):
    """``kvgrid bench serve``'s options: defaults < ``--config`` YAML < ``KVGRID_BENCH_SERVE_*`` env <
    flags."""

    device: Annotated[
        Literal["cpu", "cuda"], _d("where the model and its KV cache run; default cuda when a GPU is visible")
    ] = "cuda" if torch.cuda.is_available() else "cpu"
    model: Annotated[
        Literal["auto", "llama3-8b", "small", "tiny"],
        _d("model shape (kvgrid bench ttft's presets); auto = llama3-8b on cuda, tiny on cpu"),
    ] = "auto"
    layers: Annotated[int, msgspec.Meta(ge=0, description="override the preset's layer count (0: keep)")] = 0
    workload: Annotated[
        Literal["qa", "chat"],
        _d("qa: users each with a long document, questions round-robin (LMCache's multi-round QA); chat: "
           "multi-turn sessions over shared system prompts shaped by the Mooncake conversation trace"),
    ] = "qa"  # fmt: skip
    configs: Annotated[
        tuple[Config, ...],
        _d(
            "configurations, side by side (vllm-prefix, vllm-nocache, kvgrid, kvgrid-engine-copies, "
            "kvgrid-lookup-only)"
        ),
    ] = CONFIGS
    rates: Annotated[
        tuple[float, ...],
        _d(
            "request rates (requests/s; inf: every session's first request at once); empty = 1,2,4,8,12 on "
            "cuda, 2,8 on cpu"
        ),
    ] = ()
    max_model_len: Annotated[int, msgspec.Meta(ge=0, description="context (0: 8192 on cuda, 512 on cpu)")] = 0
    users: Annotated[int, msgspec.Meta(ge=0, description="qa: users (0: 12 on cuda, 6 on cpu)")] = 0
    sessions: Annotated[int, msgspec.Meta(ge=0, description="chat: sessions (0: 200 on cuda, 8 on cpu)")] = 0
    rounds: Annotated[
        int, msgspec.Meta(ge=0, description="qa: rounds per user (0: 12 on cuda, 3 on cpu)")
    ] = 0
    think_s: Annotated[float, msgspec.Meta(ge=0, description="mean think time after an answer, seconds")] = (
        0.5
    )
    output_tokens: Annotated[
        int, msgspec.Meta(ge=0, description="qa: tokens per answer (0: max_model_len / 256, at least 8)")
    ] = 0
    gpu_cache_fraction: Annotated[
        float,
        msgspec.Meta(gt=0, le=1, description="GPU KV cache as a fraction of the workload's working set"),
    ] = 0.25
    l1_size: Annotated[
        int, msgspec.Meta(ge=0, description="agent L1 bytes (0: 8 GiB on cuda as the chart, 256 MiB on cpu)")
    ] = 0
    max_num_seqs: Annotated[int, msgspec.Meta(ge=1, description="vLLM's max_num_seqs")] = 64
    max_num_batched_tokens: Annotated[
        int,
        msgspec.Meta(
            ge=0, description="vLLM's max_num_batched_tokens (chunked prefill; 0: 2048 on cuda, 128 on cpu)"
        ),
    ] = 0
    block_size: Annotated[int, msgspec.Meta(ge=1, description="tokens per KV block")] = 16
    chunk_size: Annotated[int, msgspec.Meta(ge=1, description="tokens per kvgrid chunk")] = 256
    run_s: Annotated[float, msgspec.Meta(gt=0, description="seconds of arrivals per run")] = 20.0
    drain_s: Annotated[
        float, msgspec.Meta(ge=0, description="most seconds to finish admitted requests after")
    ] = 20.0
    warm_documents: Annotated[
        bool, _d("qa: each user's document is read once before a run's clock starts (the steady state)")
    ] = True
    cuda_graphs: Annotated[bool, _d("piecewise CUDA graphs for steps of <= 512 tokens, as vLLM")] = True
    check_tokens: Annotated[
        bool, _d("fail unless every request's tokens are equal across configurations (exact on CPU float32)")
    ] = False
    seed: Annotated[int, _d("weights and workload seed")] = 0
    out: Annotated[str, _d("directory for serve.json and the plots (empty: none written)")] = ""
    json: Annotated[bool, _d("print one JSON object instead of a table")] = False


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, ServeBenchConfig, env_prefix=ENV_PREFIX)
    parser.add_argument(
        "--plot-from", metavar="JSON", default=None,
        help="only draw the plots of a recorded serve.json (into --out, else beside it)",
    )  # fmt: skip


def _sig(x: float) -> float:
    return float(f"{x:.4g}")


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


class _Resolved(msgspec.Struct, frozen=True):
    shape: ModelShape
    rates: tuple[float, ...]
    max_model_len: int
    l1_size: int
    batched_tokens: int


def resolve(cfg: ServeBenchConfig) -> _Resolved:
    """Defaults by device; ValueError naming a bad value."""
    cuda = cfg.device == "cuda"
    name = cfg.model if cfg.model != "auto" else ("llama3-8b" if cuda else "tiny")
    shape = PRESETS[name]
    if cfg.layers:
        shape = msgspec.structs.replace(shape, layers=cfg.layers)
    rates = cfg.rates or ((1.0, 2.0, 4.0, 8.0, 12.0) if cuda else (2.0, 8.0))
    if any(not r > 0 for r in rates):  # NaN fails too
        raise ValueError(f"rates={rates}: expected requests/s > 0 (or inf)")
    if not cfg.configs or len(set(cfg.configs)) != len(cfg.configs):
        raise ValueError(f"configs={cfg.configs}: expected distinct names among {', '.join(CONFIGS)}")
    if cfg.chunk_size % cfg.block_size:
        raise ValueError(f"chunk_size={cfg.chunk_size} is not a multiple of block_size={cfg.block_size}")
    max_len = cfg.max_model_len or (8192 if cuda else 512)
    batched = cfg.max_num_batched_tokens or (2048 if cuda else 128)
    return _Resolved(
        shape, tuple(rates), max_len, cfg.l1_size or ((8 << 30) if cuda else (256 << 20)), batched
    )


def workload(cfg: ServeBenchConfig, r: _Resolved) -> Workload:
    cuda = cfg.device == "cuda"
    if cfg.workload == "qa":
        return QAWorkload(
            QAConfig(
                max_model_len=r.max_model_len, vocab_size=r.shape.vocab,
                users=cfg.users or (12 if cuda else 6),
                rounds=cfg.rounds or (12 if cuda else 3), seed=cfg.seed, think_time_s=cfg.think_s,
                answer_tokens=cfg.output_tokens or max(8, r.max_model_len // 256),
            )
        )  # fmt: skip
    return ChatWorkload(
        ChatConfig(
            max_model_len=r.max_model_len, vocab_size=r.shape.vocab,
            sessions=cfg.sessions or (200 if cuda else 8),
            seed=cfg.seed, think_time_s=cfg.think_s,
        )
    )  # fmt: skip


def _options(cfg: ServeBenchConfig, r: _Resolved, name: Config, num_blocks: int) -> EngineOptions:
    return EngineOptions(
        max_prompt_tokens=r.max_model_len - cfg.block_size, block_size=cfg.block_size,
        chunk_size=cfg.chunk_size,
        engine_id=f"serve-{name}", engine_copies=name == "kvgrid-engine-copies", num_blocks=num_blocks,
        max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=r.batched_tokens,
        prefix_caching=name != "vllm-nocache",
        kv_role="kv_consumer" if name == "kvgrid-lookup-only" else "kv_both",
        async_store=True,  # the CUDA default, on the CPU too: CI runs the path the GPU runs
    )  # fmt: skip


def warm_graphs(model: PagedLlama, kv_list: list[torch.Tensor], block_size: int, batched: int) -> None:
    """Capture every graph size a step can take (and compile the attention kernel) before any timing:
    one forward per size over blocks 1.. of a cache no request uses yet."""
    sizes = [n for n in GRAPH_SIZES if n <= min(model.graph_max_tokens, batched)]
    if not model.cuda_graphs or set(sizes) <= set(model.graph_sizes):
        return  # nothing to capture (an earlier run captured them all)
    for n in sizes:
        blocks = list(range(1, -(-n // block_size) + 1))
        model.forward_batch(pack_batch([RowSpan([1] * n, blocks, 0, n)], block_size, model), kv_list)
    torch.cuda.synchronize()


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (Linux /proc; its threads included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _agent_counts(agent: AgentProcess) -> tuple[int, int]:
    """(pinned, leased) chunks of the agent, once its release threads settled (at most 10 s)."""
    from kvgrid.engine.client import AgentClient

    with AgentClient(agent.uds_path) as client:
        deadline = time.monotonic() + 10
        while True:
            h = client.health()
            if (h.num_pinned_chunks == 0 and h.num_leased_chunks == 0) or time.monotonic() > deadline:
                return int(h.num_pinned_chunks), int(h.num_leased_chunks)
            time.sleep(0.05)


def serve_once(
    cfg: ServeBenchConfig, r: _Resolved, model: PagedLlama, wl: Workload, name: Config, rate: float,
    num_blocks: int, work: Path,
) -> tuple[dict[str, Any], dict[str, list[int]], list[str]]:  # fmt: skip
    """One (configuration, rate) run: (figures, tokens by request, failed checks)."""
    failures: list[str] = []
    connector = name.startswith("kvgrid")
    with contextlib.ExitStack() as stack:
        agent = None
        if connector:
            shared = str(work) if name == "kvgrid-engine-copies" else ""
            agent = AgentProcess(work, r.l1_size, l1_shared_dir=shared)
            stack.callback(agent.stop)
        eng = ServeEngine(model, agent.uds_path if agent else None, work, _options(cfg, r, name, num_blocks))
        stack.callback(eng.close)
        warm_graphs(model, eng.rank.kv_list, cfg.block_size, r.batched_tokens)
        if cfg.warm_documents and cfg.workload == "qa":
            _read_documents(eng, wl)
        loaded0 = eng.rank.connector.worker.stats.chunks_loaded if connector else 0
        agent_cpu0 = _cpu_s(agent.proc.pid) if agent else 0.0
        arrival: dict[str, float] = {}
        prompt_len: dict[str, int] = {}
        first: dict[str, float] = {}
        last: dict[str, float] = {}
        itl: list[float] = []
        tokens: dict[str, list[int]] = {}
        done: dict[str, float] = {}
        first_computed: dict[str, int] = {}
        first_external: dict[str, int] = {}
        preempted = steps = 0
        t0 = time.perf_counter()
        wl.start(rate, 0.0)
        admitting = True
        while True:
            now = time.perf_counter() - t0
            if admitting and now > cfg.run_s:
                admitting = False
            if admitting:
                for req in wl.next_ready(now):
                    if req.arrival_s > cfg.run_s:
                        admitting = False
                        break
                    arrival[req.request_id] = req.arrival_s
                    prompt_len[req.request_id] = len(req.prompt_token_ids)
                    tokens[req.request_id] = []
                    eng.add(req.request_id, req.prompt_token_ids, req.max_tokens)
            if eng.has_work():
                ev = eng.step()
                steps += 1
                t = time.perf_counter() - t0
                preempted += ev.preempted
                first_computed.update(ev.first_schedule)
                first_external.update(ev.first_external)
                for rid, tok in ev.sampled.items():
                    tokens[rid].append(tok)
                    if rid in last:
                        itl.append(t - last[rid])
                    else:
                        first[rid] = t
                    last[rid] = t
                for rid in ev.finished:
                    done[rid] = t
                    wl.complete(rid, t)
                if not admitting and t > cfg.run_s + cfg.drain_s:
                    break
                continue
            if not admitting or wl.done:
                break
            nxt = wl.next_time()
            wait = (nxt - now) if nxt is not None else 0.001
            time.sleep(min(max(wait, 0.0), 0.05))
        end = time.perf_counter() - t0
        unfinished = [rid for rid in arrival if rid not in done]
        for rid in unfinished:  # stop them so the engine drains for the leftover checks
            eng.scheduler.finish_requests([rid], _aborted())
        while eng.has_work():
            eng.step()
        if connector:
            eng.rank.connector.flush_stores()
        ws = eng.rank.connector.worker.stats if connector else None
        left = eng.leftovers()
        if any(left.values()):
            failures.append(f"{name} at {rate}/s: the drained engine still holds {left}")
        agent_cpu = 0.0
        if agent is not None:
            agent_cpu = _cpu_s(agent.proc.pid) - agent_cpu0
            pinned, leased = _agent_counts(agent)
            if pinned or leased:
                failures.append(
                    f"{name} at {rate}/s: the agent holds {pinned} pinned and {leased} leased chunks"
                )
    ttft = [first[r] - arrival[r] for r in first]
    censored = [end - arrival[r] for r in arrival if r not in first]
    all_ttft = ttft + censored
    span = max(done.values(), default=end)
    chunk_bytes = cfg.chunk_size * r.shape.kv_bytes_per_token(model.dtype)
    from_kvgrid = sum(first_external.values())  # prompt tokens kvgrid supplied at first schedule
    cached = sum(first_computed.values())
    prompts = sum(prompt_len[r] for r in first_computed)
    row = {
        "config": name,
        "rate": rate,
        "admitted": len(arrival),
        "completed": len(done),
        "without_first_token": len(censored),
        "ttft_p50_ms": _ms(_pct(all_ttft, 50)),
        "ttft_p90_ms": _ms(_pct(all_ttft, 90)),
        "ttft_p99_ms": _ms(_pct(all_ttft, 99)),
        "itl_p50_ms": _ms(_pct(itl, 50)),
        "itl_p90_ms": _ms(_pct(itl, 90)),
        "requests_per_s": _sig(len(done) / span) if span > 0 else 0.0,
        "prompt_tokens_per_s": _sig(sum(prompt_len[r] for r in done) / span) if span > 0 else 0.0,
        "gpu_prefix_hit_rate": _sig(max(0, cached - from_kvgrid) / prompts) if prompts else 0.0,
        "kvgrid_hit_rate": _sig(from_kvgrid / prompts) if prompts else 0.0,
        "bytes_loaded": (ws.chunks_loaded - loaded0) * chunk_bytes if ws else 0,
        "bytes_stored": ws.chunks_stored * chunk_bytes if ws else 0,
        "agent_cpu_s": _sig(agent_cpu),
        "preemptions": preempted,
        "steps": steps,
        "duration_s": _sig(end),
    }
    return row, tokens, failures


def _read_documents(eng: ServeEngine, wl: Workload) -> None:
    """Serve each user's document once (one token each, before the clock starts): the steady state
    of multi-round QA, where documents were read before and questions keep coming. The document is
    the prefix the user's first two rounds share."""
    firsts: dict[int, list[list[int]]] = {}
    for q in wl.planned():
        firsts.setdefault(q.session_id, [])
        if len(firsts[q.session_id]) < 2:
            firsts[q.session_id].append(q.prompt_token_ids)
    for sid, prompts in firsts.items():
        if len(prompts) < 2:
            continue
        a, b = prompts
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        if n:
            eng.add(f"document-{sid}", a[:n], 1)
            while eng.has_work():
                eng.step()
    if eng.rank.has_connector:
        eng.rank.connector.flush_stores()


def _aborted() -> Any:
    from vllm.v1.request import RequestStatus

    return RequestStatus.FINISHED_ABORTED


def _ms(x: float | None) -> float | None:
    return None if x is None else _sig(x * 1e3)


def sampled_hit_check(
    cfg: ServeBenchConfig, r: _Resolved, model: PagedLlama, wl: Workload, num_blocks: int, work: Path
) -> tuple[dict[str, Any], list[str]]:
    """One workload prompt served twice by a kvgrid engine (a miss, then a hit), its first-token
    logits against the same forwards without kvgrid (module docstring)."""
    prompt = max((q.prompt_token_ids for q in wl.planned()), key=len)
    failures: list[str] = []
    # vLLM's prefix cache off (the hit is kvgrid's) and the whole prompt in one step (the miss is
    # one full prefill: the stored KV has the reference prefill's bits)
    opts = dataclasses.replace(
        _options(cfg, r, "kvgrid", num_blocks), prefix_caching=False, max_num_batched_tokens=r.max_model_len
    )
    with contextlib.ExitStack() as stack:
        agent = AgentProcess(work, r.l1_size)
        stack.callback(agent.stop)
        eng = ServeEngine(model, agent.uds_path, work, opts)
        stack.callback(eng.close)
        eng.keep_logits = True
        logits: dict[str, torch.Tensor] = {}
        loaded = 0
        for rid in ("check-miss", "check-hit"):
            eng.add(rid, prompt, 1)
            while eng.has_work():
                ev = eng.step()
                logits.update(ev.logits)
                if rid in ev.first_schedule:
                    loaded = ev.first_schedule[rid]
            eng.rank.connector.flush_stores()
        # The same forwards without the connector, over blocks no request holds now (all freed).
        bs = cfg.block_size
        blocks = list(range(1, -(-len(prompt) // bs) + 1))
        full = model.forward_batch(
            pack_batch([RowSpan(prompt, blocks, 0, len(prompt))], bs, model), eng.rank.kv_list
        )
        tail = model.forward_batch(
            pack_batch([RowSpan(prompt, blocks, loaded, len(prompt) - loaded)], bs, model), eng.rank.kv_list
        )
    expected_hit = (len(prompt) - 1) // cfg.chunk_size * cfg.chunk_size
    if loaded != expected_hit:
        failures.append(f"sampled hit: {loaded} tokens came from the cache; expected {expected_hit}")
    if not torch.equal(full[0].cpu(), logits["check-miss"]):
        failures.append("sampled hit: the miss's logits differ from a full prefill's")
    if not torch.equal(tail[0].cpu(), logits["check-hit"]):
        failures.append("sampled hit: the hit's logits differ from its tail computed over the same KV")
    return {"prompt_tokens": len(prompt), "loaded_tokens": loaded, "bit_exact": not failures}, failures


def prefill_limit_ms(model: PagedLlama, kv_list: list[torch.Tensor], n: int, block_size: int) -> float:
    """The model over one ``n``-token prompt alone (no scheduler, no connector): median of 3."""
    blocks = list(range(1, -(-n // block_size) + 1))
    batch = pack_batch([RowSpan([1] * n, blocks, 0, n)], block_size, model)
    times = []
    for _ in range(4):
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.forward_batch(batch, kv_list).cpu()
        times.append(time.perf_counter() - t0)
    return sorted(times[1:])[1] * 1e3


def measure(
    cfg: ServeBenchConfig, work: Path, progress: Any = None, partial: Path | None = None
) -> dict[str, Any]:
    """The sweep (module docstring)."""
    r = resolve(cfg)
    device = torch.device(cfg.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    wl = workload(cfg, r)
    info = wl.describe()
    working = wl.working_set_tokens()
    num_blocks = max(
        -(-int(working * cfg.gpu_cache_fraction) // cfg.block_size), -(-r.max_model_len // cfg.block_size) + 2
    )
    model = PagedLlama(r.shape, device=device, dtype=dtype, seed=cfg.seed, cuda_graphs=cfg.cuda_graphs)
    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    tokens_by: dict[tuple[Config, float], dict[str, list[int]]] = {}
    # A warm-up run (discarded): the first steps of a process compile kernels and capture graphs.
    warm = msgspec.structs.replace(cfg, run_s=min(cfg.run_s, 4.0), drain_s=min(cfg.drain_s, 10.0))
    if progress:
        progress("warm-up run ...")
    for name in dict.fromkeys((cfg.configs[-1], cfg.configs[0])):
        serve_once(warm, r, model, wl, name, r.rates[0], num_blocks, work)
    for rate in r.rates:
        for name in cfg.configs:
            if progress:
                progress(f"{name} at {rate:g} requests/s ...")
            row, toks, fails = serve_once(cfg, r, model, wl, name, rate, num_blocks, work)
            rows.append(row)
            if partial is not None:  # a long sweep cut short keeps what it measured
                partial.write_text(json.dumps({"rows": rows, "failures": failures + fails}, indent=1))
            tokens_by[(name, rate)] = toks
            failures += fails
            if progress:
                progress(
                    f"  ttft p90 {row['ttft_p90_ms']} ms, itl p90 {row['itl_p90_ms']} ms, "
                    f"{row['requests_per_s']} req/s, {row['completed']}/{row['admitted']} completed"
                )
        base = tokens_by[(cfg.configs[0], rate)]
        for name in cfg.configs[1:]:
            other = tokens_by[(name, rate)]
            differ = [
                rid
                for rid in base
                if rid in other and len(base[rid]) == len(other[rid]) and base[rid] != other[rid]
            ]
            for row in rows:
                if row["config"] == name and row["rate"] == rate:
                    row["requests_with_other_tokens"] = len(differ)
            if cfg.check_tokens and differ:
                failures.append(
                    f"{name} at {rate}/s: {len(differ)} requests generated other tokens than "
                    f"{cfg.configs[0]}, e.g. {differ[0]}"
                )
    _add_ratios(rows)
    check, fails = sampled_hit_check(cfg, r, model, wl, num_blocks, work)
    failures += fails
    mean_prompt = int(info["mean_prompt_tokens"])
    with contextlib.ExitStack() as stack:
        eng = ServeEngine(model, None, work, _options(cfg, r, "vllm-nocache", num_blocks))
        stack.callback(eng.close)
        prefill = prefill_limit_ms(model, eng.rank.kv_list, mean_prompt, cfg.block_size)
    return {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "date": time.strftime("%Y-%m-%d"),
        "model": msgspec.to_builtins(r.shape),
        "dtype": str(dtype).removeprefix("torch."),
        "workload": info,
        "gpu_cache_blocks": num_blocks,
        "gpu_cache_tokens": num_blocks * cfg.block_size,
        "working_set_over_gpu_cache": _sig(working / (num_blocks * cfg.block_size)),
        "l1_bytes": r.l1_size,
        "max_num_seqs": cfg.max_num_seqs,
        "max_num_batched_tokens": r.batched_tokens,
        "run_s": cfg.run_s,
        "drain_s": cfg.drain_s,
        "cuda_graphs": model.cuda_graphs,
        "limits": {"prefill_mean_prompt_ms": _sig(prefill), "mean_prompt_tokens": mean_prompt},
        "rows": rows,
        "sampled_hit": check,
        "failures": failures,
    }


def _add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each row's TTFT p90 and ITL p90 over the baseline's at the same rate."""
    base = {row["rate"]: row for row in rows if row["config"] == BASELINE}
    for row in rows:
        b = base.get(row["rate"])
        if b is None:
            continue
        for key in ("ttft_p90_ms", "itl_p90_ms"):
            if row[key] is not None and b[key]:
                row[f"{key.removesuffix('_ms')}_vs_{BASELINE}"] = _sig(row[key] / b[key])


def plot(result: dict[str, Any], out: Path) -> list[Path]:
    """TTFT p90 and throughput against the rate, one line per configuration (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(dict.fromkeys(row["config"] for row in result["rows"]))
    title = f"{result['workload']['kind']} on {result['device']}"
    paths = []
    for key, label, name in (
        ("ttft_p90_ms", "TTFT p90 (ms, log)", "serve-ttft-p90.png"),
        ("requests_per_s", "completed requests/s", "serve-throughput.png"),
    ):
        fig, ax = plt.subplots(figsize=(6, 4))
        for c in configs:
            pts = [
                (row["rate"], row[key])
                for row in result["rows"]
                if row["config"] == c and row[key] is not None
            ]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=c)
        if key == "ttft_p90_ms":
            ax.set_yscale("log")
            ax.axhline(2000, color="grey", linestyle=":", linewidth=1)
        else:
            rates = sorted({row["rate"] for row in result["rows"]})
            ax.plot(rates, rates, color="grey", linestyle=":", linewidth=1, label="offered")
        ax.set_xlabel("offered rate (requests/s)")
        ax.set_ylabel(label)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = out / f"{result['workload']['kind']}-{name}"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def run(args: argparse.Namespace) -> int:
    if args.plot_from:
        src = Path(args.plot_from)
        result = json.loads(src.read_text())
        for p in plot(result, Path(args.out) if getattr(args, "out", "") else src.parent):
            print(p)
        return 0
    cfg = config_from_args(ServeBenchConfig, args, env_prefix=ENV_PREFIX)
    if cfg.device == "cuda" and not torch.cuda.is_available():
        print("kvgrid bench serve: --device cuda but no CUDA device is visible", file=sys.stderr)
        return 2
    resolve(cfg)  # bad values fail before anything starts
    shm = Path("/dev/shm")
    work = Path(tempfile.mkdtemp(prefix="kvgrid-serve-", dir=shm if shm.is_dir() else None))
    try:
        partial = None
        if cfg.out:
            Path(cfg.out).mkdir(parents=True, exist_ok=True)
            partial = Path(cfg.out) / f"serve-{cfg.workload}.partial.json"
        result = measure(cfg, work, progress=lambda m: print(m, file=sys.stderr, flush=True), partial=partial)
        if partial is not None:
            partial.unlink(missing_ok=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if cfg.out:
        out = Path(cfg.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"serve-{cfg.workload}.json").write_text(json.dumps(result, indent=1))
        with contextlib.suppress(ImportError):  # matplotlib: the test extra
            plot(result, out)
    if cfg.json:
        print(json.dumps(result))
    else:
        print_table(result)
    for f in result["failures"]:
        print(f"kvgrid bench serve: FAILED: {f}", file=sys.stderr)
    return 1 if result["failures"] else 0


def print_table(result: dict[str, Any]) -> None:
    w = result["workload"]
    print(
        f"{w['kind']}: {w['requests']} requests planned, mean prompt {w['mean_prompt_tokens']} tokens, "
        f"working "
        f"set {w['working_set_tokens']} tokens = {result['working_set_over_gpu_cache']}x the GPU cache; "
        f"{result['device']}"
    )
    print(f"limit: prefill of a mean prompt alone {result['limits']['prefill_mean_prompt_ms']} ms")
    cols = (
        ("config", "config"), ("rate", "rate"), ("done", "completed"), ("ttft p50", "ttft_p50_ms"),
        ("p90", "ttft_p90_ms"), ("p99", "ttft_p99_ms"), ("itl p50", "itl_p50_ms"), ("p90", "itl_p90_ms"),
        ("req/s", "requests_per_s"), ("tok/s", "prompt_tokens_per_s"), ("gpu hit", "gpu_prefix_hit_rate"),
        ("kvgrid hit", "kvgrid_hit_rate"), ("p90/base", f"ttft_p90_vs_{BASELINE}"),
        ("agent cpu s", "agent_cpu_s"),
    )  # fmt: skip
    print(" | ".join(head for head, _ in cols))
    for row in result["rows"]:
        print(" | ".join(str(row.get(key, "-")) for _, key in cols))
    print(f"sampled hit: {result['sampled_hit']}")
