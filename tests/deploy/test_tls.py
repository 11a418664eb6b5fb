"""The chart's TLS: which certificates it asks for, how pods get them, and that what it renders works
with the real services.

The end-to-end tests sign the rendered Certificate specs (and csi-driver volume attributes) the way
cert-manager would (tests/deploy/issuer.py), put the files where the rendered env says, and run a
real controller and agent with exactly the rendered KVGRID_TLS_* env: the agent must register over
mTLS, and a router holding the router certificate must be able to read the controller.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvgrid.agent.config import AgentConfig
from kvgrid.api.v1 import common_pb2, controller_pb2, controller_pb2_grpc
from kvgrid.common.config import config_from_args
from kvgrid.controller.config import ControllerConfig
from tests.agent.helpers import wait_for
from tests.deploy.chart import (
    CHART,
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
from tests.deploy.issuer import sign_certificate, sign_csi_volume
from tests.security.kube_tokens import KubeTokens, kube_tokens
from tests.security.pki import TestCA

MOUNT = "/etc/kvgrid/tls"
EXAMPLE: dict[str, Any] = {"examples": {"vllm": {"enabled": True}}}
SPIFFE = f"spiffe://cluster.local/ns/{NAMESPACE}/role"


def _spec_of(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _engine_pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return dict(find(docs, "Deployment", f"{RELEASE}-kvgrid-vllm")["spec"]["template"]["spec"])


def _controller_pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return dict(find(docs, "Deployment", f"{RELEASE}-kvgrid-controller")["spec"]["template"]["spec"])


def _mounted_volume(pod: dict[str, Any], c: dict[str, Any], path: str) -> dict[str, Any]:
    (name,) = [m["name"] for m in c["volumeMounts"] if m["mountPath"] == path]
    (volume,) = [v for v in pod["volumes"] if v["name"] == name]
    return dict(volume)


# --- what the chart asks cert-manager for ----------------------------------------------------------


def test_certificates_carry_the_identity_scheme(helm: list[str], tmp_path: Path) -> None:
    docs = template(helm, EXAMPLE, tmp_path)
    certs = _spec_of(docs, "Certificate")
    ctrl, router, agent = (
        certs[f"{RELEASE}-kvgrid-{r}-tls"]["spec"] for r in ("controller", "router", "agent")
    )
    assert ctrl["uris"] == [f"{SPIFFE}/controller"]
    assert router["uris"] == [f"{SPIFFE}/router"]
    assert agent["uris"] == [f"{SPIFFE}/agent"]
    # The services verify these DNS names whatever address they dial (kvgrid.common.tls).
    from kvgrid.common.tls import AGENT_SERVER_NAME, CONTROLLER_SERVER_NAME

    assert CONTROLLER_SERVER_NAME in ctrl["dnsNames"] and AGENT_SERVER_NAME in agent["dnsNames"]
    assert {"server auth", "client auth"} <= set(ctrl["usages"]) and {"server auth", "client auth"} <= set(
        agent["usages"]
    )
    assert "server auth" not in router["usages"] and "client auth" in router["usages"]
    # No issuer given: a self-signed root makes the release's CA, and the CA Issuer signs the roles.
    issuers = _spec_of(docs, "Issuer")
    assert issuers[f"{RELEASE}-kvgrid-selfsigned"]["spec"] == {"selfSigned": {}}
    ca_cert = certs[f"{RELEASE}-kvgrid-ca"]["spec"]
    assert ca_cert["isCA"] is True and ca_cert["issuerRef"]["name"] == f"{RELEASE}-kvgrid-selfsigned"
    assert issuers[f"{RELEASE}-kvgrid-ca"]["spec"] == {"ca": {"secretName": ca_cert["secretName"]}}
    for spec in (ctrl, router, agent):
        assert spec["issuerRef"] == {
            "name": f"{RELEASE}-kvgrid-ca",
            "kind": "Issuer",
            "group": "cert-manager.io",
        }


def test_an_issuer_from_values_signs_everything_and_no_ca_is_made(helm: list[str], tmp_path: Path) -> None:
    ref = {"name": "corp-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}
    docs = template(helm, {"tls": {"certManager": {"issuerRef": ref}}, **EXAMPLE}, tmp_path)
    assert "Issuer" not in {d["kind"] for d in docs}
    certs = _spec_of(docs, "Certificate")
    assert set(certs) == {f"{RELEASE}-kvgrid-{r}-tls" for r in ("controller", "router", "agent")}
    assert all(c["spec"]["issuerRef"] == ref for c in certs.values())


def test_pods_mount_the_secret_layout_and_get_tls_env_the_real_parsers_read(
    helm: list[str], tmp_path: Path
) -> None:
    docs = template(helm, EXAMPLE, tmp_path)
    for pod, name, config_type in (
        (_controller_pod(docs), "controller", ControllerConfig),
        (_engine_pod(docs), "kvgrid-agent", AgentConfig),
    ):
        c = container(pod, name)
        volume = _mounted_volume(pod, c, MOUNT)
        role = "controller" if name == "controller" else "agent"
        assert volume["secret"]["secretName"] == f"{RELEASE}-kvgrid-{role}-tls"
        env = literal_env(c)
        cfg = config_from_args(config_type, _parser_ns(c), env=env)
        assert (cfg.tls_cert_file, cfg.tls_key_file, cfg.tls_ca_file) == (
            f"{MOUNT}/tls.crt",
            f"{MOUNT}/tls.key",
            f"{MOUNT}/ca.crt",
        )
        assert cfg.tls_trust_domain == "cluster.local"
        # With TLS the services listen on the pod's network without the insecure flag.
        assert "--insecure-plaintext-on-network" not in c["args"] and not cfg.insecure_plaintext_on_network
    # Rotation is in place (the services reload the files): no checksum annotation restarts pods.
    annotations = find(docs, "Deployment", f"{RELEASE}-kvgrid-controller")["spec"]["template"]["metadata"][
        "annotations"
    ]
    assert not [k for k in annotations if "tls" in k or "cert" in k]


def _parser_ns(c: dict[str, Any]) -> Any:
    from kvgrid import cli

    args = [str(a) for a in c["args"]]
    args = [a for a in args if not a.startswith("--config=")]
    return cli.build_parser(args).parse_args(args)


def test_per_pod_identities_use_csi_volumes_with_the_pod_uid(helm: list[str], tmp_path: Path) -> None:
    values = {"tls": {"agentIdentity": "perPod"}, **EXAMPLE}
    docs = template(helm, values, tmp_path)
    for doc in docs:
        validate(doc)
    assert f"{RELEASE}-kvgrid-agent-tls" not in _spec_of(docs, "Certificate")  # no shared agent cert
    pod = _engine_pod(docs)
    volume = _mounted_volume(pod, container(pod, "kvgrid-agent"), MOUNT)
    attrs = volume["csi"]["volumeAttributes"]
    assert volume["csi"]["driver"] == "csi.cert-manager.io"
    assert attrs["csi.cert-manager.io/uri-sans"] == f"{SPIFFE}/agent/pod/${{POD_UID}}"
    assert attrs["csi.cert-manager.io/issuer-name"] == f"{RELEASE}-kvgrid-ca"
    # The same file names as a cert-manager Secret, which the KVGRID_TLS_* env names.
    files = [attrs[f"csi.cert-manager.io/{k}"] for k in ("certificate-file", "privatekey-file", "ca-file")]
    assert files == ["tls.crt", "tls.key", "ca.crt"]


# --- failures with clear messages -----------------------------------------------------------------

_SECRETS = {"provider": "existingSecrets", "existingSecrets": {"controller": "c", "agent": "a"}}
FAILING: list[tuple[dict[str, Any], bool, str]] = [
    ({"tls": {"agentIdentity": "perPod"}},
     False, 'got tls provider "helm"'),  # auto without cert-manager: the chart's CA has no per-pod form
    ({"tls": {"agentIdentity": "perPod", **_SECRETS}},
     True, "tls.agentIdentity=perPod needs certificates from cert-manager's csi-driver"),
    ({"tls": {"provider": "existingSecrets", "existingSecrets": {"controller": "c"}}},
     True, "tls.provider=existingSecrets needs tls.existingSecrets.agent"),
    ({"tls": {"agentIdentity": "shared"}},
     True, "tls.agentIdentity=shared is no longer a choice: one shared agent certificate lets any agent pod "
           "register, heartbeat and publish as any other pod. Expected podToken"),
    ({"tls": {"podToken": {"expirationSeconds": 60}}}, True, "/tls/podToken/expirationSeconds"),
]  # fmt: skip


@pytest.mark.parametrize(("values", "crds", "message"), FAILING, ids=[m for _, _, m in FAILING])
def test_tls_settings_that_cannot_work_fail_with_what_to_do(
    helm: list[str], tmp_path: Path, values: dict[str, Any], crds: bool, message: str
) -> None:
    crd_args = ["--api-versions", "cert-manager.io/v1"] if crds else []
    proc = run(
        [*helm, "template", RELEASE, str(CHART), "-n", NAMESPACE, *crd_args, *values_args(values, tmp_path)]
    )
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr


def test_existing_secrets_are_mounted_as_given(helm: list[str], tmp_path: Path) -> None:
    values = {
        "tls": {
            "provider": "existingSecrets",
            "existingSecrets": {"controller": "my-ctrl", "agent": "my-agent"},
        }
    }
    docs = template(helm, {**values, **EXAMPLE}, tmp_path, crds=False)
    assert not [d for d in docs if d["kind"] in ("Certificate", "Issuer")]
    ctrl, engine = _controller_pod(docs), _engine_pod(docs)
    assert _mounted_volume(ctrl, container(ctrl, "controller"), MOUNT)["secret"]["secretName"] == "my-ctrl"
    assert (
        _mounted_volume(engine, container(engine, "kvgrid-agent"), MOUNT)["secret"]["secretName"]
        == "my-agent"
    )


def test_tls_off_renders_the_plaintext_setup_and_warns(helm: list[str], tmp_path: Path) -> None:
    values = {"tls": {"enabled": False}, **EXAMPLE}
    docs = template(helm, values, tmp_path, crds=False)
    assert not [d for d in docs if d["kind"] in ("Certificate", "Issuer")]
    for pod, name, port in (
        (_controller_pod(docs), "controller", 50061),
        (_engine_pod(docs), "kvgrid-agent", 50062),
    ):
        c = container(pod, name)
        assert not [e for e in c.get("env", []) if e["name"].startswith("KVGRID_TLS_")]
        assert MOUNT not in [m["mountPath"] for m in c["volumeMounts"]]
        assert c["readinessProbe"]["grpc"] == {"port": port}  # plaintext: gRPC health on the service port
        assert not [a for a in c["args"] if a.startswith("--health-port")]
        # Without TLS a service listens on the network only when told so explicitly (docs/security.md).
        assert "--insecure-plaintext-on-network" in c["args"]
        config_type = ControllerConfig if name == "controller" else AgentConfig
        cfg = config_from_args(config_type, _parser_ns(c), env=literal_env(c))
        assert cfg.tls is None and cfg.insecure_plaintext_on_network
        if isinstance(cfg, AgentConfig):
            assert cfg.listen_host == "0.0.0.0"
        else:
            assert cfg.listen == f"0.0.0.0:{port}"
    # NOTES.txt (printed by helm install) carries the warning.
    proc = run(
        [
            *helm,
            "install",
            RELEASE,
            str(CHART),
            "-n",
            NAMESPACE,
            "--dry-run=client",
            *values_args(values, tmp_path),
        ]
    )
    assert proc.returncode == 0, proc.stderr
    assert "WARNING: tls.enabled=false" in proc.stdout
    secrets = {"tls": {"provider": "existingSecrets", "existingSecrets": {"controller": "c", "agent": "a"}}}
    on = run(
        [
            *helm,
            "install",
            RELEASE,
            str(CHART),
            "-n",
            NAMESPACE,
            "--dry-run=client",
            *values_args(secrets, tmp_path),
        ]
    )
    assert on.returncode == 0, on.stderr
    assert "WARNING: tls.enabled=false" not in on.stdout and "mutual TLS" in on.stdout


# --- the rendered setup against the real services -------------------------------------------------


def _expand_k8s(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of an env value from earlier entries."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), value)


def _pod_env(c: dict[str, Any], pod: dict[str, str], files: Path) -> dict[str, str]:
    """The container's env as Kubernetes would set it for ``pod`` (downward API + $(VAR)), with the
    certificate mount moved to ``files``."""
    field = {
        "metadata.uid": pod["POD_UID"],
        "metadata.name": pod["POD_NAME"],
        "metadata.namespace": NAMESPACE,
    }
    field |= {"spec.nodeName": "node-1", "status.podIP": "127.0.0.1"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGRID_")}
    for e in c["env"]:
        if "value" in e:
            env[e["name"]] = _expand_k8s(str(e["value"]), env).replace(MOUNT, str(files))
        elif "fieldRef" in e.get("valueFrom", {}):
            env[e["name"]] = field[e["valueFrom"]["fieldRef"]["fieldPath"]]
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    return env


@contextmanager
def _process(cmd: list[str], env: dict[str, str]) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _channel(address: str, files: Path) -> grpc.Channel:
    creds = grpc.ssl_channel_credentials(
        (files / "ca.crt").read_bytes(), (files / "tls.key").read_bytes(), (files / "tls.crt").read_bytes()
    )
    return grpc.secure_channel(
        address, creds, options=[("grpc.ssl_target_name_override", "kvgrid-controller")]
    )


def _registered_pods(address: str, router_files: Path) -> set[str]:
    with _channel(address, router_files) as ch:
        stub = controller_pb2_grpc.ControllerServiceStub(ch)
        try:
            resp = stub.ListAgents(controller_pb2.ListAgentsRequest(), timeout=5)
        except grpc.RpcError:
            return set()
        return {a.pod.pod_uid for a in resp.agents}


def _run_rendered(
    docs: list[dict[str, Any]],
    tmp_path: Path,
    free_port: Callable[[], int],
    ca: TestCA | None,
    pod_uid: str,
    *,
    certs: dict[str, Path] | None = None,
    while_running: Callable[[str, dict[str, Path]], None] | None = None,
) -> set[str]:
    """Controller + every agent sidecar of the engine pod, run with the rendered TLS env and
    certificates signed from the rendered requests by ``ca`` (or ``certs``: Secret name -> directory
    of its files); returns the pod UIDs that registered. ``while_running(address, certs)`` runs once
    they have."""
    if certs is None:
        assert ca is not None
        certs = {
            d["spec"]["secretName"]: sign_certificate(ca, d, tmp_path / "secrets")
            for d in docs
            if d["kind"] == "Certificate"
        }
    address = f"127.0.0.1:{free_port()}"
    ctrl_pod = _controller_pod(docs)
    ctrl = container(ctrl_pod, "controller")
    ctrl_files = certs[_mounted_volume(ctrl_pod, ctrl, MOUNT)["secret"]["secretName"]]
    ctrl_env = _pod_env(ctrl, {"POD_UID": "ctrl-uid", "POD_NAME": "ctrl-0"}, ctrl_files)
    engine = _engine_pod(docs)
    sidecars = [c for c in engine["initContainers"] if c["name"].startswith("kvgrid-agent")]
    # The kubelet probes the port the rendered probe names; it is the rendered --health-port.
    probe_port = ctrl["readinessProbe"]["grpc"]["port"]
    assert f"--health-port={probe_port}" in ctrl["args"]
    health = f"127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "kvgrid.cli", "controller", "--listen", address, "--log-level", "WARNING"]
    # The rendered agent identity mode (--agent-pod-proof and its token settings), as rendered.
    cmd += [str(a) for a in ctrl["args"] if str(a).startswith("--agent-")]
    with ExitStack() as stack:
        kube = None
        if "--agent-pod-proof=token" in ctrl["args"]:
            kube = stack.enter_context(_in_cluster_api(ctrl_pod, ctrl_env, tmp_path / "kube"))
            kube.add_pod(NAMESPACE, "engine-0", "default", uid=pod_uid)
        stack.enter_context(_process([*cmd, "--health-port", health.rpartition(":")[2]], ctrl_env))
        router_files = certs[f"{RELEASE}-kvgrid-router-tls"]
        wait_for("the controller serving mTLS", lambda: _serving(address, router_files), 60)
        assert _plaintext_health(health) == health_pb2.HealthCheckResponse.SERVING  # what the kubelet sees
        with pytest.raises(grpc.RpcError):  # while the service port wants a client certificate
            _plaintext_health(address)
        with _agents(sidecars, engine, tmp_path, certs, ca, pod_uid, address, kube) as expected:
            wait_for("the agents registered", lambda: _registered_pods(address, router_files) >= expected, 30)
            if while_running is not None:
                while_running(address, certs)
            return _registered_pods(address, router_files)


@contextmanager
def _in_cluster_api(ctrl_pod: dict[str, Any], env: dict[str, str], tmp: Path) -> Iterator[KubeTokens]:
    """What a pod with the rendered ServiceAccount gets in a cluster, for the controller's TokenReviews:
    the API server's address in KUBERNETES_SERVICE_HOST/PORT (the stand-in of
    tests/security/kube_tokens.py) and its mounted ServiceAccount token and the cluster CA (moved
    from /var/run/secrets/kubernetes.io/serviceaccount, which the test cannot write, by env)."""
    assert ctrl_pod["automountServiceAccountToken"] is True
    assert ctrl_pod["serviceAccountName"] == f"{RELEASE}-kvgrid-controller"
    with kube_tokens(tmp, TestCA("cluster CA")) as (kube, url, ca_file):
        kube.allow_reviewer("controller-sa-token")
        (tmp / "token").write_text("controller-sa-token")
        host, _, port = url.removeprefix("https://").rpartition(":")
        env |= {"KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": port}
        env |= {"KVGRID_KUBE_API_TOKEN_FILE": str(tmp / "token"), "KVGRID_KUBE_API_CA_FILE": str(ca_file)}
        yield kube


def _pod_token_mount(pod: dict[str, Any], c: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """(mount path, serviceAccountToken source) of the container's projected pod-token volume."""
    for m in c["volumeMounts"]:
        (volume,) = [v for v in pod["volumes"] if v["name"] == m["name"]]
        for source in volume.get("projected", {}).get("sources", []):
            if "serviceAccountToken" in source:
                return m["mountPath"], source["serviceAccountToken"]
    return None


