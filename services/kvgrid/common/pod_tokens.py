"""Which pod an agent is, proven by a Kubernetes ServiceAccount token bound to that pod.

A shared agent certificate proves "an agent of this namespace", not which pod. The kubelet mounts
every agent a token of its own pod (a ``projected`` volume with a ``serviceAccountToken`` source,
audience ``kvgrid``, a short expiry, rotated in place); the agent sends it on every call to the
controller and the controller asks the Kubernetes API server who it names (TokenReview), so an agent
acts only as the pod its token names (docs/security.md, "Agent identity modes").

Agent side:

- :class:`TokenFile` reads the token file and re-reads it when it changes (``(mtime, size, inode)``
  of the path, which follows the ``..data`` link the kubelet swaps); an unreadable or empty file
  later keeps the previous token (logged). :class:`BearerToken` sends it as gRPC metadata
  ``authorization: Bearer <token>`` on every call of a channel; :func:`kvgrid.common.tls.make_channel`
  adds it only to TLS channels that verify the *controller's* certificate name, so the token never
  travels in plaintext nor reaches a peer agent (which could replay it).

Controller side (mTLS on, ``agent_pod_proof``):

- :class:`AgentPodProof` is called by :class:`kvgrid.common.authz.Authorizer` for the methods its
  policy marks pod-bound, for agent identities only. A per-pod certificate already proves its pod.
  A shared agent certificate must come with a token (``token`` mode) -- none is PERMISSION_DENIED --
  which :class:`TokenReviewer` verifies; the caller then *is* that pod's agent: an :class:`Identity`
  with the per-pod URI, the pod's UID and name. ``certificate`` mode accepts per-pod certificates only.
- :class:`TokenReviewer` first reads the token's claims without trusting them, to refuse at once
  (PERMISSION_DENIED naming the value and what was expected) what the API server would refuse too:
  not a JWT, another audience, expired, not yet valid, not bound to a pod, another namespace than
  the caller's certificate. Then it asks the API server (``POST
  /apis/authentication.k8s.io/v1/tokenreviews`` with the controller's own ServiceAccount token,
  ``spec.audiences=[audience]``), which checks the signature, the expiry and that the pod (and its
  ServiceAccount) still exist with the UIDs the token names. It trusts only the answer:
  ``authenticated``, the audience echoed back, the user ``system:serviceaccount:<ns>:<sa>`` and the
  extra ``authentication.kubernetes.io/pod-name`` / ``pod-uid``. Verdicts are cached by the token's
  SHA-256 for ``cache_ttl_s`` (never past the token's expiry), so a steady agent costs one review per
  token per TTL; refusals are cached too. An API server that cannot be reached, or refuses the
  controller itself (RBAC), is UNAVAILABLE naming the URL -- the caller did nothing wrong.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import http.client
import json
import logging
import os
import ssl
import threading
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import grpc
import msgspec

from kvgrid.common.authz import Identity
from kvgrid.common.errors import PermissionDenied, ResourceExhausted, Unavailable
from kvgrid.common.streams import caller_key

__all__ = [
    "AUDIENCE",
    "IN_CLUSTER_CA_FILE",
    "IN_CLUSTER_TOKEN_FILE",
    "POD_NAME_KEY",
    "POD_UID_KEY",
    "AgentPodProof",
    "BearerToken",
    "PodProofMode",
    "PodToken",
    "ReviewBudget",
    "TokenFile",
    "TokenReviewer",
    "bearer_token",
    "in_cluster_api_url",
    "unverified_claims",
]

log = logging.getLogger(__name__)

AUDIENCE = "kvgrid"
"""The audience the chart's projected tokens carry and the controller asks the API server about."""
POD_NAME_KEY = "authentication.kubernetes.io/pod-name"
POD_UID_KEY = "authentication.kubernetes.io/pod-uid"
"""TokenReview ``status.user.extra`` keys of a token bound to a pod (the API server sets both)."""
IN_CLUSTER_TOKEN_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/token"
IN_CLUSTER_CA_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
_SA_PREFIX = "system:serviceaccount:"
_METADATA_KEY = "authorization"
_MAX_TOKEN_BYTES = 16 * 1024

PodProofMode = Literal["token", "certificate", "unverified"]
"""``agent_pod_proof``: what proves which pod an agent is (docs/security.md, "Agent identity modes")."""


