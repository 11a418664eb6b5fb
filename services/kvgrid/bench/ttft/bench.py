"""``kvgrid bench ttft``: time to first token through ``KVGridConnector`` against its limits, one run.

For every prompt length and both load modes -- ``whole`` (vLLM's asynchronous load of the whole
request before its tail is scheduled) and ``layerwise`` (the load inside the step, waited for by
``wait_for_layer_load``) -- a :class:`~kvgrid.bench.ttft.engine.TTFTEngine` serves, per iteration, a new
prompt (a **miss**: prefill + store) and then the same prompt again after the whole KV cache was
filled with NaN (a **hit**: lookup + load + prefill of the tail the agent does not hold; vLLM never
loads the whole prompt, so the tail is at least one token and at most one chunk). The agent is a
real ``kvgrid agent`` process (KV by CUDA IPC handle, or a shared-memory file on CPU).

Limits measured in the same run, on the same model, weights and KV cache, without the connector,
in the same rounds as the misses and hits (each round: per mode a miss and its hit, then the
limits; the first round warms up, figures are medians of the rest), so all see the same load:

* ``prefill``: the model over the whole prompt (what a miss costs without storing);
* ``tail``: the model over the hit's tail on top of the cached prefix;
* ``copy``: a raw copy of the hit's KV bytes (pinned host -> GPU on CUDA, host -> host on CPU), the
  fastest of five per round;
* ``plain miss`` (``plain_miss_ms``): a miss of a new prompt served by an engine without any KV
  connector (:meth:`~kvgrid.bench.ttft.engine.TTFTEngine.without_connector`: the same model, vLLM
  ``Scheduler`` code and runner order, over the first engine's KV cache buffer, but a ``VllmConfig``
  without ``kv_transfer_config``), timed as a miss is, from ``add_request`` to the first token. It
  is what the request costs vLLM alone: the prefill plus vLLM's own host work per request
  (``add_request``, ``schedule``, ``update_from_output``, building the step's inputs). vLLM's prefix
  caching is off, so it is a full miss to vLLM too. Not with tp > 1 (the ranks build connector
  workers only): shown as ``-`` (null in the JSON).

Two ratios say what storing costs, against two denominators:

* ``store +%`` (``store_overhead``) = miss / prefill - 1 (the goal: <= 3 %): ``prefill`` is
  the bare model forward, no vLLM scheduler and no connector, so this charges kvgrid with vLLM's
  own per-request host work as well as the connector's (its scheduler half's lookup and metadata,
  the worker half's calls, the store);
* ``kvgrid +%`` (``kvgrid_overhead``) = miss / plain miss - 1: both sides run vLLM's scheduler and
  the same runner order, so the difference is the connector alone (its scheduler half's lookup and
  metadata, the worker half's calls, issuing the store, and waiting for it with ``--store sync``)
  -- the goal "storing adds <= 3 % to the miss" read as what kvgrid adds to vLLM.

Other ratios: ``speed-up`` = prefill / hit, ``ceiling`` = prefill / copy,
``limit`` = prefill / (copy + tail) (what a hit can reach at the copy limit, tail included), and
``of ceiling`` = speed-up / ceiling (goal >= 0.8 at 8k and 32k). ``stored`` is the miss's time
until its stores landed in the agent: with asynchronous stores (``--store async``, the default on
CUDA) the first token does not wait for them.
With ``--copies engine`` the loads run in the engine's process and CUDA context over the agent's L1
shared in a file (connector ``engine_copies``), instead of in the agent's.

On CUDA the model runs forwards of at most 512 tokens (every hit's tail) as piecewise CUDA graphs
around an eager attention, as vLLM does (:mod:`kvgrid.bench.ttft.graphs`), captured the first time a
token count is seen (in the warm-up round: both the hit and its tail reference have the same count);
``--cuda-graphs false`` runs every forward eager, for a row to compare. Each bit-exact check below
compares two forwards of the same token count (miss and full prefill, hit and tail reference), so
both sides take the same path.

With ``--tp N`` (tensor parallelism, :mod:`kvgrid.bench.ttft.tp`) the model is sharded over N processes
(one per GPU, NCCL; gloo on CPU), each rank with its own KV cache of its KV heads and its own agent;
rank 0 runs vLLM's scheduler, whose lookup is the minimum over the ranks' agents. The rows are the
same; the limits run on the same sharded model and caches (every rank computes), and ``copy`` is
the bytes of ONE rank's hit KV (each rank moves its own shard in parallel), timed on rank 0 alone.
With tp > 1 every forward runs eager: no CUDA graphs (an all-reduce inside a captured graph needs
NCCL graph capture, which the harness's piecewise graphs do not set up); the table says so.

Correctness, every run: the hit's first-token logits must equal, bit for bit, the logits of the
tail computed without the connector over the prefix KV the model computed itself (same kernels,
same shapes: any difference is a byte the load got wrong); the miss's logits must equal the
full-prefill reference bit for bit, and so must the plain miss's (its last round's prompt). With
tp > 1 both checks compare rank 0's logits, which are replicated on every rank after the final
all-reduce: a wrong byte on any rank shows in them.
Hit against miss is reported as the largest absolute difference: the tail's projections and
attention run with other shapes than the full prompt's (fewer query rows, an explicit mask
instead of the causal flag), so on some kernels they round differently in bf16. A mismatch of the
bit-exact checks above exits 1.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import torch

from kvgrid.bench.ttft.engine import AgentProcess, EngineOptions, TTFTEngine, slots_of
from kvgrid.bench.ttft.model import LLAMA3_8B, ModelShape, PagedLlama
from kvgrid.bench.ttft.tp import TPGroup
from kvgrid.common.config import add_config_arguments, config_from_args

__all__ = ["PRESETS", "TTFTBenchConfig", "add_arguments", "run"]

ENV_PREFIX = "KVGRID_BENCH_TTFT_"

PRESETS: dict[str, ModelShape] = {
    "llama3-8b": LLAMA3_8B,
    # CPU-sized: the same GQA ratio (4 query heads per KV head), a few layers.
    "small": ModelShape(
        layers=4, hidden=512, heads=8, kv_heads=2, head_size=64, intermediate=1024, vocab=2048
    ),
    "tiny": ModelShape(layers=2, hidden=256, heads=4, kv_heads=2, head_size=64, intermediate=512, vocab=1024),
}
Mode = Literal["whole", "layerwise"]
MODES: tuple[Mode, ...] = ("whole", "layerwise")


def _d(text: str) -> msgspec.Meta:
    return msgspec.Meta(description=text)


class TTFTBenchConfig(msgspec.Struct, frozen=True, kw_only=True):
    """``kvgrid bench ttft``'s options: defaults < ``--config`` YAML < ``KVGRID_BENCH_TTFT_*`` env <
    flags."""

    device: Annotated[
        Literal["cpu", "cuda"], _d("where the model and its KV cache run; default cuda when a GPU is visible")
    ] = "cuda" if torch.cuda.is_available() else "cpu"
    model: Annotated[
        Literal["auto", "llama3-8b", "small", "tiny"],
        _d("model shape: llama3-8b (32 layers, hidden 4096, 32/8 heads of 128), small or tiny (CPU); "
           "auto = llama3-8b on cuda, small on cpu"),
    ] = "auto"  # fmt: skip
    layers: Annotated[int, msgspec.Meta(ge=0, description="override the preset's layer count (0: keep)")] = 0
    prompts: Annotated[
        tuple[int, ...], _d("prompt lengths in tokens; empty = 2048,8192,32768 on cuda, 512,1024 on cpu")
    ] = ()
    modes: Annotated[
        tuple[Mode, ...],
        _d("load modes: whole (asynchronous, before the step) and/or layerwise (inside the step)"),
    ] = MODES
    block_size: Annotated[int, msgspec.Meta(ge=1, description="tokens per KV block")] = 16
    chunk_size: Annotated[int, msgspec.Meta(ge=1, description="tokens per kvgrid chunk")] = 256
    store: Annotated[
        Literal["auto", "sync", "async"],
        _d("the connector's async_store: sync (wait_for_save returns when the agent holds the chunks), "
           "async (it returns at once; the copy waits for the forward on the GPU), auto = async on cuda"),
    ] = "auto"  # fmt: skip
    copies: Annotated[
        Literal["agent", "engine"],
        _d("who runs a load's kernels: agent (in the agent's process and CUDA context) or engine (in "
           "the engine's, over the agent's L1 shared in a file under /dev/shm: connector engine_copies)"),
    ] = "agent"  # fmt: skip
    layerwise_stages: Annotated[
        int,
        msgspec.Meta(ge=1, description="with --copies engine: the connector's layerwise_stages (a layer-wise "
                     "load moves in that many stages of layers, each layer waiting for its own; 1: for all)"),
    ] = 8  # fmt: skip
    lease_at_lookup: Annotated[
        bool,
        _d(
            "with --copies engine: the connector's lease_at_lookup (the Lookup leases the hits: no "
            "Retrieve); false: every load Retrieves"
        ),
    ] = True
    agent_spin_us: Annotated[
        int,
        msgspec.Meta(
            ge=0,
            le=1_000_000,
            description="each agent's hot_path_spin_us (it polls for the engine's next call this long "
            "before sleeping; 0: sleeps at once)",
        ),
    ] = 0
    iters: Annotated[int, msgspec.Meta(ge=1, description="timed misses and hits per figure (median)")] = 3
    cuda_graphs: Annotated[
        bool,
        _d("on cuda, run forwards of <= 512 tokens (the hit's tail) as piecewise CUDA graphs around eager "
           "attention, as vLLM does; false: every forward eager"),
    ] = True  # fmt: skip
    tp: Annotated[
        int,
        msgspec.Meta(ge=1, description="tensor parallelism: ranks (one process and agent each; one GPU each "
                     "on cuda); must divide the model's heads, kv_heads and intermediate"),
    ] = 1  # fmt: skip
    seed: Annotated[int, _d("weights and prompts seed")] = 0
    json: Annotated[bool, _d("print one JSON object instead of a table")] = False


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, TTFTBenchConfig, env_prefix=ENV_PREFIX)


def _sig(x: float) -> float:
    return float(f"{x:.4g}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def resolve(cfg: TTFTBenchConfig) -> tuple[ModelShape, tuple[int, ...]]:
    """The model shape and prompt lengths ``cfg`` asks for (``auto`` and empty resolved by device)."""
    name = cfg.model if cfg.model != "auto" else ("llama3-8b" if cfg.device == "cuda" else "small")
    shape = PRESETS[name]
    if cfg.layers:
        shape = msgspec.structs.replace(shape, layers=cfg.layers)
    prompts = cfg.prompts or ((2048, 8192, 32768) if cfg.device == "cuda" else (512, 1024))
    for n in prompts:
        if n <= cfg.chunk_size:
            raise ValueError(
                f"prompts: {n} tokens; expected more than chunk_size={cfg.chunk_size} (a hit needs one full "
                f"chunk before the last token)"
            )
    if cfg.chunk_size % cfg.block_size:
        raise ValueError(f"chunk_size={cfg.chunk_size} is not a multiple of block_size={cfg.block_size}")
    if not cfg.modes:
        raise ValueError("modes: empty; expected whole and/or layerwise")
    shape.check_tp(cfg.tp)
    if cfg.device == "cuda" and cfg.tp > torch.cuda.device_count():
        raise ValueError(
            f"tp={cfg.tp} on cuda: {torch.cuda.device_count()} GPUs visible; expected >= {cfg.tp}"
        )
    return shape, prompts


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


class _Copy:
    """A raw copy of ``nbytes``: pinned host -> GPU on CUDA, host -> host on CPU (buffers touched once)."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.device = device
        pinned = device.type == "cuda"
        self.src = torch.ones(nbytes, dtype=torch.uint8, pin_memory=pinned)
        self.dst = torch.zeros(nbytes, dtype=torch.uint8, device=device)

    def time_s(self, repeats: int = 5) -> float:
        """The fastest of ``repeats`` copies: a limit is the best case. (On the shared CPU box a copy
        right after an engine run took 4-13 ms against 0.04-0.1 ms a moment later, for any size;
        the fastest copy is the machine's, not that transient's.)"""
        best = float("inf")
        for _ in range(repeats):
            _sync(self.device)
            t0 = time.perf_counter()
            self.dst.copy_(self.src, non_blocking=True)
            _sync(self.device)
            best = min(best, time.perf_counter() - t0)
        return best


