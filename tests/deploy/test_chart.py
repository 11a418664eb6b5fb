"""Deployment artefacts: the Helm chart, the Dockerfiles and skaffold.yaml.

Real tools only: helm (scripts/fetch_helm.sh puts it at .tools/helm/helm), Kubernetes' own JSON
schemas (kubernetes-validate, strict), hadolint, and the real argument parsers of ``kvgrid agent``,
``kvgrid controller`` and ``vllm serve`` for the container args the chart renders.
"""

from __future__ import annotations

import argparse
import base64
import importlib.util
import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import msgspec
import pytest
import yaml

from kvgrid import cli
from kvgrid.agent.config import AgentConfig
from kvgrid.common.config import config_from_args, parse_byte_size
from kvgrid.common.identity import PodIdentity
from kvgrid.controller.config import ControllerConfig
from tests.deploy.chart import (
    CHART,
    CRDS,
    DOCKER,
    K8S_VERSION,
    K8S_VERSIONS,
    NAMESPACE,
    RELEASE,
    ROOT,
    SOCKET,
    validate,
)
from tests.deploy.chart import container as _container
from tests.deploy.chart import find as _find
from tests.deploy.chart import literal_env as _literal_env
from tests.deploy.chart import run as _run
from tests.deploy.chart import template as _template
from tests.deploy.chart import values_args as _values_args

# Value sets that must render into valid manifests.
REDIS_URL = "redis://:s3cret@valkey.db:6379/0"
VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "example": {"examples": {"vllm": {"enabled": True}}},
    "redis-url": {
        "controller": {
            "replicas": 3,
            "index": {"backend": "redis", "redis": {"url": REDIS_URL, "prefix": "kvg-prod:"}},
            "config": {"bytes_per_token": 65536, "prefill_tokens_per_s": 20000.0},
        },
        "otel": {
            "endpoint": "http://otel-collector.observability:4317",
            "resourceAttributes": {"team": "llm"},
        },
        "examples": {"vllm": {"enabled": True, "gpus": 2, "extraArgs": ["--tensor-parallel-size", "2"]}},
    },
    "redis-secret": {
        "controller": {
            "replicas": 2,
            "index": {"backend": "redis", "redis": {"existingSecret": "valkey-url"}},
        },
    },
    "no-metrics": {"metrics": {"enabled": False}, "examples": {"vllm": {"enabled": True}}},
    "tls-secrets": {
        "tls": {
            "provider": "existingSecrets",
            "existingSecrets": {"controller": "ctrl-tls", "agent": "agent-tls"},
        },
        "examples": {"vllm": {"enabled": True}},
    },
    "tls-off": {
        "tls": {"enabled": False},
        "networkPolicy": {"enabled": False},
        "examples": {"vllm": {"enabled": True}},
    },
    "tp2-per-gpu-per-pod": {
        "tls": {
            "agentIdentity": "perPod",
            "certManager": {"issuerRef": {"name": "corp", "kind": "ClusterIssuer"}},
        },
        "agent": {"sidecarsPerPod": 2},
        "monitoring": {"podMonitor": {"anyNamespace": True}, "labels": {"release": "prometheus"}},
        "examples": {"vllm": {"enabled": True, "gpus": 2, "extraArgs": ["--tensor-parallel-size", "2"]}},
    },
    "agent-only": {
        "controller": {"enabled": False},
        "agent": {"controllerAddress": "kvgrid.shared.svc:50061", "shm": {"enabled": False}},
        "examples": {"vllm": {"enabled": True}},
    },
}


def _parse_kvgrid(container: dict[str, Any], config_type: type[msgspec.Struct], env: dict[str, str]) -> Any:
    """Parse a container's args with the real `kvgrid` parser and build its config from them."""
    assert container["command"] == ["kvgrid"]
    args = [str(a) for a in container["args"]]
    parser = cli.build_parser(args)
    ns = parser.parse_args(args)
    assert ns.command == args[0]
    # argparse also takes unambiguous prefixes (--eviction for --eviction-policy); the chart must
    # spell every flag exactly as the command defines it.
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[args[0]]
    flags = {a.split("=", 1)[0] for a in args if a.startswith("--")}
    assert flags <= set(sub._option_string_actions), flags - set(sub._option_string_actions)
    return config_from_args(config_type, ns, env=env)


