"""Agent registry: one record per pod UID, fenced by epoch, kept alive by a lease.

Rules (docs/controller.md "Consistency"):

- A pod is known by UID; its current incarnation is its epoch. Holders in the index are
  ``<pod_uid>/<epoch>`` (never an IP), so a restarted agent (new epoch) never inherits old entries.
- Registering a newer epoch replaces the record; the caller drops the old holder's entries.
- Registering or heartbeating an *older* epoch than the known one is refused (:class:`StaleEpochError`).
- A lease lapses ``lease_ttl_ms`` after the last register/heartbeat; :meth:`Registry.expire` returns
  the lapsed records so the caller can drop their entries.
- With mTLS, a live pod belongs to the certificate identity that registered it
  (:meth:`Registry.check_owner`, :meth:`Registry.set_owner`): register, heartbeat and events for
  it from another identity are
  PERMISSION_DENIED, whatever epoch they carry; once its lease lapses the pod is free again.

The registry only keeps facts; the service decides what to do with them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import msgspec

from kvgrid.common.errors import FailedPrecondition, NotFound, PermissionDenied, check_namespace_id
from kvgrid.common.identity import PodIdentity

__all__ = ["AgentLoad", "AgentRecord", "RegisterOutcome", "Registry", "StaleEpochError", "UnknownPodError"]


class StaleEpochError(FailedPrecondition):
    """A request carries an older epoch than the registered one (FAILED_PRECONDITION)."""


class UnknownPodError(NotFound):
    """No live registration for this pod UID / epoch (NOT_FOUND or FAILED_PRECONDITION)."""


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
    registered_at: float
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


def _check_namespace_ids(namespaces: Sequence[str]) -> tuple[str, ...]:
    return tuple(check_namespace_id(ns, f"namespaces[{i}]") for i, ns in enumerate(namespaces))


class Registry:
    """Thread-safe map pod UID -> :class:`AgentRecord`."""

    def __init__(self, lease_ttl_ms: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.lease_s = lease_ttl_ms / 1000.0
        self._clock = clock
        self._by_uid: dict[str, AgentRecord] = {}
        self._owners: dict[str, str] = {}
        """pod UID -> URI of the certificate identity that registered it (mTLS only); only for
        pods in ``_by_uid``."""
        self._lock = threading.Lock()
        self.expired_total = 0

    def check_owner(self, pod_uid: str, identity: str) -> None:
        """PermissionDenied when ``pod_uid`` is registered (live) by an identity other than ``identity``."""
        with self._lock:
            owner = self._owners.get(pod_uid)
            if owner is not None and owner != identity:
                raise PermissionDenied(
                    f"pod {pod_uid!r} is registered by identity {owner!r}; the caller {identity!r} may not "
                    "register, heartbeat or publish for it (any epoch) while its lease is live"
                )

    def set_owner(self, pod_uid: str, identity: str) -> None:
        """Record ``identity`` as the owner of the live registration of ``pod_uid`` (kept until its
        lease lapses or it is removed; an existing owner is kept)."""
        with self._lock:
            if pod_uid in self._by_uid:
                self._owners.setdefault(pod_uid, identity)

    def register(
        self, pod: PodIdentity, namespaces: Sequence[str], l1_capacity_bytes: int = 0
    ) -> RegisterOutcome:
        ns = _check_namespace_ids(namespaces)
        now = self._clock()
        with self._lock:
            old = self._by_uid.get(pod.pod_uid)
            if old is not None and pod.epoch < old.pod.epoch:
                raise StaleEpochError(
                    f"pod {pod.pod_uid!r} epoch {pod.epoch} is older than the registered epoch "
                    f"{old.pod.epoch}: an agent restarted since; the old incarnation must stop"
                )
            if old is not None and pod.epoch == old.pod.epoch:
                old.pod = pod
                old.namespaces = ns or old.namespaces
                old.l1_capacity_bytes = l1_capacity_bytes or old.l1_capacity_bytes
                old.lease_deadline = now + self.lease_s
                return RegisterOutcome(record=old, replaced=None, is_new=False)
            rec = AgentRecord(
                pod=pod,
                namespaces=ns,
                l1_capacity_bytes=l1_capacity_bytes,
                load=AgentLoad(l1_capacity_bytes=l1_capacity_bytes),
                lease_deadline=now + self.lease_s,
                registered_at=now,
            )
            self._by_uid[pod.pod_uid] = rec
            return RegisterOutcome(record=rec, replaced=old, is_new=True)

    def heartbeat(self, pod_uid: str, epoch: int, load: AgentLoad | None) -> AgentRecord:
        """Renew the lease; raises UnknownPodError (register again) or StaleEpochError."""
        now = self._clock()
        with self._lock:
            rec = self._by_uid.get(pod_uid)
            if rec is None or epoch > rec.pod.epoch:
                raise UnknownPodError(f"pod {pod_uid!r} epoch {epoch} is not registered (lease lapsed?)")
            if epoch < rec.pod.epoch:
                raise StaleEpochError(
                    f"pod {pod_uid!r} epoch {epoch} is older than the registered epoch {rec.pod.epoch}"
                )
            rec.lease_deadline = now + self.lease_s
            if load is not None:
                rec.load = load
            return rec

    def get(self, pod_uid: str) -> AgentRecord | None:
        with self._lock:
            return self._by_uid.get(pod_uid)

    def current(self, pod_uid: str, epoch: int) -> AgentRecord | None:
        """The record if ``epoch`` is the registered one; StaleEpochError if older."""
        with self._lock:
            rec = self._by_uid.get(pod_uid)
            if rec is None or epoch > rec.pod.epoch:
                return None
            if epoch < rec.pod.epoch:
                raise StaleEpochError(
                    f"pod {pod_uid!r} epoch {epoch} is older than the registered epoch {rec.pod.epoch}"
                )
            return rec

    def all(self) -> list[AgentRecord]:
        with self._lock:
            return list(self._by_uid.values())

    def lease_remaining_ms(self, rec: AgentRecord) -> int:
        return int((rec.lease_deadline - self._clock()) * 1000)

    def expire(self) -> list[AgentRecord]:
        """Remove and return the records whose lease lapsed."""
        now = self._clock()
        with self._lock:
            gone = [r for r in self._by_uid.values() if r.lease_deadline <= now]
            for r in gone:
                del self._by_uid[r.pod.pod_uid]
                self._owners.pop(r.pod.pod_uid, None)
            self.expired_total += len(gone)
            return gone

    def remove(self, pod_uid: str) -> AgentRecord | None:
        with self._lock:
            self._owners.pop(pod_uid, None)
            return self._by_uid.pop(pod_uid, None)
