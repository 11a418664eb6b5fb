"""Every pod the chart renders passes Pod Security "restricted" (tests/deploy/pss.py applies the
published rules): the controller, the example vLLM engine with its agent sidecar(s), for the default
values and the value sets the other chart tests use; and the agent sidecar on its own, in a pod that
sets nothing, as a parent chart includes it. The disk tier's hostPath volume is the one documented
exception: it needs the ``privileged`` level (docs/deploy.md, Pod Security).

Control run: ``KVGRID_PSS_CHART=<another chart dir>`` renders that chart instead (e.g. the chart at
HEAD: ``git archive HEAD helm/kvgrid | tar -x -C /tmp/head``).
"""

from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.deploy import pss
from tests.deploy.chart import CHART, container, template, validate
from tests.deploy.test_chart import VALUE_SETS, _docs_snippet

CHART_UNDER_TEST = Path(os.environ.get("KVGRID_PSS_CHART", CHART))
EXAMPLE = {"examples": {"vllm": {"enabled": True}}}

# The chart tests' value sets, plus the settings that change what pods mount or run.
CASES: dict[str, tuple[dict[str, Any], bool]] = {name: (values, True) for name, values in VALUE_SETS.items()}
CASES |= {
    "defaults-no-cert-manager": ({}, False),
    "example-no-cert-manager": (EXAMPLE, False),
    "helm-ca": ({"tls": {"provider": "helm"}, **EXAMPLE}, True),
    "tiers-emptydir-s3": (
        {
            **EXAMPLE,
            "agent": {
                "tiers": {
                    "disk": {"path": "/cache", "size": "64GiB"},
                    "s3": {"endpoint": "http://minio:9000", "bucket": "kv", "credentialsSecret": "s3-creds"},
                }
            },
        },
        True,
    ),
    "tiers-pvc": (
        {
            **EXAMPLE,
            "agent": {
                "tiers": {
                    "disk": {"path": "/cache", "volume": {"type": "persistentVolumeClaim", "claimName": "kv"}}
                }
            },
        },
        True,
    ),
    "shared-l1": ({**EXAMPLE, "agent": {"l1Shared": True, "shm": {"sizeLimit": "10Gi"}}}, True),
    "tp2-shared-identity": (
        {
            "agent": {"sidecarsPerPod": 2},
            "examples": {"vllm": {"enabled": True, "gpus": 2, "extraArgs": ["--tensor-parallel-size", "2"]}},
        },
        True,
    ),
}
HOST_PATH = {
    **EXAMPLE,
    "agent": {
        "tiers": {"disk": {"path": "/cache", "volume": {"type": "hostPath", "hostPath": "/mnt/nvme/kv"}}}
    },
}


def _render(
    helm: list[str], values: dict[str, Any], tmp_path: Path, crds: bool = True
) -> list[dict[str, Any]]:
    return template(helm, values, tmp_path, chart=CHART_UNDER_TEST, crds=crds)


def _findings(docs: list[dict[str, Any]]) -> dict[str, list[str]]:
    return {name: pss.restricted(meta, spec) for name, meta, spec in pss.pod_templates(docs)}


@pytest.mark.parametrize("name", list(CASES))
def test_every_rendered_pod_passes_restricted(helm: list[str], tmp_path: Path, name: str) -> None:
    values, crds = CASES[name]
    docs = _render(helm, values, tmp_path, crds)
    found = _findings(docs)
    assert found, "no pod rendered"
    example = values.get("examples", {}).get("vllm", {}).get("enabled", False)
    assert any("-vllm" in n for n in found) == example
    assert {n: f for n, f in found.items() if f} == {}


def test_the_agent_sidecar_alone_passes_restricted(helm: list[str], tmp_path: Path) -> None:
    """A parent chart's pod that sets no securityContext of its own: the sidecar's must suffice."""
    for values in (EXAMPLE, CASES["tp2-shared-identity"][0]):
        docs = _render(helm, values, tmp_path)
        (spec,) = [s for n, _, s in pss.pod_templates(docs) if n.endswith("-vllm")]
        sidecars = [c for c in spec["initContainers"] if c["name"].startswith("kvgrid-agent")]
        assert len(sidecars) == values.get("agent", {}).get("sidecarsPerPod", 1)
        bare = {"containers": sidecars}
        assert pss.restricted({}, bare) == []
        for c in sidecars:
            sc = c["securityContext"]
            assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0
            assert sc["seccompProfile"] == {"type": "RuntimeDefault"}