def _tool(name: str) -> str:
    found = shutil.which(name) or str(Path(sys.executable).parent / name)
    if not os.access(found, os.X_OK):
        pytest.fail(f"{name} not found; install it with `.venv/bin/pip install {name}-bin`")
    return found


# --- helm lint ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["defaults", "example", "redis-url", "agent-only", "tls-secrets", "tls-off"])
def test_helm_lint_passes(helm: list[str], tmp_path: Path, name: str) -> None:
    proc = _run([*helm, "lint", "--strict", str(CHART), *_values_args(VALUE_SETS[name], tmp_path)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in proc.stdout


# --- rendered manifests against the Kubernetes schemas ------------------------------------------


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_rendered_manifests_pass_kubernetes_schema(helm: list[str], tmp_path: Path, name: str) -> None:
    docs = _template(helm, VALUE_SETS[name], tmp_path)
    assert docs
    for version in K8S_VERSIONS:
        for doc in docs:
            validate(doc, version)
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in docs)
    controller = VALUE_SETS[name].get("controller", {}).get("enabled", True)
    assert (("Deployment", f"{RELEASE}-kvgrid-controller") in kinds) == controller
    example = VALUE_SETS[name].get("examples", {}).get("vllm", {}).get("enabled", False)
    assert (("Deployment", f"{RELEASE}-kvgrid-vllm") in kinds) == example


def test_schema_validation_is_strict_enough_to_catch_a_bad_manifest() -> None:
    """The validator used above rejects what it should (so the passes mean something)."""
    bad = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "x"},
        "spec": {"ports": [{"port": 1, "bogusField": True}]},
    }
    with pytest.raises(kubernetes_validate.ValidationError, match="bogusField"):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


# --- bad values ---------------------------------------------------------------------------------

BAD_VALUES: list[tuple[dict[str, Any], list[str]]] = [
    ({"controller": {"replicas": 0}}, ["/controller/replicas", "minimum: got 0, want 1"]),
    ({"controller": {"index": {"backend": "etcd"}}}, ["/controller/index/backend", "'memory', 'redis'"]),
    ({"controller": {"replicas": 3}}, ["/controller/replicas", "maximum: got 3, want 1"]),
    ({"controller": {"index": {"backend": "redis"}}}, ["/controller/index/redis", "url", "existingSecret"]),
    ({"controller": {"port": 70000}}, ["/controller/port", "maximum"]),
    ({"controller": {"replica": 2}}, ["/controller", "'replica' not allowed"]),
    ({"controller": {"config": {"bogus_field": 1}}}, ["invalid propertyName 'bogus_field'"]),
    ({"agent": {"l1Size": "lots"}}, ["/agent/l1Size", "does not match pattern"]),
    ({"agent": {"evictionPolicy": "random"}}, ["/agent/evictionPolicy", "'lru', 'fifo'"]),
    ({"agent": {"peerDataSecurity": "none"}}, ["/agent/peerDataSecurity", "'mac', 'aead', 'tls'"]),
    ({"controller": {"logLevel": "verbose"}}, ["/controller/logLevel", "'debug', 'info'"]),
    (
        {"controller": {"index": {"backend": "redis", "redis": {"url": "http://x"}}}},
        ["/controller/index/redis/url"],
    ),
    ({"examples": {"vllm": {"kvRole": "kv_everything"}}}, ["/examples/vllm/kvRole"]),
]


@pytest.mark.parametrize(("values", "expected"), BAD_VALUES, ids=[str(v) for v, _ in BAD_VALUES])
def test_bad_values_fail_lint_and_template(
    helm: list[str], tmp_path: Path, values: dict[str, Any], expected: list[str]
) -> None:
    args = _values_args(values, tmp_path)
    lint = _run([*helm, "lint", str(CHART), *args])
    assert lint.returncode != 0
    template = _run([*helm, "template", RELEASE, str(CHART), *args])
    assert template.returncode != 0
    for out in (lint.stdout + lint.stderr, template.stderr):
        for text in expected:
            assert text in out, out


CROSS_FIELD: list[tuple[dict[str, Any], str]] = [
    ({"controller": {"replicas": 3}}, "controller.replicas=3 needs controller.index.backend=redis"),
    (
        {"controller": {"index": {"backend": "redis"}}},
        "controller.index.backend=redis needs controller.index.redis.url",
    ),
    ({"controller": {"config": {"listen": "0.0.0.0:1"}}}, "controller.config.listen is set by the chart"),
    ({"agent": {"metricsPort": 50062}}, "agent.metricsPort=50062 equals agent.port"),
]


