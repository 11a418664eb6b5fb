"""Who the caller is (its verified certificate's URI or DNS SAN) and which methods its role may call.

Identity scheme (the chart issues exactly these; docs/security.md). URI SANs (cert-manager)::

    spiffe://<trust-domain>/ns/<namespace>/role/agent                 one shared agent certificate
    spiffe://<trust-domain>/ns/<namespace>/role/agent/pod/<pod-uid>   a per-pod agent certificate
    spiffe://<trust-domain>/ns/<namespace>/role/controller
    spiffe://<trust-domain>/ns/<namespace>/role/router

and a DNS SAN form for certificates Helm makes itself (its ``genSignedCert`` writes every alt name as
a DNS SAN, never a URI), with no per-pod variant::

    <agent|controller|router>.<namespace>.kvgrid-id.<trust-domain>

Invariants:

- An identity is read only from a certificate gRPC verified against the CA (``peer_uri`` and
  ``peer_dns`` of the call's auth context: SANs only, never the subject's common name); nothing a
  client *sends* names it. A certificate with several kvgrid identities is the most specific one: a
  certificate with a kvgrid URI is judged by its URIs alone (its DNS SANs are not read), and a
  per-pod agent URI wins over the shared one.
- A DNS name is an identity only with exactly a role label, a namespace label, the ``kvgrid-id``
  label and then the whole trust domain; anything after the trust domain makes it another trust
  domain (``agent.x.kvgrid-id.cluster.local.evil.com`` is in ``cluster.local.evil.com``).
- A caller outside the trust domain, without a kvgrid identity, or whose role the method's
  :class:`Policy` entry does not list is PERMISSION_DENIED with a text naming the method, the roles
  it needs and the caller's URI. A method absent from the policy is refused for everyone.
- The trust domain is not a tenant boundary (a shared issuer or corporate CA signs many
  namespaces): a caller is also PERMISSION_DENIED, whatever the method, unless its identity's
  Kubernetes namespace is one the :class:`Authorizer` accepts, with a text naming the method, the
  caller's namespace and the accepted ones. A service's authorizer (:meth:`Authorizer.for_settings`)
  accepts ``tls_allowed_namespaces``, or when that is empty the namespace(s) of the service's own
  certificate identity (a certificate without one is a config error at start); ``*`` accepts every
  namespace of the trust domain.
- Which pod an agent is (docs/security.md, "Agent identity modes"): a per-pod certificate proves it
  by its URI. An :class:`Authorizer` with a ``pod_proof`` (the controller's ``agent_pod_proof``:
  :class:`kvgrid.common.pod_tokens.AgentPodProof`) also requires it, for the methods its
  :class:`Policy` marks ``pod_bound``, from an agent with the shared certificate: the pod's
  ServiceAccount token, verified by the Kubernetes API server, turns the caller into that pod's
  agent (the per-pod URI, its UID and name); without one the call is PERMISSION_DENIED.
  :meth:`Identity.check_acts_for` is the one check that a proven pod acts only for itself.
- :func:`caller` is the identity of the call the current thread serves (set by the server toolkit,
  :mod:`kvgrid.common.rpc`, for the duration of a call); None on a listener without TLS.
  :func:`call_context` is that call's ``grpc.ServicerContext`` on a server with an authorizer (an
  :meth:`Authorizer.unauthenticated` one on a plaintext listener), so a method can bound the call
  (cancel it at a serving deadline, tell callers apart by address without TLS).
- Tenants (:class:`ChunkReaders`, the agent's chunks; docs/security.md, "Tenants"): an identity's
  tenant is its Kubernetes namespace, the only tenant a certificate names. Every chunk an agent
  holds was stored by an engine of its own pod, or fetched for one, so it belongs to the agent's
  namespace -- the namespace(s) of the agent's own certificate identity. Identities of that namespace
  read every namespace id (a single-namespace install works as before); an identity of another
  namespace reads only the namespace ids ``chunk_readers`` grants its namespace (``<ns>`` every
  one, ``<ns>/<namespace-id>`` that one, ``*`` any namespace), else PERMISSION_DENIED naming the
  caller, its namespace, the namespace id and this agent's tenant.
"""

from __future__ import annotations

import contextvars
import logging
import re
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Literal, Protocol, get_args

import grpc
import msgspec

from kvgrid.common.errors import PermissionDenied, is_namespace_id
from kvgrid.common.tls import ANY_NAMESPACE, TlsSettings, certificate_sans

