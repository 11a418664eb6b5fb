"""One real vLLM engine (tests/connector/engines.py ``Engine``, ``vllm.LLM`` with KVGridConnector) in
a process of its own, driven over stdin/stdout: vLLM keeps its connector in a process global, so
tests that need two engines at once run each in one of these.

usage: python -m tests.connector.engine_process --model DIR --agent-socket PATH --shm-dir DIR
           [--model-name NAME] [--kv-role kv_both|kv_producer|kv_consumer]
(cwd = the repository root). Once the engine is up it prints a ``ready`` reply, then answers one
JSON command per stdin line with one reply; EOF on stdin closes the engine and exits. Replies are
single stdout lines ``KVGRID-ENGINE {json}`` (vLLM may log to stdout too); a failed command
replies ``{"error": ...}`` and the engine keeps serving.

Commands:
  {"op": "generate", "tokens": [...], "salt": "", "max_tokens": 6, "kv_transfer_params": {...}}
      -> kv_transfer_params (what the finished request returned), token_ids, logprobs (as in
         ``Completion``: per step the sorted (token id, logprob) pairs),
         keys (hex chunk keys of the prompt in this engine's namespace with that salt), stats
  {"op": "poison", "tokens": [...], "salt": "...", "other": [...], "chunks": 4}
      -> stored, keys (hex, the poisoned ones), stats: computes ``other`` (its KV stays in the
         engine's blocks), then registers the engine's own KV memory at the agent as a second
         instance (in the engine's namespace) and stores blocks 1.. (other's KV, not this
         prompt's) under the first ``chunks`` keys of ``tokens`` with ``salt``; a later request for
         ``tokens`` with that salt loads wrong KV.
  {"op": "stats"} -> stats
``stats`` is the connector worker's counters (chunks_loaded, chunks_load_failed, chunks_stored,
registrations); the ``ready`` reply carries stats, instance_id and namespace_id (what the
controller's MatchPrefix wants).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import queue
import subprocess
import sys
import threading
from collections import deque
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from tests.agent.helpers import AgentProc

REPO_ROOT = Path(__file__).resolve().parents[2]

MARK = "KVGRID-ENGINE "


def reply(out: dict[str, Any]) -> None:
    sys.stdout.write(MARK + json.dumps(out) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.connector.engine_process")
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--agent-socket", required=True)
    parser.add_argument("--shm-dir", required=True, type=Path)
    parser.add_argument("--model-name", default="")
    parser.add_argument("--kv-role", default="kv_both", choices=["kv_both", "kv_producer", "kv_consumer"])
    args = parser.parse_args(argv)

    from kvgrid.common.hashing import chunk_keys
    from kvgrid.engine.client import AgentClient
    from tests.connector.engines import CHUNK, Engine

    # Engine only reads the agent's socket path. model_name "" = vLLM's --model (the connector's default).
    agent = cast(AgentProc, SimpleNamespace(uds_path=args.agent_socket))
    engine = Engine(args.model, agent, args.shm_dir, kv_role=args.kv_role, model_name=args.model_name)
    worker = engine.worker.worker

    def stats() -> dict[str, int]:
        return dataclasses.asdict(worker.stats)

    def keys(tokens: list[int], salt: str) -> list[bytes]:
        return chunk_keys(tokens, worker.identity.namespace(0, cache_salt=salt))

    def generate(cmd: dict[str, Any]) -> dict[str, Any]:
        tokens = [int(t) for t in cmd["tokens"]]
        salt = str(cmd.get("salt", ""))
        c = engine.generate(
            tokens,
            salt=salt,
            max_tokens=int(cmd.get("max_tokens", 6)),
            kv_transfer_params=cmd.get("kv_transfer_params"),
        )
        return {
            "kv_transfer_params": engine.last_kv_transfer_params,
            "token_ids": list(c.token_ids),
            "logprobs": [[list(p) for p in step] for step in c.logprobs],
            "keys": [k.hex() for k in keys(tokens, salt)],
            "stats": stats(),
        }

    def poison(cmd: dict[str, Any]) -> dict[str, Any]:
        engine.generate([int(t) for t in cmd["other"]], salt="poison-source", max_tokens=1)
        reg = worker._registration
        assert reg is not None
        n = int(cmd.get("chunks", 4))
        blocks_per_chunk = CHUNK // worker.identity.tokens_per_block[0]
        with AgentClient(worker.identity.agent_address) as client:
            client.register_kv_caches(
                "poisoner",
                reg.tensors,
                namespace=worker.identity.namespace(0),  # the engine's: peers fetch in its namespace
                engine_groups=reg.infos,
                shm_paths=reg.shm_paths,
                layout_hints=reg.hints,
            )
            try:
                blocks = [list(range(1, 1 + blocks_per_chunk * n))]  # written blocks: not this prompt's KV
                poisoned = keys([int(t) for t in cmd["tokens"]], str(cmd["salt"]))[:n]
                res = client.store("poisoner", poisoned, blocks)
            finally:
                client.unregister_kv_caches("poisoner")
        return {"stored": res.num_stored_chunks, "keys": [k.hex() for k in poisoned], "stats": stats()}

    ops = {"generate": generate, "poison": poison, "stats": lambda _: {"stats": stats()}}
    reply(
        {
            "ready": True,
            "instance_id": worker.identity.instance_id,
            "namespace_id": worker.identity.namespace(0).namespace_id(),
            "stats": stats(),
        }
    )
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            try:
                cmd = json.loads(line)
                reply(ops[cmd["op"]](cmd))
            except Exception as e:  # reported to the driver; the engine keeps serving
                reply({"error": f"{type(e).__name__}: {e}"})
    finally:
        engine.close()
    return 0


class EngineProc:
    """The driver side: ``python -m tests.connector.engine_process`` attached to one agent."""

    def __init__(
        self,
        name: str,
        model: Path,
        agent: AgentProc,
        shm_dir: Path,
        log_dir: Path,
        *,
        model_name: str,
        kv_role: str = "kv_both",
    ) -> None:
        self.name = name
        shm_dir.mkdir()
        self.stderr_path = log_dir / f"engine-{name}.stderr"
        self._stderr = self.stderr_path.open("w")
        cmd = [
            sys.executable, "-m", "tests.connector.engine_process", "--model", str(model),
            "--agent-socket", agent.uds_path, "--shm-dir", str(shm_dir), "--model-name", model_name,
            "--kv-role", kv_role,
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO_ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env={k: v for k, v in os.environ.items() if not k.startswith("KVGRID_")},
        )
        self._replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._log: deque[str] = deque(maxlen=40)
        threading.Thread(target=self._read, daemon=True).start()
        self.ready: dict[str, Any] = {}

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                self._replies.put(json.loads(line[len(MARK) :]))
            else:
                self._log.append(line.rstrip())
        self._replies.put(None)  # EOF: the process is gone

    def _reply(self, what: str, timeout_s: float) -> dict[str, Any]:
        try:
            out = self._replies.get(timeout=timeout_s)
        except queue.Empty:
            out = None
        if out is None or "error" in out:
            stderr = self.stderr_path.read_text()[-4000:]
            stdout = "\n".join(self._log)
            raise AssertionError(
                f"engine {self.name}: {what}: {out or 'no reply'} (exit {self.proc.poll()})\n"
                f"--- stdout tail\n{stdout}\n--- stderr tail\n{stderr}"
            )
        return out

    def wait_ready(self, timeout_s: float = 240) -> None:
        self.ready = self._reply("start-up", timeout_s)

    def call(self, op: str, timeout_s: float = 120, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        return self._reply(op, timeout_s)

    def generate(self, tokens: list[int], salt: str, **args: Any) -> dict[str, Any]:
        return self.call("generate", tokens=tokens, salt=salt, **args)

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # EOF: the engine shuts down and exits
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._stderr.close()


if __name__ == "__main__":
    sys.exit(main())
