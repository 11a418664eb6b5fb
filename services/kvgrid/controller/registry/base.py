"""The agent registry's interface and types: one record per pod UID, fenced by epoch, kept by a lease.

Rules every backend keeps (docs/controller.md "Consistency story", "One registry for all replicas"):

- A pod is known by UID; its current incarnation is its epoch. Holders in the index are
  ``<pod_uid>/<epoch>`` (never an IP), so a restarted agent (new epoch) never inherits old entries.
- Registering a newer epoch replaces the record; the caller drops the old holder's entries.
- Registering or heartbeating an *older* epoch than the known one is refused (:class:`StaleEpochError`).
- A lease lapses ``lease_ttl_ms`` after the last register/heartbeat; :meth:`AgentRegistry.expire`
  removes and returns the lapsed records so the caller can drop their entries.
- With mTLS, a live pod belongs to the certificate identity that registered it
  (:meth:`AgentRegistry.check_owner`; ``owner=`` of :meth:`AgentRegistry.register` checks and sets
  it in the same atomic step): register, heartbeat and events for it from another identity are
  PERMISSION_DENIED, whatever epoch they carry; once its lease lapses the pod is free again.
- A record object stays the same object while its (pod UID, epoch) is registered: callers compare
  records by identity (an event stream notices a re-registration that way).
- Every backend refuses in the same words: :func:`stale_epoch`, :func:`not_registered`,
  :func:`owned_elsewhere`.

A shared backend (``shared`` True) keeps these facts where every controller replica reads them;
each replica holds a mirror that :meth:`AgentRegistry.sync` refreshes, and it must not answer
queries before the first successful sync (``synced``). The registry only keeps facts; the
controller decides what to do with them.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import msgspec

from kvgrid.common.errors import FailedPrecondition, NotFound, PermissionDenied, check_namespace_id
from kvgrid.common.identity import PodIdentity

__all__ = [
    "AgentLoad",
    "AgentRecord",
    "AgentRegistry",
    "RegisterOutcome",
    "StaleEpochError",
    "SyncResult",
    "UnknownPodError",
    "check_namespace_ids",
    "not_registered",
    "owned_elsewhere",
    "stale_epoch",
]


class StaleEpochError(FailedPrecondition):
    """A request carries an older epoch than the registered one (FAILED_PRECONDITION)."""


class UnknownPodError(NotFound):
    """No live registration for this pod UID / epoch (NOT_FOUND or FAILED_PRECONDITION)."""


def stale_epoch(pod_uid: str, epoch: int, registered: int, *, registering: bool = False) -> StaleEpochError:
    """The refusal of ``epoch`` of ``pod_uid``, older than the ``registered`` one; a registration
    is told why (the agent restarted since)."""
    why = ": an agent restarted since; the old incarnation must stop" if registering else ""
    return StaleEpochError(
        f"pod {pod_uid!r} epoch {epoch} is older than the registered epoch {registered}{why}"
    )


def not_registered(pod_uid: str, epoch: int) -> UnknownPodError:
    """The answer to a heartbeat of a (pod UID, epoch) the registry does not hold."""
    return UnknownPodError(f"pod {pod_uid!r} epoch {epoch} is not registered (lease lapsed?)")


def owned_elsewhere(pod_uid: str, owner: str, identity: str) -> PermissionDenied:
    """The refusal of ``identity`` for a live pod that ``owner`` registered (mTLS)."""
    return PermissionDenied(
        f"pod {pod_uid!r} is registered by identity {owner!r}; the caller {identity!r} may not "
        "register, heartbeat or publish for it (any epoch) while its lease is live"
    )


class AgentLoad(msgspec.Struct, frozen=True):
    running_requests: int = 0
    waiting_requests: int = 0
    gpu_kv_usage: float = 0.0
    l1_used_bytes: int = 0
    l1_capacity_bytes: int = 0


class AgentRecord(msgspec.Struct):
    pod: PodIdentity
    namespaces: tuple[str, ...]
    l1_capacity_bytes: int
    load: AgentLoad
    lease_deadline: float
    """On this process's monotonic clock."""
    registered_at: float
    last_sequence: int = 0
    """A shared registry: the last event sequence the replica serving this agent's stream applied
    (published by that replica's sweeps); 0 otherwise."""
    dropped: bool = False
    """Set (before its entries are dropped) once this incarnation left the registry: late events,
    resyncs and vLLM events for it must not write to the index any more."""

    @property
    def holder(self) -> str:
        return self.pod.holder_id