__all__ = [
    "ANY_NAMESPACE",
    "ANY_ROLE",
    "Authorizer",
    "ChunkReaders",
    "Identity",
    "PodProof",
    "Policy",
    "Role",
    "call_context",
    "caller",
    "certificate_namespaces",
    "parse_chunk_readers",
    "parse_dns_identity",
    "parse_identity",
    "set_caller",
]

log = logging.getLogger(__name__)

Role = Literal["agent", "controller", "router"]
ROLES: tuple[Role, ...] = get_args(Role)
ANY_ROLE: frozenset[Role] = frozenset(ROLES)


DNS_ID_LABEL = "kvgrid-id"
"""The label between namespace and trust domain that marks a DNS SAN as a kvgrid identity."""


class Identity(msgspec.Struct, frozen=True):
    uri: str
    """The SAN that proves it, as written in the certificate (a URI, or a DNS name)."""
    trust_domain: str
    namespace: str
    role: Role
    pod_uid: str = ""
    """Set only for an agent that proved its pod (a per-pod certificate, or a pod token): that pod."""
    pod_name: str = ""
    """The pod's name, when a pod token proved it (a certificate names the UID only)."""
    proof: str = ""
    """What proved a pod other than the certificate's SAN ("" = the certificate), for messages."""

    def describe(self) -> str:
        """The caller as messages name it: its URI, and what proved its pod when not the certificate."""
        return f"{self.uri!r} ({self.proof})" if self.proof else repr(self.uri)

    def check_acts_for(
        self,
        pod_uid: str,
        what: str,
        pod_name: str | None = None,
        rule: str = "an agent may act only for its own pod",
    ) -> None:
        """PermissionDenied (``what``: the call and the pod it names, e.g. ``"Heartbeat for
        pod_uid='x'"``) naming both pods unless this identity may act for ``pod_uid`` (and, when
        a pod token proved it and ``pod_name`` is not empty, that name): an identity without a proven pod
        (a shared agent certificate, a controller) is not limited here. One pod's agents may
        register as ``<pod uid>-gpu<i>`` (one agent per GPU of the pod, the chart's sidecars) when a
        pod token proved the pod; a per-pod certificate names that suffix itself."""
        if not self.pod_uid:
            return
        ok = pod_uid == self.pod_uid
        if not ok and self.pod_name:
            prefix = f"{self.pod_uid}-gpu"
            ok = pod_uid.startswith(prefix) and pod_uid[len(prefix) :].isdigit()
        if not ok:
            raise PermissionDenied(
                f"{what}: the caller {self.describe()} proves pod {self.pod_uid!r}; {rule}"
            )
        if self.pod_name and pod_name and pod_name != self.pod_name:
            raise PermissionDenied(
                f"{what} with pod_name={pod_name!r}: the caller {self.describe()} proves pod "
                f"{self.pod_name!r} (uid {self.pod_uid!r}); expected its own pod name"
            )


def parse_identity(uri: str) -> Identity | None:
    """The kvgrid identity a URI SAN names, or None when it is not one."""
    if not uri.startswith("spiffe://"):
        return None
    td, _, path = uri[len("spiffe://") :].partition("/")
    parts = path.split("/")
    if not td or len(parts) not in (4, 6) or parts[0] != "ns" or parts[2] != "role" or not parts[1]:
        return None
    role = parts[3]
    if role not in ROLES:
        return None
    if len(parts) == 6:
        if role != "agent" or parts[4] != "pod" or not parts[5]:
            return None
        return Identity(uri, td, parts[1], "agent", parts[5])
    return Identity(uri, td, parts[1], role)


def parse_dns_identity(name: str) -> Identity | None:
    """The kvgrid identity a DNS SAN names (``<role>.<namespace>.kvgrid-id.<trust-domain>``), or None."""
    labels = name.lower().split(".")
    if len(labels) < 4 or labels[2] != DNS_ID_LABEL or not labels[1] or not all(labels[3:]):
        return None
    role = labels[0]
    if role not in ROLES:
        return None
    return Identity(name, ".".join(labels[3:]), labels[1], role)


class Policy(msgspec.Struct, frozen=True):
    """Method name -> the roles that may call it, for one service on one listener."""

    allowed: Mapping[str, frozenset[Role]]
    pod_bound: frozenset[str] = frozenset()
    """Methods an agent may call only as a proven pod when the :class:`Authorizer` has a ``pod_proof``."""