# ---- agent side: read the token, send it --------------------------------------------------------


def _read_token(path: Path, field: str) -> str:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(f"{field}={str(path)!r}: cannot read the token: {e.strerror or e}") from None
    token = data.decode("ascii", errors="replace").strip()
    if not token or len(data) > _MAX_TOKEN_BYTES or any(c.isspace() for c in token):
        raise ValueError(
            f"{field}={str(path)!r}: expected one JWT (a ServiceAccount token, at most "
            f"{_MAX_TOKEN_BYTES} bytes, no spaces), got {len(data)} bytes"
        )
    return token


class TokenFile:
    """A token file (a projected ServiceAccount token), re-read when it changes. Thread-safe.

    ValueError naming ``field`` and the path when it cannot be read at start; a later failure keeps
    the previous token (logged), as the TLS files do."""

    def __init__(self, path: str, field: str = "controller_token_file") -> None:
        self.path = Path(path)
        self.field = field
        self._lock = threading.Lock()
        self._stamp = self._stat()
        self._token = _read_token(self.path, field)
        self.reloads = 0

    def _stat(self) -> tuple[int, int, int]:
        try:
            st = self.path.stat()  # follows the ..data link the kubelet swaps on rotation
        except OSError as e:
            raise ValueError(
                f"{self.field}={str(self.path)!r}: cannot read the token: {e.strerror or e}"
            ) from None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def token(self) -> str:
        """The current token (re-read if the file changed since the last call)."""
        with self._lock:
            try:
                stamp = self._stat()
                if stamp != self._stamp:
                    self._token = _read_token(self.path, self.field)
                    self._stamp = stamp
                    self.reloads += 1
            except ValueError as e:
                log.warning("token file changed but cannot be read (keeping the previous token): %s", e)
            return self._token


class _CallDetails(grpc.ClientCallDetails):
    def __init__(
        self, details: grpc.ClientCallDetails, metadata: tuple[tuple[str, str | bytes], ...]
    ) -> None:
        self.method = details.method
        self.timeout = details.timeout
        self.metadata = metadata
        self.credentials = details.credentials
        self.wait_for_ready = getattr(details, "wait_for_ready", None)
        self.compression = getattr(details, "compression", None)


class BearerToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """A client interceptor adding ``authorization: Bearer <token>`` (the file's current token) to
    every call of a channel. An interceptor runs in the calling thread; gRPC's metadata-plugin call
    credentials run on a thread of their own and cost ~0.3 ms a call more (docs/security.md)."""

    def __init__(self, source: TokenFile) -> None:
        self.source = source

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        kept = tuple((k, v) for k, v in (details.metadata or ()) if k != _METADATA_KEY)
        return _CallDetails(details, (*kept, (_METADATA_KEY, f"Bearer {self.source.token()}")))

    def intercept_unary_unary(
        self, continuation: Any, client_call_details: grpc.ClientCallDetails, request: Any
    ) -> Any:
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(
        self, continuation: Any, client_call_details: grpc.ClientCallDetails, request: Any
    ) -> Any:
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(
        self, continuation: Any, client_call_details: grpc.ClientCallDetails, request_iterator: Any
    ) -> Any:
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(
        self, continuation: Any, client_call_details: grpc.ClientCallDetails, request_iterator: Any
    ) -> Any:
        return continuation(self._details(client_call_details), request_iterator)


# ---- controller side: read, check, review -------------------------------------------------------


def bearer_token(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    """The token of the call's ``authorization: Bearer <token>`` metadata; None when there is none,
    PermissionDenied for an ``authorization`` entry of another form or several of them."""
    values = [v for k, v in (metadata or ()) if k == _METADATA_KEY]
    if not values:
        return None
    if len(values) > 1:
        raise PermissionDenied(
            f"{len(values)} 'authorization' metadata entries: expected one 'Bearer <token>'"
        )
    value = values[0].decode(errors="replace") if isinstance(values[0], bytes) else values[0]
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise PermissionDenied(
            f"'authorization' metadata {value[:16]!r}...: expected 'Bearer <ServiceAccount token>'"
        )
    return token.strip()


def _b64json(part: str, what: str) -> dict[str, object]:
    try:
        raw = base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))
        obj = json.loads(raw)
    except (binascii.Error, ValueError) as e:
        raise PermissionDenied(f"the token's {what} is not base64url JSON ({e}): expected a JWT") from None
    if not isinstance(obj, dict):
        raise PermissionDenied(f"the token's {what} is JSON {type(obj).__name__}: expected an object")
    return obj


