"""The controller's lean lookup listener as the chart deploys it, against real processes.

The chart renders ``--lookup-port`` (mTLS, since TLS is on by default), a container port, Service
ports and a NetworkPolicy rule letting routers (only) reach it. The end-to-end test runs ``kvgrid
controller`` with exactly the rendered args and env (only the port numbers moved to free ones) and
certificates signed from the rendered Certificate specs, registers a pod the way an agent does (its
snapshot pulled over mTLS), and then checks that:

- a router (``PodRanker`` and ``kvgrid router``) with the chart's router certificate gets the same
  answers over the listener as over gRPC, byte for byte for the raw messages;
- a client without a certificate or with one from another CA is refused during the TLS handshake
  (the connection is closed before any frame is read), and a certificate of our CA whose identity
  the controller does not accept (another namespace) gets PERMISSION_DENIED frames carrying the
  text gRPC sends that caller.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from kvgrid.api.v1 import common_pb2, controller_pb2, controller_pb2_grpc
from kvgrid.client import PodRanker
from kvgrid.common.hashing import KeyNamespace, chunk_keys
from kvgrid.common.tls import CONTROLLER_SERVER_NAME, TlsFiles
from kvgrid.common.wire import key_namespace_to_proto
from kvgrid.controller.lookup_server import (
    METHOD_MATCH,
    METHOD_SCORE,
    ClientSsl,
    LookupClient,
    LookupFailed,
    LookupUnavailable,
)
from tests.agent.helpers import wait_for
from tests.deploy.chart import NAMESPACE, RELEASE, container, find, template
from tests.deploy.issuer import sign_certificate
from tests.deploy.netpol import Pod, ingress_allowed
from tests.deploy.test_tls import MOUNT, _in_cluster_api, _mounted_volume, _pod_env
from tests.security.conftest import SnapshotAgent, channel_as, tls_flags
from tests.security.pki import TestCA, spiffe

NS = KeyNamespace(model="m", tokens_per_chunk=16, kv_identity="x")
TOKENS = list(range(16 * 6 + 5))  # 6 full chunks
SVC = "/kvgrid.v1.ControllerService/"
LOOKUP_PORT = 50070  # the chart's default controller.lookupPort


def _files(d: Path) -> TlsFiles:
    return TlsFiles(str(d / "tls.crt"), str(d / "tls.key"), str(d / "ca.crt"))


# --- what the chart renders ------------------------------------------------------------------------


def test_chart_exposes_the_lookup_port_to_routers_only(helm: list[str], tmp_path: Path) -> None:
    docs = template(helm, {}, tmp_path)
    pod = find(docs, "Deployment", f"{RELEASE}-kvgrid-controller")["spec"]["template"]["spec"]
    c = container(pod, "controller")
    assert f"--lookup-port={LOOKUP_PORT}" in c["args"]
    assert {"name": "lookup", "containerPort": LOOKUP_PORT, "protocol": "TCP"} in c["ports"]
    for name in (f"{RELEASE}-kvgrid-controller", f"{RELEASE}-kvgrid-controllers"):
        ports = find(docs, "Service", name)["spec"]["ports"]
        assert {"name": "lookup", "port": LOOKUP_PORT, "targetPort": "lookup", "protocol": "TCP"} in ports
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    controller = Pod("controller", NAMESPACE, find(docs, "Deployment", f"{RELEASE}-kvgrid-controller")[
        "spec"]["template"]["metadata"]["labels"])  # fmt: skip
    router = Pod("router", NAMESPACE, {"kvgrid.io/router": "true"})
    stranger = Pod("stranger", NAMESPACE, {"app": "something-else"})
    assert ingress_allowed(policies, router, controller, LOOKUP_PORT)
    assert not ingress_allowed(policies, stranger, controller, LOOKUP_PORT)


def test_chart_lookup_port_zero_turns_it_off(helm: list[str], tmp_path: Path) -> None:
    docs = template(helm, {"controller": {"lookupPort": 0}}, tmp_path)
    c = container(find(docs, "Deployment", f"{RELEASE}-kvgrid-controller")["spec"]["template"]["spec"],
                  "controller")  # fmt: skip
    assert "--lookup-port=0" in c["args"]
    assert "lookup" not in {p["name"] for p in c["ports"]}
    ports = find(docs, "Service", f"{RELEASE}-kvgrid-controller")["spec"]["ports"]
    assert "lookup" not in {p["name"] for p in ports}


# --- the rendered controller, for real ---------------------------------------------------------------


class Running:
    def __init__(self, grpc_address: str, lookup_address: str, certs: dict[str, Path], ca: TestCA) -> None:
        self.grpc, self.lookup, self.certs, self.ca = grpc_address, lookup_address, certs, ca

    @property
    def router(self) -> Path:
        return self.certs[f"{RELEASE}-kvgrid-router-tls"]


def _moved(args: list[str], ports: dict[str, int]) -> list[str]:
    """The rendered args with each ``--<flag>=<port>`` of ``ports`` on a free port instead."""
    out = []
    for a in args:
        flag = a.partition("=")[0]
        if flag == "--listen":
            a = f"--listen=0.0.0.0:{ports['--listen']}"  # the chart binds every interface
        elif flag in ports:
            a = f"{flag}={ports[flag]}"
        out.append(a)
    return out


@pytest.fixture(scope="module")
def rendered(
    helm: list[str], tmp_path_factory: pytest.TempPathFactory, free_port: Callable[[], int]
) -> Iterator[Running]:
    tmp = tmp_path_factory.mktemp("lookup-chart")
    docs = template(helm, {}, tmp)
    ca = TestCA()
    certs = {
        d["spec"]["secretName"]: sign_certificate(ca, d, tmp / "secrets")
        for d in docs
        if d["kind"] == "Certificate"
    }
    pod = find(docs, "Deployment", f"{RELEASE}-kvgrid-controller")["spec"]["template"]["spec"]
    c = container(pod, "controller")
    files = certs[_mounted_volume(pod, c, MOUNT)["secret"]["secretName"]]
    env = _pod_env(c, {"POD_UID": "ctrl-uid", "POD_NAME": "ctrl-0"}, files)
    ports = {f: free_port() for f in ("--listen", "--health-port", "--lookup-port", "--prometheus-port")}
    args = _moved(list(c["args"]), ports)
    assert c["command"] == ["kvgrid"] and args[0] == "controller"
    # The default agent identity (podToken): agents register with their pod's ServiceAccount token,
    # which the controller verifies with the API server (a stand-in, tests/security/kube_tokens.py).
    kube_api = _in_cluster_api(pod, env, tmp / "kube")
    kube = kube_api.__enter__()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvgrid.cli", *args], env=env, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    agents: list[SnapshotAgent] = []
    try:
        line = proc.stdout.readline()
        assert f"lookup listener on 0.0.0.0:{ports['--lookup-port']} (mTLS)" in line, line
        run = Running(f"127.0.0.1:{ports['--listen']}", f"127.0.0.1:{ports['--lookup-port']}", certs, ca)
        # One pod registered as an agent does: RegisterAgent with the chart's agent certificate, then
        # the controller pulls its snapshot over mTLS.
        agent_files = certs[f"{RELEASE}-kvgrid-agent-tls"]
        for uid, n in (("pod-a", 6), ("pod-b", 2)):
            agent = SnapshotAgent(agent_files, uid, 1, chunk_keys(TOKENS, NS)[:n], NS.namespace_id())
            agents.append(agent)
            kube.add_pod(NAMESPACE, uid, uid=uid)
            token = kube.token(NAMESPACE, uid)
            with channel_as(run.grpc, agent_files, CONTROLLER_SERVER_NAME) as ch:
                stub = controller_pb2_grpc.ControllerServiceStub(ch)
                wait_for(
                    "the controller answering agents", lambda s=stub, a=agent, t=token: _register(s, a, t), 60
                )
        with channel_as(run.grpc, run.router, CONTROLLER_SERVER_NAME) as ch:
            stub = controller_pb2_grpc.ControllerServiceStub(ch)
            wait_for(
                "both snapshots indexed", lambda: len(stub.MatchPrefix(_match(), timeout=5).matches) == 2, 30
            )
        yield run
    finally:
        proc.terminate()
        proc.wait(15)
        for a in agents:
            a.server.stop(0)
        kube_api.__exit__(None, None, None)


def _register(stub: controller_pb2_grpc.ControllerServiceStub, agent: SnapshotAgent, token: str) -> bool:
    try:
        stub.RegisterAgent(
            controller_pb2.RegisterAgentRequest(pod=agent.pod, namespaces=[NS.namespace_id()]),
            timeout=5,
            metadata=[("authorization", f"Bearer {token}")],
        )
        return True
    except grpc.RpcError:
        return False


def _match() -> controller_pb2.MatchPrefixRequest:
    return controller_pb2.MatchPrefixRequest(
        token_ids=common_pb2.TokenIds(ids=TOKENS), namespace=key_namespace_to_proto(NS)
    )


def test_raw_answers_are_byte_identical_to_grpc(rendered: Running) -> None:
    client = LookupClient(rendered.lookup, ssl_context=ClientSsl(_files(rendered.router)).context())
    with channel_as(rendered.grpc, rendered.router, CONTROLLER_SERVER_NAME) as ch:
        for method, path, body in (
            (METHOD_MATCH, "MatchPrefix", _match().SerializeToString()),
            (METHOD_SCORE, "Score", controller_pb2.ScoreRequest(match=_match()).SerializeToString()),
        ):
            want = ch.unary_unary(SVC + path)(body, timeout=5)
            assert client.call_raw(method, body) == want
    assert [m.pod_uid for m in client.match(_match()).matches] == ["pod-a", "pod-b"]
    client.close()


def test_pod_ranker_gets_the_same_ranking_over_the_listener(
    rendered: Running, free_port: Callable[[], int]
) -> None:
    tls = tls_flags(rendered.router)
    over_grpc = PodRanker(rendered.grpc, NS, timeout_s=5, **tls)
    # Its gRPC address is closed: only the listener can answer it.
    closed = f"127.0.0.1:{free_port()}"
    over_lookup = PodRanker(closed, NS, timeout_s=5, lookup_address=rendered.lookup, **tls)
    try:
        a, b = over_grpc.rank(TOKENS), over_lookup.rank(TOKENS)
        assert (b.source, b.error) == ("score", "")
        assert a == b
        assert [(r.pod.pod_uid, r.l1_chunks) for r in b.pods] == [("pod-a", 6), ("pod-b", 2)]
        assert over_grpc.pods() == over_lookup.pods()  # ListAgents, the same way
    finally:
        over_grpc.close()
        over_lookup.close()


def test_kvgrid_router_uses_the_listener(rendered: Running, free_port: Callable[[], int]) -> None:
    """``kvgrid router --lookup-address``: its pod list comes through the listener (the gRPC address
    given is closed, so gRPC could not have answered)."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "kvgrid.cli", "router", "--host", "127.0.0.1", "--port", str(port),
        "--controller", f"127.0.0.1:{free_port()}", "--lookup-address", rendered.lookup,
        "--model-name", "m", "--log-level", "WARNING",
        *(f"--{k.replace('_', '-')}={v}" for k, v in tls_flags(rendered.router).items()),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    try:
        line = proc.stdout.readline()
        assert f"via its lookup listener {rendered.lookup}, 2 pods known" in line, line
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
            health = json.load(r)
        # (both test pods have their agent on 127.0.0.1: one engine URL, one routable target)
        assert (health["status"], health["controller"], health["pods"]) == ("ok", "ok", 1)
    finally:
        proc.terminate()
        proc.wait(15)


