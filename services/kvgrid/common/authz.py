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
- :func:`caller` is the identity of the call the current thread serves (set by the server toolkit,
  :mod:`kvgrid.common.rpc`, for the duration of a call); None on a listener without TLS.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Literal, get_args

import grpc
import msgspec

from kvgrid.common.errors import PermissionDenied
from kvgrid.common.tls import ANY_NAMESPACE, TlsSettings, certificate_sans

__all__ = [
    "ANY_NAMESPACE",
    "ANY_ROLE",
    "Authorizer",
    "Identity",
    "Policy",
    "Role",
    "caller",
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
    """Set only by a per-pod agent certificate: the pod it proves."""


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


_CALLER: contextvars.ContextVar[Identity | None] = contextvars.ContextVar("kvgrid_caller", default=None)


def caller() -> Identity | None:
    """The proven identity of the call being served (None when the listener runs without TLS)."""
    return _CALLER.get()


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


class Authorizer:
    """Checks one call: identity from the TLS auth context (trust domain, then namespace), then the
    policy's roles.

    ``namespaces``: the Kubernetes namespaces whose identities are accepted (``*``: any); the default
    accepts every namespace, as a bare toolkit server does -- services build theirs with
    :meth:`for_settings`, which defaults to their own namespace.
    """

    def __init__(
        self, policy: Policy, trust_domain: str, namespaces: Collection[str] = (ANY_NAMESPACE,)
    ) -> None:
        if not namespaces:
            raise ValueError("namespaces=(): expected at least one namespace (or '*' for any)")
        self.policy = policy
        self.trust_domain = trust_domain
        self.namespaces: frozenset[str] | None = (
            None if ANY_NAMESPACE in namespaces else frozenset(namespaces)
        )
        """The accepted namespaces; None = every namespace of the trust domain."""

    @classmethod
    def for_settings(cls, policy: Policy, settings: TlsSettings) -> Authorizer:
        """The authorizer of a service with mTLS on: its ``tls_trust_domain``, and the namespaces of
        ``tls_allowed_namespaces`` or, when that is empty, of its own certificate's kvgrid identities
        in that trust domain (read from ``tls_cert_file`` now). ValueError naming the settings when
        neither tells a namespace."""
        td = settings.tls_trust_domain
        namespaces = list(settings.tls_allowed_namespaces)
        source = "tls_allowed_namespaces"
        if not namespaces:
            path = settings.tls_cert_file
            try:
                uris, names = certificate_sans(Path(path).read_bytes())
            except (OSError, ValueError) as e:
                raise ValueError(
                    f"tls_cert_file={path!r}: cannot read its identity ({e}), which names the namespace "
                    f"whose callers are accepted when tls_allowed_namespaces is empty"
                ) from None
            ids = [i for i in map(parse_identity, uris) if i is not None]
            ids += [i for i in map(parse_dns_identity, names) if i is not None]
            namespaces = sorted({i.namespace for i in ids if i.trust_domain == td})
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
        return cls(policy, td, namespaces)

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

    def check(self, method: str, context: grpc.ServicerContext) -> Identity:
        """The caller's identity if it is accepted and its role may call ``method``; else PermissionDenied."""
        ident = self.identify(context, method)
        roles = self.policy.allowed.get(method, frozenset())
        if ident.role not in roles:
            raise PermissionDenied(
                f"{method} needs a {_roles(roles)} identity; the caller {ident.uri!r} is a {ident.role}"
            )
        return ident
