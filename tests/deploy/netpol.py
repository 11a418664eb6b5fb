"""Kubernetes NetworkPolicy ingress semantics, for checking the chart's policies against a matrix of
who may reach what.

Implements the rules of networking.k8s.io/v1 that the chart uses: a pod selected by no Ingress policy
accepts everything; a selected pod accepts a connection when some rule of some selecting policy
matches both the port (number, or number..endPort; no ports = all) and the peer (podSelector in the
policy's namespace, namespaceSelector, or both; no from = everyone). Named ports and ipBlock are not
used by the chart and are refused here rather than guessed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Pod:
    name: str
    namespace: str
    labels: dict[str, str] = field(default_factory=dict)


def selector_matches(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    if selector is None:
        return False
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def _namespace_labels(ns: str) -> dict[str, str]:
    return {"kubernetes.io/metadata.name": ns}


def _port_matches(ports: list[dict[str, Any]] | None, port: int) -> bool:
    if not ports:
        return True
    for p in ports:
        if p.get("protocol", "TCP") != "TCP":
            continue
        if not isinstance(p.get("port"), int):
            raise ValueError(f"named or missing port in {p}: not modelled")
        if p["port"] <= port <= p.get("endPort", p["port"]):
            return True
    return False


def _peer_matches(peers: list[dict[str, Any]] | None, src: Pod, policy_ns: str) -> bool:
    if not peers:
        return True
    for peer in peers:
        if "ipBlock" in peer:
            raise ValueError("ipBlock peers are not modelled")
        pod_sel, ns_sel = peer.get("podSelector"), peer.get("namespaceSelector")
        if ns_sel is None:
            ns_ok = src.namespace == policy_ns
        else:
            ns_ok = selector_matches(ns_sel, _namespace_labels(src.namespace))
        pod_ok = True if pod_sel is None else selector_matches(pod_sel, src.labels)
        if ns_ok and pod_ok:
            return True
    return False


def ingress_allowed(policies: list[dict[str, Any]], src: Pod, dst: Pod, port: int) -> bool:
    selecting = [
        p
        for p in policies
        if p["metadata"].get("namespace", dst.namespace) == dst.namespace
        and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
        and selector_matches(p["spec"]["podSelector"], dst.labels)
    ]
    if not selecting:
        return True
    ns_of = {id(p): p["metadata"].get("namespace", dst.namespace) for p in selecting}
    return any(
        _port_matches(rule.get("ports"), port) and _peer_matches(rule.get("from"), src, ns_of[id(p)])
        for p in selecting
        for rule in p["spec"].get("ingress") or []
    )
