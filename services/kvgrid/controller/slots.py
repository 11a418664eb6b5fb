"""Per index slot: who answers for it, and which slots a query may list.

A lookup (:class:`~kvgrid.controller.index.BatchView`) names holders by slot; :class:`SlotTable`
resolves each slot to the pod UID, name and registry record that answer for it. It is derived from
the registry and the index's slot table only, so the controller builds it once per (slot table
version, registry version) and every query shares it until either changes.
"""

from __future__ import annotations

import numpy as np

from kvgrid.controller.registry import AgentRecord

__all__ = ["SlotTable"]


class SlotTable:
    """``uids[s]`` (None: not answerable), ``names[s]``, ``records[s]`` (None: another replica's
    agent) and ``holders[s]`` per slot; :meth:`eligible` / :meth:`candidates` give bool rows."""

    def __init__(
        self, holders: dict[int, str], nslots: int, records: dict[str, AgentRecord], remote_ok: bool
    ) -> None:
        self.uids: list[str | None] = [None] * nslots
        self.names: list[str] = [""] * nslots
        self.records: list[AgentRecord | None] = [None] * nslots
        self.holders: list[str] = [""] * nslots
        for slot, holder in holders.items():
            if slot >= nslots:
                continue
            rec = records.get(holder)
            if rec is None:
                # Another controller replica's agent (shared index): no namespace/load known here.
                if not remote_ok:
                    continue
                self.uids[slot] = holder.rpartition("/")[0]
            else:
                self.uids[slot] = rec.pod.pod_uid
                self.names[slot] = rec.pod.pod_name
                self.records[slot] = rec
            self.holders[slot] = holder
        self._by_namespace: dict[str, np.ndarray] = {}
        self.pod_refs: list[bytes] | None = None
        """Wire bytes of each slot's PodRef, filled by :mod:`kvgrid.controller.wire` on first use."""

    def eligible(self, namespace_id: str) -> np.ndarray:
        """bool per slot: answerable and serving ``namespace_id`` (agents that named none serve all)."""
        row = self._by_namespace.get(namespace_id)
        if row is None:
            row = np.array(
                [
                    uid is not None and (rec is None or not rec.namespaces or namespace_id in rec.namespaces)
                    for uid, rec in zip(self.uids, self.records, strict=True)
                ],
                dtype=bool,
            )
            if len(self._by_namespace) < 4096:  # bounded: namespace ids come from requests
                self._by_namespace[namespace_id] = row
        return row

    def candidates(self, uids: frozenset[str]) -> np.ndarray:
        """bool per slot: its pod UID is one of ``uids``."""
        return np.array([u is not None and u in uids for u in self.uids], dtype=bool)