def test_the_example_engine_runs_as_the_agents_user(helm: list[str], tmp_path: Path) -> None:
    """The agent's socket and shared L1 file belong to its uid: the engine runs as the same one,
    reads the certificate Secret through fsGroup, and has a writable HOME and a large /dev/shm."""
    for values in (EXAMPLE, VALUE_SETS["agent-only"]):  # agent-only: no shared kvgrid-shm volume
        docs = _render(helm, values, tmp_path)
        (spec,) = [s for n, _, s in pss.pod_templates(docs) if n.endswith("-vllm")]
        agent, vllm = container(spec, "kvgrid-agent"), container(spec, "vllm")
        pod_sc = spec["securityContext"]
        assert pod_sc["runAsUser"] == agent["securityContext"]["runAsUser"] == 65532
        assert pod_sc["runAsGroup"] == agent["securityContext"]["runAsGroup"] == 65532
        assert pod_sc["fsGroup"] == 65532
        assert vllm["securityContext"]["allowPrivilegeEscalation"] is False
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in vllm["volumeMounts"]}
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
        env = {e["name"]: e.get("value") for e in vllm["env"]}
        home = env["HOME"]
        assert mounts[home] in volumes and "emptyDir" in volumes[mounts[home]]
        assert env["HF_HOME"].startswith(home + "/")
        # The certificate Secret is mode 0440: readable through fsGroup, by no other user.
        tls_volumes = [v for v in spec["volumes"] if "secret" in v]
        assert tls_volumes and all(v["secret"]["defaultMode"] == 0o440 for v in tls_volumes)


def test_the_controller_reads_its_certificate_through_fs_group(helm: list[str], tmp_path: Path) -> None:
    docs = _render(helm, {}, tmp_path)
    (spec,) = [s for n, _, s in pss.pod_templates(docs) if n.endswith("-controller")]
    assert spec["securityContext"]["fsGroup"] == spec["securityContext"]["runAsGroup"] == 65532
    assert [v["secret"]["defaultMode"] for v in spec["volumes"] if "secret" in v] == [0o440]


def test_the_disk_tier_on_a_host_path_needs_the_privileged_level(helm: list[str], tmp_path: Path) -> None:
    """As docs/deploy.md says: hostPath breaks restricted and baseline, nothing else does."""
    docs = _render(helm, HOST_PATH, tmp_path)
    found = {n: f for n, f in _findings(docs).items() if f}
    (name,) = found
    assert name.endswith("-vllm")
    assert [f.split(":")[0] for f in found[name]] == ["HostPath Volumes", "Volume Types"]
    (spec,) = [s for n, _, s in pss.pod_templates(docs) if n == name]
    assert [f.split(":")[0] for f in pss.baseline({}, spec)] == ["HostPath Volumes"]
    text = (Path(__file__).resolve().parents[2] / "docs" / "deploy.md").read_text()
    assert "`privileged`" in text and "hostPath" in text


def test_the_parent_chart_engine_in_the_docs_passes_restricted(helm: list[str], tmp_path: Path) -> None:
    parent = tmp_path / "myapp"
    (parent / "templates").mkdir(parents=True)
    (parent / "Chart.yaml").write_text("apiVersion: v2\nname: myapp\nversion: 1.0.0\n")
    shutil.copytree(CHART_UNDER_TEST, parent / "charts" / "kvgrid")
    (parent / "templates" / "engine.yaml").write_text(_docs_snippet())
    docs = template(helm, {}, tmp_path, chart=parent)
    for doc in docs:
        validate(doc)
    found = _findings(docs)
    assert len(found) == 2  # the engine and the subchart's controller
    assert {n: f for n, f in found.items() if f} == {}


# --- the checker itself: each published control catches what it should ---------------------------


def _good_pod() -> dict[str, Any]:
    sc = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    return {
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 1000,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "initContainers": [{"name": "init", "securityContext": copy.deepcopy(sc)}],
        "containers": [
            {"name": "main", "securityContext": copy.deepcopy(sc), "ports": [{"containerPort": 80}]}
        ],
        "volumes": [{"name": "v", "emptyDir": {}}, {"name": "s", "secret": {"secretName": "x"}}],
    }