def measure(cfg: TTFTBenchConfig, work: Path) -> dict[str, Any]:
    """Run every prompt length and mode; return the figures (module docstring)."""
    shape, prompts = resolve(cfg)
    device = torch.device(cfg.device)
    dtype = torch.bfloat16
    per_token = shape.sharded(cfg.tp).kv_bytes_per_token(dtype)  # one rank's KV
    l1 = 3 * max(prompts) * per_token + (64 << 20)
    shared = ""
    if cfg.copies == "engine":
        shared = "/dev/shm" if shutil.disk_usage("/dev/shm").free > 2 * cfg.tp * l1 else str(work)
    rows: list[dict[str, Any]] = []
    failures: list[str] = []

    def options(mode: Mode) -> EngineOptions:
        return EngineOptions(
            max_prompt_tokens=max(prompts), block_size=cfg.block_size, chunk_size=cfg.chunk_size,
            layerwise=mode == "layerwise", engine_id=f"ttft-{mode}",
            async_store={"auto": None, "sync": False, "async": True}[cfg.store],
            engine_copies=cfg.copies == "engine", layerwise_stages=cfg.layerwise_stages,
            lease_at_lookup=cfg.lease_at_lookup,
        )  # fmt: skip

    with contextlib.ExitStack() as stack:
        if cfg.tp > 1:
            group = TPGroup(
                shape, work, tp=cfg.tp, device=cfg.device, seed=cfg.seed, cuda_graphs=cfg.cuda_graphs,
                l1_size=l1, l1_shared_dir=shared, agent_spin_us=cfg.agent_spin_us,
            )  # fmt: skip
            stack.callback(group.close)
            model = group.model

            def make(mode: Mode) -> TTFTEngine:
                return group.engine(options(mode))
        else:
            model = PagedLlama(shape, device=device, dtype=dtype, seed=cfg.seed, cuda_graphs=cfg.cuda_graphs)
            agent = AgentProcess(work, l1, l1_shared_dir=shared, spin_us=cfg.agent_spin_us)
            stack.callback(agent.stop)

            def make(mode: Mode) -> TTFTEngine:
                return TTFTEngine(model, agent.uds_path, work, **dataclasses.asdict(options(mode)))

        engines: dict[Mode, TTFTEngine] = {}
        for mode in cfg.modes:
            engines[mode] = make(mode)
            stack.callback(engines[mode].close)
        plain: TTFTEngine | None = None
        if cfg.tp == 1:  # the reference without a connector, over the first engine's cache (closed first)
            plain = next(iter(engines.values())).without_connector()
            stack.callback(plain.close)
        for n in prompts:
            rows.append(_one_length(cfg, n, model, engines, plain, device, per_token, failures))
        # How the loads went, per engine (rank 0's): e.g. whether layer-wise loads were staged by the engine.
        stats = {mode: dataclasses.asdict(eng.worker.worker.stats) for mode, eng in engines.items()}
    return {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "model": msgspec.to_builtins(shape),
        "tp": cfg.tp,
        "block_size": cfg.block_size,
        "chunk_size": cfg.chunk_size,
        "iters": cfg.iters,
        "store": cfg.store,
        "copies": cfg.copies,
        "layerwise_stages": cfg.layerwise_stages,
        "lease_at_lookup": cfg.lease_at_lookup,
        "agent_spin_us": cfg.agent_spin_us,
        "cuda_graphs": model.cuda_graphs,
        "graph_max_tokens": model.graph_max_tokens,
        "graph_sizes": list(model.graph_sizes),
        "rows": rows,
        "worker_stats": stats,
        "failures": failures,
    }