def unverified_claims(token: str) -> dict[str, object]:
    """The JWT claims of ``token``, *not* verified (the API server verifies): PermissionDenied when it
    is not a three-part JWT with a JSON header and claims."""
    parts = token.split(".")
    if len(parts) != 3 or not all(parts):
        raise PermissionDenied(
            f"the bearer token has {len(parts)} dot-separated part(s): expected a JWT "
            "(header.claims.signature)"
        )
    _b64json(parts[0], "header")
    return _b64json(parts[1], "claims")


class PodToken(msgspec.Struct, frozen=True):
    """What the API server confirmed about a token: the pod and ServiceAccount it is bound to."""

    namespace: str
    service_account: str
    pod_name: str
    pod_uid: str
    expires_at: float
    """The token's ``exp`` (Unix seconds), from its claims; bounds how long the verdict is cached."""


def _number(claims: dict[str, object], key: str) -> float | None:
    v = claims.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _precheck(claims: dict[str, object], audience: str, namespace: str, now: float) -> float:
    """Refuse what the API server would refuse too, with a text naming the claim; the token's exp."""
    aud = claims.get("aud")
    auds = [aud] if isinstance(aud, str) else aud if isinstance(aud, list) else []
    if audience not in auds:
        raise PermissionDenied(
            f"the token's audience is {aud!r}: expected {audience!r} (agent_token_audience)"
        )
    exp = _number(claims, "exp")
    if exp is None:
        raise PermissionDenied(
            "the token has no 'exp' claim: expected a bound ServiceAccount token, which expires"
        )
    if exp <= now:
        raise PermissionDenied(
            f"the token expired at exp={int(exp)} ({int(now - exp)} s ago): expected a current token "
            f"(the kubelet rotates the projected file; the agent re-reads it)"
        )
    nbf = _number(claims, "nbf")
    if nbf is not None and nbf > now + 60:  # the API server's leeway
        raise PermissionDenied(f"the token is not valid before nbf={int(nbf)} (now {int(now)})")
    k8s = claims.get("kubernetes.io")
    pod = k8s.get("pod") if isinstance(k8s, dict) else None
    if not isinstance(k8s, dict) or not isinstance(pod, dict) or not pod.get("name") or not pod.get("uid"):
        raise PermissionDenied(
            f"the token (sub {claims.get('sub')!r}) is not bound to a pod: expected a projected "
            "ServiceAccount token of the agent's pod (claim kubernetes.io.pod {name, uid})"
        )
    if k8s.get("namespace") != namespace:
        raise PermissionDenied(
            f"the token is of namespace {k8s.get('namespace')!r} (pod {pod.get('name')!r}, uid "
            f"{pod.get('uid')!r}); the caller's certificate is of namespace {namespace!r}: expected both "
            "the same"
        )
    return exp


def in_cluster_api_url(env: dict[str, str] | None = None) -> str:
    """``https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT``; ValueError when unset."""
    env = dict(os.environ) if env is None else env
    host, port = env.get("KUBERNETES_SERVICE_HOST", ""), env.get("KUBERNETES_SERVICE_PORT", "")
    if not host or not port:
        raise ValueError(
            "kube_api_url='' (in-cluster) but KUBERNETES_SERVICE_HOST / KUBERNETES_SERVICE_PORT are not set: "
            "expected the controller to run in a Kubernetes pod, or kube_api_url=https://host:port"
        )
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


class _Verdict(msgspec.Struct):
    until: float
    pod: PodToken | None = None
    refusal: str = ""


