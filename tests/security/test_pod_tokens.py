"""Per-pod agent identity from ServiceAccount tokens, against real controller processes with mTLS.

Every agent holds the same shared agent certificate; what tells them apart is the token of their
own pod (a projected ``serviceAccountToken`` volume, audience ``kvgrid``), which the controller
(``--agent-pod-proof token``) verifies through the TokenReview API. The API server here is the
stand-in of :mod:`tests.security.kube_tokens` (tokens and answers as Kubernetes v1.20 makes them);
``test_pod_tokens_kube.py`` runs the same checks against a real kube-apiserver when it is built.

Attacks, each refused with PERMISSION_DENIED naming the pods: pod B's token registering, heartbeating,
publishing (admits and drops) or listing as pod A, or under A's pod name; a token that expired, is
for another audience, of another namespace, signed by another key, of a deleted pod, or no JWT at
all; no token with the shared certificate. The victim keeps its registration and its entries. A
per-pod certificate still needs no token; ``certificate`` mode refuses the shared certificate;
the shared certificate without tokens still works where ``unverified`` is chosen explicitly.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa

from kvgrid.api.v1 import common_pb2, controller_pb2, controller_pb2_grpc
from kvgrid.common.identity import MAX_EPOCH
from kvgrid.common.tls import CONTROLLER_SERVER_NAME
from tests.agent.helpers import start_controller, start_pod_agent, wait_for
from tests.security.conftest import NS_ID, Pki, SnapshotAgent, channel_as
from tests.security.kube_tokens import KubeTokens, kube_tokens, sign_jwt
from tests.security.pki import NAMESPACE, spiffe

Stub = controller_pb2_grpc.ControllerServiceStub
REVIEWER = "controller-sa-token"
"""The controller's own ServiceAccount token (its kube_api_token_file), allowed to review."""


class TokenController:
    """A real ``kvgrid controller`` process with mTLS and ``agent_pod_proof``, and stubs on it."""

    def __init__(self, address: str, proc: subprocess.Popen[bytes], pki: Pki) -> None:
        self.address, self.proc, self.pki = address, proc, pki
        self._channels: list[grpc.Channel] = []

    def stub(self, who: Path) -> Stub:
        ch = channel_as(self.address, who, CONTROLLER_SERVER_NAME, ca=self.pki.ca.pem)
        self._channels.append(ch)
        return Stub(ch)

    def close(self) -> None:
        for ch in self._channels:
            ch.close()
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_token_controller(
    address: str, pki: Pki, mode: str, *, api_url: str = "", ca_file: Path | None = None,
    token_file: Path | None = None, extra: tuple[str, ...] = (), log: Path | None = None,
) -> TokenController:  # fmt: skip
    """A controller process in ``mode`` (token: TokenReviews at ``api_url``), serving once a router
    call succeeds."""
    d = pki.controller()
    env = {
        "KVGRID_TLS_CERT_FILE": str(d / "tls.crt"),
        "KVGRID_TLS_KEY_FILE": str(d / "tls.key"),
        "KVGRID_TLS_CA_FILE": str(d / "ca.crt"),
    }
    flags = ["--agent-pod-proof", mode, "--lease-ttl-ms", "60000", *extra]
    if mode == "token":
        assert ca_file is not None and token_file is not None
        flags += ["--kube-api-url", api_url, "--kube-api-token-file", str(token_file)]
        flags += ["--kube-api-ca-file", str(ca_file)]
    out = open(log, "wb") if log is not None else None  # noqa: SIM115 - the process writes it
    ctl = TokenController(address, start_controller(address, *flags, env=env, stdout=out), pki)
    router = ctl.stub(pki.router())

    def up() -> bool:
        if ctl.proc.poll() is not None:
            raise AssertionError(f"controller exited with {ctl.proc.returncode} ({log and log.read_text()})")
        try:
            router.GetStats(controller_pb2.GetStatsRequest(), timeout=2)
        except grpc.RpcError:
            return False
        return True

    wait_for("the controller serving", up, timeout_s=60)
    return ctl


def bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def register(
    stub: Stub, uid: str, token: str | None, *, name: str = "", epoch: int = 1, address: str = ""
) -> controller_pb2.RegisterAgentResponse:
    pod = common_pb2.PodIdentity(pod_uid=uid, pod_name=name, epoch=epoch, agent_address=address)
    return stub.RegisterAgent(
        controller_pb2.RegisterAgentRequest(pod=pod, namespaces=[NS_ID]),
        timeout=10,
        metadata=bearer(token) if token else None,
    )


def heartbeat(stub: Stub, uid: str, token: str | None, epoch: int = 1) -> controller_pb2.HeartbeatResponse:
    return stub.Heartbeat(
        controller_pb2.HeartbeatRequest(pod_uid=uid, epoch=epoch),
        timeout=10,
        metadata=bearer(token) if token else None,
    )


ADMIT = controller_pb2.EVENT_KIND_ADMIT


def publish(
    stub: Stub, uid: str, token: str | None, keys: list[bytes], *, kind: int = ADMIT,
    name: str = "", epoch: int = 1, sequence: int = 1,
) -> list[controller_pb2.PublishEventsResponse]:  # fmt: skip
    req = controller_pb2.PublishEventsRequest(
        pod=common_pb2.PodIdentity(pod_uid=uid, pod_name=name, epoch=epoch),
        events=[
            controller_pb2.ChunkEvent(
                sequence=sequence, kind=kind, tier=common_pb2.TIER_L1, chunk_keys=keys, namespace=NS_ID
            )
        ],
    )
    return list(stub.PublishEvents(iter([req]), timeout=10, metadata=bearer(token) if token else None))


def match(stub: Stub, keys: list[bytes]) -> dict[str, int]:
    resp = stub.MatchPrefix(
        controller_pb2.MatchPrefixRequest(chunk_keys=common_pb2.ChunkKeys(keys=keys), namespace_id=NS_ID),
        timeout=10,
    )
    return {m.pod_uid: m.l1_chunks for m in resp.matches}


def refused(fn: Callable[[], object]) -> str:
    """The PERMISSION_DENIED text of ``fn()`` (AssertionError naming the code if it was another)."""
    with pytest.raises(grpc.RpcError) as err:
        fn()
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, (err.value.code(), err.value.details())
    return err.value.details() or ""


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[tuple[KubeTokens, str, Path]]:
    with kube_tokens(tmp_path_factory.mktemp("kube"), pki.ca) as (state, url, ca):
        state.allow_reviewer(REVIEWER)
        state.add_pod(NAMESPACE, "vllm-a", "vllm", uid="uid-a")
        state.add_pod(NAMESPACE, "vllm-b", "vllm", uid="uid-b")
        state.add_pod("other-ns", "vllm-c", "vllm", uid="uid-c")
        yield state, url, ca


@pytest.fixture(scope="module")
def reviewer_token(tmp_path_factory: pytest.TempPathFactory) -> Path:
    f = tmp_path_factory.mktemp("sa") / "token"
    f.write_text(REVIEWER)
    return f