class RegisterOutcome(msgspec.Struct, frozen=True):
    record: AgentRecord
    replaced: AgentRecord | None
    """The previous incarnation (older epoch) whose entries must be dropped."""
    is_new: bool
    """New pod or new epoch: its entries must be pulled from the agent."""


class SyncResult(msgspec.Struct, frozen=True):
    gone: list[AgentRecord]
    """Records that left the registry through another replica (lapsed there, replaced, removed):
    marked ``dropped``; the caller fences their writers and drops their entries."""
    changed: bool
    """Records appeared, left, or changed their pod identity or namespaces (slot tables are stale)."""


def check_namespace_ids(namespaces: Sequence[str]) -> tuple[str, ...]:
    return tuple(check_namespace_id(ns, f"namespaces[{i}]") for i, ns in enumerate(namespaces))


class AgentRegistry(abc.ABC):
    """Map pod UID -> :class:`AgentRecord` (thread-safe in every backend)."""

    lease_s: float
    expired_total: int
    """Leases this replica found lapsed and removed."""

    @property
    def shared(self) -> bool:
        """True when every controller replica sees the same registry (a shared backend)."""
        return False

    @property
    def synced(self) -> bool:
        """True once this replica holds the registry's view (always, for a local backend)."""
        return True

    @abc.abstractmethod
    def check_owner(self, pod_uid: str, identity: str) -> None:
        """PermissionDenied when ``pod_uid`` is registered (live) by an identity other than ``identity``."""

    @abc.abstractmethod
    def set_owner(self, pod_uid: str, identity: str) -> None:
        """Record ``identity`` as the owner of the live registration of ``pod_uid`` (kept until its
        lease lapses or it is removed; an existing owner is kept)."""

    @abc.abstractmethod
    def register(
        self,
        pod: PodIdentity,
        namespaces: Sequence[str],
        l1_capacity_bytes: int = 0,
        *,
        owner: str | None = None,
    ) -> RegisterOutcome:
        """Register ``pod``; with ``owner`` (an mTLS identity) the ownership check, the epoch check,
        the write and the ownership record are one atomic step (PermissionDenied, StaleEpochError)."""

    @abc.abstractmethod
    def heartbeat(self, pod_uid: str, epoch: int, load: AgentLoad | None) -> AgentRecord:
        """Renew the lease; raises UnknownPodError (register again) or StaleEpochError."""

    @abc.abstractmethod
    def get(self, pod_uid: str) -> AgentRecord | None: ...

    @abc.abstractmethod
    def current(self, pod_uid: str, epoch: int) -> AgentRecord | None:
        """The record if ``epoch`` is the registered one; None if unknown or newer; StaleEpochError
        if older."""

    @abc.abstractmethod
    def all(self) -> list[AgentRecord]: ...

    @abc.abstractmethod
    def lease_remaining_ms(self, rec: AgentRecord) -> int: ...

    @abc.abstractmethod
    def expire(self) -> list[AgentRecord]:
        """Remove and return the records whose lease lapsed (marked nothing: the caller drops them)."""

    @abc.abstractmethod
    def remove(self, pod_uid: str) -> AgentRecord | None: ...

    @abc.abstractmethod
    def learn_namespaces(self, rec: AgentRecord, namespaces: Sequence[str]) -> bool:
        """Add valid ``namespaces`` (already checked) to ``rec``'s; True when they changed."""

    def sync(self) -> SyncResult:
        """Refresh this replica's view from the backend (nothing to do for a local one)."""
        return SyncResult([], False)

    def publish_sequences(self, sequences: dict[str, tuple[int, int]]) -> None:  # noqa: B027
        """Share ``pod_uid -> (epoch, last applied sequence)`` of the streams this replica serves
        (a local registry has nobody to share them with)."""

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release the backend's connections."""