def _plaintext_health(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return int(health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status)


def _serving(address: str, files: Path) -> bool:
    with _channel(address, files) as ch:
        try:
            controller_pb2_grpc.ControllerServiceStub(ch).GetStats(
                controller_pb2.GetStatsRequest(), timeout=2
            )
            return True
        except grpc.RpcError:
            return False


@contextmanager
def _agents(
    sidecars: list[dict[str, Any]],
    pod: dict[str, Any],
    tmp_path: Path,
    certs: dict[str, Path],
    ca: TestCA | None,
    pod_uid: str,
    address: str,
    kube: KubeTokens | None = None,
) -> Iterator[set[str]]:
    procs: list[subprocess.Popen[str]] = []
    expected: set[str] = set()
    try:
        for i, c in enumerate(sidecars):
            volume = _mounted_volume(pod, c, MOUNT)
            if "csi" in volume:  # what the csi-driver issues for this pod
                assert ca is not None
                files = sign_csi_volume(
                    ca,
                    volume,
                    {"POD_UID": pod_uid, "POD_NAME": "engine-0", "POD_NAMESPACE": NAMESPACE},
                    tmp_path / f"csi-{i}",
                )
            else:
                files = certs[volume["secret"]["secretName"]]
            env = _pod_env(c, {"POD_UID": pod_uid, "POD_NAME": "engine-0"}, files)
            expected.add(env["POD_UID"])
            d = tmp_path / f"agent-{i}"
            d.mkdir()
            token = _pod_token_mount(pod, c)
            if token is not None:  # what the kubelet writes into the projected volume
                assert kube is not None, "the agent mounts a pod token but the controller verifies none"
                path, source = token
                (d / "pod-token").mkdir()
                (d / "pod-token" / source["path"]).write_text(
                    kube.token(NAMESPACE, "engine-0", source["audience"], source["expirationSeconds"])
                )
                env = {k: v.replace(path, str(d / "pod-token")) for k, v in env.items()}
            cmd = [
                sys.executable, "-m", "kvgrid.cli", "agent", "--uds-path", str(d / "agent.sock"),
                "--tcp-host", "127.0.0.1", "--tcp-port", "0", "--l1-size", "8MiB", "--l1-page-size", "4KiB",
                "--controller-address", address, "--heartbeat-interval-ms", "200", "--log-level", "warning",
            ]  # fmt: skip
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
            assert procs[-1].stdout is not None
            line = procs[-1].stdout.readline()
            assert json.loads(line)["event"] == "serving", line
        yield expected
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:  # a stop waits up to ~7 s for its publisher and server
                p.kill()
                p.wait()


def test_rendered_default_identity_setup_registers_over_mtls_as_its_pod_only(
    helm: list[str], tmp_path: Path, free_port: Callable[[], int]
) -> None:
    """The default (podToken): the shared agent certificate plus the pod's projected token, verified
    by the rendered controller (TokenReview with its own ServiceAccount). A holder of the shared
    certificate and this pod's token still cannot register another pod, nor anyone without a token."""
    docs = template(helm, EXAMPLE, tmp_path)
    seen: dict[str, str] = {}

    def attack(address: str, certs: dict[str, Path]) -> None:
        token = next(tmp_path.glob("agent-0/pod-token/token")).read_text()
        with _channel(address, certs[f"{RELEASE}-kvgrid-agent-tls"]) as ch:
            stub = controller_pb2_grpc.ControllerServiceStub(ch)
            for name, metadata in (("other pod", [("authorization", f"Bearer {token}")]), ("no token", None)):
                req = controller_pb2.RegisterAgentRequest(
                    pod=common_pb2.PodIdentity(pod_uid="uid-other", epoch=1)
                )
                with pytest.raises(grpc.RpcError) as err:
                    stub.RegisterAgent(req, timeout=10, metadata=metadata)
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
                seen[name] = err.value.details() or ""

    assert _run_rendered(docs, tmp_path, free_port, TestCA(), "uid-1", while_running=attack) == {"uid-1"}
    assert (
        "'uid-other'" in seen["other pod"]
        and f"ServiceAccount token of pod {NAMESPACE}/engine-0" in seen["other pod"]
    )
    assert "sent no pod token" in seen["no token"]


def test_rendered_per_gpu_sidecars_share_the_pods_token(
    helm: list[str], tmp_path: Path, free_port: Callable[[], int]
) -> None:
    """Two sidecars (TP=2) with the shared certificate and the pod's one token register as
    <pod uid>-gpu0 and -gpu1: the token proves the pod, the suffix names the GPU."""
    values = {
        "agent": {"sidecarsPerPod": 2},
        "examples": {"vllm": {"enabled": True, "gpus": 2, "extraArgs": ["--tensor-parallel-size", "2"]}},
    }
    docs = template(helm, values, tmp_path)
    assert _run_rendered(docs, tmp_path, free_port, TestCA(), "uid-8") == {"uid-8-gpu0", "uid-8-gpu1"}


def test_rendered_explicit_shared_certificate_setup_still_registers(
    helm: list[str], tmp_path: Path, free_port: Callable[[], int]
) -> None:
    values = {"tls": {"agentIdentity": "sharedCertificateUnverified"}, **EXAMPLE}
    docs = template(helm, values, tmp_path)
    assert "--agent-pod-proof=unverified" in container(_controller_pod(docs), "controller")["args"]
    assert _pod_token_mount(_engine_pod(docs), container(_engine_pod(docs), "kvgrid-agent")) is None
    assert _run_rendered(docs, tmp_path, free_port, TestCA(), "uid-2") == {"uid-2"}


def test_the_unverified_shared_certificate_is_a_loud_explicit_choice(helm: list[str], tmp_path: Path) -> None:
    """Not the default; when chosen, the install notes warn what it gives away."""
    notes = {}
    for mode in ("podToken", "sharedCertificateUnverified"):
        values = {} if mode == "podToken" else {"tls": {"agentIdentity": mode}}
        proc = run(
            [
                *helm,
                "install",
                RELEASE,
                str(CHART),
                "-n",
                NAMESPACE,
                "--dry-run=client",
                *values_args(values, tmp_path),
            ]
        )
        assert proc.returncode == 0, proc.stderr
        notes[mode] = proc.stdout
    assert "WARNING: tls.agentIdentity=sharedCertificateUnverified" in notes["sharedCertificateUnverified"]
    assert (
        "any agent pod can register, heartbeat and publish as any other"
        in notes["sharedCertificateUnverified"]
    )
    assert "WARNING: tls.agentIdentity" not in notes["podToken"]
    assert "Agents prove their pod with a projected ServiceAccount token" in notes["podToken"]


def test_the_pod_token_volume_is_the_sidecars_alone(helm: list[str], tmp_path: Path) -> None:
    """A projected ServiceAccount token of tls.podToken's audience and lifetime, group-readable
    (tls.fsGroup) and read-only in every agent sidecar, named by the env the real parser reads; the
    engine container does not mount it; the controller is told the same audience."""
    values = {"tls": {"podToken": {"audience": "kv-prod", "expirationSeconds": 900, "cacheMs": 5000}}}
    docs = template(
        helm,
        {**values, "agent": {"sidecarsPerPod": 2}, "examples": {"vllm": {"enabled": True, "gpus": 2}}},
        tmp_path,
    )
    pod = _engine_pod(docs)
    for name in ("kvgrid-agent-0", "kvgrid-agent-1"):
        c = container(pod, name)
        found = _pod_token_mount(pod, c)
        assert found is not None
        path, source = found
        assert source == {"audience": "kv-prod", "expirationSeconds": 900, "path": "token"}
        (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == path]
        assert mount["readOnly"] is True
        (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        assert volume["projected"]["defaultMode"] == 0o440
        cfg = config_from_args(AgentConfig, _parser_ns(c), env=literal_env(c))
        assert cfg.controller_token_file == f"{path}/token"
        assert cfg.tls is not None and cfg.tls.controller_token_file == f"{path}/token"
    assert _pod_token_mount(pod, container(pod, "vllm")) is None
    ctrl = container(_controller_pod(docs), "controller")
    cfg = config_from_args(ControllerConfig, _parser_ns(ctrl), env=literal_env(ctrl))
    assert (cfg.agent_pod_proof, cfg.agent_token_audience, cfg.agent_token_cache_ms) == (
        "token",
        "kv-prod",
        5000,
    )


def test_rendered_per_gpu_per_pod_identities_register_over_mtls(
    helm: list[str], tmp_path: Path, free_port: Callable[[], int]
) -> None:
    """Two sidecars (TP=2), each with its csi-driver certificate proving <pod uid>-gpu<i>: the
    controller accepts each only for the pod UID its certificate proves."""
    values = {
        "tls": {"agentIdentity": "perPod"},
        "agent": {"sidecarsPerPod": 2},
        "examples": {"vllm": {"enabled": True, "gpus": 2, "extraArgs": ["--tensor-parallel-size", "2"]}},
    }
    docs = template(helm, values, tmp_path)
    assert _run_rendered(docs, tmp_path, free_port, TestCA(), "uid-7") == {"uid-7-gpu0", "uid-7-gpu1"}


def test_the_trust_domain_reaches_every_identity_and_service(helm: list[str], tmp_path: Path) -> None:
    values = {"tls": {"trustDomain": "prod.example", "agentIdentity": "perPod"}, **EXAMPLE}
    docs = template(helm, values, tmp_path)
    uris = [u for d in docs if d["kind"] == "Certificate" for u in d["spec"].get("uris", [])]
    pod = _engine_pod(docs)
    csi = _mounted_volume(pod, container(pod, "kvgrid-agent"), MOUNT)["csi"]["volumeAttributes"]
    uris.append(csi["csi.cert-manager.io/uri-sans"])
    assert len(uris) == 3 and all(u.startswith(f"spiffe://prod.example/ns/{NAMESPACE}/role/") for u in uris)
    for p, name in ((_controller_pod(docs), "controller"), (pod, "kvgrid-agent")):
        assert literal_env(container(p, name))["KVGRID_TLS_TRUST_DOMAIN"] == "prod.example"


def test_a_bad_trust_domain_is_refused(helm: list[str], tmp_path: Path) -> None:
    proc = run([*helm, "template", RELEASE, str(CHART), "--set", "tls.trustDomain=Prod/Example"])
    assert proc.returncode != 0 and "/tls/trustDomain" in proc.stderr, proc.stderr
