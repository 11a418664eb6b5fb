"""Pod tokens against a real Kubernetes API server (v1.20.2 built from Debian's source, real etcd).

Skipped, saying so, unless ``.tools/k8s/kube-apiserver`` (``make kube-apiserver``:
scripts/fetch_kube_apiserver.sh, about 5 minutes of CPU once) and ``etcd`` are present. The default
``make test`` does not build it; the same attacks run there against the stand-in of
:mod:`tests.security.kube_tokens`, and the first test here checks that the stand-in's tokens and
TokenReview answers have exactly the real server's shape.

Here the tokens come from the real TokenRequest API (what the kubelet calls for a projected
``serviceAccountToken`` volume, bound to a real Pod object), the controller's own credentials are a
token of the ServiceAccount the chart renders, with exactly the chart's ClusterRole and binding
applied to the real server, and a real ``kvgrid controller`` process reviews every token there.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from tests.agent.helpers import wait_for
from tests.deploy.chart import CHART, ROOT, helm_binary
from tests.security.conftest import Pki
from tests.security.kube_tokens import KubeTokens, sign_jwt
from tests.security.pki import NAMESPACE
from tests.security.test_pod_tokens import (
    TokenController,
    heartbeat,
    publish,
    refused,
    register,
    start_token_controller,
)

APISERVER = Path(os.environ.get("KVGRID_KUBE_APISERVER", ROOT / ".tools" / "k8s" / "kube-apiserver"))
ETCD = shutil.which("etcd")
ISSUER = "https://kubernetes.default.svc"
ADMIN = "kvgrid-test-admin-token"

pytestmark = pytest.mark.skipif(
    not (APISERVER.is_file() and ETCD),
    reason=f"needs a real kube-apiserver at {APISERVER} and etcd on PATH: run `make kube-apiserver` "
    "(scripts/fetch_kube_apiserver.sh builds Kubernetes v1.20.2 from Debian's source, ~5 min of CPU once); "
    "the default run covers the same attacks with tests/security/kube_tokens.py's stand-in",
)


class Kube:
    """A running etcd + kube-apiserver and an admin client of its REST API."""

    def __init__(self, url: str, ca: Path, sa_key: rsa.RSAPrivateKey) -> None:
        self.url, self.ca, self.sa_key = url, ca, sa_key
        self._ssl = ssl.create_default_context(cafile=str(ca))

    def call(self, method: str, path: str, body: dict[str, Any] | None = None, token: str = ADMIN) -> Any:
        req = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode() if body is not None else None,
            method=method,
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, context=self._ssl, timeout=30) as resp:
            return json.loads(resp.read())

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        kind, ns = obj["kind"], obj["metadata"].get("namespace", "")
        path = {
            "Namespace": "/api/v1/namespaces",
            "ServiceAccount": f"/api/v1/namespaces/{ns}/serviceaccounts",
            "Pod": f"/api/v1/namespaces/{ns}/pods",
            "ClusterRole": "/apis/rbac.authorization.k8s.io/v1/clusterroles",
            "ClusterRoleBinding": "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
        }[kind]
        return dict(self.call("POST", path, obj))

    def pod(self, ns: str, name: str, sa: str = "vllm") -> str:
        """A Pod object (never scheduled: no kubelet) of ServiceAccount ``sa``; its UID."""
        made = self.create(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": name, "namespace": ns},
                "spec": {
                    "serviceAccountName": sa,
                    "automountServiceAccountToken": False,
                    "containers": [{"name": "c", "image": "example.invalid/none"}],
                },
            }
        )
        return str(made["metadata"]["uid"])

    def token(self, ns: str, sa: str, audiences: list[str], pod: tuple[str, str] | None = None) -> str:
        """A TokenRequest token, bound to ``pod`` (name, uid) as the kubelet asks for one."""
        spec: dict[str, Any] = {"audiences": audiences, "expirationSeconds": 600}
        if pod is not None:
            spec["boundObjectRef"] = {"kind": "Pod", "apiVersion": "v1", "name": pod[0], "uid": pod[1]}
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec}
        return str(
            self.call("POST", f"/api/v1/namespaces/{ns}/serviceaccounts/{sa}/token", body)["status"]["token"]
        )

    def review(self, token: str, audiences: list[str]) -> dict[str, Any]:
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "spec": {"token": token, "audiences": audiences},
        }
        return dict(self.call("POST", "/apis/authentication.k8s.io/v1/tokenreviews", body)["status"])


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory, free_port: Callable[[], int]) -> Iterator[Kube]:
    d = tmp_path_factory.mktemp("kube-apiserver")
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    (d / "sa.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    (d / "sa.pub").write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    (d / "tokens.csv").write_text(f"{ADMIN},admin,admin-uid,system:masters\n")
    client, peer, port = free_port(), free_port(), free_port()
    procs: list[subprocess.Popen[bytes]] = []
    assert ETCD is not None
    try:
        procs.append(
            subprocess.Popen(
                [
                    ETCD,
                    "--data-dir",
                    str(d / "etcd"),
                    "--listen-client-urls",
                    f"http://127.0.0.1:{client}",
                    "--advertise-client-urls",
                    f"http://127.0.0.1:{client}",
                    "--listen-peer-urls",
                    f"http://127.0.0.1:{peer}",
                    "--initial-advertise-peer-urls",
                    f"http://127.0.0.1:{peer}",
                    "--initial-cluster",
                    f"default=http://127.0.0.1:{peer}",
                ],
                stdout=open(d / "etcd.log", "wb"),  # noqa: SIM115 - the process writes it
                stderr=subprocess.STDOUT,
            )
        )
        procs.append(
            subprocess.Popen(
                [
                    str(APISERVER),
                    f"--etcd-servers=http://127.0.0.1:{client}",
                    "--bind-address=127.0.0.1",
                    "--advertise-address=127.0.0.1",
                    f"--secure-port={port}",
                    f"--cert-dir={d / 'certs'}",
                    f"--token-auth-file={d / 'tokens.csv'}",
                    "--authorization-mode=RBAC",
                    f"--service-account-key-file={d / 'sa.pub'}",
                    f"--service-account-signing-key-file={d / 'sa.key'}",
                    f"--service-account-issuer={ISSUER}",
                    "--service-cluster-ip-range=10.96.0.0/24",
                ],
                stdout=open(d / "apiserver.log", "wb"),  # noqa: SIM115 - the process writes it
                stderr=subprocess.STDOUT,
            )
        )
        ca = d / "certs" / "apiserver.crt"
        wait_for("the API server's self-signed certificate", ca.exists, 60)
        k = Kube(f"https://127.0.0.1:{port}", ca, key)

        def ready() -> bool:
            assert all(p.poll() is None for p in procs), (d / "apiserver.log").read_text()[-3000:]
            try:
                req = urllib.request.Request(k.url + "/readyz", headers={"Authorization": f"Bearer {ADMIN}"})
                return urllib.request.urlopen(req, context=k._ssl, timeout=2).read() == b"ok"
            except (urllib.error.URLError, OSError):
                return False

        wait_for("kube-apiserver ready", ready, 120)
        for ns in (NAMESPACE, "other-ns"):
            k.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
            k.create(
                {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "vllm", "namespace": ns}}
            )
        yield k
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _claims(token: str) -> tuple[dict[str, Any], dict[str, Any]]:
    h, c, _ = token.split(".")
    return (
        json.loads(base64.urlsafe_b64decode(h + "=" * (-len(h) % 4))),
        json.loads(base64.urlsafe_b64decode(c + "=" * (-len(c) % 4))),
    )


def _shape(v: Any) -> Any:
    """The JSON structure of ``v`` without its values: key sets and value types."""
    if isinstance(v, dict):
        return {k: _shape(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_shape(v[0])] if v else []
    return type(v).__name__


def test_the_stand_in_makes_tokens_and_reviews_exactly_as_the_real_api_server(kube: Kube) -> None:
    uid = kube.pod(NAMESPACE, "shape-pod")
    real = kube.token(NAMESPACE, "vllm", ["kvgrid"], ("shape-pod", uid))
    standin = KubeTokens()
    standin.key = kube.sa_key  # the same signing key: the kid must come out the same
    standin.add_pod(NAMESPACE, "shape-pod", "vllm", uid=uid)
    fake = standin.token(NAMESPACE, "shape-pod", "kvgrid")
    (rh, rc), (fh, fc) = _claims(real), _claims(fake)
    assert rh == fh  # {"alg": "RS256", "kid": base64url(SHA-256(DER public key))}
    assert list(rc) == list(fc) == sorted(rc)  # the same claims, in the same (sorted) order
    assert _shape(rc) == _shape(fc)
    assert rc["iss"] == fc["iss"] == ISSUER and rc["aud"] == fc["aud"] == ["kvgrid"]
    assert rc["sub"] == fc["sub"] == f"system:serviceaccount:{NAMESPACE}:vllm"
    assert rc["kubernetes.io"]["pod"] == fc["kubernetes.io"]["pod"] == {"name": "shape-pod", "uid": uid}
    assert rc["nbf"] == rc["iat"] and rc["exp"] - rc["iat"] == 600
    der = kube.sa_key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    assert rh["kid"] == base64.urlsafe_b64encode(hashlib.sha256(der).digest()).rstrip(b"=").decode()
    # TokenReview answers: the same structure, for a good token and for a refused one.
    sa_uid = kube.call("GET", f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/vllm")["metadata"]["uid"]
    standin.service_accounts[(NAMESPACE, "vllm")] = sa_uid
    fake = standin.token(NAMESPACE, "shape-pod", "kvgrid")
    real_ok, fake_ok = kube.review(real, ["kvgrid"]), standin.review(fake, ["kvgrid"])
    assert real_ok == fake_ok, (real_ok, fake_ok)
    real_bad, fake_bad = kube.review(real, ["vault"]), standin.review(fake, ["vault"])
    assert _shape(real_bad) == _shape(fake_bad) and not real_bad.get("authenticated")
    assert real_bad["error"].startswith("[invalid bearer token") and fake_bad["error"].startswith(
        "[invalid bearer token"
    )


@pytest.fixture(scope="module")
def rbac_token(kube: Kube, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The controller's own token: of the ServiceAccount the chart renders, with exactly the chart's
    ClusterRole and ClusterRoleBinding applied to the real server."""
    home = tmp_path_factory.mktemp("helm-home")
    env = os.environ | {
        k: str(home / k.lower()) for k in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME")
    }
    out = subprocess.run(
        [str(helm_binary()), "template", "r", str(CHART), "-n", NAMESPACE],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    ).stdout
    objs = [
        o
        for o in yaml.safe_load_all(out)
        if o and o["kind"] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding")
    ]
    assert sorted(o["kind"] for o in objs) == ["ClusterRole", "ClusterRoleBinding", "ServiceAccount"]
    for o in objs:
        if o["kind"] == "ServiceAccount":
            o["metadata"]["namespace"] = NAMESPACE
            sa = o["metadata"]["name"]
        kube.create(o)
    f = tmp_path_factory.mktemp("controller-sa") / "token"
    f.write_text(kube.token(NAMESPACE, sa, [ISSUER]))  # what the kubelet mounts for the controller
    return f


