"""When the controller is ready to answer queries: its gRPC health status (main port and ``health_port``).

A controller that just started knows nothing its agents hold until they register again and their
snapshots are pulled, so its answers would route every request as a miss. :class:`Readiness` says
NOT_SERVING until, in this order:

1. the index backend answers (``data_generation()``; later the core's backend watcher's verdict:
   a Redis/Valkey that cannot be reached keeps the controller out of service at any time), and a
   shared agent registry has been loaded (``registry.synced``: the first sweep's sync), so a
   replica that starts or restarts never answers with fewer agents than the others;
2. ``readiness_settle_ms`` passed since start (time for agents to register again);
3. every registered agent with an ``agent_address`` has had its snapshot pulled (with a shared
   registry: every agent whose stream or pull this replica took; the others' entries are in the
   shared index already)
   (:meth:`~kvgrid.controller.ingest.Ingestor.is_synced`), or ``readiness_max_wait_ms`` passed
   since start (an agent that cannot be reached must not keep the controller out of service).

Steps 2 and 3 are passed once (latched): later resyncs (a new agent, a backend loss) do not take
the controller out of service, its answers for the other agents stay right. :class:`ReadinessWatcher`
re-checks every ``interval_s`` and sets the health status of ``""`` and each served service.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from grpc_health.v1 import health, health_pb2
from opentelemetry import metrics
from opentelemetry.metrics import Observation

from kvgrid.common.errors import Unavailable

if TYPE_CHECKING:
    from kvgrid.controller.core import Controller

__all__ = ["Readiness", "ReadinessWatcher"]

log = logging.getLogger(__name__)


class Readiness:
    """The readiness rule for one controller; ``check()`` -> (ready, why not)."""

    def __init__(
        self,
        ctl: Controller,
        *,
        settle_s: float,
        max_wait_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ctl = ctl
        self.settle_s, self.max_wait_s = settle_s, max_wait_s
        self._clock = clock
        self._t0 = clock()
        self._resynced = False

    def _pending_pulls(self) -> list[str]:
        ingest, shared = self.ctl.ingest, self.ctl.registry.shared
        return [
            rec.pod.pod_uid
            for rec in self.ctl.registry.all()
            if rec.pod.agent_address
            and not ingest.is_synced(rec.holder)
            and (not shared or ingest.tracks(rec.holder))
        ]

    def check(self) -> tuple[bool, str]:
        if self._resynced:
            # After start the core's backend watcher (backend_check_interval_ms) keeps this current.
            if not self.ctl.backend_available:
                return False, f"index backend {self.ctl.index.backend} unreachable"
            return True, ""
        try:
            self.ctl.index.data_generation()
        except Unavailable as e:
            return False, f"index backend unreachable: {e}"
        if not self.ctl.registry.synced:
            return False, "the shared agent registry is not loaded yet (first sync pending)"
        waited = self._clock() - self._t0
        if waited < self.settle_s:
            return False, f"settling: {waited:.1f}s of readiness_settle_ms={self.settle_s * 1000:.0f}"
        pending = self._pending_pulls()
        if pending and waited < self.max_wait_s:
            return False, f"{len(pending)} agent snapshot(s) not pulled yet (pods {', '.join(pending[:5])})"
        if pending:
            log.warning(
                "readiness_max_wait_ms=%.0f passed with %d agent snapshot(s) not pulled (pods %s): serving",
                self.max_wait_s * 1000,
                len(pending),
                ", ".join(pending[:5]),
            )
        self._resynced = True
        return True, ""


class ReadinessWatcher:
    """A thread keeping ``servicer``'s status for ``services`` equal to ``readiness.check()``."""

    def __init__(
        self,
        readiness: Readiness,
        servicer: health.HealthServicer,
        services: Sequence[str],
        interval_s: float = 0.25,
    ) -> None:
        self.readiness, self.servicer = readiness, servicer
        self.services = ("", *services)
        self.interval_s = interval_s
        self.ready: bool | None = None  # None: not checked yet
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvgrid-controller-readiness", daemon=True)

    def update(self) -> bool:
        """Check once and publish the result; True when ready."""
        try:
            ready, why = self.readiness.check()
        except Exception as e:  # never let a failed check leave a stale SERVING behind
            ready, why = False, f"readiness check failed: {type(e).__name__}: {e}"
        if ready != self.ready:
            if ready:
                log.info("ready: health SERVING")
            else:
                log.info("not ready (health NOT_SERVING): %s", why)
        self.ready = ready
        status = (
            health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in self.services:
            self.servicer.set(name, status)
        return ready

    def observe(self, meter: metrics.Meter) -> None:
        """``kvgrid_controller_ready`` (gauge, 1 ready / 0 not) on ``meter``."""
        meter.create_observable_gauge(
            "kvgrid_controller_ready",
            [lambda _opts: [Observation(1 if self.ready else 0)]],
            unit="1",
            description="1 when the controller is ready (index backend answers, agents resynced after start)",
        )

    def start(self) -> None:
        self.update()
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.update()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
