"""The chart's NetworkPolicies, rendered and schema-checked, then evaluated (tests/deploy/netpol.py)
against who may reach which port: agent <-> agent on the peer port, agents and routers -> the
controller, the controller -> agents, Prometheus -> metrics ports, clients -> the engine's own
port, and nothing else to kvgrid's pods."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.deploy.chart import K8S_VERSIONS, NAMESPACE, RELEASE, find, template, validate
from tests.deploy.netpol import Pod, ingress_allowed

EXAMPLE: dict[str, Any] = {"examples": {"vllm": {"enabled": True}}}


def _pods(docs: list[dict[str, Any]]) -> dict[str, Pod]:
    def labels(name: str) -> dict[str, str]:
        return dict(find(docs, "Deployment", name)["spec"]["template"]["metadata"]["labels"])

    return {
        "controller": Pod("controller", NAMESPACE, labels(f"{RELEASE}-kvgrid-controller")),
        "engine": Pod("engine", NAMESPACE, labels(f"{RELEASE}-kvgrid-vllm")),
        "engine2": Pod("engine2", NAMESPACE, labels(f"{RELEASE}-kvgrid-vllm")),
        "router": Pod("router", NAMESPACE, {"kvgrid.io/router": "true"}),
        "router-elsewhere": Pod("router-elsewhere", "gateway", {"kvgrid.io/router": "true"}),
        "stranger": Pod("stranger", NAMESPACE, {"app": "something-else"}),
        "prometheus": Pod("prometheus", "monitoring", {"app.kubernetes.io/name": "prometheus"}),
    }


def _policies(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = [d for d in docs if d["kind"] == "NetworkPolicy"]
    for d in out:
        for version in K8S_VERSIONS:
            validate(d, version)
    return out


# (source, destination, port, allowed) with the defaults: controller 50061/9400, agent 50062/9401, vLLM 8000.
MATRIX = [
    ("engine2", "engine", 50062, True),  # peer fetch
    ("controller", "engine", 50062, True),  # snapshot pulls
    ("engine", "controller", 50061, True),  # register, events, heartbeats
    ("router", "controller", 50061, True),  # MatchPrefix, Score
    ("prometheus", "controller", 9400, True),
    ("prometheus", "engine", 9401, True),
    ("stranger", "engine", 8000, True),  # the engine's own API
    ("router", "engine", 8000, True),
    ("router", "engine", 50062, False),  # routers never call agents
    ("stranger", "controller", 50061, False),
    ("stranger", "engine", 50062, False),
    ("stranger", "controller", 9400, False),
    ("prometheus", "controller", 50061, False),
    ("router-elsewhere", "controller", 50061, False),  # other namespaces only when selected
    ("engine2", "engine", 9401, False),
    ("controller", "controller", 50061, False),
]


@pytest.mark.parametrize(
    ("src", "dst", "port", "allowed"), MATRIX, ids=[f"{s}->{d}:{p}" for s, d, p, _ in MATRIX]
)
def test_who_reaches_what(
    helm: list[str], tmp_path: Path, src: str, dst: str, port: int, allowed: bool
) -> None:
    docs = template(helm, EXAMPLE, tmp_path)
    pods = _pods(docs)
    assert ingress_allowed(_policies(docs), pods[src], pods[dst], port) is allowed


def test_routers_in_another_namespace_when_selected(helm: list[str], tmp_path: Path) -> None:
    values = {
        "networkPolicy": {
            "routers": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}}
        },
        **EXAMPLE,
    }
    docs = template(helm, values, tmp_path)
    pods, policies = _pods(docs), _policies(docs)
    assert ingress_allowed(policies, pods["router-elsewhere"], pods["controller"], 50061)
    assert not ingress_allowed(policies, pods["router"], pods["controller"], 50061)


def test_one_agent_per_gpu_opens_each_sidecar_port_and_no_more(helm: list[str], tmp_path: Path) -> None:
    values = {"agent": {"sidecarsPerPod": 2}, "examples": {"vllm": {"enabled": True, "gpus": 2}}}
    docs = template(helm, values, tmp_path)
    pods, policies = _pods(docs), _policies(docs)
    for port, allowed in ((50062, True), (50063, True), (50064, False)):
        assert ingress_allowed(policies, pods["engine2"], pods["engine"], port) is allowed
    for port, allowed in ((9401, True), (9402, True), (9403, False)):
        assert ingress_allowed(policies, pods["prometheus"], pods["engine"], port) is allowed


def test_disabled_renders_no_policy(helm: list[str], tmp_path: Path) -> None:
    docs = template(helm, {"networkPolicy": {"enabled": False}, **EXAMPLE}, tmp_path)
    assert not [d for d in docs if d["kind"] == "NetworkPolicy"]
    pods = _pods(docs)
    assert ingress_allowed([], pods["stranger"], pods["controller"], 50061)  # the evaluator's baseline