def _one_length(
    cfg: TTFTBenchConfig,
    n: int,
    model: PagedLlama,
    engines: dict[Mode, TTFTEngine],
    plain: TTFTEngine | None,
    device: torch.device,
    per_token: int,
    failures: list[str],
) -> dict[str, Any]:
    """One prompt length: rounds of (per mode a miss and its hit, then the limits, the plain miss
    last), so that every figure sees the same machine load; the first round warms up; medians of
    the rest."""
    vocab = model.shape.vocab
    # vLLM loads the full chunks before the last prompt token, never the whole prompt.
    hit_tokens = (n - 1) // cfg.chunk_size * cfg.chunk_size
    times: dict[str, list[float]] = {k: [] for k in ("prefill", "tail", "copy", "plain")}
    for mode in engines:
        times[f"{mode}-miss"], times[f"{mode}-hit"], times[f"{mode}-stored"] = [], [], []
    diffs: dict[str, float] = dict.fromkeys(engines, 0.0)
    copier = _Copy(hit_tokens * per_token, device)
    blocks = list(range(-(-n // cfg.block_size)))
    slots = slots_of(blocks, cfg.block_size, n, device)
    seed = cfg.seed * 1_000_003 + n * 1009
    for i in range(cfg.iters + 1):
        for mode, eng in engines.items():
            seed += 1
            tokens = _prompt(n, vocab, seed)
            miss = eng.run(f"miss-{mode}-{n}-{i}", tokens)
            eng.poison()
            _sync(device)
            hit = eng.run(f"hit-{mode}-{n}-{i}", tokens)
            if hit.loaded_tokens != hit_tokens:
                failures.append(
                    f"{mode} {n}: the hit loaded {hit.loaded_tokens} tokens; expected {hit_tokens}"
                )
            if not torch.isfinite(hit.logits).all():
                failures.append(
                    f"{mode} {n}: the hit's logits are not finite (a position neither loaded nor computed)"
                )
            diffs[mode] = max(diffs[mode], float((hit.logits - miss.logits).abs().max()))
            if i:
                times[f"{mode}-miss"].append(miss.ttft_s)
                times[f"{mode}-stored"].append(miss.stored_s)
                times[f"{mode}-hit"].append(hit.ttft_s)
            if i == cfg.iters:  # references for the last prompt, computed without the connector
                _check_references(eng, tokens, hit_tokens, miss.logits, hit.logits, failures, mode)
        # Limits without the connector, on the first engine's cache (no request holds blocks now).
        first = next(iter(engines.values()))
        ids = torch.tensor(_prompt(n, vocab, seed), dtype=torch.int64, device=device)
        _sync(device)
        t0 = time.perf_counter()
        first.reference(ids, 0, slots).argmax().item()
        t1 = time.perf_counter()
        first.reference(ids[hit_tokens:], hit_tokens, slots).argmax().item()
        t2 = time.perf_counter()
        copy = copier.time_s()
        if i:
            times["prefill"].append(t1 - t0)
            times["tail"].append(t2 - t1)
            times["copy"].append(copy)
        if plain is not None:  # a new prompt: a miss to vLLM (no prefix caching) as to the others
            seed += 1
            tokens = _prompt(n, vocab, seed)
            pm = plain.run(f"plain-{n}-{i}", tokens)
            if pm.loaded_tokens:
                failures.append(f"plain {n}: the miss without kvgrid loaded {pm.loaded_tokens} tokens")
            if i:
                times["plain"].append(pm.ttft_s)
            if i == cfg.iters and not torch.equal(pm.logits, _reference(plain, tokens, 0)):
                failures.append(f"plain {n}: the miss without kvgrid's logits differ from a full prefill's")
    prefill, tail, copy = (_median(times[k]) for k in ("prefill", "tail", "copy"))
    plain_s = _median(times["plain"]) if plain is not None else None
    row: dict[str, Any] = {"prompt_tokens": n, "hit_tokens": hit_tokens}
    row["limits"] = {
        "prefill_ms": _sig(prefill * 1e3),
        "tail_prefill_ms": _sig(tail * 1e3),
        "copy_ms": _sig(copy * 1e3),
        "copy_bytes": hit_tokens * per_token,
        "copy_gbps": _sig(hit_tokens * per_token / copy / 1e9),
        "ceiling": _sig(prefill / copy),
        "limit": _sig(prefill / (copy + tail)),
        "plain_miss_ms": _sig(plain_s * 1e3) if plain_s is not None else None,
    }
    for mode in engines:
        miss_s, hit_s = _median(times[f"{mode}-miss"]), _median(times[f"{mode}-hit"])
        speedup = prefill / hit_s
        row[mode] = {
            "miss_ms": _sig(miss_s * 1e3),
            "miss_stored_ms": _sig(_median(times[f"{mode}-stored"]) * 1e3),
            "hit_ms": _sig(hit_s * 1e3),
            "hit_ms_rounds": [_sig(t * 1e3) for t in times[f"{mode}-hit"]],  # a skewed median shows
            "hit_vs_miss_max_abs_logit_diff": _sig(diffs[mode]),
            "store_overhead": _sig(miss_s / prefill - 1),
            "kvgrid_overhead": _sig(miss_s / plain_s - 1) if plain_s is not None else None,
            "speedup": _sig(speedup),
            "of_ceiling": _sig(speedup / (prefill / copy)),
            "of_limit": _sig(speedup / (prefill / (copy + tail))),
        }
    return row


def _check_references(
    eng: TTFTEngine,
    tokens: list[int],
    loaded: int,
    miss_logits: torch.Tensor,
    hit_logits: torch.Tensor,
    failures: list[str],
    mode: str,
) -> None:
    """The miss must equal a full prefill and the hit a tail prefill over self-computed KV, bit for bit
    (with tp > 1 every rank computes; rank 0's logits are the model's)."""
    full = _reference(eng, tokens, 0)
    tail = _reference(eng, tokens, loaded)  # over the KV the full prefill just computed
    if not torch.equal(full, miss_logits):
        failures.append(f"{mode} {len(tokens)}: the miss's logits differ from a full prefill's")
    if not torch.equal(tail, hit_logits):
        failures.append(f"{mode} {len(tokens)}: the hit's logits differ from a tail prefill over the same KV")


def _reference(eng: TTFTEngine, tokens: list[int], start: int) -> torch.Tensor:
    """The last token's logits of ``tokens[start:]`` computed without the connector over ``eng``'s
    cache, on top of the KV of ``tokens[:start]`` already in it (CPU)."""
    dev = eng.model.device
    t = torch.tensor(tokens, dtype=torch.int64, device=dev)
    bs = eng.block_size
    slots = slots_of(list(range(-(-len(tokens) // bs))), bs, len(tokens), dev)
    return eng.reference(t[start:], start, slots).cpu()


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(TTFTBenchConfig, args, env_prefix=ENV_PREFIX)
    if cfg.device == "cuda" and not torch.cuda.is_available():
        print("kvgrid bench ttft: --device cuda but no CUDA device is visible", file=sys.stderr)
        return 2
    resolve(cfg)  # bad values fail before anything starts
    shm = Path("/dev/shm")
    work = Path(tempfile.mkdtemp(prefix="kvgrid-ttft-", dir=shm if shm.is_dir() else None))
    try:
        result = measure(cfg, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if cfg.json:
        print(json.dumps(result))
    else:
        print_table(result)
    for f in result["failures"]:
        print(f"kvgrid bench ttft: FAILED: {f}", file=sys.stderr)
    return 1 if result["failures"] else 0


def print_table(result: dict[str, Any]) -> None:
    m = result["model"]
    tp = result.get("tp", 1)
    print(
        f"{result['device']}"
        + (f" x {tp} (tensor parallel; copy limit: one rank's KV)" if tp > 1 else "")
        + f": {m['layers']} layers, hidden {m['hidden']}, {m['heads']}/{m['kv_heads']} heads "
        f"of {m['head_size']}, bf16; block {result['block_size']}, chunk {result['chunk_size']}; "
        f"median of {result['iters']}; stores {result['store']}; loads copied by the {result['copies']}"
        + (
            f" (layer-wise in up to {result['layerwise_stages']} stages"
            + ("; leased at Lookup)" if result.get("lease_at_lookup") else "; a Retrieve per load)")
            if result["copies"] == "engine"
            else ""
        )
        + (f"; agents poll {result['agent_spin_us']} us for a call" if result.get("agent_spin_us") else "")
        + "; "
        + (
            f"forwards of <= {result['graph_max_tokens']} tokens as piecewise CUDA graphs (captured: "
            f"{', '.join(map(str, result['graph_sizes'])) or 'none'})"
            if result["cuda_graphs"]
            else "eager forwards" + (" (no CUDA graphs with tp > 1)" if tp > 1 else "")
        )
    )
    print(
        f"{'prompt':>7} {'mode':>9} {'miss ms':>9} {'store +%':>9} {'kvgrid +%':>9} {'stored ms':>9} "
        f"{'hit ms':>9} "
        f"{'loaded':>7} {'speed-up':>9} {'of ceil':>8} {'of limit':>9}"
    )
    for row in result["rows"]:
        lim = row["limits"]
        for mode in MODES:
            r = row.get(mode)
            if r is None:
                continue
            kvgrid = r.get("kvgrid_overhead")
            kvgrid_pct = f"{kvgrid * 100:>9.3g}" if kvgrid is not None else f"{'-':>9}"
            print(
                f"{row['prompt_tokens']:>7} {mode:>9} {r['miss_ms']:>9.4g} {r['store_overhead'] * 100:>9.3g} "
                f"{kvgrid_pct} {r['miss_stored_ms']:>9.4g} {r['hit_ms']:>9.4g} {row['hit_tokens']:>7} "
                f"{r['speedup']:>9.4g} {r['of_ceiling']:>8.3g} "
                f"{r['of_limit']:>9.3g}"
            )
        print(
            f"{'':>7} {'limits':>9} prefill {lim['prefill_ms']:.4g} ms, "
            f"tail {lim['tail_prefill_ms']:.4g} ms, "
            f"copy {lim['copy_ms']:.4g} ms ({lim['copy_gbps']:.4g} GB/s); ceiling {lim['ceiling']:.4g}x, "
            f"limit with tail {lim['limit']:.4g}x; "
            + (
                f"plain miss {plain:.4g} ms (vLLM without kvgrid)"
                if (plain := lim.get("plain_miss_ms")) is not None
                else "plain miss - (not with tp > 1)"
            )
        )
    for mode, st in result["worker_stats"].items():
        print(
            f"{mode} engine: {st['chunks_loaded']} chunks loaded ({st['chunks_engine_copied']} by the "
            f"engine's kernels), {st['loads_in_step']} in-step loads ({st['loads_staged']} staged by layer)"
        )
