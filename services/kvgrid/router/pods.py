"""Pod -> vLLM HTTP base URL.

The controller knows pods by UID with their agent's TCP address (``PodIdentity.agent_address``);
the agent runs as a sidecar in the engine's pod, so the agent's host is the pod IP and vLLM listens
on the same IP at ``engine_port``. ``engine_urls`` overrides that per pod (by UID or name) for pods
whose engine listens elsewhere, and names pods the router may use while the controller is down.

Invariants: :func:`check_engine_urls` rejects any URL that is not ``http(s)://host[:port]`` (naming
it); :func:`targets` never returns two targets with the same URL, and keeps the given order.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from urllib.parse import urlsplit

import msgspec

from kvgrid.client import KnownPod

__all__ = ["Target", "base_url", "check_engine_urls", "targets"]


class Target(msgspec.Struct, frozen=True):
    pod_uid: str
    url: str


def check_engine_urls(engine_urls: Mapping[str, str]) -> None:
    for pod, url in engine_urls.items():
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path.strip("/"):
            raise ValueError(
                f"engine_urls[{pod!r}] = {url!r}: expected a vLLM base URL such as http://10.0.0.5:8000"
            )


def base_url(pod: KnownPod, engine_urls: Mapping[str, str], engine_port: int) -> str | None:
    """The pod's vLLM base URL, or None when neither engine_urls nor an agent address names it."""
    url = engine_urls.get(pod.pod_uid) or (engine_urls.get(pod.pod_name) if pod.pod_name else None)
    if url:
        return url.rstrip("/")
    if pod.agent_address:
        host = pod.agent_address.rpartition(":")[0]  # "[::1]:50062" keeps its brackets
        return f"http://{host}:{engine_port}" if host else None
    return None


def targets(pods: Iterable[KnownPod], engine_urls: Mapping[str, str], engine_port: int) -> list[Target]:
    out: list[Target] = []
    seen: set[str] = set()
    for pod in pods:
        url = base_url(pod, engine_urls, engine_port)
        if url is not None and url not in seen:
            seen.add(url)
            out.append(Target(pod.pod_uid, url))
    return out