class PodProof(Protocol):
    """Proves which pod an agent caller is (:class:`kvgrid.common.pod_tokens.AgentPodProof`)."""

    def prove(self, method: str, ident: Identity, context: grpc.ServicerContext) -> Identity:
        """The caller's identity with its pod proven, or PermissionDenied / Unavailable."""
        ...


_CALLER: contextvars.ContextVar[Identity | None] = contextvars.ContextVar("kvgrid_caller", default=None)
_CONTEXT: contextvars.ContextVar[grpc.ServicerContext | None] = contextvars.ContextVar(
    "kvgrid_call_context", default=None
)


def caller() -> Identity | None:
    """The proven identity of the call being served (None when the listener runs without TLS)."""
    return _CALLER.get()


def call_context() -> grpc.ServicerContext | None:
    """The ``grpc.ServicerContext`` of the call being served, set when an :class:`Authorizer` admits
    it; None on a server without one (the agent's Unix socket). Only meaningful inside a call."""
    return _CONTEXT.get()


def set_caller(identity: Identity | None) -> None:
    """Set by the server toolkit at the start and end of every call it serves."""
    _CALLER.set(identity)


def _sans(auth: Mapping[str, object], key: str) -> list[str]:
    """One auth-context property's values (grpc gives a list of bytes per property)."""
    raw = auth.get(key) or []
    values: list[object] = list(raw) if isinstance(raw, (list, tuple)) else [raw]
    return [v.decode(errors="replace") if isinstance(v, bytes) else str(v) for v in values]


def _roles(roles: frozenset[Role]) -> str:
    return " or ".join(sorted(roles)) or "no"


def _namespaces(namespaces: Collection[str]) -> str:
    return ", ".join(repr(n) for n in sorted(namespaces))


def certificate_namespaces(settings: TlsSettings) -> tuple[list[str], list[str], list[str]]:
    """(namespaces, URI SANs, DNS SANs) of the service's own certificate (``tls_cert_file``): the
    namespaces of its kvgrid identities in ``tls_trust_domain``, sorted. ValueError naming the file
    when it cannot be read."""
    path = settings.tls_cert_file
    try:
        uris, names = certificate_sans(Path(path).read_bytes())
    except (OSError, ValueError) as e:
        raise ValueError(f"tls_cert_file={path!r}: cannot read its identity ({e})") from None
    ids = [i for i in map(parse_identity, uris) if i is not None]
    ids += [i for i in map(parse_dns_identity, names) if i is not None]
    return sorted({i.namespace for i in ids if i.trust_domain == settings.tls_trust_domain}), uris, names