@pytest.mark.parametrize(("values", "message"), CROSS_FIELD, ids=[m for _, m in CROSS_FIELD])
def test_cross_field_rules_fail_in_templates_too(
    helm: list[str], tmp_path: Path, values: dict[str, Any], message: str
) -> None:
    """Without the schema (--skip-schema-validation) the templates still refuse, in plain words."""
    proc = _run(
        [*helm, "template", RELEASE, str(CHART), "--skip-schema-validation", *_values_args(values, tmp_path)]
    )
    assert proc.returncode != 0
    assert message in proc.stderr


# --- container args against the real parsers -----------------------------------------------------


def test_controller_args_build_a_real_controller_config(helm: list[str], tmp_path: Path) -> None:
    docs = _template(helm, VALUE_SETS["redis-url"], tmp_path)
    name = f"{RELEASE}-kvgrid-controller"
    pod = _find(docs, "Deployment", name)["spec"]["template"]["spec"]
    container = _container(pod, "controller")
    # The Secret the chart made carries the URL; the ConfigMap carries the extra fields.
    env = _literal_env(container)
    (redis_env,) = [e for e in container["env"] if e["name"] == "KVGRID_REDIS_URL"]
    ref = redis_env["valueFrom"]["secretKeyRef"]
    secret = _find(docs, "Secret", ref["name"])
    env["KVGRID_REDIS_URL"] = base64.b64decode(secret["data"][ref["key"]]).decode()
    config_file = tmp_path / "controller.yaml"
    config_file.write_text(_find(docs, "ConfigMap", name)["data"]["controller.yaml"])
    mount = next(m for m in container["volumeMounts"] if m["name"] == "config")
    assert f"--config={mount['mountPath']}/controller.yaml" in container["args"]
    container["args"] = [
        f"--config={config_file}" if a.startswith("--config=") else a for a in container["args"]
    ]

    cfg = _parse_kvgrid(container, ControllerConfig, env)
    assert cfg.listen == "0.0.0.0:50061"
    assert cfg.index_backend == "redis"
    assert cfg.redis_url == REDIS_URL
    assert cfg.redis_prefix == "kvg-prod:"
    assert cfg.bytes_per_token == 65536
    assert cfg.prefill_tokens_per_s == 20000.0
    assert cfg.prometheus_port == 9400
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": 50061, "metrics": 9400, "health": 50071, "lookup": 50070}
    assert cfg.lookup_port == 50070  # the lean lookup listener, on the listen host (mTLS: TLS is on)
    # TLS is on: the kubelet's gRPC probes use the plaintext health-only listener; liveness is a TCP
    # connect (health is NOT_SERVING while the index backend is down, which a restart would not fix).
    assert cfg.health_port == 50071
    for probe in ("startupProbe", "readinessProbe"):
        assert container[probe]["grpc"] == {"port": cfg.health_port}
    assert container["livenessProbe"]["tcpSocket"] == {"port": cfg.health_port}
    # A shared (redis) index needs no settle time; the deadline for snapshot pulls is the chart's.
    assert (cfg.readiness_settle_ms, cfg.readiness_max_wait_ms) == (0, 30000)
    service = _find(docs, "Service", name)
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {
        "grpc": 50061,
        "metrics": 9400,
        "lookup": 50070,
    }
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector.observability:4317"
    assert "team=llm" in env["OTEL_RESOURCE_ATTRIBUTES"].split(",")


def test_controller_with_existing_secret_reads_the_url_from_it(helm: list[str], tmp_path: Path) -> None:
    docs = _template(helm, VALUE_SETS["redis-secret"], tmp_path)
    assert not [d for d in docs if d["kind"] == "Secret"]  # the user's Secret is used, none is made
    pod = _find(docs, "Deployment", f"{RELEASE}-kvgrid-controller")["spec"]["template"]["spec"]
    container = _container(pod, "controller")
    (redis_env,) = [e for e in container["env"] if e["name"] == "KVGRID_REDIS_URL"]
    assert redis_env["valueFrom"]["secretKeyRef"] == {"name": "valkey-url", "key": "redis-url"}
    assert not any(a.startswith("--redis-url") for a in container["args"])  # never a password in args
    env = {**_literal_env(container), "KVGRID_REDIS_URL": "redis://valkey:6379/1"}  # + the TLS files
    cfg = _parse_kvgrid(container, ControllerConfig, env)
    assert (cfg.index_backend, cfg.redis_url) == ("redis", "redis://valkey:6379/1")