class ReviewBudget:
    """Token buckets on the TokenReviews a controller sends, so that a caller minting fresh tokens
    (any holder of the shared agent certificate can send well-formed but forged ones, each a cache
    miss) cannot make the API server, or the controller's threads waiting on it, pay at its call
    rate: ``per_caller_per_s`` per caller (identity@IP, :func:`~kvgrid.common.streams.caller_key`)
    and ``total_per_s`` over all callers, each bucket holding ``burst_s`` seconds of its rate
    (at least one review). A rate of 0 is no limit. A cached verdict costs nothing, so a steady agent
    needs one review per token per cache TTL. At most ``max_callers`` buckets are kept (the least
    recently used go; a forgotten caller starts full again). Thread-safe."""

    def __init__(
        self,
        per_caller_per_s: float,
        total_per_s: float,
        *,
        burst_s: float = 10.0,
        max_callers: int = 65_536,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        for name, rate in (("per_caller_per_s", per_caller_per_s), ("total_per_s", total_per_s)):
            if not rate >= 0:
                raise ValueError(f"{name}={rate}: expected reviews per second >= 0 (0 = no limit)")
        self.per_caller_per_s, self.total_per_s = per_caller_per_s, total_per_s
        self.burst_s, self.max_callers, self.clock = burst_s, max_callers, clock
        self._callers: OrderedDict[str, tuple[float, float]] = OrderedDict()  # caller -> (tokens, at)
        self._total = (self._capacity(total_per_s), clock())
        self._lock = threading.Lock()
        self.refused = 0

    def _capacity(self, rate: float) -> float:
        return max(1.0, rate * self.burst_s)

    def _refill(self, bucket: tuple[float, float], rate: float, now: float) -> float:
        tokens, at = bucket
        return min(self._capacity(rate), tokens + (now - at) * rate)

    def take(self, caller: str) -> str | None:
        """Spend one review for ``caller``: None when allowed, else which limit refused it."""
        if not self.per_caller_per_s and not self.total_per_s:
            return None
        now = self.clock()
        with self._lock:
            mine = self._callers.pop(caller, None)
            own = (
                self._refill(mine, self.per_caller_per_s, now)
                if mine
                else self._capacity(self.per_caller_per_s)
            )
            total = self._refill(self._total, self.total_per_s, now)
            refusal = None
            if self.per_caller_per_s and own < 1:
                rate = self.per_caller_per_s
                refusal = f"more than {rate:g} per second from this caller (agent_token_reviews_per_s)"
            elif self.total_per_s and total < 1:
                refusal = (
                    f"more than {self.total_per_s:g} per second in total (agent_token_reviews_total_per_s)"
                )
            else:
                own, total = own - 1, total - 1
            self._callers[caller] = (own, now)
            self._total = (total, now)
            while len(self._callers) > self.max_callers:
                self._callers.popitem(last=False)
            if refusal is not None:
                self.refused += 1
            return refusal


class TokenReviewer:
    """Asks the Kubernetes API server who a token names (TokenReview), with a verdict cache.

    ``api_url``: ``https://host:port`` of the API server; ``credentials``: the controller's own
    token file (re-read when the kubelet rotates it); ``ca_file``: the CA the API server's certificate
    chains to. ``cache_ttl_s``: how long a verdict is kept (0 = ask every time); ``timeout_s``: one
    review's deadline; ``budget``: the :class:`ReviewBudget` on reviews sent (None: none).
    ``clock``: wall-clock seconds (tests move it). Thread-safe."""

    def __init__(
        self,
        api_url: str,
        credentials: TokenFile,
        ca_file: str,
        *,
        audience: str = AUDIENCE,
        cache_ttl_s: float = 30.0,
        timeout_s: float = 2.0,
        max_cached: int = 65_536,
        budget: ReviewBudget | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        url = urllib.parse.urlsplit(api_url)
        if url.scheme != "https" or not url.hostname or url.path.strip("/"):
            raise ValueError(f"kube_api_url={api_url!r}: expected https://host:port (the API server)")
        try:
            self._ssl = ssl.create_default_context(cafile=ca_file)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"kube_api_ca_file={ca_file!r}: cannot load the API server's CA: {e}") from None
        self.api_url = api_url.rstrip("/")
        self._host, self._port = url.hostname, url.port or 443
        self.credentials = credentials
        self.audience = audience
        self.cache_ttl_s = cache_ttl_s
        self.timeout_s = timeout_s
        self.max_cached = max_cached
        self.budget = budget
        self.clock = clock
        self._cache: OrderedDict[bytes, _Verdict] = OrderedDict()
        self._lock = threading.Lock()
        self._local = threading.local()
        self.reviews = 0
        """TokenReviews sent to the API server (cache misses that passed the local checks)."""
        self.cache_hits = 0

    # -- the cache --

    def _cached(self, key: bytes, now: float) -> _Verdict | None:
        with self._lock:
            v = self._cache.get(key)
            if v is None:
                return None
            if v.until <= now:
                del self._cache[key]
                return None
            self._cache.move_to_end(key)
            self.cache_hits += 1
            return v

    def _remember(self, key: bytes, verdict: _Verdict) -> None:
        if self.cache_ttl_s <= 0:
            return
        with self._lock:
            self._cache[key] = verdict
            self._cache.move_to_end(key)
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)

    def review(self, token: str, namespace: str, caller: str = "") -> PodToken:
        """The pod ``token`` is bound to, as the API server confirms it; PermissionDenied naming what
        is wrong (also for a token of another namespace than ``namespace``, the caller's certificate's),
        Unavailable when the API server cannot answer, ResourceExhausted when ``caller`` (or all
        callers together) sent more tokens to review than the :class:`ReviewBudget` allows (never
        cached: the same token passes once the budget refilled)."""
        now = self.clock()
        key = hashlib.sha256(token.encode()).digest() + namespace.encode()
        hit = self._cached(key, now)
        if hit is None:
            try:
                exp = _precheck(unverified_claims(token), self.audience, namespace, now)
                over = self.budget.take(caller) if self.budget is not None else None
                if over is not None:
                    raise ResourceExhausted(
                        f"too many pod tokens to review: {over}; a steady agent needs one TokenReview per "
                        "token per agent_token_cache_ms, so retry later"
                    )
                pod = self._ask(token)
                if pod.namespace != namespace:
                    raise PermissionDenied(
                        f"the token is of namespace {pod.namespace!r} (pod {pod.pod_name!r}, uid "
                        f"{pod.pod_uid!r}); the caller's certificate is of namespace {namespace!r}: "
                        "expected both the same"
                    )
            except PermissionDenied as e:
                self._remember(key, _Verdict(now + self.cache_ttl_s, refusal=str(e)))
                raise
            pod = msgspec.structs.replace(pod, expires_at=exp)
            self._remember(key, _Verdict(min(now + self.cache_ttl_s, exp), pod=pod))
            return pod
        if hit.pod is None:
            raise PermissionDenied(hit.refusal)
        return hit.pod

    # -- the API call --

    def _connection(self) -> http.client.HTTPSConnection:
        conn: http.client.HTTPSConnection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = http.client.HTTPSConnection(
                self._host, self._port, timeout=self.timeout_s, context=self._ssl
            )
            self._local.conn = conn
        return conn

    def _post(self, body: bytes) -> tuple[int, bytes]:
        headers = {
            "Authorization": f"Bearer {self.credentials.token()}",
            "Content-Type": "application/json",
            "Accept": "application/json",
        }
        for attempt in (0, 1):  # a kept-alive connection the server closed: once more on a new one
            conn = self._connection()
            try:
                conn.request("POST", "/apis/authentication.k8s.io/v1/tokenreviews", body, headers)
                resp = conn.getresponse()
                return resp.status, resp.read()
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                self._local.conn = None
                if attempt:
                    raise Unavailable(
                        f"cannot verify the agent's ServiceAccount token: the Kubernetes API server "
                        f"{self.api_url} did not answer a TokenReview ({type(e).__name__}: {e})"
                    ) from None
        raise AssertionError("unreachable")

    def _ask(self, token: str) -> PodToken:
        body = json.dumps(
            {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenReview",
                "spec": {"token": token, "audiences": [self.audience]},
            }
        ).encode()
        self.reviews += 1
        status, raw = self._post(body)
        if status in (401, 403):
            log.error(
                "the Kubernetes API server refused this controller's TokenReview: HTTP %d %s",
                status,
                raw[:300],
            )
            raise Unavailable(
                f"cannot verify the agent's ServiceAccount token: the Kubernetes API server {self.api_url} "
                f"refused this controller's TokenReview (HTTP {status}): expected the controller's "
                f"ServiceAccount to be allowed to create tokenreviews.authentication.k8s.io (the chart's "
                f"ClusterRole) and kube_api_token_file to hold its token"
            )
        if status not in (200, 201):
            raise Unavailable(
                f"cannot verify the agent's ServiceAccount token: TokenReview at {self.api_url} answered "
                f"HTTP {status}: {raw[:200]!r}"
            )
        try:
            st = json.loads(raw).get("status") or {}
        except (ValueError, AttributeError):
            raise Unavailable(
                f"TokenReview at {self.api_url} answered no JSON object: {raw[:200]!r}"
            ) from None
        return self._judge(st)

    def _judge(self, st: dict[str, object]) -> PodToken:
        if st.get("authenticated") is not True:
            raise PermissionDenied(
                "the Kubernetes API server did not authenticate the token: "
                f"{st.get('error') or 'no reason given'}"
            )
        auds = st.get("audiences")
        if not isinstance(auds, list) or self.audience not in auds:
            raise PermissionDenied(
                f"the Kubernetes API server authenticated the token for audiences {auds!r}: expected "
                f"{self.audience!r}"
            )
        user = st.get("user") if isinstance(st.get("user"), dict) else {}
        assert isinstance(user, dict)
        name = str(user.get("username", ""))
        ns, _, sa = name.removeprefix(_SA_PREFIX).partition(":")
        if not name.startswith(_SA_PREFIX) or not ns or not sa:
            raise PermissionDenied(f"the token authenticates user {name!r}: expected a ServiceAccount")
        extra = user.get("extra") if isinstance(user.get("extra"), dict) else {}
        assert isinstance(extra, dict)
        pod_name, pod_uid = extra.get(POD_NAME_KEY) or [], extra.get(POD_UID_KEY) or []
        if not (
            isinstance(pod_name, list) and isinstance(pod_uid, list) and len(pod_name) == len(pod_uid) == 1
        ):
            raise PermissionDenied(
                f"the token of {name!r} is not bound to a pod (TokenReview extra "
                f"{POD_NAME_KEY}={pod_name!r}, "
                f"{POD_UID_KEY}={pod_uid!r}): expected a projected ServiceAccount token of the agent's pod"
            )
        return PodToken(ns, sa, str(pod_name[0]), str(pod_uid[0]), 0.0)

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()


