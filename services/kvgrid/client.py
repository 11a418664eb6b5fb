"""Pods ranked for a prompt, for routers that embed kvgrid's routing (``kvgrid router`` uses it).

Tokens in, ranked pods out: :meth:`PodRanker.rank` sends the prompt's token ids and the engines'
key namespace to the controller's ``Score`` and returns the pods best first (lowest estimated time
to first token). Invariants:

- ``rank`` never raises for a controller problem: when ``Score`` fails (down, deadline, TLS) the
  answer is the fallback order, ``source == "fallback"`` with the reason in ``error``, and a warning
  is logged (once per outage, not per request). After a failure ``Score`` is not asked again for
  ``retry_s``, so an unreachable controller (connects that hang until the deadline) costs one
  deadline per ``retry_s``, not one per request.
- The fallback order is least-loaded, then round-robin: pods with the fewest requests this client
  has in flight (:meth:`PodRanker.in_flight`) first, ties rotated from call to call.
- Known pods are the union of the controller's ``ListAgents`` (refreshed at most every
  ``agents_refresh_s``; the last good list is kept through an outage) and ``static_pods``. A Score
  answer lists the pods it ranked first, then any other known pod in fallback order, so a pod
  without an agent (or one the controller has not seen yet) is still a failover target.

- Transport: ``Score`` and ``ListAgents`` go to the controller's lean lookup listener when
  ``lookup_address`` is given (the same protobuf messages as length-prefixed frames,
  :mod:`kvgrid.controller.lookup_server`; mTLS with the same ``tls_*`` files, checking the same
  ``tls_server_name``), else over gRPC to ``controller``. Never both: with a lookup address a
  listener failure is a controller error like any other (fallback order, reason in ``error``),
  never a silent switch to gRPC, so what is configured is what is measured.

Thread-safe; one instance per process is enough (one gRPC channel reconnecting by itself, or a
pool of listener connections, one per concurrent caller).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Literal

import grpc
import msgspec

from kvgrid.api.client import controller_channel
from kvgrid.api.v1 import common_pb2, controller_pb2, controller_pb2_grpc
from kvgrid.common.hashing import KeyNamespace
from kvgrid.common.tls import CONTROLLER_SERVER_NAME, tls_files
from kvgrid.common.wire import key_namespace_to_proto
from kvgrid.controller.lookup_server import (
    METHOD_LIST_AGENTS,
    METHOD_SCORE,
    LookupFailed,
    LookupPool,
    LookupUnavailable,
)

__all__ = ["KnownPod", "PodRanker", "RankedPod", "Ranking"]

log = logging.getLogger(__name__)


class KnownPod(msgspec.Struct, frozen=True):
    """A pod the router may send requests to."""

    pod_uid: str
    pod_name: str = ""
    # host:port of the pod's agent (its TCP AgentService); "" for a pod known only from static_pods.
    agent_address: str = ""


class RankedPod(msgspec.Struct, frozen=True):
    pod: KnownPod
    # None when the pod was not scored (fallback order, or not in the Score answer).
    estimated_ttft_ms: float | None = None
    # Leading prompt chunks the pod holds in its GPU cache, L1 or lower tiers (disk / object store),
    # or can fetch from peers; each chunk counts in the fastest tier holding it.
    gpu_chunks: int = 0
    l1_chunks: int = 0
    peer_chunks: int = 0
    l2_chunks: int = 0


class Ranking(msgspec.Struct, frozen=True):
    pods: tuple[RankedPod, ...]
    """Best first; empty only when no pod is known at all."""
    source: Literal["score", "fallback"]
    num_query_chunks: int = 0
    error: str = ""
    """Why the fallback order was used ("" for a Score answer)."""


class PodRanker:
    """Ranks pods for token ids through ``Score``; falls back to least-loaded/round-robin."""

    def __init__(
        self,
        controller: str,
        namespace: KeyNamespace,
        *,
        tls_cert_file: str = "",
        tls_key_file: str = "",
        tls_ca_file: str = "",
        tls_server_name: str = CONTROLLER_SERVER_NAME,
        timeout_s: float = 1.0,
        reserve: bool = False,
        static_pods: Sequence[str] = (),
        agents_refresh_s: float = 5.0,
        retry_s: float = 1.0,
        lookup_address: str = "",
    ) -> None:
        """``namespace``: the engines' key namespace with an empty cache salt and LoRA (set per
        request in :meth:`rank`). ``reserve``: ask Score to record a speculative entry for the best
        pod. ``static_pods``: pod UIDs known without the controller. ``retry_s``: after a controller
        error, how long requests take the fallback order without asking. ``lookup_address``: host:port
        of the controller's lookup listener (its ``lookup_port``); "" = gRPC to ``controller``."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s}: expected a positive number of seconds")
        self.namespace = namespace
        self.timeout_s = timeout_s
        self.reserve = reserve
        self.agents_refresh_s = agents_refresh_s
        self.retry_s = retry_s
        self._channel = controller_channel(
            controller,
            cert_file=tls_cert_file,
            key_file=tls_key_file,
            ca_file=tls_ca_file,
            server_name=tls_server_name,
        )
        self._stub = controller_pb2_grpc.ControllerServiceStub(self._channel)
        self.lookup_address = lookup_address
        self._lookups: LookupPool | None = None
        if lookup_address:
            self._lookups = LookupPool(
                lookup_address,
                tls=tls_files(tls_cert_file, tls_key_file, tls_ca_file),
                server_name=tls_server_name,
                timeout_s=timeout_s,
            )
        self._lock = threading.Lock()
        self._static = {uid: KnownPod(uid) for uid in static_pods}
        self._agents: dict[str, KnownPod] = {}
        self._agents_at = -float("inf")
        self._in_flight: dict[str, int] = {}
        self._turn = itertools.count()
        self._outage = ""  # the last controller error while it lasts; "" when the controller answers
        self._retry_at = -float("inf")  # no Score call before this (monotonic s) during an outage

    # ---- known pods ---------------------------------------------------------------------------

    def pods(self) -> list[KnownPod]:
        """Every known pod (agents the controller lists, then static pods not among them)."""
        now = time.monotonic()
        if now - self._agents_at >= self.agents_refresh_s:
            self._agents_at = now
            try:
                resp = self._list_agents()
            except (grpc.RpcError, LookupFailed) as e:
                self._note_outage(self._describe(e))
            else:
                agents = {
                    a.pod.pod_uid: KnownPod(a.pod.pod_uid, a.pod.pod_name, a.pod.agent_address)
                    for a in resp.agents
                }
                with self._lock:
                    self._agents = agents
        with self._lock:
            return [*self._agents.values(), *(p for u, p in self._static.items() if u not in self._agents)]

    # ---- load ------------------------------------------------------------------------------------

    @contextmanager
    def in_flight(self, pod_uid: str) -> Iterator[None]:
        """Count a request on ``pod_uid`` while inside (the fallback order's load)."""
        with self._lock:
            self._in_flight[pod_uid] = self._in_flight.get(pod_uid, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                self._in_flight[pod_uid] -= 1

    def fallback_order(self, pods: Sequence[KnownPod], *, rotate: bool = True) -> list[KnownPod]:
        """Least requests in flight first; ties in a rotating (round-robin) order. ``rotate=False``
        keeps the given order among ties and does not advance the rotation (for lookups that are
        not a routing decision)."""
        if not pods:
            return []
        start = next(self._turn) % len(pods) if rotate else 0
        rotated = [*pods[start:], *pods[:start]]
        with self._lock:
            return sorted(rotated, key=lambda p: self._in_flight.get(p.pod_uid, 0))  # stable: keeps rotation

    # ---- ranking ---------------------------------------------------------------------------------

    def rank(
        self,
        token_ids: Sequence[int],
        *,
        namespace: KeyNamespace | None = None,
        cache_salt: str = "",
        lora_name: str = "",
    ) -> Ranking:
        """Known pods for a prompt, best first (see the module docstring for the fallback).

        ``namespace``: instead of the one given at construction (e.g. per requested model);
        ``cache_salt`` and ``lora_name`` replace its own."""
        known = self.pods()
        ns = msgspec.structs.replace(namespace or self.namespace, cache_salt=cache_salt, lora_name=lora_name)
        req = controller_pb2.ScoreRequest(
            match=controller_pb2.MatchPrefixRequest(
                token_ids=common_pb2.TokenIds(ids=token_ids), namespace=key_namespace_to_proto(ns)
            ),
            reserve=self.reserve,
        )
        with self._lock:
            waiting = self._outage if time.monotonic() < self._retry_at else ""
        if waiting:
            error = f"{waiting} (asked again within {self.retry_s:g} s)"
            return Ranking(tuple(RankedPod(p) for p in self.fallback_order(known)), "fallback", error=error)
        try:
            resp = self._score(req)
        except (grpc.RpcError, LookupFailed) as e:
            error = self._note_outage(self._describe(e))
            return Ranking(tuple(RankedPod(p) for p in self.fallback_order(known)), "fallback", error=error)
        except ValueError as e:  # a token id outside u32: the prompt, not the controller, is wrong
            raise ValueError(f"token ids: {e}") from None
        self._note_recovery()
        by_uid = {p.pod_uid: p for p in known}
        ranked: list[RankedPod] = []
        for s in resp.scores:
            m = s.match
            pod = by_uid.get(m.pod_uid) or KnownPod(m.pod_uid, m.pod_name)
            ranked.append(
                RankedPod(pod, s.estimated_ttft_ms, m.gpu_chunks, m.l1_chunks, m.peer_chunks, m.l2_chunks)
            )
        scored = {r.pod.pod_uid for r in ranked}
        rest = self.fallback_order([p for p in known if p.pod_uid not in scored])
        return Ranking((*ranked, *(RankedPod(p) for p in rest)), "score", resp.num_query_chunks)

    @property
    def controller_error(self) -> str:
        """The last controller error while the controller is away; "" while it answers."""
        with self._lock:
            return self._outage

    def _score(self, req: controller_pb2.ScoreRequest) -> controller_pb2.ScoreResponse:
        if self._lookups is None:
            return self._stub.Score(req, timeout=self.timeout_s)
        return controller_pb2.ScoreResponse.FromString(
            self._lookups.call_raw(METHOD_SCORE, req.SerializeToString())
        )

    def _list_agents(self) -> controller_pb2.ListAgentsResponse:
        if self._lookups is None:
            return self._stub.ListAgents(controller_pb2.ListAgentsRequest(), timeout=self.timeout_s)
        return controller_pb2.ListAgentsResponse.FromString(self._lookups.call_raw(METHOD_LIST_AGENTS, b""))

    def _describe(self, e: grpc.RpcError | LookupFailed) -> str:
        if isinstance(e, LookupFailed):
            if isinstance(e, LookupUnavailable):  # its text names the listener's address
                return f"controller {e.code_name}: {e.detail}"
            return f"controller {e.code_name} (lookup listener {self.lookup_address}): {e.detail}"
        return f"controller {e.code().name}: {e.details()}"

    def _note_outage(self, error: str) -> str:
        with self._lock:
            first = not self._outage
            self._outage = error
            self._retry_at = time.monotonic() + self.retry_s
        if first:
            log.warning("%s; routing least-loaded/round-robin until it answers again", error)
        return error

    def _note_recovery(self) -> None:
        with self._lock:
            was, self._outage = self._outage, ""
        if was:
            log.warning("controller answers again; routing by Score")

    def close(self) -> None:
        self._channel.close()
        if self._lookups is not None:
            self._lookups.close()
