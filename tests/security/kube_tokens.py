"""A stand-in for the Kubernetes API server's ServiceAccount token issuer (TokenRequest, as the kubelet
uses it for a ``projected`` ``serviceAccountToken`` volume) and its TokenReview API, because a real
kube-apiserver needs a ~5-minute Go build from Debian's source (``make kube-apiserver``,
``scripts/fetch_kube_apiserver.sh``) that the default ``make test`` does not do. The tests against
the real API server (``tests/security/test_pod_tokens_kube.py``) run whenever that binary is present,
and one of them checks that this stand-in's tokens and TokenReview answers have the real ones' shape.

What it reproduces of Kubernetes v1.20 (``pkg/serviceaccount/claims.go``, ``jwt.go``):

- Tokens are RS256 JWTs, header ``{"alg":"RS256","kid":<base64url SHA-256 of the key's DER
  SubjectPublicKeyInfo>}``; claims (keys sorted, as go-jose merges them): ``aud`` (list), ``exp``,
  ``iat``, ``iss``, ``kubernetes.io`` = ``{namespace, pod: {name, uid}, serviceaccount: {name, uid}}``,
  ``nbf`` (= ``iat``), ``sub`` = ``system:serviceaccount:<ns>:<sa>``.
- TokenReview (``POST /apis/authentication.k8s.io/v1/tokenreviews``) requires the caller's own bearer
  token (401 unknown, 403 without ``create tokenreviews``); it verifies the signature against its
  keys, the issuer, the audience (``spec.audiences``, default the issuer), ``exp``/``nbf`` with
  go-jose's one-minute leeway, and that the bound pod and ServiceAccount still exist with the UIDs
  the token names; it answers 201 with ``status.authenticated``, ``user`` (username, uid, groups,
  ``extra`` ``authentication.kubernetes.io/pod-name`` / ``pod-uid``) and ``audiences``, or
  ``status.error`` in the API server's words.
"""

from __future__ import annotations

import base64
import hashlib
import json
import ssl
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa

from tests.security.pki import TestCA

__all__ = ["ISSUER", "KubeTokens", "b64url", "kube_tokens", "sign_jwt"]

ISSUER = "https://kubernetes.default.svc"
"""The chart-agnostic default ``--service-account-issuer`` (also the real server's in the tests)."""
LEEWAY_S = 60
"""go-jose's DefaultLeeway, which the API server's claim validation uses."""


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(s: str) -> bytes:
    return base64.urlsafe_b64decode(s + "=" * (-len(s) % 4))


def _key_id(key: rsa.RSAPrivateKey) -> str:
    der = key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return b64url(hashlib.sha256(der).digest())


def sign_jwt(key: rsa.RSAPrivateKey, claims: dict[str, Any], kid: str | None = None) -> str:
    """An RS256 JWT of ``claims`` signed by ``key`` (JSON as Go writes it: compact, keys sorted)."""
    header = {"alg": "RS256", "kid": kid if kid is not None else _key_id(key)}
    enc = [b64url(json.dumps(p, separators=(",", ":"), sort_keys=True).encode()) for p in (header, claims)]
    signing_input = f"{enc[0]}.{enc[1]}".encode()
    sig = key.sign(signing_input, padding.PKCS1v15(), hashes.SHA256())
    return f"{enc[0]}.{enc[1]}.{b64url(sig)}"