def _set(pod: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    node: Any = pod
    for key in parents:
        node = node[int(key)] if key.isdigit() else node.setdefault(key, {})
    if last.isdigit():
        node[int(last)] = value
    else:
        node[last] = value


BAD: list[tuple[str, str, Any, str]] = [
    # (what, path in the pod spec, value, the control that must fire)
    ("hostProcess", "securityContext.windowsOptions.hostProcess", True, "HostProcess"),
    ("hostNetwork", "hostNetwork", True, "Host Namespaces"),
    ("hostPID", "hostPID", True, "Host Namespaces"),
    ("hostIPC", "hostIPC", True, "Host Namespaces"),
    ("privileged", "containers.0.securityContext.privileged", True, "Privileged Containers"),
    ("baseline cap", "containers.0.securityContext.capabilities.add", ["SYS_ADMIN"], "Capabilities"),
    ("restricted cap", "initContainers.0.securityContext.capabilities.add", ["CHOWN"], "Capabilities"),
    ("no drop ALL", "containers.0.securityContext.capabilities.drop", ["NET_RAW"], "Capabilities"),
    ("hostPath", "volumes.0", {"name": "v", "hostPath": {"path": "/"}}, "HostPath Volumes"),
    ("hostPort", "containers.0.ports.0.hostPort", 80, "Host Ports"),
    ("apparmor", "containers.0.securityContext.appArmorProfile", {"type": "Unconfined"}, "AppArmor"),
    ("selinux type", "securityContext.seLinuxOptions", {"type": "spc_t"}, "SELinux"),
    ("selinux user", "containers.0.securityContext.seLinuxOptions", {"user": "root"}, "SELinux"),
    ("procMount", "containers.0.securityContext.procMount", "Unmasked", "/proc Mount Type"),
    ("seccomp unconfined", "containers.0.securityContext.seccompProfile", {"type": "Unconfined"}, "Seccomp"),
    ("no seccomp", "securityContext.seccompProfile", None, "Seccomp"),
    ("sysctl", "securityContext.sysctls", [{"name": "kernel.msgmax", "value": "1"}], "Sysctls"),
    ("nfs volume", "volumes.1", {"name": "s", "nfs": {"server": "x", "path": "/"}}, "Volume Types"),
    (
        "escalation unset",
        "containers.0.securityContext.allowPrivilegeEscalation",
        None,
        "Privilege Escalation",
    ),
    (
        "escalation true",
        "initContainers.0.securityContext.allowPrivilegeEscalation",
        True,
        "Privilege Escalation",
    ),
    ("root allowed", "securityContext.runAsNonRoot", None, "Running as Non-root"),
    ("container root", "containers.0.securityContext.runAsNonRoot", False, "Running as Non-root"),
    ("uid 0", "containers.0.securityContext.runAsUser", 0, "Running as Non-root user"),
]


@pytest.mark.parametrize(("what", "path", "value", "control"), BAD, ids=[b[0] for b in BAD])
def test_the_checker_catches_each_control(what: str, path: str, value: Any, control: str) -> None:
    assert pss.restricted({}, _good_pod()) == []
    pod = _good_pod()
    _set(pod, path, value)
    found = pss.restricted({}, pod)
    assert found and {f.split(":")[0] for f in found} <= {control, "Volume Types"}, found
    assert control in {f.split(":")[0] for f in found}


def test_the_checker_accepts_what_restricted_allows() -> None:
    pod = _good_pod()
    pod["securityContext"] = {"runAsNonRoot": True}  # seccomp on every container instead of the pod
    for c in (*pod["initContainers"], *pod["containers"]):
        c["securityContext"]["seccompProfile"] = {"type": "Localhost", "localhostProfile": "p.json"}
    pod["containers"][0]["securityContext"]["capabilities"]["add"] = ["NET_BIND_SERVICE"]
    pod["securityContext"]["sysctls"] = [{"name": "net.ipv4.ip_unprivileged_port_start", "value": "0"}]
    pod["volumes"] += [
        {"name": n, src: {}}
        for n, src in [("c", "configMap"), ("d", "downwardAPI"), ("p", "projected"), ("e", "ephemeral")]
    ]
    pod["volumes"] += [
        {"name": "pvc", "persistentVolumeClaim": {"claimName": "x"}},
        {"name": "csi", "csi": {"driver": "d"}},
    ]
    meta = {"annotations": {"container.apparmor.security.beta.kubernetes.io/main": "runtime/default"}}
    assert pss.restricted(meta, pod) == []
    meta = {"annotations": {"container.apparmor.security.beta.kubernetes.io/main": "unconfined"}}
    assert [f.split(":")[0] for f in pss.restricted(meta, pod)] == ["AppArmor"]