@contextmanager
def _refused_client(rendered: Running, who: Path | None) -> Iterator[Callable[[], object]]:
    import ssl

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(cafile=str(rendered.router / "ca.crt"))
    if who is not None:
        ctx.load_cert_chain(who / "tls.crt", who / "tls.key")

    def call() -> object:
        c = LookupClient(rendered.lookup, ssl_context=ctx)
        try:
            return c.match(_match())
        finally:
            c.close()

    yield call


@pytest.mark.parametrize("who", ["no certificate", "another CA"])
def test_no_or_foreign_certificate_is_refused_at_the_handshake(
    rendered: Running, tmp_path: Path, who: str
) -> None:
    d = (
        None
        if who == "no certificate"
        else TestCA("other").write(tmp_path / "x", spiffe("router", ns=NAMESPACE))
    )
    with _refused_client(rendered, d) as call, pytest.raises(LookupUnavailable) as err:
        call()
    assert (
        "closed the connection before its first answer: it refuses a client certificate its CA did not sign"
        in (err.value.detail)
    )


def test_identity_of_another_namespace_is_permission_denied(rendered: Running, tmp_path: Path) -> None:
    d = rendered.ca.write(tmp_path / "theirs", spiffe("router", ns="someone-else"))
    with _refused_client(rendered, d) as call, pytest.raises(LookupFailed) as err:
        call()
    assert not isinstance(err.value, LookupUnavailable)
    with channel_as(rendered.grpc, d, CONTROLLER_SERVER_NAME) as ch, pytest.raises(grpc.RpcError) as grpc_err:
        controller_pb2_grpc.ControllerServiceStub(ch).MatchPrefix(_match(), timeout=5)
    assert (err.value.code_name, err.value.detail) == ("PERMISSION_DENIED", grpc_err.value.details())
    assert f"accepts callers of namespace '{NAMESPACE}' only" in err.value.detail
    # A router holding it falls back, naming why.
    ranker = PodRanker(rendered.grpc, NS, timeout_s=5, lookup_address=rendered.lookup, **tls_flags(d))
    try:
        r = ranker.rank(TOKENS)
        assert r.source == "fallback"
        assert r.error.startswith(
            f"controller PERMISSION_DENIED (lookup listener {rendered.lookup}): ListAgents:"
        )
    finally:
        ranker.close()