class KubeTokens:
    """The API server's state the tokens depend on (pods, ServiceAccounts, signing key, who may
    review) and its two APIs; :func:`kube_tokens` serves TokenReview over HTTPS."""

    __test__ = False

    def __init__(self) -> None:
        self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.issuer = ISSUER
        self.pods: dict[tuple[str, str], tuple[str, str]] = {}
        """(namespace, pod name) -> (pod uid, ServiceAccount name)."""
        self.service_accounts: dict[tuple[str, str], str] = {}
        """(namespace, name) -> uid."""
        self.reviewers: dict[str, bool] = {}
        """Bearer tokens known to the server -> whether they may create tokenreviews."""
        self.reviewed: list[str] = []
        """Every token a TokenReview asked about, in order."""
        self.lock = threading.Lock()

    # -- objects --

    def add_pod(self, namespace: str, name: str, service_account: str = "default", uid: str = "") -> str:
        """A pod (and its ServiceAccount, if new); its UID."""
        with self.lock:
            self.service_accounts.setdefault((namespace, service_account), str(uuid.uuid4()))
            uid = uid or str(uuid.uuid4())
            self.pods[(namespace, name)] = (uid, service_account)
            return uid

    def delete_pod(self, namespace: str, name: str) -> None:
        with self.lock:
            del self.pods[(namespace, name)]

    def allow_reviewer(self, token: str, may_review: bool = True) -> None:
        self.reviewers[token] = may_review

    # -- TokenRequest (what the kubelet asks for a projected serviceAccountToken volume) --

    def claims(
        self, namespace: str, pod: str, audience: str, expiration_s: int = 600, now: float | None = None
    ) -> dict[str, Any]:
        uid, sa = self.pods[(namespace, pod)]
        iat = int(time.time() if now is None else now)
        return {
            "aud": [audience],
            "exp": iat + expiration_s,
            "iat": iat,
            "iss": self.issuer,
            "kubernetes.io": {
                "namespace": namespace,
                "pod": {"name": pod, "uid": uid},
                "serviceaccount": {"name": sa, "uid": self.service_accounts[(namespace, sa)]},
            },
            "nbf": iat,
            "sub": f"system:serviceaccount:{namespace}:{sa}",
        }

    def token(
        self,
        namespace: str,
        pod: str,
        audience: str = "kvgrid",
        expiration_s: int = 600,
        now: float | None = None,
    ) -> str:
        """A token bound to the pod, as TokenRequest (the kubelet's projected volume) issues it."""
        return sign_jwt(self.key, self.claims(namespace, pod, audience, expiration_s, now))

    # -- TokenReview --

    def review(self, token: str, audiences: list[str]) -> dict[str, Any]:
        """The ``status`` of a TokenReview of ``token`` for ``audiences``."""
        self.reviewed.append(token)
        try:
            claims = self._verify(token, audiences or [self.issuer])
        except _Invalid as e:
            return {"user": {}, "error": f"[invalid bearer token, {e}]"}
        k8s = claims["kubernetes.io"]
        ns, sa, pod = k8s["namespace"], k8s["serviceaccount"], k8s.get("pod")
        user: dict[str, Any] = {
            "username": f"system:serviceaccount:{ns}:{sa['name']}",
            "uid": sa["uid"],
            "groups": ["system:serviceaccounts", f"system:serviceaccounts:{ns}", "system:authenticated"],
        }
        if pod:
            user["extra"] = {
                "authentication.kubernetes.io/pod-name": [pod["name"]],
                "authentication.kubernetes.io/pod-uid": [pod["uid"]],
            }
        aud = claims["aud"] if isinstance(claims["aud"], list) else [claims["aud"]]
        return {
            "authenticated": True,
            "user": user,
            "audiences": [a for a in (audiences or [self.issuer]) if a in aud],
        }

    def _verify(self, token: str, audiences: list[str]) -> dict[str, Any]:
        parts = token.split(".")
        if len(parts) != 3:
            raise _Invalid("square/go-jose: compact JWS format must have three parts")
        try:
            header, claims = json.loads(_unb64(parts[0])), json.loads(_unb64(parts[1]))
            sig = _unb64(parts[2])
        except ValueError:
            raise _Invalid("illegal base64 data") from None
        if header.get("alg") != "RS256":
            raise _Invalid("square/go-jose: error in cryptographic primitive")
        try:
            self.key.public_key().verify(
                sig, f"{parts[0]}.{parts[1]}".encode(), padding.PKCS1v15(), hashes.SHA256()
            )
        except InvalidSignature:
            raise _Invalid("square/go-jose: error in cryptographic primitive") from None
        if claims.get("iss") != self.issuer:
            raise _Invalid("token issuer not recognized")
        aud = claims.get("aud")
        aud = aud if isinstance(aud, list) else [aud]
        if not any(a in aud for a in audiences):
            raise _Invalid(
                "token audiences "
                + json.dumps(aud)
                + " is invalid for the target audiences "
                + json.dumps(audiences)
            )
        now = time.time()
        if claims.get("exp", 0) + LEEWAY_S < now:
            raise _Invalid("Token has expired.")
        if claims.get("nbf", 0) - LEEWAY_S > now:
            raise _Invalid("Token not valid yet.")
        k8s = claims.get("kubernetes.io") or {}
        ns, sa, pod = k8s.get("namespace"), k8s.get("serviceaccount") or {}, k8s.get("pod")
        with self.lock:
            if self.service_accounts.get((ns, sa.get("name"))) != sa.get("uid"):
                raise _Invalid("Token has been invalidated")
            if pod is not None:
                found = self.pods.get((ns, pod.get("name")))
                if found is None or found[0] != pod.get("uid"):
                    raise _Invalid("Token has been invalidated")
        return claims


class _Invalid(Exception):
    pass


@contextmanager
def kube_tokens(tmp: Path, ca: TestCA) -> Iterator[tuple[KubeTokens, str, Path]]:
    """Serve a :class:`KubeTokens`' TokenReview API over HTTPS on loopback, its certificate signed by
    ``ca`` for ``localhost``; yields (the state, its https://localhost:<port> URL, the CA file)."""
    kube = KubeTokens()
    tmp.mkdir(parents=True, exist_ok=True)
    cert, key = ca.issue(dns=("localhost",))
    (tmp / "apiserver.crt").write_bytes(cert)
    (tmp / "apiserver.key").write_bytes(key)
    (tmp / "ca.crt").write_bytes(ca.pem)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the real server
        disable_nagle_algorithm = True  # headers and body are two writes: no delayed-ACK stall

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _send(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            if self.path != "/apis/authentication.k8s.io/v1/tokenreviews":
                self._send(404, {"kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404})
                return
            auth = self.headers.get("Authorization", "")
            who = auth.removeprefix("Bearer ")
            if not auth.startswith("Bearer ") or who not in kube.reviewers:
                self._send(
                    401, {"kind": "Status", "status": "Failure", "reason": "Unauthorized", "code": 401}
                )
                return
            if not kube.reviewers[who]:
                self._send(
                    403,
                    {
                        "kind": "Status",
                        "status": "Failure",
                        "reason": "Forbidden",
                        "code": 403,
                        "message": "tokenreviews.authentication.k8s.io is forbidden: User cannot "
                        'create resource "tokenreviews"',
                    },
                )
                return
            req = json.loads(body)
            spec = req.get("spec") or {}
            status = kube.review(spec.get("token", ""), list(spec.get("audiences") or []))
            self._send(
                201,
                {
                    "kind": "TokenReview",
                    "apiVersion": "authentication.k8s.io/v1",
                    "metadata": {"creationTimestamp": None},
                    "spec": spec,
                    "status": status,
                },
            )

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(tmp / "apiserver.crt", tmp / "apiserver.key")
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield kube, f"https://localhost:{server.server_address[1]}", tmp / "ca.crt"
    finally:
        server.shutdown()
        server.server_close()
