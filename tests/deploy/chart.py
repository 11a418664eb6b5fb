"""Rendering and validating the Helm chart in tests: helm runs, value files, lookups in the output,
and schema validation of every rendered object.

Core Kubernetes kinds are validated against Kubernetes' own JSON schemas (kubernetes-validate,
strict). The custom resources the chart renders (cert-manager's Certificate and Issuer, the
Prometheus Operator's ServiceMonitor, PodMonitor and PrometheusRule) are validated against models
generated from those projects' CRDs (cloudcoil-models-*), strictly: a field the model does not know
fails, as kubeconform's strict mode would.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml
from cloudcoil.models.cert_manager import v1 as cert_manager
from cloudcoil.models.prometheus_operator import v1 as prometheus_operator
from pydantic import BaseModel

ROOT = Path(__file__).resolve().parent.parent.parent
CHART = ROOT / "helm" / "kvgrid"
DOCKER = ROOT / "docker"
K8S_VERSIONS = ("1.29.0", "1.33.0", "1.37.0")
K8S_VERSION = K8S_VERSIONS[0]
RELEASE = "r"
NAMESPACE = "llm"
SOCKET = "/run/kvgrid/agent.sock"
# What a cluster with cert-manager and the Prometheus Operator installed tells helm.
CRDS = ("--api-versions", "cert-manager.io/v1", "--api-versions", "monitoring.coreos.com/v1")

CUSTOM_RESOURCES: dict[tuple[str, str], type[BaseModel]] = {
    ("cert-manager.io/v1", "Certificate"): cert_manager.Certificate,
    ("cert-manager.io/v1", "Issuer"): cert_manager.Issuer,
    ("monitoring.coreos.com/v1", "ServiceMonitor"): prometheus_operator.ServiceMonitor,
    ("monitoring.coreos.com/v1", "PodMonitor"): prometheus_operator.PodMonitor,
    ("monitoring.coreos.com/v1", "PrometheusRule"): prometheus_operator.PrometheusRule,
}


class UnknownFieldsError(AssertionError):
    pass


def _unknown_fields(given: Any, kept: Any, path: str = "") -> list[str]:
    """Paths present in ``given`` that the model dropped (so it does not define them)."""
    if isinstance(given, dict):
        if not isinstance(kept, dict):
            return [path or "/"]
        out = []
        for k, v in given.items():
            if k not in kept:
                out.append(f"{path}/{k}")
            else:
                out += _unknown_fields(v, kept[k], f"{path}/{k}")
        return out
    if isinstance(given, list) and isinstance(kept, list):
        return [
            p
            for i, (g, k) in enumerate(zip(given, kept, strict=False))
            for p in _unknown_fields(g, k, f"{path}/{i}")
        ]
    return []


def validate(doc: dict[str, Any], version: str = K8S_VERSION) -> None:
    """Raise if ``doc`` is not a valid object of its kind (strict: unknown fields fail too)."""
    model = CUSTOM_RESOURCES.get((doc["apiVersion"], doc["kind"]))
    if model is None:
        kubernetes_validate.validate(doc, version, strict=True)
        return
    parsed = model.model_validate(doc)
    kept = parsed.model_dump(mode="json", by_alias=True, exclude_unset=True)
    unknown = _unknown_fields(doc, kept)
    if unknown:
        raise UnknownFieldsError(f"{doc['kind']} {doc['metadata']['name']}: unknown fields {unknown}")


def run(cmd: list[str], cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120, check=False)


def values_args(values: dict[str, Any], tmp_path: Path) -> list[str]:
    f = tmp_path / f"values-{len(list(tmp_path.glob('values-*')))}.yaml"
    f.write_text(yaml.safe_dump(values))
    return ["-f", str(f)]


def template(
    helm: list[str],
    values: dict[str, Any],
    tmp_path: Path,
    *extra: str,
    chart: Path = CHART,
    crds: bool = True,
    release: str = RELEASE,
) -> list[dict[str, Any]]:
    """``helm template`` as on a cluster with cert-manager and the Prometheus Operator (``crds``)."""
    proc = run(
        [
            *helm, "template", release, str(chart), "--namespace", NAMESPACE,
            *(CRDS if crds else ()), *values_args(values, tmp_path), *extra,
        ]
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    for d in docs:
        if d["kind"] == kind and d["metadata"]["name"] == name:
            return d
    raise AssertionError(f"no {kind} {name!r} in {[(d['kind'], d['metadata']['name']) for d in docs]}")


def kinds(docs: list[dict[str, Any]]) -> set[str]:
    return {d["kind"] for d in docs}


def container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    for c in [*pod.get("initContainers", []), *pod["containers"]]:
        if c["name"] == name:
            return dict(c)
    raise AssertionError(f"no container {name!r}")


def literal_env(c: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}


def helm_binary() -> Path:
    return Path(os.environ.get("KVGRID_HELM", ROOT / ".tools" / "helm" / "helm"))
