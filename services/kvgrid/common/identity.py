"""Identity of one agent incarnation: which pod it runs in, and which start of it this is.

Holders of chunks are keyed by ``pod_uid`` + ``epoch``, never by IP: IPs are reused across pods,
and a restarted agent has lost its L1, so its old entries must not be confused with new ones.
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from collections.abc import Mapping

import msgspec

__all__ = ["MAX_EPOCH", "PodIdentity", "new_epoch"]

# 63 bits: the epoch fits a signed 64-bit integer (Redis, JSON consumers, Go int64) as well as
# the proto's uint64.
MAX_EPOCH = (1 << 63) - 1
_RANDOM_BITS = 20


def new_epoch() -> int:
    """A fresh 63-bit epoch: wall-clock milliseconds in the high bits, 20 random bits below.

    Later starts get larger epochs (unless the clock steps back), and two starts in the same
    millisecond still differ with probability 1 - 2**-20.
    """
    millis = time.time_ns() // 1_000_000
    return ((millis << _RANDOM_BITS) | secrets.randbits(_RANDOM_BITS)) & MAX_EPOCH


class PodIdentity(msgspec.Struct, frozen=True):
    """Who an agent is. ``epoch`` changes on every agent start and is never reused."""

    pod_uid: str
    pod_name: str = ""
    namespace: str = ""
    node_name: str = ""
    epoch: int = 0
    agent_address: str = ""
    """host:port of the agent's TCP AgentService (peers, snapshot pulls); "" if not serving TCP."""

    def __post_init__(self) -> None:
        if not self.pod_uid:
            raise ValueError("pod_uid='': expected the pod's UID (non-empty)")
        if not 0 <= self.epoch <= MAX_EPOCH:
            raise ValueError(f"epoch={self.epoch}: expected 0 <= epoch < 2**63")

    @property
    def holder_id(self) -> str:
        """Stable text key of this incarnation: ``<pod_uid>/<epoch>``."""
        return f"{self.pod_uid}/{self.epoch}"

    @classmethod
    def from_env(
        cls,
        env: Mapping[str, str] | None = None,
        *,
        agent_address: str = "",
        epoch: int | None = None,
    ) -> PodIdentity:
        """Identity from the Kubernetes downward API, with a fresh epoch.

        Reads (set them in the pod spec with ``valueFrom.fieldRef``):

        - ``POD_UID``: ``metadata.uid``
        - ``POD_NAME``: ``metadata.name``
        - ``POD_NAMESPACE``: ``metadata.namespace``
        - ``NODE_NAME``: ``spec.nodeName``

        Outside Kubernetes (no ``POD_UID``) the host name stands in: ``pod_uid`` becomes
        ``local-<hostname>`` and ``pod_name``/``node_name`` the host name, so a laptop or CI run
        still has a stable identity; the epoch keeps restarts apart.
        """
        env = os.environ if env is None else env
        host = socket.gethostname()
        uid = env.get("POD_UID", "")
        return cls(
            pod_uid=uid or f"local-{host}",
            pod_name=env.get("POD_NAME", "") or (host if not uid else ""),
            namespace=env.get("POD_NAMESPACE", ""),
            node_name=env.get("NODE_NAME", "") or (host if not uid else ""),
            epoch=new_epoch() if epoch is None else epoch,
            agent_address=agent_address,
        )
