"""A tiny read-only Kubernetes API server, enough for ``helm template --dry-run=server``: helm's
reachability check, discovery (which sets ``.Capabilities.APIVersions``) and ``lookup`` of stored
objects. Anything not stored is 404 on a GET and an empty list on a LIST; nothing can be written.
Run helm with ``--disable-openapi-validation`` (no OpenAPI documents are served).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

_CORE = [
    ("configmaps", "ConfigMap"),
    ("secrets", "Secret"),
    ("services", "Service"),
    ("pods", "Pod"),
    ("serviceaccounts", "ServiceAccount"),
]
_GROUPS = {
    "apps/v1": [("deployments", "Deployment")],
    "policy/v1": [("poddisruptionbudgets", "PodDisruptionBudget")],
    "networking.k8s.io/v1": [("networkpolicies", "NetworkPolicy")],
    "rbac.authorization.k8s.io/v1": [
        ("clusterroles", "ClusterRole"),
        ("clusterrolebindings", "ClusterRoleBinding"),
    ],
}
_CLUSTER_SCOPED = {"ClusterRole", "ClusterRoleBinding"}
CERT_MANAGER = {"cert-manager.io/v1": [("certificates", "Certificate"), ("issuers", "Issuer")]}
_PLURAL = {kind: plural for plural, kind in _CORE}


def _resources(group_version: str, items: list[tuple[str, str]]) -> dict[str, Any]:
    verbs = ["get", "list", "watch", "create", "update", "patch", "delete"]
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": group_version,
        "resources": [
            {
                "name": p,
                "singularName": k.lower(),
                "namespaced": k not in _CLUSTER_SCOPED,
                "kind": k,
                "verbs": verbs,
            }
            for p, k in items
        ],
    }


@contextmanager
def fake_apiserver(
    tmp_path: Path, objects: list[dict[str, Any]], namespace: str, cert_manager: bool
) -> Iterator[tuple[Path, list[str]]]:
    """Serve ``objects`` (core kinds, in ``namespace``); yields (kubeconfig, log of request paths)."""
    groups = {**_GROUPS, **(CERT_MANAGER if cert_manager else {})}
    store = {(_PLURAL[o["kind"]], o["metadata"]["name"]): o for o in objects}
    log: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _refuse(self) -> None:
            log.append(f"{self.command} {self.path}")
            self._send(405, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 405})

        do_POST = do_PUT = do_PATCH = do_DELETE = _refuse

        def do_GET(self) -> None:
            path = self.path.split("?")[0]
            log.append(f"GET {path}")
            if path == "/version":
                return self._send(200, {"major": "1", "minor": "33", "gitVersion": "v1.33.0"})
            if path == "/api":
                return self._send(
                    200, {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []}
                )
            if path == "/apis":
                return self._send(
                    200,
                    {
                        "kind": "APIGroupList",
                        "apiVersion": "v1",
                        "groups": [
                            {
                                "name": gv.split("/")[0],
                                "versions": [{"groupVersion": gv, "version": gv.split("/")[1]}],
                                "preferredVersion": {"groupVersion": gv, "version": gv.split("/")[1]},
                            }
                            for gv in groups
                        ],
                    },
                )
            if path == "/api/v1":
                return self._send(200, _resources("v1", _CORE))
            if (m := re.fullmatch(r"/apis/([^/]+/[^/]+)", path)) and m.group(1) in groups:
                return self._send(200, _resources(m.group(1), groups[m.group(1)]))
            if m := re.fullmatch(rf"/api/v1/namespaces/{namespace}/([^/]+)/([^/]+)", path):
                if (m.group(1), m.group(2)) in store:
                    return self._send(200, store[(m.group(1), m.group(2))])
            elif re.fullmatch(r"/api/v1/(namespaces/[^/]+/)?[^/]+", path):
                return self._send(200, {"kind": "List", "apiVersion": "v1", "metadata": {}, "items": []})
            self._send(
                404,
                {
                    "kind": "Status",
                    "apiVersion": "v1",
                    "status": "Failure",
                    "reason": "NotFound",
                    "code": 404,
                },
            )

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {"name": "fake", "cluster": {"server": f"http://127.0.0.1:{server.server_port}"}}
                ],
                "users": [{"name": "u", "user": {"token": "fake"}}],
                "contexts": [
                    {"name": "c", "context": {"cluster": "fake", "user": "u", "namespace": namespace}}
                ],
                "current-context": "c",
            }
        )
    )
    try:
        yield kubeconfig, log
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