class AgentPodProof:
    """What proves which pod an agent is, for :class:`~kvgrid.common.authz.Authorizer` (its
    ``pod_proof``): ``token`` (a per-pod certificate, or the shared certificate with a token the
    ``reviewer`` verifies) or ``certificate`` (per-pod certificates only)."""

    def __init__(self, mode: PodProofMode, reviewer: TokenReviewer | None = None) -> None:
        if mode == "token" and reviewer is None:
            raise ValueError("agent_pod_proof='token' needs a TokenReviewer")
        if mode == "unverified":
            raise ValueError("agent_pod_proof='unverified' checks nothing: use no AgentPodProof")
        self.mode = mode
        self.reviewer = reviewer

    def prove(self, method: str, ident: Identity, context: grpc.ServicerContext) -> Identity:
        """``ident`` if it is a per-pod certificate, else the identity of the pod the call's token
        names; PermissionDenied naming the caller and what it lacks."""
        if ident.pod_uid:
            return ident
        if self.mode == "certificate" or self.reviewer is None:
            raise PermissionDenied(
                f"{method}: the caller {ident.uri!r} is a shared agent certificate, which does not prove "
                f"which pod it is; this controller (agent_pod_proof=certificate) accepts per-pod agent "
                f"certificates only (spiffe://{ident.trust_domain}/ns/{ident.namespace}/role/agent/pod/<pod-uid>)"
            )
        token = bearer_token(context.invocation_metadata())
        if token is None:
            raise PermissionDenied(
                f"{method}: the caller {ident.uri!r} is a shared agent certificate and sent no pod token; "
                f"this controller (agent_pod_proof=token) needs the ServiceAccount token of the agent's pod "
                f"(audience {self.reviewer.audience!r}; the agent's controller_token_file) as "
                f"'authorization: Bearer' metadata, or a per-pod certificate"
            )
        try:
            pod = self.reviewer.review(token, ident.namespace, caller_key(ident, context))
        except PermissionDenied as e:
            raise PermissionDenied(f"{method}: the caller {ident.uri!r}: {e}") from None
        return Identity(
            f"spiffe://{ident.trust_domain}/ns/{pod.namespace}/role/agent/pod/{pod.pod_uid}",
            ident.trust_domain,
            pod.namespace,
            "agent",
            pod.pod_uid,
            pod_name=pod.pod_name,
            proof=f"ServiceAccount token of pod {pod.namespace}/{pod.pod_name} (uid {pod.pod_uid})",
        )
