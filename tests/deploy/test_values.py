"""Values the chart must accept and render correctly, or refuse with a clear message: sizes and
quantities, the L1-vs-memory check, long release names, top-level typos, one agent per GPU, and the
controller's availability settings (PDB, headless Service, rollout strategy, anti-affinity)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvgrid import cli
from kvgrid.agent.config import AgentConfig
from kvgrid.common.config import config_from_args, parse_byte_size
from tests.deploy.chart import (
    CHART,
    CRDS,
    K8S_VERSIONS,
    NAMESPACE,
    RELEASE,
    container,
    find,
    literal_env,
    run,
    template,
    validate,
    values_args,
)

EXAMPLE: dict[str, Any] = {"examples": {"vllm": {"enabled": True}}}


def _fails(
    helm: list[str], tmp_path: Path, values: dict[str, Any], *texts: str, schema: bool = False
) -> None:
    """``helm template`` refuses ``values`` saying ``texts``; with ``schema`` (a values.schema.json
    rule) ``helm lint --strict`` does too (lint logs a template's ``fail`` without failing)."""
    proc = run(
        [*helm, "template", RELEASE, str(CHART), "-n", NAMESPACE, *CRDS, *values_args(values, tmp_path)]
    )
    assert proc.returncode != 0, "rendered, expected a failure"
    for text in texts:
        assert text in proc.stderr, proc.stderr
    if schema:
        lint = run([*helm, "lint", "--strict", str(CHART), *values_args(values, tmp_path)])
        assert lint.returncode != 0
        for text in texts:
            assert text in lint.stdout + lint.stderr, lint.stdout + lint.stderr


def _shm_limit(docs: list[dict[str, Any]]) -> str:
    pod = find(docs, "Deployment", f"{RELEASE}-kvgrid-vllm")["spec"]["template"]["spec"]
    (shm,) = [v for v in pod["volumes"] if v["name"] == "kvgrid-shm"]
    return str(shm["emptyDir"]["sizeLimit"])


@pytest.mark.parametrize(
    ("given", "rendered"),
    [
        ("8GiB", "8Gi"),
        ("8Gi", "8Gi"),
        ("64G", "64G"),
        ("64GB", "64G"),
        ("512MiB", "512Mi"),
        ("1.5Gi", "1.5Gi"),
        ("100K", "100k"),
        ("2kiB", "2Ki"),
        (1073741824, "1073741824"),
    ],
)
def test_shm_size_renders_a_valid_quantity(
    helm: list[str], tmp_path: Path, given: Any, rendered: str
) -> None:
    docs = template(helm, {"agent": {"shm": {"sizeLimit": given}}, **EXAMPLE}, tmp_path)
    assert _shm_limit(docs) == rendered
    for version in K8S_VERSIONS:  # the schema checks quantities with Kubernetes' own pattern
        validate(find(docs, "Deployment", f"{RELEASE}-kvgrid-vllm"), version)


@pytest.mark.parametrize("bad", ["8 GiB", "lots", "8GiBs", "-1Gi", "8i"])
def test_bad_shm_sizes_are_refused_by_the_schema(helm: list[str], tmp_path: Path, bad: str) -> None:
    _fails(helm, tmp_path, {"agent": {"shm": {"sizeLimit": bad}}}, "/agent/shm/sizeLimit", schema=True)


def test_l1_larger_than_the_memory_limit_fails(helm: list[str], tmp_path: Path) -> None:
    values = {"agent": {"l1Size": "12GiB", "resources": {"limits": {"memory": "10Gi"}}}}
    _fails(
        helm,
        tmp_path,
        values,
        "agent.l1Size=12GiB does not fit agent.resources.limits.memory=10Gi",
        "e.g. a limit of 14Gi",
    )


@pytest.mark.parametrize(
    ("l1", "memory", "ok"),
    [("8GiB", "10Gi", True), ("10GiB", "10Gi", False), ("9000MB", "9G", False), ("8GB", "8Gi", True),
     ("1TiB", "1100Gi", True), ("1TB", "931Gi", False)],
)  # fmt: skip
def test_l1_vs_memory_compares_bytes_across_units(
    helm: list[str], tmp_path: Path, l1: str, memory: str, ok: bool
) -> None:
    values = {"agent": {"l1Size": l1, "resources": {"limits": {"memory": memory}}}}
    proc = run([*helm, "template", RELEASE, str(CHART), *CRDS, *values_args(values, tmp_path)])
    assert (proc.returncode == 0) is ok, proc.stderr
    assert (parse_byte_size(l1) < _k8s_bytes(memory)) is ok  # the reference arithmetic agrees


def _k8s_bytes(q: str) -> int:
    units = {
        "Ki": 2**10,
        "Mi": 2**20,
        "Gi": 2**30,
        "Ti": 2**40,
        "k": 10**3,
        "M": 10**6,
        "G": 10**9,
        "T": 10**12,
    }
    for u, f in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if q.endswith(u):
            return int(float(q[: -len(u)]) * f)
    return int(q)


@pytest.mark.parametrize("release", ["a" * 53, "team-" + "b" * 41 + "-kvgrid"], ids=["plain", "with-kvgrid"])
def test_a_53_character_release_keeps_every_name_a_dns_label(
    helm: list[str], tmp_path: Path, release: str
) -> None:
    assert len(release) == 53  # the longest release name helm allows
    values = {
        "controller": {"replicas": 2, "index": {"backend": "redis", "redis": {"url": "redis://v:6379/0"}}},
        **EXAMPLE,
    }
    docs = template(helm, values, tmp_path, release=release)
    names = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(names) == len(set(names)), "truncation made two objects the same name"
    for kind, name in names:
        assert len(name) <= 63, (kind, name)
    for doc in docs:
        validate(doc)  # Services are DNS-1035 labels, the schemas check the rest
    suffixes = {n.rsplit("-", 1)[-1] for _, n in names}
    assert {"controller", "controllers", "vllm", "tls"} <= suffixes  # the suffix survives truncation


def test_a_top_level_typo_is_refused(helm: list[str], tmp_path: Path) -> None:
    _fails(
        helm,
        tmp_path,
        {"controler": {"replicas": 1}},
        "additional properties 'controler' not allowed",
        schema=True,
    )


def test_one_agent_per_gpu_renders_a_sidecar_per_rank(helm: list[str], tmp_path: Path) -> None:
    values = {
        "agent": {"sidecarsPerPod": 2},
        "examples": {"vllm": {"enabled": True, "gpus": 2, "extraArgs": ["--tensor-parallel-size", "2"]}},
    }
    docs = template(helm, values, tmp_path)
    for doc in docs:
        validate(doc)
    pod = find(docs, "Deployment", f"{RELEASE}-kvgrid-vllm")["spec"]["template"]["spec"]
    configs = []
    for i in range(2):
        c = container(pod, f"kvgrid-agent-{i}")
        args = [str(a) for a in c["args"]]
        cfg = config_from_args(AgentConfig, cli.build_parser(args).parse_args(args), env=literal_env(c))
        configs.append(cfg)
        assert cfg.uds_path == f"/run/kvgrid/agent-{i}.sock"
        assert (cfg.tcp_port, cfg.prometheus_port) == (50062 + i, 9401 + i)
        assert literal_env(c)["POD_UID"] == f"$(K8S_POD_UID)-gpu{i}"
    # The connector's socket template resolves to each rank's sidecar socket.
    vllm = container(pod, "vllm")
    (kv,) = [a for a in vllm["args"] if a.startswith("--kv-transfer-config=")]
    socket = json.loads(kv.split("=", 1)[1])["kv_connector_extra_config"]["agent_socket"]
    assert [socket.replace("{rank}", str(r)) for r in range(2)] == [c.uds_path for c in configs]


def test_per_gpu_sidecars_must_match_the_example_gpus(helm: list[str], tmp_path: Path) -> None:
    values = {"agent": {"sidecarsPerPod": 2}, **EXAMPLE}
    _fails(helm, tmp_path, values, "agent.sidecarsPerPod=2 with examples.vllm.gpus=1")


def test_per_gpu_port_ranges_must_not_overlap(helm: list[str], tmp_path: Path) -> None:
    values = {"agent": {"sidecarsPerPod": 4, "port": 9000, "metricsPort": 9002}}
    _fails(helm, tmp_path, values, "agent.sidecarsPerPod=4 uses ports 9000-9003 and metrics ports 9002-9005")


# --- controller availability ---------------------------------------------------------------------------

REDIS = {"backend": "redis", "redis": {"url": "redis://v:6379/0"}}


def test_several_replicas_get_a_pdb_a_headless_service_and_a_surge_rollout(
    helm: list[str], tmp_path: Path
) -> None:
    docs = template(helm, {"controller": {"replicas": 3, "index": REDIS}}, tmp_path)
    name = f"{RELEASE}-kvgrid-controller"
    deployment = find(docs, "Deployment", name)
    selector = deployment["spec"]["selector"]["matchLabels"]
    pdb = find(docs, "PodDisruptionBudget", name)
    assert pdb["spec"]["maxUnavailable"] == 1 and pdb["spec"]["selector"]["matchLabels"] == selector
    headless = find(docs, "Service", f"{RELEASE}-kvgrid-controllers")
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["selector"] == selector
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    term = deployment["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    (pref,) = term["preferredDuringSchedulingIgnoredDuringExecution"]
    assert pref["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert pref["podAffinityTerm"]["labelSelector"]["matchLabels"] == selector
    # The controller certificate names the headless Service too (routers dial it).
    cert = find(docs, "Certificate", f"{RELEASE}-kvgrid-controller-tls")
    assert f"{RELEASE}-kvgrid-controllers.{NAMESPACE}.svc" in cert["spec"]["dnsNames"]


def test_the_memory_index_is_replaced_not_surged(helm: list[str], tmp_path: Path) -> None:
    """A surge pod of the memory index would answer from an empty index while the agents still
    stream to the old one; one replica also gets no PDB (it would block every drain)."""
    docs = template(helm, {}, tmp_path)
    deployment = find(docs, "Deployment", f"{RELEASE}-kvgrid-controller")
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert "PodDisruptionBudget" not in {d["kind"] for d in docs}
