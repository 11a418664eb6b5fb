"""In-process backend of :class:`~kvgrid.controller.registry.base.AgentRegistry` (the default).

Each controller replica keeps its own records, so with several replicas each knows only the agents
that talk to it; use the shared backend (:mod:`kvgrid.controller.registry.redis`) for replicas.
Rules: :mod:`kvgrid.controller.registry.base`. One lock guards the records and the owners, so an
ownership check and the registration it guards are one step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from kvgrid.common.identity import PodIdentity
from kvgrid.controller.registry.base import (
    AgentLoad,
    AgentRecord,
    AgentRegistry,
    RegisterOutcome,
    check_namespace_ids,
    not_registered,
    owned_elsewhere,
    stale_epoch,
)

__all__ = ["MemoryRegistry", "Registry"]


class MemoryRegistry(AgentRegistry):
    """Thread-safe map pod UID -> :class:`AgentRecord` in this process."""

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
                raise owned_elsewhere(pod_uid, owner, identity)

    def set_owner(self, pod_uid: str, identity: str) -> None:
        """Record ``identity`` as the owner of the live registration of ``pod_uid`` (kept until its
        lease lapses or it is removed; an existing owner is kept)."""
        with self._lock:
            if pod_uid in self._by_uid:
                self._owners.setdefault(pod_uid, identity)

    def register(
        self,
        pod: PodIdentity,
        namespaces: Sequence[str],
        l1_capacity_bytes: int = 0,
        *,
        owner: str | None = None,
    ) -> RegisterOutcome:
        ns = check_namespace_ids(namespaces)
        now = self._clock()
        with self._lock:
            if owner is not None:
                cur_owner = self._owners.get(pod.pod_uid)
                if cur_owner is not None and cur_owner != owner:
                    raise owned_elsewhere(pod.pod_uid, cur_owner, owner)
            out = self._register_locked(pod, ns, l1_capacity_bytes, now)
            if owner is not None:
                self._owners.setdefault(pod.pod_uid, owner)
            return out

    def _register_locked(
        self, pod: PodIdentity, ns: tuple[str, ...], l1_capacity_bytes: int, now: float
    ) -> RegisterOutcome:
        old = self._by_uid.get(pod.pod_uid)
        if old is not None and pod.epoch < old.pod.epoch:
            raise stale_epoch(pod.pod_uid, pod.epoch, old.pod.epoch, registering=True)
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
                raise not_registered(pod_uid, epoch)
            if epoch < rec.pod.epoch:
                raise stale_epoch(pod_uid, epoch, rec.pod.epoch)
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
                raise stale_epoch(pod_uid, epoch, rec.pod.epoch)
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

    def learn_namespaces(self, rec: AgentRecord, namespaces: Sequence[str]) -> bool:
        with self._lock:
            if not namespaces or set(namespaces) <= set(rec.namespaces):
                return False
            rec.namespaces = tuple(dict.fromkeys((*rec.namespaces, *namespaces)))
            return True


Registry = MemoryRegistry
"""The name this backend had before the registry had backends."""