class Authorizer:
    """Checks one call: identity from the TLS auth context (trust domain, then namespace), then the
    policy's roles.

    ``namespaces``: the Kubernetes namespaces whose identities are accepted (``*``: any); the default
    accepts every namespace, as a bare toolkit server does -- services build theirs with
    :meth:`for_settings`, which defaults to their own namespace.
    """

    def __init__(
        self,
        policy: Policy,
        trust_domain: str,
        namespaces: Collection[str] = (ANY_NAMESPACE,),
        pod_proof: PodProof | None = None,
    ) -> None:
        if not namespaces:
            raise ValueError("namespaces=(): expected at least one namespace (or '*' for any)")
        self.policy = policy
        self.trust_domain = trust_domain
        self.namespaces: frozenset[str] | None = (
            None if ANY_NAMESPACE in namespaces else frozenset(namespaces)
        )
        """The accepted namespaces; None = every namespace of the trust domain."""
        self.authenticates = True
        """False for :meth:`unauthenticated`: no identity is read, every call is admitted."""
        self.pod_proof = pod_proof
        """Proves an agent caller's pod for the policy's ``pod_bound`` methods (None: the identity
        the certificate proves is all there is: a shared agent certificate may claim any pod)."""

    @classmethod
    def unauthenticated(cls, policy: Policy) -> Authorizer:
        """For a plaintext listener: admits every call with no identity (:func:`caller` is None) and
        still publishes its :func:`call_context`."""
        authorizer = cls(policy, "")
        authorizer.authenticates = False
        return authorizer

    @classmethod
    def for_settings(
        cls, policy: Policy, settings: TlsSettings, pod_proof: PodProof | None = None
    ) -> Authorizer:
        """The authorizer of a service with mTLS on: its ``tls_trust_domain``, and the namespaces of
        ``tls_allowed_namespaces`` or, when that is empty, of its own certificate's kvgrid identities
        in that trust domain (read from ``tls_cert_file`` now); ``pod_proof`` as in the constructor.
        ValueError naming the settings when neither tells a namespace."""
        td = settings.tls_trust_domain
        namespaces = list(settings.tls_allowed_namespaces)
        source = "tls_allowed_namespaces"
        if not namespaces:
            path = settings.tls_cert_file
            try:
                namespaces, uris, names = certificate_namespaces(settings)
            except ValueError as e:
                raise ValueError(
                    f"{e}, which names the namespace whose callers are accepted when "
                    f"tls_allowed_namespaces is empty"
                ) from None
            if not namespaces:
                raise ValueError(
                    f"tls_cert_file={path!r} carries no kvgrid identity of trust domain {td!r} (URI SANs: "
                    f"{uris or 'none'}; DNS SANs: {names or 'none'}), so its namespace is unknown: set "
                    f"tls_allowed_namespaces to the namespaces whose callers are accepted"
                )
            source = "this service's certificate"
        log.info(
            "authorizing callers of trust domain %r, namespaces %s (from %s)",
            td,
            ", ".join(namespaces),
            source,
        )
        return cls(policy, td, namespaces, pod_proof)

    def identify(self, context: grpc.ServicerContext, method: str = "") -> Identity:
        """The caller's identity, if it is of our trust domain and an accepted namespace; else
        PermissionDenied (``method`` names the call in the text)."""
        auth = context.auth_context()
        uris, names = _sans(auth, "peer_uri"), _sans(auth, "peer_dns")
        by_uri = [i for i in map(parse_identity, uris) if i is not None]
        by_dns = [i for i in map(parse_dns_identity, names) if i is not None]
        ids = by_uri + by_dns
        if not ids:
            raise PermissionDenied(
                f"client certificate carries no kvgrid identity (URI SANs: {uris or 'none'}; DNS SANs: "
                f"{names or 'none'}); expected a URI SAN "
                f"spiffe://{self.trust_domain}/ns/<namespace>/role/<agent|controller|router> or a DNS SAN "
                f"<agent|controller|router>.<namespace>.{DNS_ID_LABEL}.{self.trust_domain}"
            )
        # A URI identity wins: DNS SANs are read only from a certificate without a kvgrid URI.
        ours = [i for i in (by_uri or by_dns) if i.trust_domain == self.trust_domain]
        if not ours:
            raise PermissionDenied(
                f"client identity {ids[0].uri!r} is outside trust domain {self.trust_domain!r}"
            )
        ident = max(ours, key=lambda i: bool(i.pod_uid))
        if self.namespaces is not None and ident.namespace not in self.namespaces:
            raise PermissionDenied(
                f"{method or 'this call'}: the caller {ident.uri!r} is of namespace {ident.namespace!r}; "
                f"this server accepts callers of namespace {_namespaces(self.namespaces)} only "
                f"(tls_allowed_namespaces; empty = the namespace of the server's own certificate)"
            )
        return ident

    def check(self, method: str, context: grpc.ServicerContext) -> Identity | None:
        """The caller's identity if it is accepted and its role may call ``method``; else
        PermissionDenied. Publishes ``context`` (:func:`call_context`) either way; an
        :meth:`unauthenticated` authorizer returns None."""
        _CONTEXT.set(context)
        if not self.authenticates:
            return None
        ident = self.identify(context, method)
        roles = self.policy.allowed.get(method, frozenset())
        if ident.role not in roles:
            raise PermissionDenied(
                f"{method} needs a {_roles(roles)} identity; the caller {ident.uri!r} is a {ident.role}"
            )
        if self.pod_proof is not None and ident.role == "agent" and method in self.policy.pod_bound:
            ident = self.pod_proof.prove(method, ident, context)
        return ident


# ---- tenants: who may read an agent's chunks ----------------------------------------------------

_K8S_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")

Grants = Mapping[str, frozenset[str] | None]
"""Kubernetes namespace (or ``*``) -> the namespace ids its identities may read (None: every one)."""