def test_agent_sidecar_args_build_a_real_agent_config(helm: list[str], tmp_path: Path) -> None:
    docs = _template(helm, VALUE_SETS["example"], tmp_path)
    pod = _find(docs, "Deployment", f"{RELEASE}-kvgrid-vllm")["spec"]["template"]["spec"]
    agent = _container(pod, "kvgrid-agent")
    cfg = _parse_kvgrid(agent, AgentConfig, _literal_env(agent))
    assert cfg.uds_path == SOCKET
    assert cfg.tcp_port == 50062
    assert cfg.l1_size == parse_byte_size("8GiB")
    assert cfg.eviction_policy == "lru"
    assert cfg.prometheus_port == 9401
    assert cfg.controller_address == f"{RELEASE}-kvgrid-controller.{NAMESPACE}.svc:50061"
    # The address points at the Service this release renders, on its gRPC port.
    service = _find(docs, "Service", f"{RELEASE}-kvgrid-controller")
    assert 50061 in [p["port"] for p in service["spec"]["ports"]]


@pytest.mark.parametrize(
    ("tls", "security", "expected"), [(True, None, "mac"), (True, "aead", "aead"), (False, "tls", None)]
)
def test_agent_peer_data_security_reaches_the_agent_with_tls_only(
    helm: list[str], tmp_path: Path, tls: bool, security: str | None, expected: str | None
) -> None:
    agent_values = {"peerDataSecurity": security} if security else {}
    values = {"examples": {"vllm": {"enabled": True}}, "tls": {"enabled": tls}, "agent": agent_values}
    docs = _template(helm, values, tmp_path)
    agent = _container(
        _find(docs, "Deployment", f"{RELEASE}-kvgrid-vllm")["spec"]["template"]["spec"], "kvgrid-agent"
    )
    flags = [a for a in agent["args"] if a.startswith("--peer-data-security")]
    if expected is None:
        assert flags == []  # without TLS the data plane is plaintext with checksums: no mode to choose
    else:
        assert flags == [f"--peer-data-security={expected}"]
        assert _parse_kvgrid(agent, AgentConfig, _literal_env(agent)).peer_data_security == expected


def test_agent_extra_args_and_explicit_controller_reach_the_parser(helm: list[str], tmp_path: Path) -> None:
    values = {
        "controller": {"enabled": False},
        "agent": {
            "controllerAddress": "kvgrid.shared.svc:50061",
            "l1Size": "64GiB",
            "resources": {"limits": {"memory": "66Gi"}},
            "extraArgs": ["--pin-ttl-ms", "60000", "--l1-pin-memory=on"],
        },
        "metrics": {"enabled": False},
        "examples": {"vllm": {"enabled": True}},
    }
    docs = _template(helm, values, tmp_path)
    pod = _find(docs, "Deployment", f"{RELEASE}-kvgrid-vllm")["spec"]["template"]["spec"]
    agent = _container(pod, "kvgrid-agent")
    cfg = _parse_kvgrid(agent, AgentConfig, _literal_env(agent))
    assert cfg.controller_address == "kvgrid.shared.svc:50061"
    assert cfg.l1_size == 64 << 30
    assert cfg.pin_ttl_ms == 60000
    assert cfg.pin_memory is True
    assert cfg.prometheus_port == 0  # metrics off: no endpoint, no annotations
    assert not _find(docs, "Deployment", f"{RELEASE}-kvgrid-vllm")["spec"]["template"]["metadata"].get(
        "annotations"
    )


