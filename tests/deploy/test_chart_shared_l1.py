"""The chart's shared-L1 value (``agent.l1Shared``): ``helm template`` renders ``--l1-shared-dir``
pointing at the ``/dev/shm`` emptyDir that the sidecar and the engine both mount, which the real
``kvgrid agent`` parser turns into ``l1_shared_dir``; off by default; and the chart refuses a
``/dev/shm`` that is off or too small for the agents' L1 files, the minimum being the size of the
file a real :class:`~kvgrid.agent.l1.L1Pool` allocates."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from kvgrid.agent.config import AgentConfig
from kvgrid.agent.l1 import L1Pool
from tests.deploy.chart import (
    CHART,
    CRDS,
    K8S_VERSIONS,
    RELEASE,
    container,
    find,
    literal_env,
    run,
    template,
    validate,
    values_args,
)
from tests.deploy.test_chart import _parse_kvgrid
from tests.deploy.test_values import _fails

SHM = "/dev/shm"


def _values(**agent: Any) -> dict[str, Any]:
    gpus = int(agent.get("sidecarsPerPod", 1))
    tp = ["--tensor-parallel-size", str(gpus)] if gpus > 1 else []
    return {"examples": {"vllm": {"enabled": True, "gpus": gpus, "extraArgs": tp}}, "agent": agent}


def _pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    pod: dict[str, Any] = find(docs, "Deployment", f"{RELEASE}-kvgrid-vllm")["spec"]["template"]["spec"]
    return pod


def _mount_path(c: dict[str, Any], volume: str) -> str | None:
    paths = [m["mountPath"] for m in c.get("volumeMounts", []) if m["name"] == volume]
    return paths[0] if paths else None


def _agent_config(agent: dict[str, Any]) -> AgentConfig:
    cfg: AgentConfig = _parse_kvgrid(agent, AgentConfig, literal_env(agent))
    return cfg


@pytest.mark.parametrize("sidecars", [1, 2])
def test_shared_l1_puts_every_agents_pool_on_the_engines_dev_shm(
    helm: list[str], tmp_path: Path, sidecars: int
) -> None:
    values = _values(l1Shared=True, sidecarsPerPod=sidecars, shm={"sizeLimit": f"{9 * sidecars}Gi"})
    docs = template(helm, values, tmp_path)
    for version in K8S_VERSIONS:
        for doc in docs:
            validate(doc, version)
    pod = _pod(docs)
    (shm,) = [v for v in pod["volumes"] if v["name"] == "kvgrid-shm"]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": f"{9 * sidecars}Gi"}
    names = ["kvgrid-agent"] if sidecars == 1 else [f"kvgrid-agent-{i}" for i in range(sidecars)]
    for name in names:
        agent = container(pod, name)
        assert f"--l1-shared-dir={SHM}" in agent["args"]
        cfg = _agent_config(agent)
        assert cfg.l1_shared_dir == SHM
        assert cfg.l1_size == 8 << 30
        # The file lies on the memory-backed volume, which the engine mounts at the same path.
        assert _mount_path(agent, "kvgrid-shm") == cfg.l1_shared_dir
    assert _mount_path(container(pod, "vllm"), "kvgrid-shm") == SHM


def test_l1_is_private_by_default(helm: list[str], tmp_path: Path) -> None:
    pod = _pod(template(helm, _values(), tmp_path))
    agent = container(pod, "kvgrid-agent")
    assert not any(str(a).startswith("--l1-shared") for a in agent["args"])
    assert _agent_config(agent).l1_shared_dir == ""


@pytest.mark.parametrize(
    ("agent", "texts"),
    [
        (
            {"l1Shared": True, "shm": {"enabled": False}},
            ["agent.l1Shared=true needs agent.shm.enabled=true"],
        ),
        (
            # The default /dev/shm (8Gi) cannot hold the default L1 (8GiB) plus its alignment page.
            {"l1Shared": True},
            ["agent.l1Shared=true with agent.shm.sizeLimit=8Gi", "agent.l1Size=8GiB", "at least 9Gi"],
        ),
        (
            {"l1Shared": True, "l1Size": "4GiB", "shm": {"sizeLimit": "3Gi"}},
            ["agent.shm.sizeLimit=3Gi", "agent.l1Size=4GiB", "at least 5Gi"],
        ),
        (
            # One agent per GPU: every sidecar's file lies in the one emptyDir.
            {"l1Shared": True, "sidecarsPerPod": 2, "shm": {"sizeLimit": "9Gi"}},
            ["agent.shm.sizeLimit=9Gi", "agent.sidecarsPerPod=2", "at least 17Gi"],
        ),
    ],
)
def test_shared_l1_without_room_in_dev_shm_is_refused(
    helm: list[str], tmp_path: Path, agent: dict[str, Any], texts: list[str]
) -> None:
    _fails(helm, tmp_path, _values(**agent), *texts)


def test_a_non_boolean_l1_shared_is_refused_by_the_schema(helm: list[str], tmp_path: Path) -> None:
    _fails(helm, tmp_path, _values(l1Shared="yes"), "/agent/l1Shared", schema=True)


@pytest.mark.parametrize("sidecars", [1, 2])
def test_the_smallest_dev_shm_accepted_is_what_the_agents_files_take(
    helm: list[str], tmp_path: Path, sidecars: int
) -> None:
    """The chart's minimum equals the bytes real agents allocate: an L1 pool built from the rendered
    config in a shared directory makes a file of exactly that size (posix_fallocate'd, so a tmpfs of
    sizeLimit bytes must hold it whole)."""
    agent = {"l1Shared": True, "l1Size": "64MiB", "sidecarsPerPod": sidecars}
    names = ["kvgrid-agent"] if sidecars == 1 else ["kvgrid-agent-0"]
    pod = _pod(template(helm, _values(**agent, shm={"sizeLimit": "1Gi"}), tmp_path))
    cfg = _agent_config(container(pod, names[0]))
    shared = tmp_path / "shm"
    shared.mkdir()
    pool = L1Pool(cfg.l1_size, page_bytes=cfg.l1_page_size, pin=False, shared_dir=str(shared))
    try:
        file_bytes = os.stat(pool.shared_file).st_size
        assert file_bytes == pool.file_bytes
    finally:
        pool.close()
    need = sidecars * file_bytes

    def renders(size_limit: int) -> bool:
        values = _values(**agent, shm={"sizeLimit": size_limit})
        proc = run([*helm, "template", RELEASE, str(CHART), *CRDS, *values_args(values, tmp_path)])
        assert proc.returncode == 0 or "agent.l1Shared=true with agent.shm.sizeLimit" in proc.stderr
        return proc.returncode == 0

    assert renders(need)
    assert not renders(need - 1)