def parse_chunk_readers(
    entries: Sequence[str], field: str = "chunk_readers"
) -> dict[str, frozenset[str] | None]:
    """The grants of ``chunk_readers`` entries: ``<ns>`` (every namespace id), ``<ns>/<namespace-id>``
    (that one), ``*`` or ``*/<namespace-id>`` (any namespace); ValueError naming the entry."""
    out: dict[str, frozenset[str] | None] = {}
    for entry in entries:
        ns, sep, nsid = entry.partition("/")
        if ns != ANY_NAMESPACE and not _K8S_NAMESPACE.fullmatch(ns):
            raise ValueError(
                f"{field}={list(entries)!r}: {entry!r} does not start with a Kubernetes namespace name "
                f"(lowercase letters, digits and '-', at most 63) or {ANY_NAMESPACE!r}; expected "
                f"<namespace>, <namespace>/<namespace-id> or {ANY_NAMESPACE}"
            )
        if sep and not is_namespace_id(nsid):
            raise ValueError(
                f"{field}={list(entries)!r}: {entry!r} names namespace id {nsid!r}; expected the 32-char "
                f"lowercase hex namespace id after '/'"
            )
        if not sep:
            out[ns] = None
        elif ns not in out or out[ns] is not None:
            out[ns] = (out.get(ns) or frozenset()) | {nsid}
    return out


def _grant_text(grant: frozenset[str] | None) -> str:
    return "every namespace id" if grant is None else ", ".join(sorted(grant)) or "no namespace id"


class ChunkReaders:
    """Which identities may read which namespace ids of one agent's chunks (FetchChunks, its data
    plane, Snapshot): the agent's own tenant (``tenant``: the namespace(s) of its certificate
    identity) reads everything; another namespace reads what ``grants`` give it."""

    def __init__(self, tenant: Collection[str], grants: Grants | None = None) -> None:
        self.tenant = frozenset(tenant)
        self.grants: dict[str, frozenset[str] | None] = dict(grants or {})

    @classmethod
    def for_settings(cls, settings: TlsSettings, entries: Sequence[str]) -> ChunkReaders:
        """The readers of an agent with mTLS on: its tenant from ``tls_cert_file`` (read now) and the
        grants of ``entries`` (``chunk_readers``). ValueError naming the settings when the certificate
        names no tenant and nothing is granted (nobody could read a chunk)."""
        tenant, uris, names = certificate_namespaces(settings)
        grants = parse_chunk_readers(entries)
        if not tenant and not grants:
            raise ValueError(
                f"tls_cert_file={settings.tls_cert_file!r} carries no kvgrid identity of trust domain "
                f"{settings.tls_trust_domain!r} (URI SANs: {uris or 'none'}; DNS SANs: "
                f"{names or 'none'}), so this agent's tenant is unknown: set chunk_readers to the "
                f"namespaces whose identities may read its chunks"
            )
        log.info(
            "chunks readable by identities of namespace %s (this agent's tenant)%s",
            ", ".join(sorted(tenant)) or "none",
            "".join(f"; {ns}: {_grant_text(g)}" for ns, g in sorted(grants.items())),
        )
        return cls(tenant, grants)

    def readable(self, ident: Identity) -> frozenset[str] | None:
        """The namespace ids ``ident`` may read (None: every one; empty: none)."""
        if ident.namespace in self.tenant:
            return None
        ids: frozenset[str] = frozenset()
        for key in (ident.namespace, ANY_NAMESPACE):
            if key in self.grants:
                grant = self.grants[key]
                if grant is None:
                    return None
                ids |= grant
        return ids

    def refusal(self, method: str, ident: Identity, what: str) -> PermissionDenied:
        """The PERMISSION_DENIED of ``ident`` reading ``what`` (a namespace id, or its chunks at all)."""
        granted = self.readable(ident)
        return PermissionDenied(
            f"{method}: the caller {ident.uri!r} of namespace {ident.namespace!r} may not read {what}: "
            f"this agent's chunks belong to tenant {_namespaces(self.tenant) or 'none'} (the namespace "
            f"of its certificate), and chunk_readers grants namespace {ident.namespace!r} "
            f"{_grant_text(granted) if granted is not None else 'every namespace id'}"
        )

    def check(self, method: str, ident: Identity, namespace_id: str) -> None:
        """PermissionDenied naming the caller and the tenant unless ``ident`` may read ``namespace_id``."""
        ids = self.readable(ident)
        if ids is not None and namespace_id not in ids:
            raise self.refusal(method, ident, f"namespace_id={namespace_id!r}")