def test_example_engine_pod_wiring(helm: list[str], tmp_path: Path) -> None:
    docs = _template(helm, VALUE_SETS["example"], tmp_path)
    deployment = _find(docs, "Deployment", f"{RELEASE}-kvgrid-vllm")
    template = deployment["spec"]["template"]
    pod = template["spec"]
    agent, vllm = _container(pod, "kvgrid-agent"), _container(pod, "vllm")
    # Native sidecar: an init container that keeps running, ready (startup probe) before vLLM starts.
    assert agent in pod["initContainers"] and agent["restartPolicy"] == "Always"
    # mTLS on the agent port: the kubelet (no client certificate) probes it by TCP connect.
    assert agent["startupProbe"]["tcpSocket"]["port"] == 50062
    # The engine's pid is visible to the agent (it drops registrations of exited engines).
    assert pod["shareProcessNamespace"] is True
    # One emptyDir holds the socket; both containers mount it at the socket's directory.
    volumes = {v["name"]: v for v in pod["volumes"]}
    for c in (agent, vllm):
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        assert mounts[os.path.dirname(SOCKET)] == "kvgrid-socket"
        assert mounts["/dev/shm"] == "kvgrid-shm"
    assert volumes["kvgrid-socket"] == {"name": "kvgrid-socket", "emptyDir": {}}
    assert volumes["kvgrid-shm"]["emptyDir"]["medium"] == "Memory"
    # Downward-API identity: the agent's PodIdentity.from_env sees exactly these fields.
    field_refs = {
        e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"]
        for e in agent["env"]
        if "fieldRef" in e.get("valueFrom", {})
    }
    assert field_refs == {
        "POD_UID": "metadata.uid",
        "POD_NAME": "metadata.name",
        "POD_NAMESPACE": "metadata.namespace",
        "NODE_NAME": "spec.nodeName",
        "POD_IP": "status.podIP",
    }
    fake_pod = {"metadata.uid": "uid-1", "metadata.name": "vllm-0", "metadata.namespace": NAMESPACE}
    fake_pod |= {"spec.nodeName": "gpu-node-3", "status.podIP": "10.1.2.3"}
    identity = PodIdentity.from_env({name: fake_pod[path] for name, path in field_refs.items()})
    assert (identity.pod_uid, identity.pod_name, identity.namespace, identity.node_name) == (
        "uid-1",
        "vllm-0",
        NAMESPACE,
        "gpu-node-3",
    )
    # GPU: the engine requests it; the sidecar sees it through NVIDIA_VISIBLE_DEVICES.
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert _literal_env(agent)["NVIDIA_VISIBLE_DEVICES"] == "all"
    # The engine pod's prometheus.io/* annotations stay vLLM's: the PodMonitor scrapes the agent by
    # its named metrics port, and selects the pod by the label the example carries.
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(vllm["ports"][0]["containerPort"]) == "8000"
    monitor = _find(docs, "PodMonitor", f"{RELEASE}-kvgrid-agents")
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    ports = {p["name"]: p["containerPort"] for p in agent["ports"]}
    assert ports[endpoint["port"]] == cfg_metrics_port(agent)
    assert monitor["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    assert pod["enableServiceLinks"] is False


def cfg_metrics_port(agent: dict[str, Any]) -> int:
    return int(_parse_kvgrid(agent, AgentConfig, _literal_env(agent)).prometheus_port)


def test_vllm_args_parse_with_the_real_vllm_parser(helm: list[str], tmp_path: Path) -> None:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    docs = _template(helm, VALUE_SETS["redis-url"], tmp_path)
    pod = _find(docs, "Deployment", f"{RELEASE}-kvgrid-vllm")["spec"]["template"]["spec"]
    vllm = _container(pod, "vllm")
    assert vllm["command"] == ["vllm"] and vllm["args"][0] == "serve"
    ns = make_arg_parser(FlexibleArgumentParser(prog="vllm serve")).parse_args(vllm["args"][1:])
    assert ns.model_tag == "Qwen/Qwen3-0.6B"
    assert ns.port == 8000
    assert ns.tensor_parallel_size == 2
    kv = ns.kv_transfer_config
    assert kv.kv_connector == "KVGridConnector"  # docs/architecture.md: kvgrid.connector.vllm.KVGridConnector
    assert kv.kv_connector_module_path == "kvgrid.connector.vllm"
    assert kv.kv_role == "kv_both"
    assert kv.kv_connector_extra_config["agent_socket"] == SOCKET
    assert importlib.util.find_spec(kv.kv_connector_module_path) is not None
    # The connector's own parser accepts the rendered extra config (unknown keys are rejected there).
    from kvgrid.connector.config import parse_connector_config
    from kvgrid.connector.vllm import KVGridConnector  # noqa: F401 - the class vLLM will load

    assert parse_connector_config(kv.kv_connector_extra_config).agent_socket == SOCKET
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == 2


# --- the documented sidecar include, from a parent chart ----------------------------------------


def _docs_snippet() -> str:
    text = (ROOT / "docs" / "deploy.md").read_text()
    m = re.search(r"<!-- parent-chart-template -->\s*```yaml\n(.*?)```", text, re.S)
    assert m, "docs/deploy.md lost its parent-chart example"
    return m.group(1)


def test_sidecar_include_from_a_parent_chart_as_documented(helm: list[str], tmp_path: Path) -> None:
    parent = tmp_path / "myapp"
    (parent / "templates").mkdir(parents=True)
    (parent / "Chart.yaml").write_text("apiVersion: v2\nname: myapp\nversion: 1.0.0\n")
    (parent / "values.yaml").write_text(
        "kvgrid:\n  agent:\n    l1Size: 32GiB\n    resources:\n      limits:\n        memory: 34Gi\n"
    )
    shutil.copytree(CHART, parent / "charts" / "kvgrid")
    (parent / "templates" / "engine.yaml").write_text(_docs_snippet())
    docs = _template(helm, {}, tmp_path, chart=parent)
    for doc in docs:
        validate(doc)
    engine = next(d for d in docs if d["kind"] == "Deployment" and "controller" not in d["metadata"]["name"])
    pod = engine["spec"]["template"]["spec"]
    agent = _container(pod, "kvgrid-agent")
    cfg = _parse_kvgrid(agent, AgentConfig, _literal_env(agent))
    assert cfg.l1_size == 32 << 30  # the parent's kvgrid: values reach the sidecar
    assert cfg.controller_address == f"{RELEASE}-kvgrid-controller.{NAMESPACE}.svc:50061"
    _find(docs, "Deployment", f"{RELEASE}-kvgrid-controller")  # the subchart's controller is there too


# --- observability and RBAC ---------------------------------------------------------------------


def test_otel_endpoint_reaches_every_kvgrid_container(helm: list[str], tmp_path: Path) -> None:
    docs = _template(helm, VALUE_SETS["redis-url"], tmp_path)
    pods = [d["spec"]["template"]["spec"] for d in docs if d["kind"] == "Deployment"]
    containers = [c for p in pods for c in [*p.get("initContainers", []), *p["containers"]]]
    assert {c["name"] for c in containers} == {"controller", "kvgrid-agent", "vllm"}
    for c in containers:
        assert _literal_env(c)["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector.observability:4317"
    defaults = _template(helm, {}, tmp_path)
    for d in defaults:
        if d["kind"] == "Deployment":
            for c in d["spec"]["template"]["spec"]["containers"]:
                assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in _literal_env(c)


_RBAC_KINDS = {"ServiceAccount", "Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding"}


def test_rbac_is_exactly_the_token_reviews_the_controller_makes(helm: list[str], tmp_path: Path) -> None:
    """RBAC only for what the code does: the controller's one Kubernetes API call is creating a
    TokenReview (agent_pod_proof=token, the chart's podToken default). When the code calls more,
    this fails: grant that too."""
    sources = [*(ROOT / "services" / "kvgrid" / "controller").glob("*.py")]
    sources += [*(ROOT / "services" / "kvgrid" / "common").glob("*.py")]
    uses_client = [
        p.name for p in sources if re.search(r"^\s*(import|from)\s+kubernetes\b", p.read_text(), re.M)
    ]
    assert uses_client == [], (
        f"the controller now uses the Kubernetes client ({uses_client}): grant its calls"
    )
    paths = {m for p in sources for m in re.findall(r"\"(/apis?/[^\"]+)\"", p.read_text())}
    assert paths == {"/apis/authentication.k8s.io/v1/tokenreviews"}, paths

    docs = _template(helm, VALUE_SETS["redis-url"], tmp_path)  # the default identity: podToken
    ctrl = f"{RELEASE}-kvgrid-controller"
    pod = _find(docs, "Deployment", ctrl)["spec"]["template"]["spec"]
    assert (pod["serviceAccountName"], pod["automountServiceAccountToken"]) == (ctrl, True)
    assert _find(docs, "ServiceAccount", ctrl)["automountServiceAccountToken"] is False  # only this pod
    (role,) = [d for d in docs if d["kind"] == "ClusterRole"]
    assert role["rules"] == [
        {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"]}
    ]
    (binding,) = [d for d in docs if d["kind"] == "ClusterRoleBinding"]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": ctrl, "namespace": NAMESPACE}]
    assert NAMESPACE in role["metadata"]["name"]  # cluster-wide names: one per release and namespace
    assert not {"Role", "RoleBinding"} & {d["kind"] for d in docs}

    # No tokens to verify (per-pod certificates, the explicit shared certificate, no TLS): no RBAC.
    for values in (
        VALUE_SETS["tp2-per-gpu-per-pod"],
        {"tls": {"agentIdentity": "sharedCertificateUnverified"}},
        VALUE_SETS["tls-off"],
    ):
        docs = _template(helm, values, tmp_path)
        assert not _RBAC_KINDS & {d["kind"] for d in docs}, values
        pod = _find(docs, "Deployment", ctrl)["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False and "serviceAccountName" not in pod


def test_service_link_env_would_not_break_the_config_loaders(helm: list[str], tmp_path: Path) -> None:
    """Pods set enableServiceLinks: false; even with links on, a release named kvgrid stays loadable."""
    proc = _run(
        [*helm, "template", "kvgrid", str(CHART), *CRDS, *_values_args(VALUE_SETS["example"], tmp_path)]
    )
    assert proc.returncode == 0, proc.stderr
    env: dict[str, str] = {}
    for doc in yaml.safe_load_all(proc.stdout):
        if doc and doc["kind"] == "Service":
            prefix = doc["metadata"]["name"].upper().replace("-", "_")
            env[f"{prefix}_SERVICE_HOST"] = "10.0.0.1"
            env[f"{prefix}_PORT"] = "tcp://10.0.0.1:1"
            for p in doc["spec"]["ports"]:
                env[f"{prefix}_SERVICE_PORT_{p['name'].upper().replace('-', '_')}"] = str(p["port"])
                env[f"{prefix}_PORT_{p['port']}_TCP_PORT"] = str(p["port"])
    assert "KVGRID_CONTROLLER_SERVICE_HOST" in env
    from kvgrid.common.config import load_config

    assert load_config(AgentConfig, env=env) == AgentConfig()
    assert load_config(ControllerConfig, env=env) == ControllerConfig()


def test_memory_index_readiness_waits_for_the_agents_to_reconnect(helm: list[str], tmp_path: Path) -> None:
    """With the memory index a new controller starts empty: it stays NOT_SERVING at least as long as
    an agent may wait before reconnecting, so the agents have registered (and been resynced)."""
    docs = _template(helm, {}, tmp_path)
    pod = _find(docs, "Deployment", f"{RELEASE}-kvgrid-controller")["spec"]["template"]["spec"]
    c = _container(pod, "controller")
    cfg = _parse_kvgrid(c, ControllerConfig, _literal_env(c))
    assert cfg.readiness_settle_ms == AgentConfig().reconnect_max_backoff_ms
    assert (
        cfg.readiness_max_wait_ms
        < c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] * 1000
    )


def test_values_schema_knows_every_controller_config_field() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    names = schema["properties"]["controller"]["properties"]["config"]["propertyNames"]["enum"]
    assert sorted(names) == sorted(f.encode_name for f in msgspec.structs.fields(ControllerConfig))


def test_chart_defaults_are_valid_service_values() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    agent = values["agent"]
    assert parse_byte_size(agent["l1Size"]) > 0
    assert agent["port"] == AgentConfig().tcp_port
    assert values["controller"]["port"] == int(ControllerConfig().listen.rpartition(":")[2])
    assert (values["controller"]["leaseTtlMs"], values["controller"]["grpcWorkers"]) == (
        ControllerConfig().lease_ttl_ms,
        ControllerConfig().grpc_workers,
    )


# --- Dockerfiles --------------------------------------------------------------------------------

DOCKERFILES = sorted(DOCKER.glob("*.Dockerfile"))


def test_dockerfiles_exist() -> None:
    assert [p.name for p in DOCKERFILES] == ["agent.Dockerfile", "controller.Dockerfile", "vllm.Dockerfile"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=[p.name for p in DOCKERFILES])
def test_hadolint_passes(dockerfile: Path) -> None:
    proc = _run([_tool("hadolint"), "--failure-threshold", "info", str(dockerfile)])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerfiles_expose_the_ports_the_services_and_chart_use() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    exposed = {
        name: set(re.findall(r"^EXPOSE (.+)$", (DOCKER / f"{name}.Dockerfile").read_text(), re.M)[0].split())
        for name in ("agent", "controller")
    }
    agent, controller = values["agent"], values["controller"]
    assert exposed["agent"] == {str(AgentConfig().tcp_port), str(agent["port"]), str(agent["metricsPort"])}
    listen_port = ControllerConfig().listen.rpartition(":")[2]
    assert exposed["controller"] == {
        listen_port,
        str(controller["port"]),
        str(controller["metricsPort"]),
        str(controller["healthPort"]),
    }


def test_hadolint_catches_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian\nRUN apt-get update && apt-get install curl\nRUN cd /tmp\n")
    proc = _run([_tool("hadolint"), "-f", "json", str(bad)])
    assert proc.returncode != 0
    codes = {finding["code"] for finding in json.loads(proc.stdout)}
    assert {"DL3006", "DL3015", "DL3003"} <= codes


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=[p.name for p in DOCKERFILES])
def test_dockerfile_copies_only_what_its_dockerignore_sends(dockerfile: Path) -> None:
    text = dockerfile.read_text()
    assert re.search(r"^ARG BASE=\S+", text, re.M), "the base image must be a build arg"
    ignore = Path(f"{dockerfile}.dockerignore").read_text().split()
    sent = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    copied = [
        src for m in re.finditer(r"^COPY (?!--from)(.+) \S+$", text, re.M) for src in m.group(1).split()
    ]
    assert copied
    for src in copied:
        assert src.rstrip("/") in sent, f"{dockerfile.name} copies {src} but its dockerignore drops it"
        assert (ROOT / src).exists()


def test_controller_image_needs_no_torch() -> None:
    """docker/controller.Dockerfile leaves torch out: the controller's code must not import it."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from kvgrid import cli\n"
        "cli.build_parser(['controller', '--help'])\n"
        "import kvgrid.controller.service, kvgrid.controller.index_redis, kvgrid.controller.vllm_events\n"
        "import kvgrid.controller.cli, kvgrid.controller.lookup_cli\n"
        "print('ok')\n"
    )
    proc = _run([sys.executable, "-c", code])
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


# --- skaffold.yaml ------------------------------------------------------------------------------


def _dockerfile_args(path: Path) -> set[str]:
    return set(re.findall(r"^ARG (\w+)", path.read_text(), re.M))


def test_skaffold_references_real_files_args_and_values(helm: list[str], tmp_path: Path) -> None:
    config = yaml.safe_load((ROOT / "skaffold.yaml").read_text())
    assert config["apiVersion"].startswith("skaffold/v4") and config["kind"] == "Config"
    artifacts = list(config["build"]["artifacts"])
    releases = list(config["deploy"]["helm"]["releases"])
    for profile in config.get("profiles", []):
        artifacts += [p["value"] for p in profile.get("patches", []) if p["path"] == "/build/artifacts/-"]
        releases += profile.get("deploy", {}).get("helm", {}).get("releases", [])
    images = set()
    for art in artifacts:
        dockerfile = ROOT / art.get("context", ".") / art["docker"]["dockerfile"]
        assert dockerfile.is_file()
        assert set(art["docker"].get("buildArgs", {})) <= _dockerfile_args(dockerfile)
        images.add(art["image"].replace("-", "_").replace("/", "_"))
    for rel in releases:
        assert (ROOT / rel["chartPath"]).resolve() == CHART
        templates = rel.get("setValueTemplates", {})
        for value in templates.values():
            (image,) = set(re.findall(r"\{\{\.IMAGE_(?:REPO|TAG)_(\w+)\}\}", value))
            assert image in images, f"{value} names no artifact of skaffold.yaml"
        # Render with what skaffold would substitute: the keys must be real chart values. The agent
        # image only shows in an engine pod, so the example engine is on.
        sets = [
            f"{k}=registry.local/{k.split('.')[0]}" if k.endswith("repository") else f"{k}=abc123"
            for k in templates
        ]
        sets += [f"{k}={str(v).lower()}" for k, v in rel.get("setValues", {}).items()]
        sets += ["examples.vllm.enabled=true"]
        docs = _template(helm, {}, tmp_path, *[a for s in sets for a in ("--set", s)])
        rendered = {c["image"] for d in docs if d["kind"] == "Deployment" for c in _all_containers(d)}
        for key in templates:
            if key.endswith("repository"):
                assert f"registry.local/{key.split('.')[0]}:abc123" in rendered


def _all_containers(deployment: dict[str, Any]) -> list[dict[str, Any]]:
    pod = deployment["spec"]["template"]["spec"]
    return [*pod.get("initContainers", []), *pod["containers"]]