@pytest.fixture(scope="module")
def ctl(
    kube: tuple[KubeTokens, str, Path], reviewer_token: Path, pki: Pki, free_port: Callable[[], int],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[TokenController]:  # fmt: skip
    _, url, ca = kube
    log = tmp_path_factory.mktemp("ctl") / "controller.log"
    c = start_token_controller(
        f"127.0.0.1:{free_port()}", pki, "token", api_url=url, ca_file=ca, token_file=reviewer_token, log=log
    )
    yield c
    c.close()


def test_pod_b_cannot_register_heartbeat_publish_drop_or_list_as_pod_a(
    ctl: TokenController, kube: tuple[KubeTokens, str, Path], pki: Pki, request: pytest.FixtureRequest
) -> None:
    state, _, _ = kube
    tok_a, tok_b = state.token(NAMESPACE, "vllm-a"), state.token(NAMESPACE, "vllm-b")
    shared = pki.agent()  # every agent's certificate: "an agent of this namespace"
    a, b, router = ctl.stub(shared), ctl.stub(shared), ctl.stub(pki.router())
    keys = [bytes([7]) * 16, bytes([8]) * 16]
    # The victim: pod A's agent, its snapshot side serving what it holds.
    snap = SnapshotAgent(shared, "uid-a", 5, keys, NS_ID)
    request.addfinalizer(snap.stop)
    register(a, "uid-a", tok_a, name="vllm-a", epoch=5, address=snap.pod.agent_address)
    wait_for("A's snapshot indexed", lambda: match(router, keys) == {"uid-a": 2}, timeout_s=15)
    assert publish(a, "uid-a", tok_a, [bytes([9]) * 16], name="vllm-a", epoch=5, sequence=1)

    for what, attempt in {
        "register (newer epoch)": lambda: register(b, "uid-a", tok_b, name="vllm-a", epoch=MAX_EPOCH),
        "heartbeat": lambda: heartbeat(b, "uid-a", tok_b, epoch=5),
        "publish": lambda: publish(b, "uid-a", tok_b, [bytes([1]) * 16], epoch=5, sequence=2),
        "drop": lambda: publish(
            b, "uid-a", tok_b, keys, kind=controller_pb2.EVENT_KIND_EVICT, epoch=5, sequence=2
        ),
        "clear": lambda: publish(
            b, "uid-a", tok_b, [], kind=controller_pb2.EVENT_KIND_CLEAR, epoch=5, sequence=2
        ),
        "list": lambda: b.SnapshotIndex(
            controller_pb2.SnapshotIndexRequest(pod_uid="uid-a"), timeout=10, metadata=bearer(tok_b)
        ),
        "a fake pod": lambda: register(b, "uid-fake", tok_b, name="vllm-b"),
    }.items():
        text = refused(attempt)
        assert "'uid-b'" in text and ("'uid-a'" in text or "'uid-fake'" in text), (what, text)
        assert f"ServiceAccount token of pod {NAMESPACE}/vllm-b" in text, (what, text)
    # B under its own UID but A's pod name (routers send requests to the pod name): refused too.
    text = refused(lambda: register(b, "uid-b", tok_b, name="vllm-a"))
    assert "'vllm-a'" in text and "'vllm-b'" in text
    # The victim keeps its registration, lease and entries; B may act as itself.
    assert not heartbeat(a, "uid-a", tok_a, epoch=5).reregister
    assert match(router, keys) == {"uid-a": 2}
    agents = {
        x.pod.pod_uid: x.pod for x in router.ListAgents(controller_pb2.ListAgentsRequest(), timeout=5).agents
    }
    assert agents["uid-a"].epoch == 5 and agents["uid-a"].pod_name == "vllm-a"
    assert register(b, "uid-b", tok_b, name="vllm-b").lease_ttl_ms == 60000
    assert not heartbeat(b, "uid-b", tok_b).reregister
    # One pod's sidecars (one agent per GPU) register as <pod uid>-gpu<i> with the pod's token.
    assert register(b, "uid-b-gpu1", tok_b, name="vllm-b").lease_ttl_ms == 60000
    assert "uid-b-gpux" in refused(lambda: register(b, "uid-b-gpux", tok_b, name="vllm-b"))


def test_a_missing_or_malformed_token_is_refused(ctl: TokenController, pki: Pki) -> None:
    shared = ctl.stub(pki.agent())
    text = refused(lambda: register(shared, "uid-a", None, name="vllm-a"))
    assert "sent no pod token" in text and spiffe("agent") in text and "agent_pod_proof=token" in text
    for what, attempt in {
        "heartbeat": lambda: heartbeat(shared, "uid-a", None),
        "publish": lambda: publish(shared, "uid-a", None, [bytes([1]) * 16]),
    }.items():
        assert "sent no pod token" in refused(attempt), what
    text = refused(lambda: register(shared, "uid-a", "not-a-jwt", name="vllm-a"))
    assert "expected a JWT" in text
    text = refused(
        lambda: shared.Heartbeat(
            controller_pb2.HeartbeatRequest(pod_uid="uid-a", epoch=1),
            timeout=10,
            metadata=[("authorization", "Basic dXNlcjpwYXNz")],
        )
    )
    assert "expected 'Bearer <ServiceAccount token>'" in text
    # Reads need no pod: the shared certificate still matches prefixes without a token.
    assert match(shared, [bytes([3]) * 16]) == {}


def test_expired_foreign_audience_other_namespace_and_forged_tokens_are_refused(
    ctl: TokenController, kube: tuple[KubeTokens, str, Path], pki: Pki
) -> None:
    state, _, _ = kube
    shared = ctl.stub(pki.agent())
    forger = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    unbound = state.claims(NAMESPACE, "vllm-a", "kvgrid")
    del unbound["kubernetes.io"]["pod"]  # a ServiceAccount token bound to no pod (e.g. a Secret's)
    cases = {
        "expired": (state.token(NAMESPACE, "vllm-a", now=time.time() - 3600), "expired"),
        "another audience": (state.token(NAMESPACE, "vllm-a", audience="vault"), "audience is ['vault']"),
        "another namespace": (
            state.token("other-ns", "vllm-c"),
            "namespace 'other-ns' (pod 'vllm-c', uid 'uid-c'); the caller's certificate is of "
            f"namespace {NAMESPACE!r}",
        ),
        # The right claims, signed by a key the API server does not know.
        "forged signature": (
            sign_jwt(forger, state.claims(NAMESPACE, "vllm-a", "kvgrid"), kid="forged"),
            "did not authenticate the token: [invalid bearer token",
        ),
        "not bound to a pod": (sign_jwt(state.key, unbound), "not bound to a pod"),
    }
    for what, (token, expected) in cases.items():
        for attempt in (
            lambda t=token: register(shared, "uid-a", t, name="vllm-a"),
            lambda t=token: heartbeat(shared, "uid-a", t),
            lambda t=token: publish(shared, "uid-a", t, [bytes([4]) * 16], name="vllm-a"),
        ):
            text = refused(attempt)
            assert expected in text, (what, text)


def test_a_deleted_pods_token_is_refused(
    kube: tuple[KubeTokens, str, Path], reviewer_token: Path, pki: Pki, free_port: Callable[[], int]
) -> None:
    """The API server checks that the bound pod still exists: a token outliving its pod is refused
    once the verdict cache (here 0: every call is reviewed) no longer holds it."""
    state, url, ca = kube
    state.add_pod(NAMESPACE, "vllm-gone", "vllm", uid="uid-gone")
    token = state.token(NAMESPACE, "vllm-gone")
    c = start_token_controller(
        f"127.0.0.1:{free_port()}", pki, "token", api_url=url, ca_file=ca, token_file=reviewer_token,
        extra=("--agent-token-cache-ms", "0"),
    )  # fmt: skip
    try:
        shared = c.stub(pki.agent())
        register(shared, "uid-gone", token, name="vllm-gone")
        state.delete_pod(NAMESPACE, "vllm-gone")
        assert "Token has been invalidated" in refused(lambda: heartbeat(shared, "uid-gone", token))
    finally:
        c.close()


def test_verdicts_are_cached_and_rotated_tokens_reviewed(
    ctl: TokenController, kube: tuple[KubeTokens, str, Path], pki: Pki
) -> None:
    """A steady agent costs one TokenReview per token per agent_token_cache_ms (30 s by default)."""
    state, _, _ = kube
    state.add_pod(NAMESPACE, "vllm-d", "vllm", uid="uid-d")
    shared = ctl.stub(pki.agent())
    token = state.token(NAMESPACE, "vllm-d")
    register(shared, "uid-d", token, name="vllm-d")
    for _ in range(20):
        heartbeat(shared, "uid-d", token)
    assert state.reviewed.count(token) == 1
    rotated = state.token(NAMESPACE, "vllm-d", now=time.time() + 1)  # the kubelet's next one
    assert rotated != token
    heartbeat(shared, "uid-d", rotated)
    assert state.reviewed.count(rotated) == 1


def test_a_per_pod_certificate_needs_no_token(ctl: TokenController, pki: Pki) -> None:
    """cert-manager's csi-driver identities keep working in token mode, for their own pod only."""
    own = ctl.stub(pki.agent("uid-csi"))
    assert register(own, "uid-csi", None, name="whatever").lease_ttl_ms == 60000
    assert not heartbeat(own, "uid-csi", None).reregister
    text = refused(lambda: register(own, "uid-a", None))
    assert "'uid-a'" in text and "'uid-csi'" in text


def test_the_api_server_unreachable_or_refusing_the_controller_is_unavailable(
    kube: tuple[KubeTokens, str, Path], pki: Pki, free_port: Callable[[], int], tmp_path: Path
) -> None:
    state, url, ca = kube
    token = state.token(NAMESPACE, "vllm-a")
    unknown = tmp_path / "token"
    unknown.write_text("not-allowed-to-review")
    state.allow_reviewer("not-allowed-to-review", may_review=False)
    for api_url, expected in (
        (url, "tokenreviews.authentication.k8s.io"),
        (f"https://localhost:{free_port()}", "did not answer a TokenReview"),
    ):
        c = start_token_controller(
            f"127.0.0.1:{free_port()}", pki, "token", api_url=api_url, ca_file=ca, token_file=unknown
        )
        try:
            with pytest.raises(grpc.RpcError) as err:
                register(c.stub(pki.agent()), "uid-a", token, name="vllm-a")
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert expected in (err.value.details() or "") and api_url in (err.value.details() or "")
        finally:
            c.close()


def test_certificate_mode_refuses_the_shared_certificate(
    pki: Pki, free_port: Callable[[], int], kube: tuple[KubeTokens, str, Path]
) -> None:
    state, _, _ = kube
    c = start_token_controller(f"127.0.0.1:{free_port()}", pki, "certificate")
    try:
        text = refused(lambda: register(c.stub(pki.agent()), "uid-a", state.token(NAMESPACE, "vllm-a")))
        assert "agent_pod_proof=certificate" in text and "per-pod agent certificates only" in text
        assert register(c.stub(pki.agent("uid-p")), "uid-p", None).lease_ttl_ms == 60000
    finally:
        c.close()


def test_the_shared_certificate_alone_still_works_when_chosen(
    pki: Pki, free_port: Callable[[], int], tmp_path: Path
) -> None:
    """``agent_pod_proof=unverified`` (the chart's ``tls.agentIdentity=sharedCertificateUnverified``):
    the shared certificate registers and publishes without a token -- as any pod it claims first,
    which the start-up log says loudly."""
    log = tmp_path / "controller.log"
    c = start_token_controller(f"127.0.0.1:{free_port()}", pki, "unverified", log=log)
    try:
        shared = c.stub(pki.agent())
        assert register(shared, "uid-x", None).lease_ttl_ms == 60000
        assert publish(shared, "uid-x", None, [bytes([5]) * 16])
        agents = c.stub(pki.router()).ListAgents(controller_pb2.ListAgentsRequest(), timeout=5).agents
        assert [x.pod.pod_uid for x in agents] == ["uid-x"]
    finally:
        c.close()
    assert (
        "agent_pod_proof=unverified: an agent with the shared agent certificate may register"
        in log.read_text()
    )


def test_real_agents_send_their_pods_tokens_and_pick_up_rotations(
    ctl: TokenController, kube: tuple[KubeTokens, str, Path], pki: Pki, tmp_path: Path
) -> None:
    """Two real agent processes with the shared certificate and each its pod's token file register
    and heartbeat; a rotated file (the kubelet's atomic swap) is read and reviewed."""
    state, _, _ = kube
    shared = pki.agent()
    tls = ["--tls-cert-file", str(shared / "tls.crt"), "--tls-key-file", str(shared / "tls.key")]
    tls += ["--tls-ca-file", str(shared / "ca.crt")]
    agents = []
    (tmp_path / "pods").mkdir()
    try:
        for uid in ("pod-e", "pod-f"):
            state.add_pod(NAMESPACE, uid, "vllm", uid=uid)  # start_pod_agent's POD_NAME is its uid
            (tmp_path / uid).mkdir()
            token_file = tmp_path / uid / "token"
            token_file.write_text(state.token(NAMESPACE, uid))
            flags = [*tls, "--controller-token-file", str(token_file)]
            agents.append(start_pod_agent(tmp_path / "pods", uid, ctl.address, *flags))
        router = ctl.stub(pki.router())

        def names() -> dict[str, str]:
            return {
                x.pod.pod_uid: x.pod.pod_name
                for x in router.ListAgents(controller_pb2.ListAgentsRequest(), timeout=5).agents
            }

        wait_for("both agents registered", lambda: {"pod-e", "pod-f"} <= set(names()))
        assert names()["pod-e"] == "pod-e" and names()["pod-f"] == "pod-f"
        # The kubelet rotates pod-e's token: a new file swapped in by rename.
        new = state.token(NAMESPACE, "pod-e", now=time.time() + 2)
        staged = tmp_path / "pod-e" / "token.new"
        staged.write_text(new)
        staged.rename(tmp_path / "pod-e" / "token")
        wait_for(
            "the rotated token used by the agent's heartbeats", lambda: new in state.reviewed, timeout_s=20
        )
    finally:
        for a in agents:
            a.stop()


def test_the_token_goes_only_to_the_controller_over_tls(pki: Pki, tmp_path: Path) -> None:
    """An agent's channels to peer agents never carry its pod token (a peer could replay it to the
    controller as that pod), nor does a plaintext channel; its channels to the controller always do."""
    from concurrent import futures

    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from kvgrid.common.tls import AGENT_SERVER_NAME, ClientTls, TlsFiles, make_channel, server_credentials

    seen: list[dict[str, str]] = []

    class Recorder(health.HealthServicer):
        def Check(self, request: object, context: grpc.ServicerContext) -> health_pb2.HealthCheckResponse:
            seen.append(dict(context.invocation_metadata()))  # type: ignore[arg-type]
            return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    (tmp_path / "token").write_text("header.claims.signature")
    shared = pki.agent()
    files = TlsFiles(
        str(shared / "tls.crt"), str(shared / "tls.key"), str(shared / "ca.crt"), str(tmp_path / "token")
    )
    client = ClientTls(files)
    servers = []
    try:
        for who, name in ((pki.controller(), CONTROLLER_SERVER_NAME), (pki.agent("peer"), AGENT_SERVER_NAME)):
            server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
            health_pb2_grpc.add_HealthServicer_to_server(Recorder(), server)
            d = TlsFiles(str(who / "tls.crt"), str(who / "tls.key"), str(who / "ca.crt"))
            port = server.add_secure_port("127.0.0.1:0", server_credentials(d))
            server.start()
            servers.append(server)
            with make_channel(f"127.0.0.1:{port}", client, name) as ch:
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        plain = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        health_pb2_grpc.add_HealthServicer_to_server(Recorder(), plain)
        port = plain.add_insecure_port("127.0.0.1:0")
        plain.start()
        servers.append(plain)
        with make_channel(f"127.0.0.1:{port}", None, CONTROLLER_SERVER_NAME) as ch:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    finally:
        for s in servers:
            s.stop(0)
    to_controller, to_peer, plaintext = seen
    assert to_controller.get("authorization") == "Bearer header.claims.signature"
    assert "authorization" not in to_peer and "authorization" not in plaintext


def test_a_flood_of_fresh_tokens_is_held_to_the_review_budget(
    kube: tuple[KubeTokens, str, Path], reviewer_token: Path, pki: Pki, free_port: Callable[[], int]
) -> None:
    """Any holder of the shared certificate can mint well-formed tokens (right claims, forged
    signature), each a cache miss: past ``agent_token_reviews_per_s`` (here 0.5/s, a burst of 5)
    they are RESOURCE_EXHAUSTED without reaching the API server, while an agent whose token was
    already reviewed goes on heartbeating."""
    state, url, ca = kube
    state.add_pod(NAMESPACE, "vllm-steady", "vllm", uid="uid-steady")
    steady = state.token(NAMESPACE, "vllm-steady")
    c = start_token_controller(
        f"127.0.0.1:{free_port()}", pki, "token", api_url=url, ca_file=ca, token_file=reviewer_token,
        extra=("--agent-token-reviews-per-s", "0.5"),
    )  # fmt: skip
    try:
        shared = c.stub(pki.agent())
        register(shared, "uid-steady", steady, name="vllm-steady")
        forger = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        before = len(state.reviewed)
        codes = []
        for i in range(20):
            claims = state.claims(NAMESPACE, "vllm-a", "kvgrid")
            claims["jti"] = f"forged-{i}"  # a fresh token each time: never a cached verdict
            with pytest.raises(grpc.RpcError) as err:
                heartbeat(shared, "uid-a", sign_jwt(forger, claims, kid="forged"))
            codes.append(err.value.code())
            if err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                assert "agent_token_reviews_per_s" in (err.value.details() or ""), err.value.details()
        # The first of the burst (4 left after the steady agent's) reached the API server and were
        # refused there; the rest never left the controller.
        assert codes.count(grpc.StatusCode.PERMISSION_DENIED) <= 5, codes
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 15, codes
        assert len(state.reviewed) - before <= 5
        for _ in range(5):
            heartbeat(shared, "uid-steady", steady)  # its verdict is cached: no review, no budget
    finally:
        c.close()


def test_a_cached_verdict_never_outlives_its_token(
    kube: tuple[KubeTokens, str, Path], reviewer_token: Path
) -> None:
    """The verdict cache (10 s here) keeps a token's verdict at most until its exp: after that the
    token is expired, whatever the cache held."""
    from kvgrid.common.pod_tokens import TokenFile, TokenReviewer

    state, url, ca = kube
    now = [float(int(time.time()))]
    reviewer = TokenReviewer(
        url, TokenFile(str(reviewer_token)), str(ca), cache_ttl_s=10, clock=lambda: now[0]
    )
    token = state.token(NAMESPACE, "vllm-a", expiration_s=2, now=now[0] - 1)  # exp in 1 s
    assert reviewer.review(token, NAMESPACE).pod_uid == "uid-a"
    now[0] += 0.5
    assert reviewer.review(token, NAMESPACE).pod_uid == "uid-a" and reviewer.reviews == 1  # cached
    now[0] += 1.0
    with pytest.raises(Exception, match="expired") as err:
        reviewer.review(token, NAMESPACE)
    assert type(err.value).__name__ == "PermissionDenied"


def test_bad_settings_are_refused_naming_the_value_and_what_was_expected(
    pki: Pki, tmp_path: Path, reviewer_token: Path, kube: tuple[KubeTokens, str, Path]
) -> None:
    from kvgrid.agent.config import AgentConfig
    from kvgrid.common.config import load_config
    from kvgrid.common.pod_tokens import TokenFile, TokenReviewer, in_cluster_api_url
    from kvgrid.common.tls import ClientTls, TlsFiles
    from kvgrid.controller.config import ControllerConfig
    from kvgrid.controller.pod_proof import pod_proof_for
    from tests.security.conftest import tls_flags

    url = kube[1]
    tls = tls_flags(pki.controller())
    cases: list[tuple[Callable[[], object], str]] = [
        (lambda: ControllerConfig(agent_pod_proof="token"), "agent_pod_proof='token' needs mTLS"),
        (lambda: ControllerConfig(agent_pod_proof="certificate"), "agent_pod_proof='certificate' needs mTLS"),
        (lambda: ControllerConfig(kube_api_url="http://10.0.0.1:6443", **tls), "expected https://host:port"),
        (
            lambda: load_config(ControllerConfig, overrides={"agent_pod_proof": "shared"}),
            "'agent_pod_proof' has invalid value 'shared'",
        ),
        (lambda: AgentConfig(controller_token_file="/t"), "controller_token_file='/t' needs mTLS"),
        (lambda: in_cluster_api_url({}), "KUBERNETES_SERVICE_HOST / KUBERNETES_SERVICE_PORT are not set"),
        (
            lambda: pod_proof_for(
                ControllerConfig(
                    agent_pod_proof="token", kube_api_token_file=str(tmp_path / "no"), kube_api_url=url, **tls
                )
            ),
            f"kube_api_token_file={str(tmp_path / 'no')!r}: cannot read the token",
        ),
        (
            lambda: TokenReviewer(url, TokenFile(str(reviewer_token)), str(tmp_path / "no-ca.crt")),
            f"kube_api_ca_file={str(tmp_path / 'no-ca.crt')!r}: cannot load",
        ),
        (
            lambda: ClientTls(
                TlsFiles(
                    tls["tls_cert_file"],
                    tls["tls_key_file"],
                    tls["tls_ca_file"],
                    controller_token_file=str(tmp_path / "none"),
                )
            ),
            f"controller_token_file={str(tmp_path / 'none')!r}: cannot read the token",
        ),
    ]
    (tmp_path / "empty").write_text("\n")
    cases.append((lambda: TokenFile(str(tmp_path / "empty")), "expected one JWT"))
    for make, expected in cases:
        with pytest.raises(ValueError) as err:
            make()
        assert expected in str(err.value), (expected, str(err.value))