@pytest.fixture(scope="module")
def ctl(
    kube: Kube,
    rbac_token: Path,
    pki: Pki,
    free_port: Callable[[], int],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[TokenController]:
    c = start_token_controller(
        f"127.0.0.1:{free_port()}", pki, "token", api_url=kube.url, ca_file=kube.ca, token_file=rbac_token,
        extra=("--agent-token-cache-ms", "0"), log=tmp_path_factory.mktemp("ctl") / "controller.log",
    )  # fmt: skip
    yield c
    c.close()


def test_pods_act_only_as_themselves_with_real_tokens(ctl: TokenController, kube: Kube, pki: Pki) -> None:
    uid_a, uid_b = kube.pod(NAMESPACE, "vllm-a"), kube.pod(NAMESPACE, "vllm-b")
    tok_a = kube.token(NAMESPACE, "vllm", ["kvgrid"], ("vllm-a", uid_a))
    tok_b = kube.token(NAMESPACE, "vllm", ["kvgrid"], ("vllm-b", uid_b))
    shared = ctl.stub(pki.agent())
    assert register(shared, uid_a, tok_a, name="vllm-a").lease_ttl_ms == 60000
    for attempt in (
        lambda: register(shared, uid_a, tok_b, name="vllm-a", epoch=2),
        lambda: heartbeat(shared, uid_a, tok_b),
        lambda: publish(shared, uid_a, tok_b, [bytes([1]) * 16]),
        lambda: register(shared, uid_b, tok_b, name="vllm-a"),
    ):
        text = refused(attempt)
        assert uid_b in text and (uid_a in text or "'vllm-a'" in text), text
    assert not heartbeat(shared, uid_a, tok_a).reregister
    assert "sent no pod token" in refused(lambda: heartbeat(shared, uid_a, None))


def test_foreign_audience_other_namespace_forged_and_deleted_pods_tokens_are_refused(
    ctl: TokenController, kube: Kube, pki: Pki
) -> None:
    uid_c = kube.pod("other-ns", "vllm-c")
    uid_d = kube.pod(NAMESPACE, "vllm-d")
    uid_e = kube.pod(NAMESPACE, "vllm-e")
    tok_d = kube.token(NAMESPACE, "vllm", ["kvgrid"], ("vllm-d", uid_d))
    _, claims = _claims(kube.token(NAMESPACE, "vllm", ["kvgrid"], ("vllm-e", uid_e)))
    forger = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    shared = ctl.stub(pki.agent())
    cases = {
        "another audience": (kube.token(NAMESPACE, "vllm", ["vault"], ("vllm-e", uid_e)), uid_e, "audience"),
        "another namespace": (
            kube.token("other-ns", "vllm", ["kvgrid"], ("vllm-c", uid_c)),
            uid_c,
            "namespace 'other-ns'",
        ),
        "forged signature": (
            sign_jwt(forger, claims),
            uid_e,
            "did not authenticate the token: [invalid bearer token",
        ),
        "not bound to a pod": (kube.token(NAMESPACE, "vllm", ["kvgrid"]), uid_e, "not bound to a pod"),
    }
    for what, (token, uid, expected) in cases.items():

        def attempt(t: str = token, u: str = uid) -> object:
            return register(shared, u, t)

        text = refused(attempt)
        assert expected in text, (what, text)
    # The API server checks that the bound pod still exists (agent_token_cache_ms=0 here).
    register(shared, uid_d, tok_d, name="vllm-d")
    kube.call("DELETE", f"/api/v1/namespaces/{NAMESPACE}/pods/vllm-d?gracePeriodSeconds=0")
    wait_for(
        "the deleted pod's token refused", lambda: _refused_now(lambda: heartbeat(shared, uid_d, tok_d)), 30
    )


def _refused_now(fn: Callable[[], object]) -> bool:
    try:
        fn()
    except grpc.RpcError as e:
        return e.code() == grpc.StatusCode.PERMISSION_DENIED
    return False


def test_without_the_charts_rbac_the_controller_is_unavailable_and_says_why(
    kube: Kube, pki: Pki, free_port: Callable[[], int], tmp_path: Path
) -> None:
    kube.create(
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": "no-rbac", "namespace": NAMESPACE},
        }
    )
    (tmp_path / "token").write_text(kube.token(NAMESPACE, "no-rbac", [ISSUER]))
    uid = kube.pod(NAMESPACE, "vllm-f")
    token = kube.token(NAMESPACE, "vllm", ["kvgrid"], ("vllm-f", uid))
    c = start_token_controller(
        f"127.0.0.1:{free_port()}",
        pki,
        "token",
        api_url=kube.url,
        ca_file=kube.ca,
        token_file=tmp_path / "token",
    )
    try:
        with pytest.raises(grpc.RpcError) as err:
            register(c.stub(pki.agent()), uid, token)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "tokenreviews.authentication.k8s.io" in (err.value.details() or "")
    finally:
        c.close()


def test_review_cost_against_the_real_api_server(
    kube: Kube, rbac_token: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What one TokenReview costs the controller (a cache miss) and what a cached verdict costs,
    printed for docs/security.md; the bounds only catch a broken cache."""
    from kvgrid.common.pod_tokens import TokenFile, TokenReviewer

    uid = kube.pod(NAMESPACE, "vllm-cost")
    token = kube.token(NAMESPACE, "vllm", ["kvgrid"], ("vllm-cost", uid))
    cold = TokenReviewer(
        kube.url, TokenFile(str(rbac_token), "kube_api_token_file"), str(kube.ca), cache_ttl_s=0
    )
    cold.review(token, NAMESPACE)  # connect once (TLS handshake), as a running controller has
    n = 50
    t0 = time.perf_counter()
    for _ in range(n):
        cold.review(token, NAMESPACE)
    miss = (time.perf_counter() - t0) / n
    warm = TokenReviewer(
        kube.url, TokenFile(str(rbac_token), "kube_api_token_file"), str(kube.ca), cache_ttl_s=60
    )
    warm.review(token, NAMESPACE)
    t0 = time.perf_counter()
    for _ in range(10_000):
        warm.review(token, NAMESPACE)
    hit = (time.perf_counter() - t0) / 10_000
    with capsys.disabled():
        print(
            f"\nTokenReview round trip (real kube-apiserver, kept-alive TLS): {miss * 1e3:.2f} ms; "
            f"cached verdict: {hit * 1e6:.1f} us"
        )
    assert cold.reviews == n + 1 and warm.reviews == 1
    assert hit < miss
